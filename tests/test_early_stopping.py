"""Early stopping with patience and a minimum delta, on a scripted sequence of dev scores
(validation is replaced, training runs for real on the tiny shapes corpus)."""

import pytest
from helpers import TINY_CONFIG, word_trainer

from captionkit.core.checkpoint import read_config, resolve
from captionkit.training.config import RunConfig, TrainConfig
from captionkit.training.run import build_trainer
from captionkit.training.trainer import Trainer

# dev CIDEr-D per epoch, on the scorers' own scale (0..10): with min_delta 0.001 epoch 2 gains
# too little, epoch 3 enough, epochs 4 and 5 too little again -> patience 2 stops after epoch 5
SCORES = [0.500, 0.5008, 0.5020, 0.5025, 0.5029, 0.600, 0.600, 0.600]


def _config(tmp_path, flickr_dir, min_delta: float, name: str) -> RunConfig:
    path = tmp_path / f"{name}.toml"
    path.write_text(TINY_CONFIG.format(dataset=flickr_dir).replace(
        "epochs = 3", f"epochs = 8\npatience = 2\nmin_delta = {min_delta}\nlr_patience = 9"))
    return RunConfig.load(path)


def scripted_run(cfg: RunConfig, out, max_steps=None, resume=False) -> Trainer:
    if resume:
        saved = read_config(resolve(out / "last"))
        trainer = build_trainer(cfg, out, saved=saved)
        trainer.restore(resolve(out / "last"), saved)
    else:
        trainer = word_trainer(cfg, out)
    # the n-th epoch's validation sees n - 1 epochs in the history (restored on resume)
    trainer.validate = lambda length_penalty=None, stoppable=False: {
        "Bleu_4": 0.1, "CIDEr": SCORES[min(len(trainer.state.history), len(SCORES) - 1)]}
    trainer.fit(max_steps=max_steps, progress=False)
    return trainer


@pytest.mark.slow  # training runs
def test_min_delta_decides_what_counts_as_a_gain(tmp_path, flickr_dir, capsys):
    st = scripted_run(_config(tmp_path, flickr_dir, 0.001, "delta"), tmp_path / "delta").state
    assert (st.epoch, st.best_epoch, st.best_score, st.bad_epochs) == (5, 3, 0.5020, 2)
    assert [h["CIDEr"] for h in st.history] == SCORES[:5]
    assert "early stop: no CIDEr gain above 0.1 (x100) for 2 epochs" in capsys.readouterr().err
    assert read_config(tmp_path / "delta" / "best")["state"]["best_epoch"] == 3  # small gains keep the old best
    # without a minimum every gain counts: epochs 2-6 improve, 7 and 8 do not
    st = scripted_run(_config(tmp_path, flickr_dir, 0.0, "plain"), tmp_path / "plain").state
    assert (st.epoch, st.best_epoch, st.best_score) == (8, 6, 0.600)


@pytest.mark.slow  # a training run
def test_patience_counts_validations_when_not_every_epoch_is_scored(tmp_path, flickr_dir, capsys):
    cfg = _config(tmp_path, flickr_dir, 0.2, "sparse")
    cfg.train.val_every = 2
    st = scripted_run(cfg, tmp_path / "sparse").state
    # scored after epochs 2, 4 and 6; neither 4 nor 6 beats epoch 2 by 0.2 -> stop after epoch 6
    assert (st.epoch, st.best_epoch, st.bad_epochs) == (6, 2, 2)
    assert "early stop: no CIDEr gain above 20 (x100) for 2 validations (every 2 epochs)" in capsys.readouterr().err


@pytest.mark.slow  # training runs
def test_a_resumed_run_stops_where_an_unbroken_one_does(tmp_path, flickr_dir):
    cfg = _config(tmp_path, flickr_dir, 0.001, "delta")
    whole = scripted_run(cfg, tmp_path / "whole").state
    mid_epoch_4 = whole.history[2]["step"] + 2  # after epoch 3's best and two steps into epoch 4
    scripted_run(cfg, tmp_path / "broken", max_steps=mid_epoch_4)
    saved = read_config(tmp_path / "broken" / "last")
    assert saved["state"]["epoch"] == 3 and saved["train"]["train"]["min_delta"] == 0.001
    again = scripted_run(cfg, tmp_path / "broken", resume=True).state
    keys = ("epoch", "step", "best_epoch", "best_score", "bad_epochs", "lr")
    assert {k: getattr(again, k) for k in keys} == {k: getattr(whole, k) for k in keys}
    assert [(h["epoch"], h["CIDEr"]) for h in again.history] == [(h["epoch"], h["CIDEr"]) for h in whole.history]


def test_the_chosen_metric_is_scored_in_validation(tmp_path, flickr_dir):
    cfg = _config(tmp_path, flickr_dir, 0.0, "rouge")
    cfg.train.val_metric = "ROUGE_L"
    trainer = word_trainer(cfg, tmp_path / "rouge")
    assert "ROUGE_L" in trainer.validate()
    with pytest.raises(ValueError, match="train.val_metric must be one of Bleu_1, .*, CIDEr, not 'SPICE'"):
        TrainConfig(val_metric="SPICE")
    with pytest.raises(ValueError, match="train.min_delta must be >= 0"):
        TrainConfig(min_delta=-0.1)


@pytest.mark.slow  # training runs
def test_resuming_a_run_that_stopped_early_trains_no_further(tmp_path, flickr_dir):
    cfg = _config(tmp_path, flickr_dir, 0.001, "stopped")
    whole = scripted_run(cfg, tmp_path / "stopped").state
    assert whole.epoch == 5 and whole.bad_epochs == 2  # stopped early, 3 epochs short of 8
    again = scripted_run(cfg, tmp_path / "stopped", resume=True).state
    assert (again.epoch, again.step) == (whole.epoch, whole.step)
