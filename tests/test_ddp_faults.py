"""A DDP run where one rank fails (issue 28, item 2): every rank ends within a minute, non-zero,
and the failing rank's error is in the output once, not buried under the other ranks'
tracebacks. Two gloo processes on the tiny config, the fault injected by tests/ddp_faults.py.

Before the fix the failing rank called ``dist.barrier()`` on its way out while the other rank
waited in a different collective: both waited for the process group's 3-hour timeout."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import captionkit
from ddp_faults import FAULT_ENV, fault_message
from helpers import free_port

pytestmark = pytest.mark.slow  # two (or three) Python processes importing torch: 10-20 s each

HERE = Path(__file__).parent
LIMIT = 60.0  # seconds from the start of the processes to the exit of the last


def child_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    paths = [str(Path(captionkit.__file__).parents[1]), str(HERE), os.environ.get("PYTHONPATH", "")]
    env.update(PYTHONPATH=os.pathsep.join(filter(None, paths)), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)
    return env


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """A process writing its output to ``log`` (a file, not a pipe: a hung grandchild holding a
    pipe open would block the test's read), in a session of its own (so that it can be stopped
    whole)."""
    with open(log, "w") as fh:
        return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def finish(procs: list[subprocess.Popen], logs: list[Path], t0: float) -> tuple[list[int | None], float, str]:
    """Wait for every process until LIMIT after t0 and stop what is left (SIGTERM first: torchrun's
    agent then stops its workers, which live in sessions of their own). -> (exit codes, None for
    a process that had to be stopped; seconds until the last exited; their output, together)."""
    codes: list[int | None] = []
    for p in procs:
        try:
            p.wait(max(0.0, t0 + LIMIT - time.monotonic()))
            codes.append(p.returncode)
        except subprocess.TimeoutExpired:
            codes.append(None)
    seconds, ended = time.monotonic() - t0, time.time()
    for p, code in zip(procs, codes):
        if code is None:
            os.killpg(p.pid, signal.SIGTERM)
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    output = "".join(f"---- process {i} ----\n{log.read_text()}" for i, log in enumerate(logs))
    failed_at = re.search(rf"{FAULT_ENV}: rank \d+ fails at ([\d.]+)", output)
    after = f", {ended - float(failed_at[1]):.1f} s after the fault" if failed_at else ""
    state = "still running" if None in codes else "all processes gone"
    print(f"{state} {seconds:.1f} s after their start{after}; exit codes {codes}")  # (pytest -s)
    return codes, seconds, output


def train_args(config: Path, out: Path, steps: int) -> list[str]:
    return ["train", "--config", str(config), "--out", str(out), "--max-steps", str(steps)]


def assert_ended_once(codes: list[int | None], seconds: float, output: str, message: str) -> None:
    assert None not in codes, f"still running {LIMIT:.0f} s after the start (killed):\n{output[-4000:]}"
    assert all(code != 0 for code in codes), f"exit codes {codes}:\n{output[-4000:]}"
    assert output.count(message) == 1, f"the failing rank's error {output.count(message)} times:\n{output[-4000:]}"


def test_a_rank_that_fails_mid_epoch_ends_both_processes_and_its_error_is_shown_once(tiny_config, tmp_path):
    """Rank 1 fails inside its 2nd step (an out-of-memory error in the forward) while rank 0
    waits for it in the gradient all-reduce. Two plain processes, no torchrun agent to stop
    the other: captionkit itself must end both. Rank 0 says in one line that it stopped."""
    env = child_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                    **{FAULT_ENV: "1:step@2"})
    logs = [tmp_path / f"rank{r}.txt" for r in range(2)]
    t0 = time.monotonic()
    procs = [start([sys.executable, str(HERE / "ddp_faults.py"), *train_args(tiny_config, tmp_path / "run", 6)],
                   dict(env, RANK=str(r), LOCAL_RANK=str(r)), logs[r]) for r in range(2)]
    codes, seconds, output = finish(procs, logs, t0)
    assert_ended_once(codes, seconds, output, fault_message(1, "step", 2))
    assert "rank 0 stopped: another rank failed" in output  # one line, not a traceback of a lost connection
    assert output.count("Traceback") == 1  # the failing rank's own


def test_rank_0_failing_in_validation_ends_the_run_under_torchrun(tiny_config, tmp_path):
    """Rank 0 fails while validating the first epoch; rank 1 waits meanwhile for its training
    state. Started by torchrun's launcher, as ``captionkit train --nproc 2`` does: the launcher
    exits non-zero and the error is in its output once."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(HERE / "ddp_faults.py"), *train_args(tiny_config, tmp_path / "run", 100)]
    log = tmp_path / "torchrun.txt"
    t0 = time.monotonic()
    codes, seconds, output = finish([start(cmd, child_env(**{FAULT_ENV: "0:validate"}), log)], [log], t0)
    assert_ended_once(codes, seconds, output, fault_message(0, "validate", 1))
