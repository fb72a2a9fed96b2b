"""Full disks and read-only folders (issue 30, item 2): a checkpoint and a JSONL file whose write
meets ENOSPC/EDQUOT/EROFS -- injected at the write call, or for real on a tiny tmpfs where this
machine lets the tests mount one -- leave the previous state intact (the earlier checkpoint
loads, the earlier lines are whole), and the user sees one line naming the path and the bytes;
the command exits non-zero. Training refuses to start a checkpoint the disk has no room for."""

from __future__ import annotations

import errno
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import shape_image

import captionkit.core.checkpoint as ckpt
import captionkit.inference.writer as writer_mod
from captionkit.cli.main import main
from captionkit.core.diskspace import DiskFull, ReadOnlyFolder
from captionkit.core.outputs import atomic_write_text


def _weights(n: int, value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((n,), value)}


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


def _one_line(err: str, *parts: str) -> str:
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


@pytest.fixture
def tiny_fs(tmp_path):
    """A 1 MB tmpfs mounted for the test (skipped where mounting is not allowed)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip() or r.returncode})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# --- checkpoints ---------------------------------------------------------------------------------

@pytest.mark.parametrize("code, why", [(errno.ENOSPC, "no space left"), (errno.EDQUOT, "disk quota exceeded")])
def test_checkpoint_that_fills_the_disk_leaves_the_previous_one(tmp_path, monkeypatch, code, why):
    folder = tmp_path / "last"
    ckpt.save_checkpoint(folder, _weights(1000, 1.0), {"state": 1}, {"m": torch.zeros(1000)})
    real, calls = ckpt.save_file, []

    def full_on_second(tensors, path):  # safetensors reports I/O failures as its own error type
        calls.append(path)
        if len(calls) == 2:
            real(tensors, path)  # part of it fits ...
            raise Exception(f"Error while serializing: I/O error: {os.strerror(code)} (os error {code})")
        return real(tensors, path)

    monkeypatch.setattr(ckpt, "save_file", full_on_second)
    with pytest.raises(DiskFull) as e:
        ckpt.save_checkpoint(folder, _weights(2000, 2.0), {"state": 2}, {"m": torch.zeros(2000)})
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{folder}: {why}") and "bytes" in msg
    assert e.value.needed >= 2 * 2000 * 4 and f"{folder} is as it was" in msg
    assert torch.equal(ckpt.read_weights(folder)["w"], torch.full((1000,), 1.0))  # the earlier one loads
    assert ckpt.read_config(folder)["state"] == 1
    assert _leftovers(folder) == []  # no half-written temporary folder stays to fill the disk


def test_checkpoint_in_a_read_only_folder_is_one_line(tmp_path, monkeypatch):
    folder = tmp_path / "best"
    ckpt.save_checkpoint(folder, _weights(10, 1.0), {})

    def read_only(*a, **k):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(ckpt.tempfile, "mkdtemp", read_only)
    with pytest.raises(ReadOnlyFolder, match=f"^{folder}: the folder is on a read-only file system"):
        ckpt.save_checkpoint(folder, _weights(10, 2.0), {})
    assert torch.equal(ckpt.read_weights(folder)["w"], torch.full((10,), 1.0))


def test_other_os_errors_stay_loud(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(ckpt.tempfile, "mkdtemp", broken)
    with pytest.raises(OSError) as e:
        ckpt.save_checkpoint(tmp_path / "x", _weights(10, 2.0), {})
    assert not isinstance(e.value, (DiskFull, ReadOnlyFolder)) and e.value.errno == errno.EIO


def test_on_a_real_full_disk(tiny_fs, monkeypatch):
    folder = tiny_fs / "last"
    ckpt.save_checkpoint(folder, _weights(50_000, 1.0), {})  # 200 kB
    # too big for what is free: refused before a byte is written, naming needed and free
    with pytest.raises(DiskFull) as e:
        ckpt.save_checkpoint(folder, _weights(400_000, 2.0), {})  # 1.6 MB
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{tiny_fs}: not starting the checkpoint {folder}: it needs 1.6 MB")
    assert e.value.free < e.value.needed and f"{e.value.free:,} bytes" in msg
    # where the estimate passes but the disk fills all the same (another writer took the room)
    monkeypatch.setattr(ckpt, "check_free", lambda *a: None)
    with pytest.raises(DiskFull, match=f"^{folder}: no space left on the device: the write needs"):
        ckpt.save_checkpoint(folder, _weights(230_000, 3.0), {})  # 920 kB: the old one must stay beside it
    assert torch.equal(ckpt.read_weights(folder)["w"], torch.full((50_000,), 1.0))
    assert _leftovers(folder) == []
    # a read-only remount: one line, the checkpoint still loads
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    with pytest.raises(ReadOnlyFolder, match=f"^{folder}: the folder is on a read-only"):
        ckpt.save_checkpoint(folder, _weights(10, 4.0), {})
    with pytest.raises(ReadOnlyFolder, match=f"^{tiny_fs / 'scores.json'}: the folder is on a read-only"):
        atomic_write_text(tiny_fs / "scores.json", "{}")
    assert torch.equal(ckpt.read_weights(folder)["w"], torch.full((50_000,), 1.0))


def test_atomic_file_write_on_a_full_disk_keeps_the_old_file(tiny_fs):
    target = tiny_fs / "summary.json"
    atomic_write_text(target, '{"old": true}')
    with pytest.raises(DiskFull) as e:
        atomic_write_text(target, "x" * 2_000_000)
    msg = str(e.value)
    assert msg.startswith(f"{target}: no space left on the device: the write needs 2.0 MB (2,000,000 bytes)")
    assert f"{target} is as it was" in msg and target.read_text() == '{"old": true}'
    assert sorted(p.name for p in tiny_fs.iterdir()) == ["summary.json"]  # no temporary file left


def test_training_stops_at_a_checkpoint_that_does_not_fit(tiny_config, tmp_path, monkeypatch, capsys):
    """captionkit train: the second save of ``last`` meets a full disk -> one line, exit 2, the
    first ``last`` still loads and resumes."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(tiny_config.read_text().replace("checkpoint_every = 0", "checkpoint_every = 1"))
    out = tmp_path / "run"
    real, saves = ckpt._write_checkpoint, []

    def full_on_second_save(folder, *a):
        if folder.name == "last":
            saves.append(folder)
            if len(saves) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(folder, *a)

    monkeypatch.setattr(ckpt, "_write_checkpoint", full_on_second_save)
    assert main(["train", "--config", str(cfg), "--out", str(out), "--max-steps", "3"]) == 2
    _one_line(capsys.readouterr().err, f"{out / 'last'}: no space left on the device", "bytes", "free in",
              f"{out / 'last'} is as it was")
    assert ckpt.read_config(out / "last")["state"]["step"] == 1  # the first save, whole
    ckpt.read_weights(out / "last")
    ckpt.read_weights(out / "last", "optimizer.safetensors")


