"""The device path's cost on this machine: training captions/s through the Trainer, and beam-3
captioning images/s of shipped models, with one tree of captionkit against another in one run.

    python benchmarks/device_path.py                                   # this tree only
    python benchmarks/device_path.py --compare /path/to/other/src      # both, alternating

What is timed (the median of ``--repeats`` alternating passes, after a warm-up):
1. training: ``Trainer.fit`` on the SAT recipe's sizes (configs/sat_lite2_flickr8k.toml: embed,
   hidden and attention width 512, batch 32, Adam, gradient clipping 5, alpha_c 1; 9x9x1280
   features of a random-weight EfficientNet-Lite2) over a synthetic Flickr8k-layout dataset of
   ``--images`` photos with 5 captions each from a 2,500-word vocabulary, 8-16 words long. The
   trainer reads its features from the memory-mapped store, builds each batch, steps: the whole
   loop as ``captionkit train`` runs it, without validation. The figure is the rate between two
   step counts, so the fixed costs (set-up, the ``last`` checkpoint written when max_steps is
   reached) cancel.
2. captioning: ``Captioner.decode_features`` with beam 3 over the encoder rows of the repository's
   samples/ photos (repeated to 48 images, batch 16), for the default model (the ensemble, flip
   views) and the single transformer; decoding only (the encoder is the same code in both trees).

``--compare SRC`` runs each measurement in a child process per tree (PYTHONPATH), alternating
A, B, A, B, so both trees see the same machine state; the table gives each tree's figure and
B / A. Both trees must offer the names used here (Trainer.fit, build_trainer, Captioner.load).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIG = """
[data]
dataset = "{dataset}"
min_count = 1

[encoder]
name = "efficientnet_lite2"
weights = "random"

[model]
family = "sat"
embed_dim = 512
hidden_dim = 512
attn_dim = 512
dropout = 0.5
embed_dropout = 0.3
gate = true

