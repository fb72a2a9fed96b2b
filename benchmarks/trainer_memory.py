"""The trainer's memory with lazy feature reads against the eager copy it made before.

    OMP_NUM_THREADS=1 python benchmarks/trainer_memory.py [--config configs/sat_lite2_flickr8k.toml]
                                                          [--steps 20]

Each mode trains ``--steps`` steps of the config (no validation) in a fresh process, on the
cached features (build them first: ``captionkit features`` or a training run; the Flickr8k
Lite2 cache is 8,000 x 207 KB = 1.66 GB):
- lazy: the trainer as it is (captionkit.encoders.features.FeatureRows: a batch's rows read from the
  memory-mapped store when the batch needs them);
- eager: every training and dev image's rows read into memory first
  (``FeatureRows.in_memory()``, what the trainer did before).
Printed per mode: the process's peak resident memory (VmHWM), and at the end its anonymous
(private) and file-backed resident memory (RssAnon, RssFile: the store's pages it has touched,
shared with every other process mapping the file through the page cache), the set-up time
(data, model) and the training time. RssFile counts the libraries too (about 330 MB here: the
eager run's figure, its store mapping closed once the rows are copied).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MB = 2 ** 20


def memory(field: str) -> int:
    """A /proc/self/status figure in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def one_run(config: str, steps: int, eager: bool) -> dict:
    from captionkit.training.config import RunConfig
    from captionkit.training.run import build_trainer
    from captionkit.training.stages import prepare_data

    cfg = RunConfig.load(config)
    t0 = time.time()
    data = prepare_data(cfg)
    if eager:
        data.train_feats, data.val_feats = data.train_feats.in_memory(), data.val_feats.in_memory()
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(cfg, Path(out) / "run", data)
        t1 = time.time()
        trainer.fit(max_steps=steps, progress=False)
        t2 = time.time()
    return {"images": len(data.train_feats) + len(data.val_feats), "VmHWM": memory("VmHWM"),
            "RssAnon": memory("RssAnon"), "RssFile": memory("RssFile"), "setup_s": t1 - t0, "train_s": t2 - t1}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/sat_lite2_flickr8k.toml")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--one", choices=("lazy", "eager"), help=argparse.SUPPRESS)  # a child process's mode
    args = ap.parse_args()
    if args.one:
        print(json.dumps(one_run(args.config, args.steps, args.one == "eager")))
        return
    for mode in ("lazy", "eager"):
        proc = subprocess.run([sys.executable, __file__, "--config", args.config, "--steps", str(args.steps),
                               "--one", mode], capture_output=True, text=True, check=True)
        r = json.loads(proc.stdout.splitlines()[-1])
        print(f"{mode:5}: peak RSS {r['VmHWM'] / MB:,.0f} MB; at the end anonymous {r['RssAnon'] / MB:,.0f} MB, "
              f"file-backed {r['RssFile'] / MB:,.0f} MB; set-up {r['setup_s']:.1f} s, {args.steps} steps "
              f"{r['train_s']:.1f} s ({r['images']:,} training and dev images, {args.config})")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT / "src"))
    main()
