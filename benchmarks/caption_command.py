"""The whole ``captionkit caption`` command, this tree against another, on the Flickr8k test photos:
wall-clock time (start-up included), images/s, and whether the JSONL files are the same.

    git worktree add --detach ../old 71eb136
    python benchmarks/caption_command.py --compare ../old/src [--images 1000] [--precision fp32] [--rounds 1]

Each round runs, one after the other, each a fresh process with the tree's ``src`` on PYTHONPATH:
``old`` (the other tree's default), ``new`` (this tree's default, as shipped: with the default
model's caption rules, and ``--processes auto``), ``new, no rules`` (the rules turned off, so the
captions can be compared with the old tree's) and ``new, no rules, 1 process`` (what
``--processes`` adds). Medians over the rounds; "same as old" compares the last round's files
line for line. ``--extra`` adds options to every run (e.g. ``--beam 5``).
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLICKR = ROOT.parent / "shared" / "data" / "flickr8k"
NO_RULES = ["--no-repeat-ngram", "0", "--repetition-penalty", "1", "--rare-word-bonus", "0"]


def run(src: Path, listing: Path, out: Path, options: list[str]) -> float:
    """One ``captionkit caption`` of the listed photos with ``src``'s captionkit: its wall time."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    cmd = [sys.executable, "-m", "captionkit", "caption", "--paths-from", str(listing), "--jsonl", str(out),
           "--overwrite", *options]
    t = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if done.returncode:
        sys.exit(f"{shlex.join(cmd)} failed ({done.returncode}):\n{done.stderr[-2000:]}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--compare", type=Path, required=True, metavar="OTHER/src", help="the other tree's src folder")
    ap.add_argument("--images", type=int, default=1000, help="the first N Flickr8k test photos (default 1000)")
    ap.add_argument("--precision", default="fp32", help="--precision of every run (default fp32)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--extra", default="", help="more options for every run, as one string")
    args = ap.parse_args()
    names = (FLICKR / "Flickr_8k.testImages.txt").read_text().split()[:args.images]
    common = ["--precision", args.precision, *shlex.split(args.extra)]
    variants = {"old": (args.compare.resolve(), common),
                "new": (ROOT / "src", common),
                "new, no rules": (ROOT / "src", common + NO_RULES),
                "new, no rules, 1 process": (ROOT / "src", common + NO_RULES + ["--processes", "1"])}
    print(f"{len(names)} Flickr8k test photos, {' '.join(common)}; old: {variants['old'][0]}; "
          f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        listing = Path(tmp) / "photos.txt"
        listing.write_text("".join(f"{FLICKR / 'Flicker8k_Dataset' / n}\n" for n in names))
        walls: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(args.rounds):
            for name, (src, options) in variants.items():
                walls[name].append(run(src, listing, Path(tmp) / f"{name}.jsonl", options))
                print(f"  {name:26s} {walls[name][-1]:7.1f} s", flush=True)
        old_lines = (Path(tmp) / "old.jsonl").read_text().splitlines()
        old = statistics.median(walls["old"])
        print(f"{'run':26s} {'wall s':>8s} {'images/s':>9s} {'speed-up':>8s}  same captions as old")
        for name in variants:
            wall = statistics.median(walls[name])
            lines = (Path(tmp) / f"{name}.jsonl").read_text().splitlines()
            same = sum(a == b for a, b in zip(old_lines, lines))
            print(f"{name:26s} {wall:8.1f} {len(names) / wall:9.2f} {old / wall:7.2f}x  {same} of {len(lines)}")
    print(f"(load average {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
