"""Nothing lost: what pack, train --out, export onnx, merge-lora and features do with a target
that exists (issue 17, point 1; the rule is captionkit.core.outputs, the table docs/outputs.md).
Every refusal is one line, comes before any expensive work, and leaves the target as it was."""

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from captionkit.cli.main import main
from captionkit.core.checkpoint import read_config, read_weights
from captionkit.core.errors import CheckpointError, OutputError
from captionkit.core.outputs import MARKER, owner_kind, write_marker


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(capsys, command: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"captionkit {command}: error: ") and err.count("\n") == 1 and "Traceback" not in err
    return err


@pytest.fixture
def victim(tmp_path) -> Path:
    """A user's folder that has nothing to do with captionkit."""
    folder = tmp_path / "victim"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    return folder


# ---- pack ---------------------------------------------------------------------------------------
def test_pack_never_replaces_an_unrelated_folder_or_a_file(tiny_run, victim, tmp_path, capsys):
    before = snapshot(victim)
    assert main(["pack", str(tiny_run / "best"), str(victim)]) == 2
    assert "victim: exists and is not empty; pass --overwrite" in one_line_error(capsys, "pack")
    assert main(["pack", str(tiny_run / "best"), str(victim), "--overwrite"]) == 2
    assert "was not written by captionkit" in one_line_error(capsys, "pack")
    assert snapshot(victim) == before
    plain = tmp_path / "notes.txt"
    plain.write_text("not a folder")
    assert main(["pack", str(tiny_run / "best"), str(plain), "--overwrite"]) == 2
    assert "exists and is not a folder" in one_line_error(capsys, "pack")
    assert plain.read_text() == "not a folder"


