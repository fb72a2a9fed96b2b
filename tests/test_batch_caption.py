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
from helpers import shape_image

from captionkit.cli.main import main
from captionkit.core.precision import resolve_precision


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
    # a third run has nothing left to do and changes nothing, but says that two images failed
    assert _run(folder, tiny_run / "best", "--jsonl", str(part)) == 1
    err = capsys.readouterr().err
    assert "0/0 images" in err and part.read_text() == full.read_text()
    assert "2 of 26 images could not be captioned (2 in an earlier run)" in err and "--retry-failed" in err


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


@pytest.mark.slow  # child processes killed and resumed
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


# --- issue 17: batch captioning you can trust ---------------------------------------------------

def _photos(d: Path, names: list[str]) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for k, name in enumerate(names):
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        shape_image(k, size=64).save(d / name, format="PNG" if name.endswith(".png") else "JPEG")
    return d


def test_a_rerun_with_failures_says_so_and_retry_failed_captions_them(tiny_run, tmp_path, capsys):
    d = _photos(tmp_path / "in", ["a.jpg", "b.jpg", "c.jpg"])
    (d / "bad.jpg").write_bytes(b"not yet a photo")
    jsonl, csv_out = tmp_path / "caps.jsonl", tmp_path / "caps.csv"
    outs = ["--jsonl", str(jsonl), "--csv", str(csv_out)]
    assert _run(d, tiny_run / "best", *outs) == 1
    assert _run(d, tiny_run / "best", *outs) == 1  # nothing to do, but the failure is still there
    err = capsys.readouterr().err
    assert "1 of 4 images could not be captioned (1 in an earlier run)" in err and "--retry-failed" in err
    shape_image(5, size=64).save(d / "bad.jpg")  # the user fixes the photo
    assert _run(d, tiny_run / "best", *outs, "--retry-failed") == 0
    assert "1/1 images" in capsys.readouterr().err
    recs = _jsonl(jsonl)
    assert sorted(r["image"] for r in recs) == ["a.jpg", "b.jpg", "bad.jpg", "c.jpg"]  # one line each
    assert all("error" not in r and r["caption"] for r in recs)
    rows = list(csv.reader(csv_out.open()))
    assert sorted(r[0] for r in rows[1:]) == ["a.jpg", "b.jpg", "bad.jpg", "c.jpg"] and all(r[2] == "" for r in rows[1:])
    assert _run(d, tiny_run / "best", *outs) == 0


def test_resuming_with_other_settings_is_refused_and_names_the_option(tiny_run, tmp_path, capsys):
    d = _photos(tmp_path / "in", ["a.jpg", "b.jpg"])
    out = tmp_path / "caps.jsonl"
    assert _run(d, tiny_run / "best", "--jsonl", str(out)) == 0  # (_run uses --beam 2)
    meta = json.loads((tmp_path / "caps.jsonl.meta.json").read_text())
    native = resolve_precision("auto", "cpu") == "bf16"  # a CPU that multiplies bf16: auto's captions are bf16's
    assert meta["settings"] == {"command": "caption", "model": str((tiny_run / "best").resolve()), "onnx": None,
                                "beam": 2, "length_penalty": None, **({"precision": "bf16"} if native else {})}
    before = out.read_bytes()
    capsys.readouterr()
    for extra, named in ((["--beam", "3"], "--beam 2, this run has --beam 3"),
                         (["--length-penalty", "0.5"],
                          "with the model's length penalty (no --length-penalty), this run has --length-penalty 0.5")):
        assert main(["caption", str(d), "--model", str(tiny_run / "best"), "--beam", "2", "--jsonl", str(out),
                     *extra]) == 2
        err = capsys.readouterr().err
        assert named in err and err.count("\n") == 1 and out.read_bytes() == before
    assert _run(d, tiny_run / "last", "--jsonl", str(out)) == 2
    err = capsys.readouterr().err
    assert (f"caps.jsonl: was written with --model {(tiny_run / 'best').resolve()}, "
            f"this run has --model {(tiny_run / 'last').resolve()} (see caps.jsonl.meta.json)") in err
    # the same model spelt another way resumes; --overwrite starts again with the new settings
    assert _run(d, Path(os.path.relpath(tiny_run / "best")), "--jsonl", str(out)) == 0
    assert out.read_bytes() == before
    assert _run(d, tiny_run / "last", "--jsonl", str(out), "--overwrite") == 0
    assert len(_jsonl(out)) == 2
    assert json.loads((tmp_path / "caps.jsonl.meta.json").read_text())["settings"]["model"].endswith("last")