# --- JSONL / CSV outputs ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("photos")
    for i in range(8):
        shape_image(i, size=64).save(d / f"p{i}.jpg")
    return d


def _full_after(monkeypatch, target: Path, lines: int, code: int = errno.ENOSPC) -> None:
    """os.write to ``target`` fills the disk after ``lines`` lines: the next line is half
    written, then ENOSPC (as a real disk does: a short write, then the error)."""
    real, written = os.write, []

    def write(fd, data):
        try:
            mine = os.path.samefile(f"/proc/self/fd/{fd}", target)
        except OSError:
            mine = False
        if not mine:
            return real(fd, data)
        if len(written) < lines:
            written.append(data)
            return real(fd, data)
        if not written or written[-1] is not None:
            written.append(None)
            return real(fd, data[:len(data) // 2])
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(writer_mod.os, "write", write)


@pytest.mark.parametrize("option", ["--jsonl", "--csv"])
def test_caption_file_that_fills_the_disk_keeps_whole_lines_and_resumes(photos, tiny_run, tmp_path, monkeypatch,
                                                                           capsys, option):
    full = tmp_path / f"full.{option[2:]}"
    cmd = ["caption", str(photos), "--model", str(tiny_run / "best"), "--beam", "2"]
    assert main(cmd + [option, str(full)]) == 0
    out = tmp_path / f"out.{option[2:]}"
    capsys.readouterr()
    with monkeypatch.context() as m:
        _full_after(m, out, lines=3)  # (the CSV's header is written whole when the file is made)
        assert main(cmd + [option, str(out)]) == 2
    _one_line(capsys.readouterr().err, f"{out}: no space left on the device: the write needs", "bytes",
              "3 images written before it are whole")
    head = full.read_text().splitlines(keepends=True)[:4 if option == "--csv" else 3]
    assert out.read_text() == "".join(head)  # the earlier lines, whole; no torn line
    assert main(cmd + [option, str(out)]) == 0  # the disk has room again: the rerun resumes
    assert "3 already done" in capsys.readouterr().err
    assert out.read_text() == full.read_text()


def test_caption_jsonl_into_a_read_only_folder(photos, tiny_run, tmp_path, monkeypatch, capsys):
    out = tmp_path / "caps.jsonl"
    cmd = ["caption", str(photos), "--model", str(tiny_run / "best"), "--beam", "2", "--jsonl", str(out)]
    with monkeypatch.context() as m:
        _full_after(m, out, lines=2, code=errno.EROFS)
        assert main(cmd) == 2
    _one_line(capsys.readouterr().err, f"{out}: the folder is on a read-only file system")
    assert [json.loads(line)["image"] for line in out.read_text().splitlines()] == ["p0.jpg", "p1.jpg"]


def test_caption_jsonl_on_a_real_read_only_mount(photos, tiny_run, tiny_fs, capsys):
    out = tiny_fs / "caps.jsonl"
    cmd = ["caption", str(photos), "--model", str(tiny_run / "best"), "--beam", "2", "--jsonl", str(out)]
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_fs)], check=True)
    assert main(cmd) == 2
    _one_line(capsys.readouterr().err, f"{out}: cannot write here: {tiny_fs} is on a read-only file system")
    assert not out.exists()


