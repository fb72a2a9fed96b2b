"""captionkit.core.locks: a second holder (another process) is refused in one line naming the
first one's pid and host; a kill -9'd holder never blocks (flock dies with the process); a lock
file left behind is never what blocks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from captionkit.core.errors import UserError
from captionkit.core.locks import Locked, hold_lock, lock_path

ROOT = Path(__file__).resolve().parents[1]
HOLDER = """
import sys, time
from captionkit.core.locks import hold_lock
with hold_lock(sys.argv[1], "holding for a test"):
    print("held", flush=True)
    time.sleep(120)
"""


def _holder(target: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(target)], stdout=subprocess.PIPE, env=env)
    assert proc.stdout.readline().strip() == b"held"
    return proc


def test_second_process_refused_naming_pid_and_host(tmp_path):
    target = tmp_path / "out.jsonl"
    proc = _holder(target)
    try:
        with pytest.raises(Locked) as e:
            with hold_lock(target, "captioning"):
                pass
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith(f"{target}: in use by pid {proc.pid} on {socket.gethostname()}")
        assert "holding for a test" in msg
        assert isinstance(e.value, UserError) and e.value.pid == proc.pid
    finally:
        proc.terminate()
        proc.wait(10)
    with hold_lock(target, "captioning"):  # a holder that exited released it
        pass
    assert not lock_path(target).exists()  # the holder that finished took its file with it


def test_kill_9_holder_never_blocks(tmp_path):
    target = tmp_path / "run"
    proc = _holder(target)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10)
    assert lock_path(target).exists()  # left behind by the kill ...
    start = time.monotonic()
    with hold_lock(target, "training") as lock:  # ... and it does not block
        assert lock == lock_path(target)
        assert f"pid={os.getpid()}" in lock.read_text()
    assert time.monotonic() - start < 1


def test_a_stale_lock_file_is_not_the_lock(tmp_path):
    target = tmp_path / "run"
    lock_path(target).write_text("pid=1\nhost=elsewhere\nwhat=training\n")  # as a crashed holder leaves it
    with hold_lock(target, "training"):
        assert "host=elsewhere" not in lock_path(target).read_text()


def test_same_process_twice_is_refused_too(tmp_path):
    target = tmp_path / "out.csv"
    with hold_lock(target, "captioning to CSV"):
        with pytest.raises(Locked, match=f"pid {os.getpid()} "):
            with hold_lock(target, "captioning to CSV"):
                pass
    with hold_lock(target, "again"):
        pass


def test_released_when_the_block_fails(tmp_path):
    target = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with hold_lock(target, "training"):
            raise RuntimeError("boom")
    with hold_lock(target, "training"):
        pass