def test_a_resume_refusal_names_the_options_the_user_typed(tiny_run, tmp_path, capsys):
    """Issue 29, item 15: `--rerank mbr` was refused as `--nbest null, this run has --nbest 5`
    (an option the user never typed, in JSON); `--tta flip` as `--tta null`."""
    d = _photos(tmp_path / "in", ["a.jpg", "b.jpg"])
    out = tmp_path / "caps.jsonl"
    assert _run(d, tiny_run / "best", "--jsonl", str(out)) == 0
    capsys.readouterr()
    for extra, named in ((["--rerank", "mbr"], "was written with no --rerank, this run has --rerank mbr"),
                         (["--tta", "flip"], "was written with no --tta, this run has --tta flip")):
        assert _run(d, tiny_run / "best", "--jsonl", str(out), *extra) == 2
        err = capsys.readouterr().err
        assert f"caps.jsonl: {named} (see caps.jsonl.meta.json)" in err and err.count("\n") == 1, err
        assert "null" not in err and "--nbest" not in err
    rerank = tmp_path / "rerank.jsonl"
    assert _run(d, tiny_run / "best", "--jsonl", str(rerank), "--rerank", "mbr") == 0
    capsys.readouterr()
    assert _run(d, tiny_run / "best", "--jsonl", str(rerank)) == 2
    assert "was written with --rerank mbr, this run has no --rerank" in capsys.readouterr().err


def test_a_file_from_before_settings_were_recorded_resumes_and_records_them(tiny_run, tmp_path, capsys):
    d = _photos(tmp_path / "in", ["a.jpg", "b.jpg"])
    out = tmp_path / "old.jsonl"
    out.write_text('{"image": "a.jpg", "caption": "a thing"}\n')
    assert _run(d, tiny_run / "best", "--jsonl", str(out)) == 0
    assert "no record of the settings" in capsys.readouterr().err
    assert [r["image"] for r in _jsonl(out)] == ["a.jpg", "b.jpg"]
    assert json.loads((tmp_path / "old.jsonl.meta.json").read_text())["settings"]["beam"] == 2


