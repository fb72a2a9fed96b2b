import json
import os
import stat
from pathlib import Path

import pytest
import torch

from captionkit.core.checkpoint import CheckpointError, atomic_folder, read_config, read_weights, save_checkpoint
from captionkit.inference.captioner import Captioner
from captionkit.training.config import RunConfig
from captionkit.training.run import train
from captionkit.training.schedule import length_batches


def test_length_batches_hold_one_length_each_and_cover_everything():
    lengths = [3, 5, 3, 7, 5, 5, 3, 3, 9]
    batches = length_batches(lengths, batch_size=2, seed=1)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len({lengths[i] for i in b}) == 1 for b in batches)
    assert batches == length_batches(lengths, batch_size=2, seed=1)


def test_config_errors_name_the_field(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[data]\ndataset = "x"\n[train]\nlearning_rate = 1.0\n')
    with pytest.raises(ValueError, match=r"bad.toml: unknown field\(s\) in \[train\]: learning_rate"):
        RunConfig.load(bad)
    bad.write_text('[data]\ndataset = "x"\n[train]\noptimizer = "sgd"\n')
    with pytest.raises(ValueError, match="bad.toml: train.optimizer must be one of adam, adamw, rmsprop, not .sgd."):
        RunConfig.load(bad)


def test_init_on_the_command_line_replaces_the_configs(tmp_path):
    cfg = tmp_path / "scst.toml"
    cfg.write_text('[data]\ndataset = "x"\n[train]\ninit = "runs/a/best"\nobjective = "scst"\n')
    assert RunConfig.load(cfg).train.init == "runs/a/best"
    assert RunConfig.load(cfg, init="elsewhere/best").train.init == "elsewhere/best"
    # a config that builds its own model cannot also start from a checkpoint's
    cfg.write_text('[data]\ndataset = "x"\n[model]\nembed_dim = 8\n')
    with pytest.raises(ValueError, match=r"scst.toml: with train.init the model comes from that checkpoint"):
        RunConfig.load(cfg, init="elsewhere/best")


@pytest.mark.slow  # three short trainings
def test_set_on_the_command_line_trains_what_the_edited_file_trains(tiny_config, tmp_path):
    """`train --set train.seed=3 --set train.lr=5e-3` trains what a copy of the config with those
    two fields trains, weight for weight, and not what the file alone trains; the run records
    the fields as set."""
    from captionkit.cli.main import main
    edited = tmp_path / "edited.toml"
    edited.write_text(tiny_config.read_text().replace("lr = 1e-2\n", "lr = 5e-3\nseed = 3\n"))
    runs = {"edited": ["--config", str(edited)],
            "set": ["--config", str(tiny_config), "--set", "train.seed=3", "--set", "train.lr=5e-3"],
            "file": ["--config", str(tiny_config)]}
    for name, args in runs.items():
        assert main(["train", *args, "--out", str(tmp_path / name), "--max-steps", "4"]) == 0
    w = {name: read_weights(tmp_path / name / "last") for name in runs}
    assert w["set"].keys() == w["edited"].keys() == w["file"].keys()
    assert all(torch.equal(w["set"][k], w["edited"][k]) for k in w["set"])
    assert not all(torch.equal(w["set"][k], w["file"][k]) for k in w["set"])
    saved = read_config(tmp_path / "set" / "last")["train"]["train"]  # (the run config as trained)
    assert (saved["seed"], saved["lr"]) == (3, 5e-3)


@pytest.mark.slow  # a short training, resumed twice
def test_a_resume_says_which_fields_differ_from_the_run(tiny_config, tmp_path, capsys):
    """Resuming with a --set (or an edited file) that changes the fields of the checkpoint resumed
    from says which, in one line (more epochs may be meant; a forgotten --set shows); the same
    config says nothing."""
    from captionkit.cli.main import main
    run = ["train", "--config", str(tiny_config), "--out", str(tmp_path / "run")]
    assert main([*run, "--set", "train.seed=3", "--max-steps", "2"]) == 0
    capsys.readouterr()
    assert main([*run, "--resume", "--max-steps", "3", "--set", "train.epochs=4"]) == 0
    err = capsys.readouterr().err
    assert f"{tmp_path / 'run'}: resuming with train.epochs = 4 (was 3); train.seed = 0 (was 3)\n" in err
    # (compared with the checkpoint resumed from, which the last resume wrote with its fields)
    assert main([*run, "--resume", "--max-steps", "4", "--set", "train.epochs=4"]) == 0
    assert "resuming with" not in capsys.readouterr().err


def test_set_goes_to_every_process_of_nproc(tiny_config, tmp_path, monkeypatch):
    """--nproc N starts N copies of the command: each gets the same --set fields, as given."""
    from captionkit.cli.main import main
    from captionkit.training import distributed
    got = {}
    monkeypatch.setattr(distributed, "launch", lambda nproc, args: got.update(nproc=nproc, args=args) or 0)
    assert main(["train", "--config", str(tiny_config), "--out", str(tmp_path / "run"), "--nproc", "2",
                 "--set", "train.seed=3", "--set", "train.optimizer=adamw"]) == 0
    assert got["nproc"] == 2
    i = got["args"].index("--set")
    assert got["args"][i:i + 4] == ["--set", "train.seed=3", "--set", "train.optimizer=adamw"]


def test_auto_precision_uses_bf16_only_where_the_cpu_has_it(monkeypatch):
    from captionkit.core import precision
    for native, want in ((True, "bf16"), (False, "fp32")):
        monkeypatch.setattr(precision, "native_bf16", lambda native=native: native)
        assert precision.resolve_precision("auto") == want
        assert precision.resolve_precision("fp32") == "fp32" and precision.resolve_precision("bf16") == "bf16"
    with pytest.raises(ValueError, match="precision fp16 needs a CUDA device"):
        precision.resolve_precision("fp16")
    with pytest.raises(ValueError, match="precision must be one of auto, bf16, fp16, fp32, not 'fp8'"):
        precision.resolve_precision("fp8")
    with pytest.raises(ValueError, match="train.precision must be one of"):
        RunConfig.from_dict({"data": {"dataset": "x"}, "train": {"precision": "fp8"}})


def test_training_run_writes_best_and_last_with_history(tiny_run):
    cfg = read_config(tiny_run / "best")
    assert cfg["state"]["epoch"] >= 1 and cfg["state"]["best_score"] is not None
    assert len(cfg["vocab"]) > 4 and cfg["encoder"]["grid"] == [7, 7]
    search = cfg["length_penalty_search"]
    assert set(search["scores"]) == {"0.0", "1.0"}
    assert search["scores"][str(cfg["decoding"]["length_penalty"])] == max(search["scores"].values())
    last = read_config(tiny_run / "last")
    assert last["state"]["epoch"] == 3
    model = Captioner.load(tiny_run / "best").decoder
    assert cfg["trained_parameters"] == {"decoder": sum(p.numel() for p in model.parameters()),
                                         "total": sum(p.numel() for p in model.parameters())}
    assert set(read_weights(tiny_run / "last", "optimizer.safetensors")) >= {"rng.torch"}
    hist = [json.loads(l) for l in (tiny_run / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == [1, 2, 3] and all("CIDEr" in h and "Bleu_4" in h for h in hist)
    assert hist[-1]["loss"] < 0.7 * hist[0]["loss"]  # the tiny shapes corpus is learnable


@pytest.mark.slow  # training runs
@pytest.mark.parametrize("schedule", ["", 'schedule = "cosine"\nwarmup_steps = 4\n'])
def test_resume_continues_the_step_count_and_matches_an_unbroken_run(tiny_config, tmp_path, schedule):
    """Also with a warm-up and a cosine schedule: the resumed run's learning rate goes on along
    the same curve (schedule.lr_factor reads the saved step), not from the warm-up's start."""
    if schedule:  # (the [train] table is the config's last)
        scheduled = tmp_path / "scheduled.toml"
        scheduled.write_text(tiny_config.read_text() + schedule)
        tiny_config = scheduled
    broken, whole = tmp_path / "broken", tmp_path / "whole"
    train(tiny_config, out=broken, max_steps=3, progress=False)
    assert read_config(broken / "last")["state"]["step"] == 3
    train(tiny_config, out=broken, max_steps=5, resume=True, progress=False)
    assert read_config(broken / "last")["state"]["step"] == 5
    train(tiny_config, out=whole, max_steps=5, progress=False)
    a, b = read_weights(broken / "last"), read_weights(whole / "last")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # training runs
def test_a_run_resumed_mid_epoch_reports_whole_epochs(tiny_config, tmp_path):
    """The history of a run stopped inside its first epoch and resumed counts that epoch's
    captions and mean loss as the unbroken run does (its time includes both parts). The unbroken
    run is trained here, beside the resumed one, not taken from the session's tiny_run: in a
    fresh-clone CI run the session's tiny_run differed from a run made here by 4e-4 of the loss
    (the test alone passed; the cause in the session's state was not found). The tiny config's
    lr 1e-2 lets a float difference grow over two epochs."""
    out, unbroken = tmp_path / "resumed", tmp_path / "unbroken"
    train(tiny_config, out=unbroken, progress=False)
    train(tiny_config, out=out, max_steps=3, progress=False)
    assert read_config(out / "last")["state"]["epoch_progress"]["seen"] > 0
    train(tiny_config, out=out, resume=True, progress=False)
    resumed, whole = ([json.loads(l) for l in (run / "history.jsonl").read_text().splitlines()]
                      for run in (out, unbroken))
    assert [h["captions"] for h in resumed] == [h["captions"] for h in whole]
    assert whole[0]["captions"] == whole[1]["captions"] > 0  # every caption, each epoch
    for a, b in zip(resumed, whole):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4)


def test_checkpoint_round_trip_gives_identical_captions(tiny_run, tmp_path):
    cap = Captioner.load(tiny_run / "best", with_encoder=False)
    feats = torch.randn(4, 49, 1280).abs()
    before = [c.ids for c in cap.decode_features(feats, beam=2)]
    cfg = read_config(tiny_run / "best")
    save_checkpoint(tmp_path / "copy", cap.decoder.state_dict(), cfg)
    again = Captioner.load(tmp_path / "copy", with_encoder=False)
    assert [c.ids for c in again.decode_features(feats, beam=2)] == before


def test_incompatible_checkpoint_gets_a_clear_error(tiny_run, tmp_path):
    cfg = read_config(tiny_run / "best")
    cfg["model"] = dict(cfg["model"], hidden_dim=cfg["model"]["hidden_dim"] + 1)
    save_checkpoint(tmp_path / "bad", read_weights(tiny_run / "best"), cfg)
    with pytest.raises(CheckpointError, match=r"bad: weights do not fit the model its config describes"):
        Captioner.load(tmp_path / "bad")
    cfg["model"] = dict(cfg["model"], colour="blue")
    save_checkpoint(tmp_path / "bad2", read_weights(tiny_run / "best"), cfg)
    with pytest.raises(CheckpointError, match=r"incompatible config .*colour"):
        Captioner.load(tmp_path / "bad2")
    with pytest.raises(CheckpointError, match="no such model folder"):
        Captioner.load(tmp_path / "nothing")


def test_a_failed_save_keeps_the_previous_checkpoint(tiny_run, tmp_path, monkeypatch):
    import captionkit.core.checkpoint as ck
    w = read_weights(tiny_run / "best")
    cfg = {"family": "sat", "note": "first"}
    save_checkpoint(tmp_path / "ck", w, cfg)

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(OSError):
        save_checkpoint(tmp_path / "ck", w, {"family": "sat", "note": "second"})
    assert read_config(tmp_path / "ck")["note"] == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # no temporary left behind


def test_the_models_own_length_penalty_is_the_default(tiny_run, tmp_path):
    from captionkit.inference.decoding import beam_search
    cfg = read_config(tiny_run / "best")
    cfg["decoding"] = dict(cfg["decoding"], length_penalty=1.0)
    save_checkpoint(tmp_path / "lp", read_weights(tiny_run / "best"), cfg)
    cap = Captioner.load(tmp_path / "lp", with_encoder=False)
    feats = torch.randn(3, 49, 1280).abs()
    want = beam_search(cap.decoder, feats, beam=3, max_len=cap.max_len, length_penalty=1.0)
    assert [c.ids for c in cap.decode_features(feats, beam=3)] == [c.ids for c in want]


def test_atomic_folder_publishes_on_success_only(tmp_path):
    out = tmp_path / "export"
    out.mkdir()  # an empty folder is replaced
    with atomic_folder(out) as tmp:
        (tmp / "a.txt").write_text("a")
        assert not (out / "a.txt").exists()  # nothing visible before the block ends
    assert (out / "a.txt").read_text() == "a"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's private 0o700
    failed = tmp_path / "failed"
    with pytest.raises(RuntimeError), atomic_folder(failed) as tmp:
        (tmp / "half.txt").write_text("half")
        raise RuntimeError("killed")
    assert not failed.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["export"]


def test_every_recipe_in_configs_loads():
    recipes = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))
    assert recipes
    for path in recipes:
        RunConfig.load(path)  # raises, naming the file and field, on a bad recipe


