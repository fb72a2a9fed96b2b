"""The one rule for what commands may write over (captionkit.core.outputs)."""

import os

import pytest

from captionkit.core.errors import OutputError
from captionkit.core.outputs import (
    MARKER,
    atomic_write_text,
    check_file_target,
    check_folder_target,
    owner_kind,
    write_marker,
)


def test_a_new_file_and_its_missing_parents_are_fine(tmp_path):
    assert check_file_target(tmp_path / "a" / "b.json", overwrite=False) == tmp_path / "a" / "b.json"


def test_an_existing_file_needs_overwrite(tmp_path):
    f = tmp_path / "caps.json"
    f.write_text("{}")
    with pytest.raises(OutputError, match="caps.json: exists; pass --overwrite"):
        check_file_target(f, overwrite=False)
    assert check_file_target(f, overwrite=True) == f


def test_a_folder_is_never_a_file_target(tmp_path):
    with pytest.raises(OutputError, match="is a folder"):
        check_file_target(tmp_path, overwrite=True)
    with pytest.raises(OutputError, match="is a folder"):
        check_file_target(f"{tmp_path}/new_folder/", overwrite=True)


def test_a_file_in_the_way_of_the_parent_is_refused(tmp_path):
    (tmp_path / "plain").write_text("x")
    with pytest.raises(OutputError, match="is a file, not a folder"):
        check_file_target(tmp_path / "plain" / "out.json", overwrite=True)


def test_a_fifo_is_never_replaced(tmp_path):
    fifo = tmp_path / "x.json"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="not a regular file"):
        check_file_target(fifo, overwrite=True)


def test_an_unrelated_folder_is_never_replaced_even_with_overwrite(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "thesis.tex").write_text("years of work")
    with pytest.raises(OutputError, match="is not empty; pass --overwrite"):
        check_folder_target(victim, overwrite=False)
    with pytest.raises(OutputError, match="was not written by captionkit"):
        check_folder_target(victim, overwrite=True)
    assert (victim / "thesis.tex").read_text() == "years of work"


def test_a_folder_captionkit_wrote_may_be_replaced_with_overwrite(tmp_path):
    ours = tmp_path / "ours"
    write_marker(ours, "onnx")
    assert owner_kind(ours) == "onnx"
    assert check_folder_target(ours, overwrite=True, kinds=("onnx",)) == ours
    with pytest.raises(OutputError, match="holds a captionkit onnx, not a checkpoint"):
        check_folder_target(ours, overwrite=True, kinds=("checkpoint",))
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text('{"format": "captionkit-checkpoint"}')
    assert owner_kind(tmp_path / "ck") == "checkpoint"
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / MARKER).write_text('{"written_by": "someone else"}')
    assert owner_kind(tmp_path / "fake") is None


def test_a_file_is_not_a_folder_target_and_empty_folders_are_fine(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(OutputError, match="is not a folder"):
        check_folder_target(tmp_path / "f", overwrite=True)
    (tmp_path / "empty").mkdir()
    assert check_folder_target(tmp_path / "empty", overwrite=False) == tmp_path / "empty"


def test_atomic_write_leaves_no_temporary_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "out.json"
    atomic_write_text(target, "old")

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]
