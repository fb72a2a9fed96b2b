"""Kill it anywhere, many times: a tiny training run (tests/helpers.py's shapes corpus and tiny
config, checkpoints every 2 steps, dropout 0.3, one thread) is killed with SIGKILL --kills
times at random points -- at a random moment of its training, or at a random one of the named
points inside checkpoint writes and validation -- and resumed with ``captionkit train --resume``
after each kill; then compared with a run never interrupted.

    python benchmarks/kill_resume.py --kills 60 [--seed 0] [--timer-s 1.5]

Prints the kills by where they landed, the resumes (and the steps they resumed from), the fresh
starts (kills before the first checkpoint), and whether the final weights, optimizer state,
best checkpoint and history equal the unbroken run's. Exits 1 if anything differs or a resume
broke a promise (see tests/killharness.py). A run needs about 4 s of startup and training per
launch on an idle machine. If the run ends before all kills are used, it is started again in a
fresh folder for the kills that are left.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from helpers import TINY_CONFIG, write_flickr8k  # noqa: E402
from killharness import Launch, compare_runs, kill_and_resume, kill_config, random_plans  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=60)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timer-s", type=float, default=1.5,
                    help="timer kills land 0..this many seconds after a launch is set up")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="kill_resume.") as tmp:
        tmp = Path(tmp)
        os.environ["CAPTIONKIT_CACHE"] = str(tmp / "cache")
        config = tmp / "kill.toml"
        config.write_text(kill_config(TINY_CONFIG.format(dataset=write_flickr8k(tmp / "data"))))
        Launch(config, tmp / "whole", resume=False).finish()  # also fills the feature cache
        plans = random_plans(args.kills, rng, args.timer_s)
        kills, resumes, fresh, via_old, seconds, problems, rounds = Counter(), 0, 0, 0, 0.0, [], 0
        while plans:
            rounds += 1
            out = tmp / f"resumed{rounds}"
            report = kill_and_resume(config, out, plans)
            used = sum(report.kills.values())
            plans = plans[used + 1:]  # past the kills, and the plan whose kill the run ended before
            kills += report.kills
            resumes, fresh, via_old = resumes + report.resumes, fresh + report.fresh_starts, via_old + report.via_old
            seconds += report.seconds
            problems += [f"round {rounds}: {p}" for p in compare_runs(out, tmp / "whole")]
            print(f"round {rounds}: {report.summary()}", flush=True)
            shutil.rmtree(out)
    print(f"\n{sum(kills.values())} kills in {rounds} runs to the end, {resumes} resumes "
          f"({via_old} from .last.old), {fresh} fresh starts, {seconds:.0f} s")
    for where, n in sorted(kills.items()):
        print(f"  {n:4d}  {where}")
    print("final weights, optimizer state, best checkpoint and history equal the unbroken run's: "
          + ("yes, every run" if not problems else "NO"))
    for p in problems:
        print("  " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