[train]
epochs = 1000
batch_size = 32
optimizer = "adam"
lr = 4e-4
grad_clip = 5.0
alpha_c = 1.0
precision = "{precision}"
checkpoint_every = 0
max_len = 20
"""


def write_dataset(root: Path, n_images: int) -> Path:
    """A Flickr8k-layout folder of small noise photos, 5 random captions each (seeded)."""
    import numpy as np
    from PIL import Image

    rng = random.Random(0)
    words = [f"w{i}" for i in range(2500)]
    img_dir = root / "Flicker8k_Dataset"
    img_dir.mkdir(parents=True)
    names, lines = [], []
    gen = np.random.default_rng(0)
    for i in range(n_images):
        name = f"img{i:05d}.jpg"
        names.append(name)
        Image.fromarray(gen.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(img_dir / name)
        for j in range(5):
            lines.append(f"{name}#{j}\t" + " ".join(rng.choice(words) for _ in range(rng.randint(8, 16))))
    (root / "Flickr8k.token.txt").write_text("\n".join(lines) + "\n")
    n_dev = max(2, n_images // 20)
    splits = {"train": names[:-2 * n_dev], "dev": names[-2 * n_dev:-n_dev], "test": names[-n_dev:]}
    for split, ns in splits.items():
        (root / f"Flickr_8k.{split}Images.txt").write_text("\n".join(ns) + "\n")
    return root


def measure_training(work: Path, images: int, precision: str, steps: int, repeats: int) -> list[float]:
    """captions/s of ``repeats`` spans of ``steps`` steps each, in this process."""
    import torch

    from captionkit.training.config import RunConfig
    from captionkit.training.run import build_trainer

    dataset = work / "data"
    if not dataset.exists():
        write_dataset(dataset, images)
    cfg_path = work / f"bench_{precision}.toml"
    cfg_path.write_text(CONFIG.format(dataset=dataset, precision=precision))
    cfg = RunConfig.load(cfg_path)
    trainer = build_trainer(cfg, work / f"run_{os.getpid()}", device=torch.device("cpu"))
    batch = cfg.train.batch_size
    trainer.fit(max_steps=5, progress=False)  # warm-up (and the first checkpoint's write)
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        trainer.fit(max_steps=trainer.state.step + 2, progress=False)  # fixed costs alone
        t1 = time.perf_counter()
        trainer.fit(max_steps=trainer.state.step + 2 + steps, progress=False)
        t2 = time.perf_counter()
        rates.append(steps * batch / max((t2 - t1) - (t1 - t0), 1e-9))
    return rates


def measure_captioning(model: str, precision: str, repeats: int) -> list[float]:
    """images/s of beam-3 decoding of 48 images' rows, batch 16, in this process."""
    import torch

    from captionkit.data.images import find_images, load_rgb, to_tensor
    from captionkit.inference.captioner import Captioner

    cap = Captioner.load(model, device="cpu", precision=precision)
    pixels = torch.stack([to_tensor(load_rgb(p), cap.encoder.preprocess) for p in find_images([ROOT / "samples"])])
    feats = cap.encode(pixels)
    feats = feats.repeat(-(-48 // feats.shape[0]), *([1] * (feats.dim() - 1)))[:48]
    batches = feats.split(16)
    for b in batches[:1]:
        cap.decode_features(b, beam=3)  # warm-up
    rates = []
    for _ in range(repeats):
        t = time.perf_counter()
        for b in batches:
            cap.decode_features(b, beam=3)
        rates.append(48 / (time.perf_counter() - t))
    return rates


def child(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.what == "train":
        rates = measure_training(Path(args.work), args.images, args.precision, args.steps, args.repeats)
    else:
        rates = measure_captioning(args.what.split(":", 1)[1], args.precision, args.repeats)
    print(json.dumps(rates))


def run_in_tree(src: Path, script: str | Path, argv: list[str], env: dict[str, str] | None = None):
    """Run the benchmark ``script`` with ``argv`` in a child process that imports the captionkit
    of the tree ``src`` (its src/ folder, as PYTHONPATH), with ``env`` added to the environment
    -> the JSON value the child printed on its last line of stdout. A child that fails ends this
    run with the tail of its stderr. (benchmarks/speed.py --compare uses it too.)"""
    cmd = [sys.executable, str(script), *argv]
    out = subprocess.run(cmd, env={**os.environ, **(env or {}), "PYTHONPATH": str(src)}, capture_output=True,
                         text=True)
    if out.returncode:
        sys.exit(f"{src}: {' '.join(argv)} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_child(src: Path, what: str, args: argparse.Namespace, work: Path, cache: str) -> list[float]:
    # a cache per tree: the trees may store features differently
    return run_in_tree(src, __file__, ["--child", what, "--work", str(work), "--images", str(args.images),
                                       "--steps", str(args.steps), "--repeats", "1", "--precision", args.precision,
                                       "--threads", str(args.threads)],
                       {"CAPTIONKIT_CACHE": str(work / cache)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", type=Path, help="another tree's src/ folder (A); this tree is B")
    ap.add_argument("--images", type=int, default=400, help="synthetic training images (default 400)")
    ap.add_argument("--steps", type=int, default=20, help="training steps per timed span (default 20)")
    ap.add_argument("--repeats", type=int, default=3, help="alternating passes per tree (default 3)")
    ap.add_argument("--precision", default="fp32", help="fp32 (default), bf16 or auto")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="*", default=["ensemble-lite2-flickr8k", "transformer-lite2-flickr8k"])
    ap.add_argument("--skip-training", action="store_true")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        args.what = args.child
        return child(args)
    trees = {"B (this tree)": ROOT / "src"}
    if args.compare:
        trees = {"A (" + str(args.compare) + ")": args.compare.resolve(), **trees}
    import torch
    print(f"torch {torch.__version__}, {args.threads} threads, precision {args.precision}, "
          f"{os.cpu_count()} CPUs", flush=True)
    whats = ([] if args.skip_training else ["train"]) + [f"caption:{m}" for m in args.models]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        results: dict[tuple[str, str], list[float]] = {}
        for what in whats:
            for _ in range(args.repeats):
                for i, (label, src) in enumerate(trees.items()):
                    results.setdefault((what, label), []).extend(run_child(src, what, args, work, f"cache{i}"))
    print(f"{'measure':40} " + " ".join(f"{label[:28]:>30}" for label in trees) + ("   B/A" if args.compare else ""))
    for what in whats:
        unit = "captions/s" if what == "train" else "images/s (beam 3)"
        meds = [statistics.median(results[(what, label)]) for label in trees]
        line = f"{what + ' ' + unit:40} " + " ".join(f"{m:30.1f}" for m in meds)
        if args.compare:
            line += f"   {meds[1] / meds[0]:.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
