"""Experiments: sweeps (local and Ray Tune), the dev loss, curves, reports, TensorBoard."""

from __future__ import annotations

import csv
import json
import math
import re
import sys
import tomllib
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pytest
import torch

from captionkit.cli.main import main
from captionkit.core.checkpoint import read_config
from captionkit.core.errors import OutputError, UserError
from captionkit.experiments import sweep as sw
from captionkit.experiments.runs import find_runs, read_history

SWEEP_TRAIN = {"epochs": 2, "length_penalties": [0.0]}


def sweep_config(tiny_config: Path, folder: Path, **train) -> Path:
    """The tiny config with other [train] values (two epochs, one length penalty by default)."""
    d = tomllib.loads(tiny_config.read_text())
    d["train"].update({**SWEEP_TRAIN, **train})
    path = folder / "base.toml"
    path.write_text(sw.to_toml(d))
    return path


@pytest.fixture(scope="module")
def tiny_sweep(tiny_config, tmp_path_factory) -> Path:
    """A 4-trial local grid (lr x hidden_dim), run through the command line."""
    root = tmp_path_factory.mktemp("sweep")
    out = root / "grid"
    assert main(["sweep", "--config", str(sweep_config(tiny_config, root)), "--set", "train.lr=1e-2,1e-3",
                 "--set", "model.hidden_dim=16,24", "--out", str(out)]) == 0
    return out


# ---- overrides -------------------------------------------------------------------------------
def test_set_values_parse_as_toml_with_bare_strings_and_distributions():
    ax = sw.parse_set("train.length_penalties=[0.0, 1.0],[0.5]")
    assert ax.key == "train.length_penalties" and ax.values == [[0.0, 1.0], [0.5]]
    assert sw.parse_set("model.family=sat,transformer").values == ["sat", "transformer"]
    assert sw.parse_set("train.lr=1e-4, 3e-5").values == [1e-4, 3e-5]
    assert sw.parse_set("train.freeze_embeddings=true").values == [True]
    assert sw.parse_set("train.lr_groups={lora = 2e-4}").values == [{"lora": 2e-4}]
    assert sw.parse_set("train.lr=loguniform(1e-5, 1e-3)").dist == {"dist": "loguniform", "low": 1e-5, "high": 1e-3}
    for bad in ("lr=1", "train.lr", "train.lr=", "train.lr=loguniform(0, 1)", "train.lr=uniform(2, 1)"):
        with pytest.raises(ValueError, match="--set"):
            sw.parse_set(bad)


def test_grid_random_sample_and_draws_are_reproducible():
    axes = [sw.parse_set("train.lr=1,2,3"), sw.parse_set("model.hidden_dim=8,16")]
    grid = sw.trial_overrides(axes)
    assert grid[:3] == [{"train.lr": 1, "model.hidden_dim": 8}, {"train.lr": 1, "model.hidden_dim": 16},
                        {"train.lr": 2, "model.hidden_dim": 8}] and len(grid) == 6
    sample = sw.trial_overrides(axes, random_count=4, seed=3)
    assert len(sample) == 4 and all(s in grid for s in sample) and len({json.dumps(s) for s in sample}) == 4
    assert sample == sw.trial_overrides(axes, random_count=4, seed=3)
    with pytest.raises(ValueError, match="the grid has 6 combinations"):
        sw.trial_overrides(axes, random_count=7)
    draws = sw.trial_overrides([sw.parse_set("train.lr=loguniform(1e-5,1e-3)")], random_count=20, seed=0)
    assert all(1e-5 <= d["train.lr"] <= 1e-3 for d in draws) and len({d["train.lr"] for d in draws}) > 10
    with pytest.raises(ValueError, match="needs --random N"):
        sw.trial_overrides([sw.parse_set("train.lr=uniform(0,1)")])
    names = sw.trial_names(grid)
    assert names[1] == "001-lr=1-hidden_dim=16" and len(set(names)) == 6


