"""Issue 29, items 12, 13 and 14: training's first hour. `train --threads N`; a run that says
why it stopped and what it saved; `--resume --max-steps N` on a run already at step N or past
it refused before any data; bf16 on a CPU that emulates it warned about; and a `caption --jsonl`
file that keeps to one precision when resumed."""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers import shape_image

import captionkit.core.precision as precision_module
from captionkit.cli.main import main
from captionkit.core.precision import resolve_precision
from captionkit.training.run import train


def _short(tiny_config, tmp_path, epochs: int = 1):
    """The tiny config for ``epochs`` epochs (one length penalty, greedy dev scores): seconds."""
    path = tmp_path / "short.toml"
    path.write_text(tiny_config.read_text().replace("epochs = 3", f"epochs = {epochs}")
                    .replace("length_penalties = [0.0, 1.0]", "length_penalties = [0.0]")
                    .replace("val_beam = 2", "val_beam = 1"))
    return path


# ---- item 12: --threads ------------------------------------------------------------------------
def test_train_threads_sets_torchs_thread_count(tiny_config, tmp_path, monkeypatch):
    """Was no option at all (argparse refused --threads); now it reaches torch.set_num_threads
    before the features are built, for the whole run."""
    asked: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", asked.append)  # recorded, not applied: other tests keep theirs
    assert main(["train", "--config", str(tiny_config), "--out", str(tmp_path / "run"), "--max-steps", "1",
                 "--threads", "1"]) == 0
    assert asked == [1]
    asked.clear()
    assert main(["train", "--config", str(tiny_config), "--out", str(tmp_path / "run2"), "--max-steps", "1"]) == 0
    assert asked == []  # no --threads: torch's default stays


@pytest.mark.parametrize("cpus,load,threads,advice", [(2, 3.0, 2, "--threads 1"), (2, 0.2, 2, None),
                                                      (2, 3.0, 1, None), (16, 6.2, 16, "--threads 10"),
                                                      (16, 15.8, 16, "--threads 1"), (16, 2.0, 16, "--threads 14")])
def test_a_loaded_machine_is_named_with_the_threads_option(monkeypatch, capsys, cpus, load, threads, advice):
    """Two torch threads on two cores that other work keeps busy ran 10x slower than one."""
    from captionkit.training.run import warn_busy_cores

    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    warn_busy_cores()
    err = capsys.readouterr().err
    if advice is None:
        assert err == ""
    else:
        assert err.startswith("warning: ") and err.endswith(f"; {advice} runs faster then\n") and err.count("\n") == 1


def test_the_command_warns_on_a_loaded_machine_and_the_python_api_does_not(tiny_config, tmp_path, monkeypatch,
                                                                           capsys):
    """A sweep's trials (train() from Python) share the cores by design: the line is the command's."""
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (6.0, 6.0, 6.0))
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert main(["train", "--config", str(tiny_config), "--out", str(tmp_path / "cli"), "--max-steps", "1"]) == 0
    assert capsys.readouterr().err.startswith("warning: the load on this machine (6.0 on 2 cores) leaves fewer than 2 ")
    train(tiny_config, out=tmp_path / "api", max_steps=1, progress=False)
    assert "warning" not in capsys.readouterr().err


def test_train_threads_must_be_positive(tiny_config, tmp_path, capsys, no_expensive_work):
    with pytest.raises(SystemExit):
        main(["train", "--config", str(tiny_config), "--out", str(tmp_path / "run"), "--threads", "0"])
    assert "--threads" in capsys.readouterr().err


# ---- item 13: the end of a run -----------------------------------------------------------------
def test_a_run_stopped_by_max_steps_says_so_and_where_it_saved(tiny_config, tmp_path, capsys):
    """Was silence after the progress line."""
    out = tmp_path / "run"
    assert main(["train", "--config", str(tiny_config), "--out", str(out), "--max-steps", "2"]) == 0
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == (f"stopped at --max-steps 2: saved {out / 'last'} (epoch 0, step 2); continue it with --resume "
                    f"and a larger --max-steps, or without one to train to the end")


def test_a_finished_run_says_its_epochs_are_done_and_names_the_best_checkpoint(tiny_config, tmp_path, capsys):
    out = tmp_path / "run"
    state = train(_short(tiny_config, tmp_path), out=out, progress=False)
    last = capsys.readouterr().err.splitlines()[-1]
    assert last == (f"all 1 epochs done: saved {out / 'best'} (epoch 1, dev CIDEr {100 * state.best_score:.2f}) "
                    f"and {out / 'last'} (epoch 1, step {state.step})")


def test_an_early_stop_says_so(tiny_config, tmp_path, capsys):
    """patience 1 and a min_delta no epoch can beat: the second epoch stops the run."""
    config = _short(tiny_config, tmp_path, epochs=3)
    config.write_text(config.read_text().replace("[train]", "[train]\npatience = 1\nmin_delta = 100.0"))
    out = tmp_path / "run"
    train(config, out=out, progress=False)
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"stopped early at epoch 2 (no CIDEr gain for 1 epochs): saved {out / 'best'} (epoch 1, ")


