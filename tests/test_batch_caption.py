"""captionkit caption DIR --jsonl/--csv: unreadable images listed, resumable after a kill."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import shape_image

from captionkit.cli import main


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("batch")
    for i in range(24):
        sub = d / ("a" if i < 12 else "b")
        sub.mkdir(exist_ok=True)
        shape_image(i, size=64, jitter=i % 5).save(sub / f"p{i:03d}.jpg")
    (d / "a" / "broken.jpg").write_bytes(b"not a photo")
    (d / "b" / "empty.png").write_bytes(b"")
    return d


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _run(folder, model, *extra) -> int:
    return main(["caption", str(folder), "--model", str(model), "--beam", "2", "--batch-size", "4", *extra])


def test_jsonl_lists_captions_and_unreadable_images(folder, tiny_run, tmp_path, capsys):
    out = tmp_path / "caps.jsonl"
    assert _run(folder, tiny_run / "best", "--jsonl", str(out)) == 1  # two unreadable images
    captured = capsys.readouterr()
    recs = _jsonl(out)
    assert len(recs) == 26 and len({r["image"] for r in recs}) == 26
    errors = {r["image"]: r["error"] for r in recs if "error" in r}
    assert set(errors) == {"broken.jpg", "empty.png"} and "empty file" in errors["empty.png"]
    assert all(r["caption"] for r in recs if "error" not in r)
    assert "26/26 images" in captured.err and "images/s" in captured.err
    assert captured.out == ""  # batch mode writes the file, not one line per image
    # the same captions as the one-line-per-image mode
    _run(folder, tiny_run / "best")
    lines = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
    assert lines == {r["image"]: r["caption"] for r in recs if "error" not in r}


def test_resume_skips_done_images_and_drops_a_torn_line(folder, tiny_run, tmp_path, capsys):
    full = tmp_path / "full.jsonl"
    _run(folder, tiny_run / "best", "--jsonl", str(full))
    lines = full.read_text().splitlines(keepends=True)
    part = tmp_path / "part.jsonl"
    part.write_text("".join(lines[:9]) + lines[9][:15])  # 9 lines and a torn tenth
    capsys.readouterr()
    _run(folder, tiny_run / "best", "--jsonl", str(part))
    err = capsys.readouterr().err
    assert "torn last line" in err and "9 already done" in err and "17/17 images" in err
    assert part.read_text() == full.read_text()
    # a third run has nothing left to do and changes nothing
    assert _run(folder, tiny_run / "best", "--jsonl", str(part)) == 0
    assert "0/0 images" in capsys.readouterr().err and part.read_text() == full.read_text()


def test_csv_output_and_resume(folder, tiny_run, tmp_path, capsys):
    out = tmp_path / "caps.csv"
    _run(folder, tiny_run / "best", "--csv", str(out))
    rows = list(csv.reader(out.open()))
    assert rows[0] == ["image", "caption", "error"] and len(rows) == 27
    text = out.read_text()
    out.write_text("".join(text.splitlines(keepends=True)[:5]))
    _run(folder, tiny_run / "best", "--csv", str(out))
    assert out.read_text() == text


def test_foreign_file_is_refused(folder, tiny_run, tmp_path, capsys):
    out = tmp_path / "notes.jsonl"
    out.write_text("hello\nworld\n")
    assert _run(folder, tiny_run / "best", "--jsonl", str(out)) == 2
    assert "notes.jsonl:1: not a captionkit JSONL line" in capsys.readouterr().err


def test_kill_and_resume_gives_the_uninterrupted_output(folder, tiny_run, tmp_path):
    """A real SIGKILL in the middle of a run, then the same command again."""
    cmd = [sys.executable, "-m", "captionkit", "caption", str(folder), "--model", str(tiny_run / "best"),
           "--beam", "2", "--batch-size", "1", "--workers", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    full = tmp_path / "full.jsonl"
    subprocess.run(cmd + ["--jsonl", str(full)], env=env, capture_output=True, timeout=300)
    out = tmp_path / "killed.jsonl"
    p = subprocess.Popen(cmd + ["--jsonl", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or out.read_text().count("\n") < 3):
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    n_before = out.read_bytes().count(b"\n")
    assert 3 <= n_before < 26, "the run should have been killed part-way"
    r = subprocess.run(cmd + ["--jsonl", str(out)], env=env, capture_output=True, text=True, timeout=300)
    assert f"{n_before} already done" in r.stderr
    assert out.read_text() == full.read_text()