def test_fields_that_vary_together_are_one_axis_of_inline_tables(tiny_config):
    ax = sw.parse_set('{model.hidden_dim = 16},{model.hidden_dim = 24, train.lr_groups.decoder = 1e-3}')
    trials = sw.trial_overrides([sw.parse_set("train.lr=1e-2"), ax])
    assert sw.trial_names(trials) == ["000-lr=0.01-hidden_dim=16", "001-lr=0.01-hidden_dim=24-decoder=0.001"]
    base = tomllib.loads(tiny_config.read_text())
    d = sw.apply_overrides(base, {**trials[1], "train.lr_groups.decoder": 2e-3}, "base.toml")
    assert d["model"] == {**base["model"], "hidden_dim": 24} and d["train"]["lr_groups"] == {"decoder": 2e-3}
    assert sw.override_columns(trials[1]) == {"train.lr": 1e-2, "model.hidden_dim": 24, "train.lr_groups.decoder": 1e-3}
    with pytest.raises(ValueError, match="expected inline tables"):
        sw.parse_set("{model.hidden_dim = 16},24")
    with pytest.raises(ValueError, match="expected TABLE.FIELD=VALUE"):
        sw.parse_set("model=16")


def test_overrides_are_validated_like_a_config_file_naming_the_field(tiny_config):
    base = tomllib.loads(tiny_config.read_text())
    d = sw.apply_overrides(base, {"train.lr": 3e-3, "train.lr_groups.decoder": 1e-4}, "base.toml")
    assert d["train"]["lr"] == 3e-3 and d["train"]["lr_groups"] == {"decoder": 1e-4}
    assert base["train"]["lr"] == 1e-2  # the base is left alone
    assert tomllib.loads(sw.to_toml(d)) == d
    with pytest.raises(ValueError, match=r"base.toml: unknown field\(s\) in \[train\]: lrr"):
        sw.apply_overrides(base, {"train.lrr": 1.0}, "base.toml")
    with pytest.raises(ValueError, match="train.optimizer must be one of adam, adamw, rmsprop"):
        sw.apply_overrides(base, {"train.optimizer": "sgd"}, "base.toml")
    with pytest.raises(ValueError, match=r"unknown field\(s\) in \[model\]: hidden"):
        sw.apply_overrides(base, {"model.hidden": 3}, "base.toml")
    with pytest.raises(ValueError, match="unknown table"):
        sw.apply_overrides(base, {"trian.lr": 1.0}, "base.toml")
    with pytest.raises(ValueError, match="train.lr_groups: the sat family has no parameter group 'lora'"):
        sw.apply_overrides(base, {"train.lr_groups.lora": 1e-4}, "base.toml")


