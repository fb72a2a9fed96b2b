"""Two writers (issue 30, item 3), with real processes: two ``train --out same`` and two
``caption --jsonl same.jsonl`` at once -- the second is refused in one line naming the first
one's pid and host; then the first is killed with SIGKILL and the next run goes (the lock dies
with its holder; the lock file it leaves is not what blocks)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import shape_image

from captionkit.core.locks import lock_path

ROOT = Path(__file__).resolve().parents[1]
# a captionkit command whose writes of caption lines are slowed (0.2 s each), so that it is still
# writing when the second one starts; everything else is the real command line
SLOW_CAPTION = """
import sys, time
import captionkit.inference.writer as w
write = w._Output.write
def slow(self, *a):
    time.sleep(0.2)
    return write(self, *a)
w._Output.write = slow
from captionkit.cli.main import main
raise SystemExit(main(sys.argv[1:]))
"""


def _env() -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return env


def _wait(cond, proc: subprocess.Popen, what: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert proc.poll() is None, f"the first process ended before {what}"
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.05)


def _refused(r: subprocess.CompletedProcess, target: Path, holder: subprocess.Popen, what: str) -> None:
    assert r.returncode == 2, r.stderr
    errors = [line for line in r.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, r.stderr
    assert f"{target}: in use by pid {holder.pid} on {socket.gethostname()} ({what})" in errors[0]


@pytest.mark.slow  # child processes: several seconds
def test_two_trainings_into_one_run_folder(tiny_config, tmp_path):
    cfg = tmp_path / "long.toml"
    cfg.write_text(tiny_config.read_text().replace("epochs = 3", "epochs = 1000")
                   .replace("checkpoint_every = 0", "checkpoint_every = 1\npatience = 1000"))
    out = tmp_path / "run"
    train = [sys.executable, "-m", "captionkit", "train", "--config", str(cfg), "--out", str(out)]
    first = subprocess.Popen(train, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: (out / "last" / "config.json").is_file(), first, "its first checkpoint")
        for extra in ([], ["--resume"], ["--overwrite"]):  # however the second is started
            second = subprocess.run(train + extra + ["--max-steps", "1"], env=_env(), capture_output=True,
                                    text=True, timeout=300)
            _refused(second, out, first, "training")
        assert first.poll() is None  # the first trains on, undisturbed
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    assert lock_path(out).exists()  # the killed holder left its lock file ...
    third = subprocess.run(train + ["--overwrite", "--max-steps", "2"], env=_env(), capture_output=True, text=True,
                           timeout=300)
    assert third.returncode == 0, third.stderr  # ... which does not block the next run
    assert not lock_path(out).exists()


@pytest.fixture(scope="module")
def many_photos(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("many")
    for i in range(40):
        shape_image(i, size=48, jitter=i % 5).save(d / f"p{i:03d}.jpg")
    return d


@pytest.mark.slow  # child processes: several seconds
@pytest.mark.parametrize("option", ["--jsonl", "--csv"])
def test_two_captionings_into_one_file(many_photos, tiny_run, tmp_path, option):
    out = tmp_path / f"caps.{option[2:]}"
    args = ["caption", str(many_photos), "--model", str(tiny_run / "best"), "--beam", "2", option, str(out)]
    first = subprocess.Popen([sys.executable, "-c", SLOW_CAPTION, *args], env=_env(), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        _wait(lambda: out.is_file() and out.read_text().count("\n") >= 2, first, "its first lines")
        second = subprocess.run([sys.executable, "-m", "captionkit", *args], env=_env(), capture_output=True,
                                text=True, timeout=300)
        _refused(second, out, first, f"writing captions to {option[2:].upper()}")
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(30)
    done = out.read_text().count("\n")
    third = subprocess.run([sys.executable, "-m", "captionkit", *args], env=_env(), capture_output=True,
                           text=True, timeout=300)
    assert third.returncode == 0, third.stderr  # the kill -9'd holder does not block: it resumes
    header = option == "--csv"
    assert f"{done - header} already done" in third.stderr
    lines = out.read_text().splitlines()[header:]
    keys = [json.loads(line)["image"] if option == "--jsonl" else line.split(",")[0] for line in lines]
    assert sorted(keys) == [f"p{i:03d}.jpg" for i in range(40)]  # each image once


def test_a_file_written_between_the_check_and_the_lock_is_read_again(tmp_path):
    """Two runs that both passed the early check: the one that takes the lock second resumes
    what the first wrote instead of starting the file again over it."""
    from captionkit.inference.writer import JsonlOutput

    out, settings = tmp_path / "caps.jsonl", {"command": "caption", "model": "m"}
    late, early = JsonlOutput(out, settings, overwrite=False), JsonlOutput(out, settings, overwrite=False)
    early.open(set())
    early.write("a.jpg", "a red circle", None)
    early.close()
    late.open(set())  # it read a missing file when constructed; the file is there now
    assert late.done == {"a.jpg"}  # so it resumes after the first one's line, not over it
    late.write("b.jpg", "a blue square", None)
    late.close()
    assert [json.loads(line)["image"] for line in out.read_text().splitlines()] == ["a.jpg", "b.jpg"]