def test_a_folder_write_whose_library_hides_the_full_disk(tmp_path):
    """atomic_folder (exports, pack, ensembles): a library's own error type that names the
    system error in its text (safetensors, transformers' save_pretrained) is recognised too;
    the message gives what had fitted as a lower bound."""
    folder = tmp_path / "export"
    with pytest.raises(DiskFull) as e:
        with ckpt.atomic_folder(folder, kind="onnx") as tmp:
            (tmp / "model.onnx").write_bytes(b"x" * 5000)
            raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")
    assert str(e.value).startswith(f"{folder}: no space left on the device: "
                                   f"the write needs more than 5.0 kB (5,000 bytes)")
    assert not folder.exists() and _leftovers(folder) == []
    with pytest.raises(ValueError, match="^unrelated$"):  # anything else stays as it is
        with ckpt.atomic_folder(folder):
            raise ValueError("unrelated")


def test_an_append_on_a_real_full_disk_keeps_whole_lines(tiny_fs):
    """outputs.append_whole (a run's history.jsonl): the part of a line that fitted in the file's
    last block is cut off again when the disk refuses the rest."""
    from captionkit.core.outputs import append_whole

    history = tiny_fs / "history.jsonl"
    append_whole(history, b'{"epoch": 1}\n')
    fd = os.open(tiny_fs / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    line = b'{"epoch": 2, "pad": "' + b"x" * 6000 + b'"}\n'
    with pytest.raises(DiskFull, match=f"^{history}: no space left on the device: the write needs 6.0 kB"):
        append_whole(history, line)
    assert history.read_bytes() == b'{"epoch": 1}\n'


def test_a_file_system_that_reports_no_size_is_not_refused(tmp_path, monkeypatch):
    """Some FUSE/object-store mounts report 0 bytes total and free: the check lets the write try."""
    from types import SimpleNamespace

    import captionkit.core.diskspace as ds

    monkeypatch.setattr(ds.shutil, "disk_usage", lambda p: SimpleNamespace(total=0, used=0, free=0))
    ckpt.save_checkpoint(tmp_path / "last", _weights(10, 1.0), {})
    monkeypatch.setattr(ds.shutil, "disk_usage", lambda p: SimpleNamespace(total=10**9, used=10**9, free=10))
    with pytest.raises(DiskFull, match="only 10 bytes free"):
        ckpt.save_checkpoint(tmp_path / "last", _weights(10, 2.0), {})