def test_pack_replaces_its_own_checkpoint_only_with_overwrite(tiny_run, tmp_path, capsys):
    out = tmp_path / "packed"
    assert main(["pack", str(tiny_run / "best"), str(out)]) == 0
    assert owner_kind(out) == "checkpoint" and (out / MARKER).is_file()
    assert not (out / "optimizer.safetensors").exists()
    capsys.readouterr()
    assert main(["pack", str(tiny_run / "best"), str(out), "--fp16"]) == 2
    assert "pass --overwrite" in one_line_error(capsys, "pack")
    assert {str(v.dtype) for v in read_weights(out).values()} == {"torch.float32"}
    assert main(["pack", str(tiny_run / "best"), str(out), "--fp16", "--overwrite"]) == 0
    assert {str(v.dtype) for v in read_weights(out).values()} == {"torch.float16"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packed"]  # no temporary or .old left


def test_pack_refuses_other_captionkit_folders_and_itself(tiny_run, tmp_path, capsys):
    export = tmp_path / "export"
    write_marker(export, "onnx")
    assert main(["pack", str(tiny_run / "best"), str(export), "--overwrite"]) == 2
    assert "holds a captionkit onnx, not a checkpoint" in one_line_error(capsys, "pack")
    copy = tmp_path / "copy"
    shutil.copytree(tiny_run / "best", copy)
    assert main(["pack", str(copy), str(copy), "--overwrite"]) == 2
    assert "is the checkpoint being packed" in one_line_error(capsys, "pack")
    assert (copy / "model.safetensors").read_bytes() == (tiny_run / "best" / "model.safetensors").read_bytes()


# ---- train --out --------------------------------------------------------------------------------
@pytest.fixture
def finished_run(tiny_run, tmp_path) -> Path:
    """A copy of a finished run (best, last, history.jsonl), as written before folders were marked."""
    run = tmp_path / "existing"
    shutil.copytree(tiny_run, run)
    (run / MARKER).unlink(missing_ok=True)
    return run


def test_train_into_a_finished_run_without_resume_is_refused(tiny_config, finished_run, no_expensive_work, capsys):
    before = snapshot(finished_run)
    assert main(["train", "--config", str(tiny_config), "--out", str(finished_run)]) == 2
    err = one_line_error(capsys, "train")
    assert "existing: holds a training run; pass --resume to continue it" in err and "another --out" in err
    assert snapshot(finished_run) == before  # last/, best/ and history.jsonl untouched


def test_resume_with_nothing_to_resume_is_an_error(tiny_config, tmp_path, no_expensive_work, capsys):
    for out in (tmp_path / "missing", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        assert main(["train", "--config", str(tiny_config), "--out", str(out), "--resume"]) == 2
        assert "no checkpoint to resume" in one_line_error(capsys, "train")
    assert not (tmp_path / "missing").exists() and not any((tmp_path / "empty").iterdir())


def test_train_never_writes_into_an_unrelated_folder(tiny_config, victim, no_expensive_work, capsys):
    before = snapshot(victim)
    for extra in ([], ["--overwrite"], ["--resume"]):
        assert main(["train", "--config", str(tiny_config), "--out", str(victim), *extra]) == 2
        one_line_error(capsys, "train")
    assert snapshot(victim) == before


def test_resume_and_overwrite_together_are_refused(tiny_config, finished_run, no_expensive_work, capsys):
    assert main(["train", "--config", str(tiny_config), "--out", str(finished_run), "--resume", "--overwrite"]) == 2
    assert "not both" in one_line_error(capsys, "train")


def test_resume_with_another_model_config_is_refused_before_any_work(tiny_config, finished_run, tmp_path,
                                                                     no_expensive_work, capsys):
    other = tmp_path / "other.toml"
    other.write_text(tiny_config.read_text().replace("hidden_dim = 24", "hidden_dim = 32"))
    assert main(["train", "--config", str(other), "--out", str(finished_run), "--resume"]) == 2
    assert "trained with model.hidden_dim = 24, the config says 32" in one_line_error(capsys, "train")


def test_train_overwrite_starts_a_marked_run_again(tiny_config, finished_run):
    from captionkit.training.run import train
    train(tiny_config, out=finished_run, max_steps=2, overwrite=True, progress=False)
    assert owner_kind(finished_run) == "run"
    assert sorted(p.name for p in finished_run.iterdir()) == [MARKER, "last"]  # the old best and history are gone
    assert read_config(finished_run / "last")["state"]["step"] == 2


def test_resuming_a_run_written_before_markers_marks_it(tiny_config, finished_run):
    from captionkit.training.run import train
    step = read_config(finished_run / "last")["state"]["step"]
    train(tiny_config, out=finished_run, resume=True, progress=False)  # (all its epochs done: nothing to train)
    assert json.loads((finished_run / MARKER).read_text())["kind"] == "run"
    assert read_config(finished_run / "last")["state"]["step"] == step


def test_a_new_run_folder_is_marked_and_resumable(tiny_run):
    assert json.loads((tiny_run / MARKER).read_text())["kind"] == "run"
    assert owner_kind(tiny_run / "best") == "checkpoint"


# ---- export onnx, merge-lora, the Hugging Face exports -------------------------------------------
@pytest.mark.parametrize("command", [["export", "onnx", "--model", "no-such-model"],
                                     ["merge-lora", "--model", "no-such-model"]])
def test_exports_refuse_an_unrelated_folder_before_loading_the_model(command, victim, no_expensive_work, capsys):
    before = snapshot(victim)
    for extra in ([], ["--overwrite"]):
        assert main([*command, "--out", str(victim), *extra]) == 2
        err = one_line_error(capsys, " ".join(command[:2]) if command[0] == "export" else command[0])
        assert "victim: " in err and "no-such-model" not in err
    assert snapshot(victim) == before


def test_export_replaces_its_own_export_only_with_overwrite(tiny_run, tmp_path, monkeypatch):
    """The folder rule of export_onnx; the graphs themselves are test_export's (a real export
    takes seconds), so here a stand-in writes the export's files."""
    import captionkit.export.exporters as export
    from captionkit.inference.captioner import Captioner

    def write(captioner, out, *args):
        (out / "step.onnx").write_bytes(b"graph")
        (out / "manifest.json").write_text(json.dumps({"format": "captionkit-onnx"}))

    monkeypatch.setattr(export, "_write_onnx", write)
    out = tmp_path / "exp"
    cap = Captioner.load(tiny_run / "best")
    export.export_onnx(cap, out)
    assert owner_kind(out) == "onnx" and sorted(p.name for p in out.iterdir()) == [MARKER, "manifest.json", "step.onnx"]
    with pytest.raises(OutputError, match="exp: exists and is not empty; pass --overwrite"):
        export.export_onnx(cap, out)
    (out / "step.onnx").write_bytes(b"stale")
    export.export_onnx(cap, out, overwrite=True)
    assert (out / "step.onnx").read_bytes() == b"graph"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no temporary or .old left
    (out / MARKER).unlink()  # an export written before folders were marked: its manifest says what it is
    assert owner_kind(out) == "onnx"
    export.export_onnx(cap, out, overwrite=True)
    write_marker(tmp_path / "ck", "checkpoint")
    with pytest.raises(OutputError, match="holds a captionkit checkpoint, not a onnx"):
        export.export_onnx(cap, tmp_path / "ck", overwrite=True)


# ---- features -----------------------------------------------------------------------------------
def test_features_refuse_a_cache_that_is_a_file_and_a_folder_they_did_not_write(tmp_path, flickr_dir,
                                                                                monkeypatch, capsys):
    from captionkit.encoders import create_encoder
    from captionkit.encoders.features import _folder_for, build_features

    cache = tmp_path / "cache-file"
    cache.write_text("not a folder")
    monkeypatch.setenv("CAPTIONKIT_CACHE", str(cache))
    assert main(["features", "--dataset", str(flickr_dir), "--encoder", "efficientnet_lite0"]) == 2
    assert "cache-file: is a file, not a folder" in one_line_error(capsys, "features")
    assert main(["features", "--dataset", str(flickr_dir), "--encoder", "vgg20"]) == 2
    assert "unknown encoder 'vgg20'" in one_line_error(capsys, "features")

    enc = create_encoder("patches")
    paths = sorted((flickr_dir / "Flicker8k_Dataset").glob("*.jpg"))[:2]
    root = tmp_path / "cache"
    folder = _folder_for(root, enc, paths)
    folder.mkdir(parents=True)
    (folder / "mine.txt").write_text("someone else's")
    with pytest.raises(OutputError, match="holds files captionkit did not write"):
        build_features(enc, paths, root=root, progress=False)
    assert sorted(p.name for p in folder.iterdir()) == ["mine.txt"]
    (folder / "mine.txt").unlink()
    store = build_features(enc, paths, root=root, progress=False)
    assert len(store.index) == 2 and owner_kind(folder) == "features"
    assert len(build_features(enc, paths, root=root, progress=False).index) == 2  # reused, not refused


# ---- weights files -------------------------------------------------------------------------------
class _Payload:
    def __reduce__(self):
        return (os.system, (f"touch {self.flag}",))


def test_a_malicious_weights_pickle_is_one_line_without_unsafe_advice(tiny_config, tmp_path, capsys):
    flag = tmp_path / "pwned"
    payload = _Payload()
    payload.flag = flag
    evil = tmp_path / "encoder.weights"
    evil.write_bytes(pickle.dumps({"state_dict": payload}))
    from captionkit.encoders import create_encoder
    with pytest.raises(CheckpointError) as e:
        create_encoder("efficientnet_lite0", weights=str(evil))
    msg = str(e.value)
    assert msg.startswith(f"{evil}: not a readable weights file") and "\n" not in msg
    assert "weights_only" not in msg and not flag.exists()
    cfg = tmp_path / "evil.toml"
    cfg.write_text(tiny_config.read_text().replace('weights = "random"', f'weights = "{evil}"'))
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("captionkit train: error: ") and "Traceback" not in err
    assert "not a readable weights file" in err and "weights_only" not in err and not flag.exists()