def test_a_bad_override_is_one_line_before_any_training(tiny_config, tmp_path, capsys):
    out = tmp_path / "s"
    assert main(["sweep", "--config", str(tiny_config), "--set", "train.lr=1e-3,-1", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "with --set train.lr=-1" in err and "train.lr" in err
    assert not out.exists()


def test_sweep_folder_follows_the_write_rule(tiny_config, tmp_path):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(OutputError, match="not a captionkit sweep"):
        sw.define(tiny_config, ["train.lr=1e-3"], other)
    assert (other / "notes.txt").read_text() == "keep me"
    out = tmp_path / "s"
    first = sw.define(tiny_config, ["train.lr=1e-3,1e-2"], out)
    assert [t["name"] for t in first.trials] == ["000-lr=0.001", "001-lr=0.01"]
    assert json.loads((out / ".captionkit.json").read_text())["kind"] == "sweep"
    again = sw.define(tiny_config, ["train.lr=1e-3,1e-2"], out, engine="ray")  # the same sweep: taken up
    assert again.trials == first.trials
    with pytest.raises(OutputError, match="holds a different sweep"):
        sw.define(tiny_config, ["train.lr=1e-3,3e-3"], out)
    with pytest.raises(OutputError, match="holds a different sweep"):
        sw.define(tiny_config, ["train.lr=1e-3,1e-2"], out, metric="Bleu_4")


def test_ray_engine_without_ray_says_how_to_install_it(tiny_config, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray fails
    assert main(["sweep", "--config", str(tiny_config), "--set", "train.lr=1e-3", "--out", str(tmp_path / "s"),
                 "--engine", "ray"]) == 2
    assert "pip install 'captionkit[ray]'" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


# ---- sweeps ----------------------------------------------------------------------------------
@pytest.mark.slow  # the tiny_sweep fixture: 4 trials, ~30 s on the shared 2-core machine
def test_a_local_grid_gives_a_run_folder_per_trial_and_the_summary(tiny_sweep, capsys):
    trials = sorted(p.name for p in (tiny_sweep / "trials").iterdir())
    assert trials == ["000-lr=0.01-hidden_dim=16", "001-lr=0.01-hidden_dim=24",
                      "002-lr=0.001-hidden_dim=16", "003-lr=0.001-hidden_dim=24"]
    for name in trials:  # ordinary run folders of the ordinary trainer, each with its own config
        run = tiny_sweep / "trials" / name
        cfg = read_config(run / "best")["train"]
        lr, hidden = re.match(r"\d+-lr=([\d.]+)-hidden_dim=(\d+)", name).groups()
        assert cfg["train"]["lr"] == float(lr) and cfg["model"]["hidden_dim"] == int(hidden)
        assert [h["epoch"] for h in read_history(run)] == [1, 2]
        assert tomllib.loads((tiny_sweep / "configs" / f"{name}.toml").read_text())["train"]["lr"] == float(lr)
    rows = list(csv.DictReader((tiny_sweep / "summary.csv").open()))
    doc = json.loads((tiny_sweep / "summary.json").read_text())
    assert sorted(r["trial"] for r in rows) == trials and [r["trial"] for r in doc["trials"]] == [r["trial"] for r in rows]
    cider = [float(r["CIDEr"]) for r in rows]
    assert cider == sorted(cider, reverse=True)  # best first
    for r, d in zip(rows, doc["trials"]):
        assert r["status"] == "finished" and int(r["captions"]) == 2 * 45 and float(r["seconds"]) > 0
        history = read_history(tiny_sweep / "trials" / r["trial"])
        best = max(history, key=lambda h: h["CIDEr"])
        assert d["CIDEr"] == round(100 * best["CIDEr"], 2) and d["val_loss"] == round(best["val_loss"], 4)
        assert d["train.lr"] in (0.01, 0.001) and d["model.hidden_dim"] in (16, 24)
    assert {"train.lr", "model.hidden_dim", "Bleu_4", "CIDEr", "val_loss", "trained_parameters"} <= set(rows[0])


@pytest.mark.slow  # a sweep of training runs
def test_an_interrupted_sweep_resumes_without_repeating_finished_trials(tiny_config, tmp_path, monkeypatch):
    import captionkit.training.run as train_module
    real_train = train_module.train
    calls = []

    def interrupted(config, out, **kw):  # trial 1 is stopped after 3 steps, as by Ctrl-C
        calls.append((Path(out).name, kw["resume"]))
        if Path(out).name.startswith("001") and len(calls) == 2:
            real_train(config, out, **{**kw, "max_steps": 3})
            raise KeyboardInterrupt
        return real_train(config, out, **kw)

    monkeypatch.setattr(train_module, "train", interrupted)
    args = ["sweep", "--config", str(sweep_config(tiny_config, tmp_path)), "--set", "train.lr=1e-2,3e-3,1e-3",
            "--out", str(tmp_path / "s")]
    assert main(args) == 130
    # every trial is trained with --resume auto: it continues a trial's last checkpoint if there is one
    assert calls == [("000-lr=0.01", "auto"), ("001-lr=0.003", "auto")]
    assert sw.load_sweep(tmp_path / "s").status("001-lr=0.003")["status"] == "running"
    finished = (tmp_path / "s" / "trials" / "000-lr=0.01" / "best" / "model.safetensors").stat().st_mtime_ns
    calls.clear()
    assert main(args) == 0
    assert calls == [("001-lr=0.003", "auto"), ("002-lr=0.001", "auto")]  # trial 000 is not trained again
    assert (tmp_path / "s" / "trials" / "000-lr=0.01" / "best" / "model.safetensors").stat().st_mtime_ns == finished
    resumed = tmp_path / "s" / "trials" / "001-lr=0.003"
    assert [h["epoch"] for h in read_history(resumed)] == [1, 2]  # each epoch once
    assert read_config(resumed / "last")["state"]["step"] == 18
    rows = json.loads((tmp_path / "s" / "summary.json").read_text())["trials"]
    assert sorted(r["status"] for r in rows) == ["finished"] * 3


@pytest.mark.slow
def test_ray_tune_sweep_stops_a_weak_trial_early_with_asha(tiny_config, tmp_path, tiny_sweep):
    pytest.importorskip("ray.tune", reason="Ray Tune is not installed (pip install 'captionkit[ray]')")
    import ray
    out = tmp_path / "ray"
    # one trial at a time on a local Ray of 2 CPUs, so the strong trial reaches each rung first.
    # Ranked by the dev loss: the tiny model's CIDEr after one epoch is noise (0 for the trained
    # trials, 0.7 for an untrained one's captions). Measured at epoch 1: val_loss 2.86 at lr 3e-3,
    # 3.15 at lr 1e-5 (which barely moves); lr 1e-2 overshoots on the photo's features (4.89).
    try:
        assert main(["sweep", "--config", str(sweep_config(tiny_config, tmp_path, epochs=3)),
                     "--set", "train.lr=3e-3,1e-5", "--metric", "val_loss", "--out", str(out), "--engine", "ray",
                     "--cpus", "2", "--cpus-per-trial", "2"]) == 0
    finally:
        ray.shutdown()
    rows = {r["trial"]: r for r in json.loads((out / "summary.json").read_text())["trials"]}
    assert rows["000-lr=0.003"]["status"] == "finished" and rows["000-lr=0.003"]["epochs"] == 3
    assert rows["001-lr=1e-05"]["status"] == "stopped early" and rows["001-lr=1e-05"]["epochs"] < 3
    assert (out / "trials" / "001-lr=1e-05" / "best" / "config.json").is_file()
    # the same summary as a local sweep's: the same columns after the overrides
    local = json.loads((tiny_sweep / "summary.json").read_text())["columns"]
    remote = json.loads((out / "summary.json").read_text())["columns"]
    assert [c for c in remote if c != "train.lr"] == [c for c in local if c not in ("train.lr", "model.hidden_dim")]
    assert next(csv.reader((out / "summary.csv").open())) == remote


@pytest.fixture
def fake_ray(monkeypatch):
    """Ray Tune as run_ray calls it, without starting Ray: a Ray whose GPU count the test sets
    (``calls["gpus"]``); the resources each trial asks for, and the trainable, are recorded."""
    pytest.importorskip("ray.tune", reason="Ray Tune is not installed (pip install 'captionkit[ray]')")
    import ray
    from ray import tune

    calls: dict = {"gpus": 0}

    def with_resources(trainable, resources):
        calls.update(trainable=trainable, resources=resources)
        return trainable

    class Tuner:
        def __init__(self, trainable, **kwargs):
            pass

        def fit(self):
            return []

    def no_ray(**kwargs):
        raise AssertionError("Ray started")

    monkeypatch.setattr(ray, "is_initialized", lambda: calls.get("init", False))
    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0, **({"GPU": calls["gpus"]} if calls["gpus"] else {})})
    monkeypatch.setattr(tune, "with_resources", with_resources)
    monkeypatch.setattr(tune, "Tuner", Tuner)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # (the trainable sets its trial's)
    return calls


@pytest.mark.slow  # (importing Ray Tune: ~5 s)
@pytest.mark.parametrize("device, ray_gpus, given, wanted", [
    ("cuda", 2, None, 1.0), ("cuda:1", 2, None, 1.0), ("auto", 1, None, 1.0), ("auto", 0, None, 0.0),
    ("cpu", 2, None, 0.0), ("cuda", 2, 0.5, 0.5)])
def test_ray_trials_that_train_on_cuda_hold_a_gpu(fake_ray, tiny_config, tmp_path, monkeypatch, device, ray_gpus,
                                                  given, wanted):
    """Ray shows a trial only the GPUs it holds (none: CUDA_VISIBLE_DEVICES empty), so a trial
    of train.device cuda (or auto, on a Ray that has GPUs) must ask for one (issue 28, item 8).
    A trial's cuda:N becomes cuda: the GPU Ray gives it is its cuda:0."""
    fake_ray.update(init=True, gpus=ray_gpus)
    sweep = sw.define(sweep_config(tiny_config, tmp_path, device=device), ["train.lr=1e-2"], tmp_path / "s",
                      engine="ray")
    sw.run_ray(sweep, cpus_per_trial=1, gpus_per_trial=given)
    assert fake_ray["resources"] == {"cpu": 1, "gpu": wanted}
    ran = {}
    monkeypatch.setattr(sw, "run_trial", lambda sweep, name, on_epoch, device: ran.update(device=device))
    fake_ray["trainable"]({"trial": sweep.trials[0]["name"]})
    assert ran["device"] == ("cuda" if device == "cuda:1" else None)


@pytest.mark.slow  # (importing Ray Tune: ~5 s)
def test_ray_trials_on_cuda_without_a_gpu_to_hold_are_one_line_before_ray_starts(fake_ray, tiny_config, tmp_path):
    sweep = sw.define(sweep_config(tiny_config, tmp_path, device="cuda"), ["train.lr=1e-2,1e-3"], tmp_path / "s",
                      engine="ray")
    with pytest.raises(UserError, match=r"^--gpus-per-trial 0, but trial 000-lr=0.01 trains on cuda "):
        sw.run_ray(sweep, gpus_per_trial=0)
    fake_ray.update(init=True, gpus=0)  # a local Ray without GPUs: the trials would wait for ever
    with pytest.raises(UserError, match=r"^each trial needs 1 GPU\(s\) .* but this Ray has 0"):
        sw.run_ray(sweep)
    assert "resources" not in fake_ray


@pytest.mark.slow  # (importing Ray Tune: ~5 s)
def test_gpus_per_trial_reaches_the_ray_engine(fake_ray, tiny_config, tmp_path, monkeypatch):
    asked = []
    monkeypatch.setattr(sw, "run_ray", lambda sweep, **kwargs: asked.append(kwargs["gpus_per_trial"]) or [])
    for given in (["--gpus-per-trial", "0.5"], []):
        assert main(["sweep", "--config", str(tiny_config), "--set", "train.lr=1e-2", "--out", str(tmp_path / "s"),
                     "--engine", "ray", *given]) == 0
    assert asked == [0.5, None]  # None: as the trials' train.device asks (trial_gpus)


# ---- the dev loss and TensorBoard ------------------------------------------------------------
def test_each_validation_records_the_teacher_forced_dev_loss(tiny_run, flickr_dir):
    """history's val_loss of the last epoch is the per-token cross-entropy of the dev captions
    under the last checkpoint (on the cached features the trainer uses), computed here caption
    by caption, apart from the trainer."""
    from captionkit.data.datasets import load_dataset
    from captionkit.encoders.features import build_features
    from captionkit.inference.captioner import Captioner

    history = read_history(tiny_run)
    assert all(math.isfinite(h["val_loss"]) and h["val_loss"] > 0 for h in history)
    assert history[-1]["val_loss"] < history[0]["val_loss"]  # the tiny corpus generalises to dev
    cap = Captioner.load(tiny_run / "last")
    ds = load_dataset(str(flickr_dir))
    store = build_features(cap.encoder, [it.path for it in ds.all_items()])
    total, tokens = 0.0, 0
    with torch.no_grad():
        for it in ds.split("dev"):
            feats = torch.from_numpy(np.ascontiguousarray(store.rows([it.name]))).float()
            for words in it.words():
                ids = torch.tensor([cap.vocab.encode(words)])
                _, ce = cap.decoder.training_loss(feats, ids[:, :-1], ids[:, 1:], alpha_c=0.0)
                total += float(ce) * (ids.shape[1] - 1)
                tokens += ids.shape[1] - 1
    assert history[-1]["val_loss"] == pytest.approx(total / tokens, rel=2e-3)


@pytest.mark.slow  # a training run and TensorBoard
def test_train_writes_tensorboard_event_files_that_tensorboard_reads(tiny_config, tmp_path):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    cfg = sweep_config(tiny_config, tmp_path)
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "run"), "--tensorboard",
                 str(tmp_path / "tb")]) == 0
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"loss/train", "loss/dev", "dev/CIDEr", "dev/Bleu_4", "train/lr"} <= set(events.Tags()["scalars"])
    history = read_history(tmp_path / "run")
    for tag, key, scale in (("loss/train", "loss", 1), ("loss/dev", "val_loss", 1), ("dev/CIDEr", "CIDEr", 100)):
        got = [(s.step, s.value) for s in events.Scalars(tag)]
        assert [g[0] for g in got] == [h["step"] for h in history]
        np.testing.assert_allclose([g[1] for g in got], [scale * h[key] for h in history], rtol=1e-6)