@pytest.mark.slow  # training runs
def test_keep_epochs_keeps_the_last_n_epochs_to_average(tiny_config, tmp_path):
    """train.keep_epochs = 2 of 3 epochs: epoch-2 and epoch-3 stay (epoch-3 is the last epoch's
    weights), epoch-1 goes; resumed for two more epochs the run keeps epoch-4 and epoch-5 and leaves
    alone a folder of the user's named like them. Without the field no epoch is kept."""
    from captionkit.cli.main import main

    kept = tmp_path / "kept.toml"
    kept.write_text(tiny_config.read_text() + "keep_epochs = 2\n")  # (the [train] table is the last)
    out = tmp_path / "run"
    train(kept, out=out, progress=False)
    assert sorted(p.name for p in out.glob("epoch-*")) == ["epoch-2", "epoch-3"]
    last, third, second = (read_weights(out / n) for n in ("last", "epoch-3", "epoch-2"))
    assert all(torch.equal(last[k], third[k]) for k in last)
    assert any(not torch.equal(second[k], third[k]) for k in second)
    assert not (out / "epoch-3" / "optimizer.safetensors").exists()
    assert read_config(out / "epoch-2")["state"]["epoch"] == 2
    # the kept epochs are checkpoints of one model: `average` takes them
    assert main(["average", str(out / "epoch-2"), str(out / "epoch-3"), "--out", str(tmp_path / "soup")]) == 0
    soup = read_weights(tmp_path / "soup")
    k = next(k for k in soup if soup[k].is_floating_point() and not torch.equal(second[k], third[k]))
    torch.testing.assert_close(soup[k], (second[k] + third[k]) / 2)
    (out / "epoch-1").mkdir()  # the user's, before the run goes on
    (out / "epoch-1" / "notes.txt").write_text("mine")
    longer = tmp_path / "longer.toml"
    longer.write_text(kept.read_text().replace("epochs = 3", "epochs = 5"))
    train(longer, out=out, resume=True, progress=False)
    assert sorted(p.name for p in out.glob("epoch-*")) == ["epoch-1", "epoch-4", "epoch-5"]
    assert (out / "epoch-1" / "notes.txt").read_text() == "mine"
    plain = tmp_path / "plain"
    train(tiny_config, out=plain, max_steps=2, progress=False)
    assert not list(plain.glob("epoch-*"))


def test_prune_epochs_removes_older_epoch_checkpoints_and_their_leftovers(tmp_path):
    """What keep_epochs removes: epoch-J checkpoints of J below the cut, and what killed saves of
    them left (a temporary folder, a .old); a later epoch, and a folder of the user's named like
    an epoch, stay."""
    from captionkit.core.checkpoint import epoch_names, prune_epochs

    w = {"x": torch.ones(2)}
    for k in (1, 3):
        save_checkpoint(tmp_path / f"epoch-{k}", w, {"state": {"epoch": k}})
    (tmp_path / ".epoch-1.abcd1234").mkdir()  # a killed save of epoch 1
    (tmp_path / ".epoch-2.old").mkdir()  # a save of epoch 2 killed after its first rename
    (tmp_path / "epoch-0").mkdir()
    (tmp_path / "epoch-0" / "notes.txt").write_text("mine")
    assert epoch_names(tmp_path) == ["epoch-0", "epoch-1", "epoch-2", "epoch-3"]
    prune_epochs(tmp_path, keep_from=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch-0", "epoch-3"]
    assert (tmp_path / "epoch-0" / "notes.txt").read_text() == "mine"
    assert torch.equal(read_weights(tmp_path / "epoch-3")["x"], w["x"])
