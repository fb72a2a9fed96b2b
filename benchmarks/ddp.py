"""DDP throughput: the same training run in 2 processes (torchrun, gloo on the CPU) and in 1,
measured in one run on this machine.

    python benchmarks/ddp.py [--images 200] [--steps 20] [--batch-size 32]

A synthetic dataset in the Flickr8k layout (coloured shapes, 5 captions per image) on a
random-weight EfficientNet-Lite0, and a small soft-attention LSTM (embed 128, hidden 256,
attention 128); the feature cache is filled once before anything is timed. Each run trains
``--steps`` steps of the same global batch (``--batch-size`` captions; 2 processes take half
each). Printed per run: wall time of the command (start-up, data, features from the cache,
process group), the training time the run itself records (its epoch's seconds), and
captions/s over that time; then the 2-process/1-process ratios.

Two processes on one machine compete for the same cores: on a 2-core machine shared with
other work, DDP cannot show the speed-up it gives with a GPU per process or many cores. Both
runs inherit OMP_NUM_THREADS (printed; torchrun sets 1 per process when it is unset), so
with OMP_NUM_THREADS=1 the comparison is one thread against two single-thread processes.
What this shows is the overhead: the gradient all-reduce per step and the per-rank start-up
(the weights match, see tests/test_ddp.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from PIL import Image, ImageDraw

ROOT = Path(__file__).resolve().parents[1]
COLOURS = {"red": (220, 30, 30), "blue": (30, 60, 220), "green": (30, 180, 60), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square")
CONFIG = """
[data]
dataset = "{dataset}"
min_count = 1
[encoder]
name = "efficientnet_lite0"
weights = "random"  # the features' values do not change the cost
[model]
family = "sat"  # a small soft-attention LSTM, without dropout
embed_dim = 128
hidden_dim = 256
attn_dim = 128
dropout = 0.0

[train]
epochs = 1
batch_size = {batch_size}
precision = "fp32"
checkpoint_every = 0
max_len = 12
"""


def write_dataset(root: Path, n_train: int) -> Path:
    """n_train training images (and 10 dev images) of one coloured shape each, 5 captions each."""
    rng = random.Random(0)
    img_dir = root / "Flicker8k_Dataset"
    img_dir.mkdir(parents=True)
    lines, names = [], []
    for i in range(n_train + 10):
        colour, shape = rng.choice(list(COLOURS)), rng.choice(SHAPES)
        im = Image.new("RGB", (96, 96), (255, 255, 255))
        box = [20 + i % 5, 20, 76, 76 - i % 7]
        (ImageDraw.Draw(im).ellipse if shape == "circle" else ImageDraw.Draw(im).rectangle)(box, fill=COLOURS[colour])
        name = f"img{i:04d}.jpg"
        im.save(img_dir / name, quality=90)
        names.append(name)
        extra = ["", " on a white background", " in the middle of the picture", " drawn in one colour", ""]
        lines += [f"{name}#{j}\ta {colour} {shape}{extra[j]}" for j in range(5)]
    (root / "Flickr8k.token.txt").write_text("\n".join(lines) + "\n")
    (root / "Flickr_8k.trainImages.txt").write_text("\n".join(names[:n_train]) + "\n")
    (root / "Flickr_8k.devImages.txt").write_text("\n".join(names[n_train:]) + "\n")
    (root / "Flickr_8k.testImages.txt").write_text("\n".join(names[n_train:]) + "\n")
    return root


def run(config: Path, out: Path, steps: int, nproc: int, env: dict) -> dict:
    cmd = [sys.executable, "-m", "captionkit", "train", "--config", str(config), "--out", str(out),
           "--max-steps", str(steps), "--nproc", str(nproc)]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    progress = json.loads((out / "last" / "config.json").read_text())["state"]["epoch_progress"]
    if progress is None:
        raise SystemExit(f"the epoch ended before {steps} steps: give more --images or fewer --steps")
    return {"wall": wall, "train": progress["seconds"], "captions": progress["seen"],
            "rate": progress["seen"] / max(progress["seconds"], 1e-9)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=200, help="training images (5 captions each)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=32, help="the global batch, in captions")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        config = tmp / "ddp.toml"
        config.write_text(CONFIG.format(dataset=write_dataset(tmp / "data", args.images), batch_size=args.batch_size))
        env = dict(os.environ, CAPTIONKIT_CACHE=str(tmp / "cache"),
                   PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
        run(config, tmp / "warm", 1, 1, env)  # fills the feature cache; not timed
        one = run(config, tmp / "one", args.steps, 1, env)
        two = run(config, tmp / "two", args.steps, 2, env)
    print(f"{os.cpu_count()} CPU cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}; "
          f"{args.steps} steps of {args.batch_size} captions (global batch)")
    print(f"{'':22}{'wall s':>9}{'train s':>9}{'captions/s':>12}")
    for name, r in (("1 process", one), ("2 processes (DDP)", two)):
        print(f"{name:22}{r['wall']:9.1f}{r['train']:9.1f}{r['rate']:12.1f}")
    print(f"2 / 1 processes: captions/s x{two['rate'] / one['rate']:.2f}, wall time x{two['wall'] / one['wall']:.2f}"
          f" (same captions: {one['captions']} and {two['captions']})")


if __name__ == "__main__":
    main()