# ---- curves and reports ----------------------------------------------------------------------
@pytest.mark.slow  # the tiny_sweep fixture: 4 trials, ~30 s on the shared 2-core machine
def test_plot_draws_one_line_per_run_in_every_panel(tiny_sweep, tmp_path, capsys):
    png, data = tmp_path / "curves.png", tmp_path / "curves.json"
    assert main(["plot", str(tiny_sweep), "--out", str(png), "--data", str(data),
                 "--metrics", "loss,val_loss,CIDEr"]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    series = json.loads(data.read_text())
    assert [p["metric"] for p in series["panels"]] == ["loss", "val_loss", "CIDEr"]
    labels = {"lr=0.01, hidden_dim=16", "lr=0.01, hidden_dim=24", "lr=0.001, hidden_dim=16", "lr=0.001, hidden_dim=24"}
    for panel in series["panels"]:
        assert len(panel["lines"]) == 4
        assert {" ".join(sorted(l["label"].split(", "))) for l in panel["lines"]} == \
            {" ".join(sorted(l.split(", "))) for l in labels}  # the legend names what differs
        for line in panel["lines"]:
            history = read_history(line["run"])
            assert line["x"] == [45, 90]  # captions seen
            scale = 100 if panel["metric"] == "CIDEr" else 1
            assert line["y"] == pytest.approx([scale * h[panel["metric"]] for h in history])
    # the same again is refused without --overwrite; by epochs with it
    assert main(["plot", str(tiny_sweep), "--out", str(png)]) == 2
    assert main(["plot", str(tiny_sweep), "--out", str(png), "--data", str(data), "--x", "epochs", "--overwrite"]) == 0
    assert json.loads(data.read_text())["panels"][0]["lines"][0]["x"] == [1, 2]
    assert main(["plot", str(tiny_sweep), "--out", str(tmp_path / "x.png"), "--metrics", "SPICE"]) == 2
    assert "no run recorded 'SPICE'" in capsys.readouterr().err


class _Page(HTMLParser):
    """What a report shows: its images, the run labels of the caption table, external links."""

    def __init__(self):
        super().__init__()
        self.images, self.rows, self.external, self.text = [], [], [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "img":
            self.images.append(a)
        if tag == "tr" and "data-image" in a:
            self.rows.append(a["data-image"])
        for key in ("src", "href"):
            if a.get(key) and not a[key].startswith("data:"):
                self.external.append(a[key])
        if tag == "link":
            self.external.append(a)

    def handle_data(self, data):
        self.text.append(data)


@pytest.mark.slow  # the tiny_sweep fixture: 4 trials, ~30 s on the shared 2-core machine
def test_report_holds_every_run_and_image(tiny_sweep, tiny_run, tmp_path, flickr_dir):
    out = tmp_path / "report.html"
    data = tmp_path / "report.json"
    assert main(["report", str(tiny_sweep), "--out", str(out), "--images", "3", "--metrics", "bleu,rouge,cider",
                 "--bootstrap", "50", "--data", str(data)]) == 0
    page = _Page()
    page.feed(out.read_text())
    text = " ".join(page.text)
    assert page.external == []  # self-contained
    runs = find_runs([tiny_sweep])
    for r in runs:  # in the runs table, the scores table and under every image
        assert text.count(r.label) >= 2 + 3
    from captionkit.data.datasets import load_dataset
    dev = [it.name for it in load_dataset(str(flickr_dir)).split("dev")]
    assert page.rows == dev[:3]
    photos = [i for i in page.images if i["src"].startswith("data:image/jpeg;base64,")]
    assert [i["alt"] for i in photos] == dev[:3]
    assert any(i["src"].startswith("data:image/png;base64,") for i in page.images)  # the curves
    assert text.count("[") >= 4 * 6  # an interval beside every score
    for ref in load_dataset(str(flickr_dir)).split("dev")[0].raw:
        assert ref in text
    # --data: the same runs, every dev image's caption, and scores that these captions give again
    from captionkit.scoring.evaluation import score_captions
    saved = json.loads(data.read_text())
    assert [r["label"] for r in saved["runs"]] == [r.label for r in runs] and saved["split"] == "dev"
    refs = {it.name: it.raw for it in load_dataset(str(flickr_dir)).split("dev")}
    for r in saved["runs"]:
        assert sorted(r["captions"]) == sorted(dev) and set(r["intervals"]) == set(r["scores"])
        again = score_captions(r["captions"], refs, quiet=True, metrics=["bleu", "rouge", "cider"]).scores
        assert again == pytest.approx(r["scores"], abs=1e-12)


def test_report_max_images_scores_the_splits_first_images_only(tiny_run, tmp_path, flickr_dir):
    from captionkit.data.datasets import load_dataset
    from captionkit.scoring.evaluation import score_captions
    dev = load_dataset(str(flickr_dir)).split("dev")
    assert len(dev) > 2
    out, data = tmp_path / "report.html", tmp_path / "report.json"
    assert main(["report", str(tiny_run), "--out", str(out), "--images", "1", "--max-images", "2",
                 "--metrics", "bleu,cider", "--bootstrap", "0", "--data", str(data)]) == 0
    saved = json.loads(data.read_text())
    assert saved["images"] == 2 and sorted(saved["runs"][0]["captions"]) == sorted(it.name for it in dev[:2])
    again = score_captions(saved["runs"][0]["captions"], {it.name: it.raw for it in dev[:2]}, quiet=True,
                           metrics=["bleu", "cider"]).scores
    assert again == pytest.approx(saved["runs"][0]["scores"], abs=1e-12)
    assert f"its first 2 of {len(dev)} images" in out.read_text()


def test_report_attention_is_kept_only_where_it_says_something():
    from captionkit.experiments.report import _attention
    from captionkit.inference.captioner import Result
    peaked = Result(["a", "dog"], torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]]), (2, 2))
    flat = Result(["a", "dog"], torch.full((2, 4), 0.25), (2, 2))
    assert _attention(peaked, keep=True)["attention"][1] == [0.1, 0.1, 0.1, 0.7]
    assert "attention" not in _attention(flat, keep=True)
