"""The fuzz tests, longer: every dataset reader and the image loader with --examples random
examples per test (the suite runs 30, derandomised), fresh random ones each run unless --seed.

    python benchmarks/fuzz.py --examples 2000 [--seed 1] [--only images|datasets]

Runs tests/test_fuzz_datasets.py and tests/test_fuzz_images.py under pytest with Hypothesis'
statistics, and prints, per test, how many examples ran, how long, and whether any escaped
(an exception other than the documented one-line DatasetError / ImageError). Exits as pytest
does: 0 when nothing escaped.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = {"datasets": "tests/test_fuzz_datasets.py", "images": "tests/test_fuzz_images.py"}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=1000, help="examples per test")
    ap.add_argument("--seed", type=int, help="Hypothesis seed (default: a random one, printed by pytest on failure)")
    ap.add_argument("--only", choices=sorted(FILES))
    args = ap.parse_args()
    env = dict(os.environ, CAPTIONKIT_FUZZ_EXAMPLES=str(args.examples), CAPTIONKIT_FUZZ_RANDOM="1",
               OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    files = [FILES[args.only]] if args.only else list(FILES.values())
    cmd = [sys.executable, "-m", "pytest", *files, "-q", "-p", "no:cacheprovider", "-p", "no:warnings",
           "--hypothesis-show-statistics", *([f"--hypothesis-seed={args.seed}"] if args.seed is not None else [])]
    print(f"{args.examples} examples per test: {' '.join(cmd[1:])}", flush=True)
    run = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    # Hypothesis' statistics per test, what failed, and pytest's summary (not the readers' notes
    # on stderr about malformed lines, nor Pillow's warnings about the damaged files)
    keep = ("during generate", " passing, ", "Stopped because", "Falsifying", "FAILED", "Error")
    for line in run.stdout.splitlines():
        if (line.startswith("tests/") and line.endswith(":")) or any(k in line for k in keep) or \
                line.lstrip("= ").split(" ")[0].isdigit():
            print(line)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