def test_non_regular_and_unsupported_files_are_named_never_silently_skipped(tiny_run, tmp_path, capsys):
    d = _photos(tmp_path / "in", ["a.jpg", "sub/b.png"])
    (d / "notes.txt").write_text("hello")
    (d / "README").write_text("hello")
    (d / "data.json").write_text("{}")
    (d / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    (d / "alias.jpg").symlink_to(d / "a.jpg")  # a link to a photo is a photo
    os.mkfifo(d / "pipe.jpg")
    (d / "elsewhere").symlink_to(tmp_path, target_is_directory=True)
    assert _run(d, tiny_run / "best") == 0
    out, err = capsys.readouterr()
    assert sorted(line.split("\t")[0] for line in out.splitlines()) == ["a.jpg", "alias.jpg", "b.png"]
    head = [line for line in err.splitlines() if line.startswith("skipped")]
    assert len(head) == 1 and head[0].startswith("skipped 6 files that are not images to caption: ")
    for name, why in (("README", "no extension"), ("data.json", "unsupported extension '.json'"),
                      ("elsewhere", "symbolic link to a folder (not followed)"),
                      ("gone.jpg", "dangling symbolic link"), ("notes.txt", "unsupported extension '.txt'")):
        assert f"{d / name} ({why})" in head[0]
    assert "--verbose lists them all" in head[0] and "pipe.jpg" not in head[0]  # the sixth and after
    assert _run(d, tiny_run / "best", "--verbose") == 0
    err = capsys.readouterr().err
    assert f"  {d / 'pipe.jpg'}: not a regular file (a FIFO)" in err.splitlines()


def test_a_fifo_named_on_the_command_line_is_refused_not_read(tiny_run, tmp_path, capsys):
    import threading

    d = _photos(tmp_path / "in", ["a.jpg"])
    fifo = d / "x.jpg"
    os.mkfifo(fifo)
    stop = threading.Event()

    def unblock():  # should anything open the FIFO to read, give it end-of-file instead of a hang
        while not stop.wait(0.05):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:  # ENXIO: nobody is reading it
                pass

    threading.Thread(target=unblock, daemon=True).start()
    try:
        rc = main(["caption", str(fifo), str(d / "a.jpg"), "--model", str(tiny_run / "best"),
                   "--jsonl", str(tmp_path / "o.jsonl")])
    finally:
        stop.set()
    assert rc == 1
    recs = {r["image"]: r for r in _jsonl(tmp_path / "o.jsonl")}
    assert recs["x.jpg"]["error"] == f"{fifo}: not a regular file (a FIFO); refused" and recs["a.jpg"]["caption"]


def test_file_names_that_are_not_utf8_are_captioned_and_escaped(tiny_run, tmp_path, capsys):
    d = _photos(tmp_path / "in", ["a.jpg"])
    raw = os.fsencode(d) + b"/caf\xe9 \xff.jpg"  # Latin-1 bytes: not UTF-8
    (d / "a.jpg").rename(os.fsdecode(raw))
    _photos(d, ["b.jpg"])
    jsonl, js, figs = tmp_path / "o.jsonl", tmp_path / "o.json", tmp_path / "figs"
    assert _run(d, tiny_run / "best", "--jsonl", str(jsonl), "--csv", str(tmp_path / "o.csv")) == 0
    assert sorted(r["image"] for r in _jsonl(jsonl)) == ["b.jpg", "caf\\xe9 \\xff.jpg"]
    assert "caf\\xe9 \\xff.jpg," in (tmp_path / "o.csv").read_text()
    assert _run(d, tiny_run / "best", "--jsonl", str(jsonl)) == 0  # resumes: the escaped key matches
    assert "2 already done" in capsys.readouterr().err
    assert _run(os.fsdecode(raw), tiny_run / "best", "--json", str(js), "--attention", str(figs)) == 0
    printed = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
    assert set(printed) == set(json.loads(js.read_text())) == {"caf\\xe9 \\xff.jpg"}
    assert (figs / "caf\\xe9 \\xff.jpg.png").is_file()


def test_attention_figure_names_never_collide(tiny_run, tmp_path, capsys):
    d = _photos(tmp_path / "in", ["x.jpg", "x.png", "a/y.jpg", "b/y.jpg", "X.jpg"])
    figs = tmp_path / "figs"
    assert _run(d, tiny_run / "best", "--attention", str(figs)) == 0
    names = sorted(p.name for p in figs.iterdir() if p.suffix == ".png")
    assert len(names) == 5 and len({n.casefold() for n in names}) == 5  # case-insensitive disks too
    assert {"X.jpg.png", "x.png.png"} <= set(names) and sum(n.startswith("x.jpg~") for n in names) == 1
    assert f"{d}/a/y.jpg".replace("/", "%2F") + ".png" in names  # a shared name is keyed by its path
    # a second run into the same folder needs --overwrite; a folder captionkit did not write is never used
    assert _run(d, tiny_run / "best", "--attention", str(figs)) == 2
    assert "pass --overwrite" in capsys.readouterr().err
    assert _run(d / "x.png", tiny_run / "best", "--attention", str(figs), "--overwrite") == 0
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "holiday.png").write_bytes(b"mine")
    assert _run(d, tiny_run / "best", "--attention", str(mine), "--overwrite") == 2
    assert "was not written by captionkit" in capsys.readouterr().err
    assert [p.name for p in mine.iterdir()] == ["holiday.png"]


def test_a_folder_does_not_caption_the_attention_figures_an_earlier_run_wrote(tiny_run, tmp_path, capsys):
    """Issue 29, item 16: `caption .` after `caption . --attention figs` captioned the figures."""
    d = _photos(tmp_path / "in", ["a.jpg", "b.jpg"])
    assert _run(d, tiny_run / "best", "--attention", str(d / "figs")) == 0
    assert sorted(p.name for p in (d / "figs").glob("*.png")) == ["a.jpg.png", "b.jpg.png"]
    capsys.readouterr()
    assert _run(d, tiny_run / "best", "--json", str(tmp_path / "caps.json")) == 0
    assert sorted(json.loads((tmp_path / "caps.json").read_text())) == ["a.jpg", "b.jpg"]
    assert f"{d / 'figs'} (attention figures captionkit wrote (not captioned))" in capsys.readouterr().err
    # named itself, the folder is captioned: the user asked for it
    assert _run(d / "figs", tiny_run / "best", "--json", str(tmp_path / "figs.json")) == 0
    assert sorted(json.loads((tmp_path / "figs.json").read_text())) == ["a.jpg.png", "b.jpg.png"]