def test_resume_with_max_steps_the_run_has_reached_is_refused_before_any_data(tiny_config, tmp_path, capsys,
                                                                            monkeypatch):
    """Was a silent no-op that loaded everything and saved last/ again."""
    out = tmp_path / "run"
    train(tiny_config, out=out, max_steps=3, progress=False)
    saved = (out / "last" / "config.json").stat().st_mtime_ns
    capsys.readouterr()
    import captionkit.training.stages as stages

    def expensive(*a, **k):
        raise AssertionError("data loaded before the refusal")

    monkeypatch.setattr(stages, "load_dataset", expensive)
    for steps in ("3", "2"):
        assert main(["train", "--config", str(tiny_config), "--out", str(out), "--resume", "--max-steps", steps]) == 2
        assert capsys.readouterr().err == (
            f"captionkit train: error: {out}: the run is at step 3 already and --max-steps counts from its start, "
            f"so --max-steps {steps} leaves nothing to train; give more than 3, or leave it out to train to the end\n")
    assert (out / "last" / "config.json").stat().st_mtime_ns == saved


# ---- item 14: bf16 on a CPU that emulates it, and --jsonl's precision ---------------------------
@pytest.fixture
def emulated_bf16(monkeypatch):
    """A CPU without native bf16, and the once-per-process warning not given yet."""
    monkeypatch.setattr(precision_module, "native_bf16", lambda: False)
    precision_module._warn_emulated_bf16.cache_clear()
    yield
    precision_module._warn_emulated_bf16.cache_clear()


def test_bf16_on_a_cpu_without_it_warns_once(emulated_bf16, capsys):
    assert resolve_precision("bf16", "cpu") == "bf16"
    assert resolve_precision("bf16", "cpu") == "bf16"
    err = capsys.readouterr().err
    assert err.count("warning: precision bf16 on a CPU without native bf16") == 1 and err.count("\n") == 1
    assert "several times slower than fp32" in err
    assert resolve_precision("auto", "cpu") == "fp32" and resolve_precision("fp32", "cpu") == "fp32"
    assert capsys.readouterr().err == ""


def test_bf16_on_a_cpu_with_it_says_nothing(monkeypatch, capsys):
    monkeypatch.setattr(precision_module, "native_bf16", lambda: True)
    precision_module._warn_emulated_bf16.cache_clear()
    assert resolve_precision("bf16", "cpu") == "bf16" and resolve_precision("auto", "cpu") == "bf16"
    assert capsys.readouterr().err == ""


def _caption(folder, model, out, *extra) -> int:
    return main(["caption", str(folder), "--model", str(model), "--beam", "2", "--jsonl", str(out), *extra])


def test_a_jsonl_file_keeps_to_one_precision_when_resumed(tiny_run, tmp_path, capsys, emulated_bf16):
    """Was resumed whatever --precision said: one file could mix fp32 and bf16 captions."""
    photos = tmp_path / "in"
    photos.mkdir()
    for k in range(2):
        shape_image(k, size=64).save(photos / f"{k}.jpg")
    fp32, bf16 = tmp_path / "fp32.jsonl", tmp_path / "bf16.jsonl"
    assert _caption(photos, tiny_run / "best", fp32, "--precision", "fp32") == 0
    assert _caption(photos, tiny_run / "best", bf16, "--precision", "bf16") == 0
    assert "precision" not in json.loads((tmp_path / "fp32.jsonl.meta.json").read_text())["settings"]
    assert json.loads((tmp_path / "bf16.jsonl.meta.json").read_text())["settings"]["precision"] == "bf16"
    before = fp32.read_bytes(), bf16.read_bytes()
    capsys.readouterr()
    assert _caption(photos, tiny_run / "best", fp32, "--precision", "bf16") == 2
    assert capsys.readouterr().err == (
        f"captionkit caption: error: {fp32}: was written with --precision fp32, this run has --precision bf16 "
        f"(see fp32.jsonl.meta.json); use the same options to resume it, --overwrite to start it again, or write "
        f"to another file\n")
    assert _caption(photos, tiny_run / "best", bf16, "--precision", "auto") == 2  # auto is fp32 on this CPU
    err = capsys.readouterr().err
    assert "was written with --precision bf16, this run has --precision fp32" in err and err.count("\n") == 1
    assert (fp32.read_bytes(), bf16.read_bytes()) == before
    # the same precision resumes (nothing left to caption), however it was asked for
    assert _caption(photos, tiny_run / "best", fp32, "--precision", "auto") == 0
    assert _caption(photos, tiny_run / "best", bf16, "--precision", "bf16") == 0
    assert (fp32.read_bytes(), bf16.read_bytes()) == before
    assert os.path.exists(tmp_path / "bf16.jsonl.meta.json")
