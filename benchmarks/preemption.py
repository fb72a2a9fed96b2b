"""Preemption, many times: a tiny training run (tests/helpers.py's shapes corpus and tiny config,
dropout 0.3, one thread) gets SIGTERM (or SIGUSR1) --signals times at a random moment of its
training, and ``captionkit train --resume auto`` runs it again after each stop; then it is
compared with a run never interrupted.

    python benchmarks/preemption.py --signals 10 [--seed 0] [--timer-s 0.6]

Prints, for every signal, where it came (as the run's last output showed), the exit status and
the time from the signal to the exit. A signal that comes after the run's training (its final
choice of the length penalty is not stopped) finds it finishing with 0; the signals left go to
a new run. At the end it prints the times' min, median and max, and
whether the final weights, optimizer state, best checkpoint and history equal the unbroken
run's. Exits 1 if a stop was not exit 75 (or 0 for a run that had already finished), if one took
longer than the documented bound (core.signals.STOP_BOUND_S), or if anything differs.
"""

from __future__ import annotations

import argparse
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from helpers import TINY_CONFIG, write_flickr8k  # noqa: E402
from killharness import Child, compare_runs, where_it_was  # noqa: E402

from captionkit.core.signals import EXIT_PREEMPTED, STOP_BOUND_S  # noqa: E402


def _launch(config: Path, out: Path) -> Child:
    """``captionkit train --resume auto`` in a child, its stderr collected."""
    return Child("train", "--config", str(config), "--out", str(out), "--resume", "auto")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--signals", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timer-s", type=float, default=0.6,
                    help="signals land 0..this many seconds after a launch is set up")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    tmp = Path(tempfile.mkdtemp(prefix="preempt-"))
    try:
        data = write_flickr8k(tmp / "data")
        config = tmp / "preempt.toml"
        config.write_text(TINY_CONFIG.format(dataset=data).replace("dropout = 0.0", "dropout = 0.3"))
        epochs = tomllib.loads(config.read_text())["train"]["epochs"]
        whole = _launch(config, tmp / "whole")
        if whole.finish() != 0:
            print(whole.err[-3000:], file=sys.stderr)
            return 1
        out, times, bad, problems, runs = tmp / "run0", [], [], [], 0
        for i in range(args.signals):
            launch = _launch(config, out)
            sig = signal.SIGUSR1 if rng.random() < 0.3 else signal.SIGTERM
            launch.wait_for("trained parameters")
            time.sleep(rng.uniform(0.0, args.timer_s))
            where = where_it_was(launch.err, epochs)
            sent = time.monotonic()
            launch.proc.send_signal(sig)
            rc = launch.finish()
            seconds = time.monotonic() - sent
            print(f"{i + 1:3d} {sig.name:8s} {where:32s} exit {rc:3d}  {seconds:5.2f} s")
            if rc == 0:  # the run ended before the signal came (its final tuning is not stopped)
                problems += compare_runs(out, tmp / "whole")
                runs += 1
                out = tmp / f"run{runs}"  # the signals left go to a new run
                continue
            times.append(seconds)
            if rc != EXIT_PREEMPTED or seconds > STOP_BOUND_S:
                bad.append(f"signal {i + 1}: exit {rc} after {seconds:.2f} s\n{launch.err[-2000:]}")
        last = _launch(config, out)
        if last.finish() != 0:
            bad.append(f"the final --resume auto failed:\n{last.err[-2000:]}")
        problems += compare_runs(out, tmp / "whole") if not bad else []
        print(f"{runs + 1} runs to the end")
        if times:
            print(f"signal to exit: min {min(times):.2f} s, median {statistics.median(times):.2f} s, "
                  f"max {max(times):.2f} s over {len(times)} stops (bound {STOP_BOUND_S} s)")
        print("final weights, optimizer state, best checkpoint and history equal the unbroken run's: "
              + ("yes" if not (bad or problems) else "NO"))
        for p in bad + problems:
            print(p)
        return 1 if bad or problems else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
