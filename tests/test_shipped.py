"""The models shipped inside the package: found by name, the default one, and the error
for a name that is neither a folder nor a shipped model."""

import pytest

from captionkit.captioner import DEFAULT_MODEL, Captioner, model_folder
from captionkit.checkpoint import CheckpointError


def test_the_default_is_the_transformer_and_the_lstm_ships_by_name():
    assert model_folder(None) == DEFAULT_MODEL
    default = Captioner.load(with_encoder=False)
    assert default.config["family"] == "transformer" and default.grid == (9, 9)
    lstm = Captioner.load("sat-lite2-flickr8k", with_encoder=False)
    assert lstm.config["family"] == "sat" and lstm.grid == (9, 9)
    # both decode the same 9x9x1280 Lite2 grid; their tuned length normalisations differ
    assert default.decoder.cfg.feat_dim == lstm.decoder.cfg.feat_dim == 1280
    assert default.length_penalty != lstm.length_penalty


def test_a_local_folder_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sat-lite2-flickr8k").mkdir()
    assert model_folder("sat-lite2-flickr8k").resolve() == (tmp_path / "sat-lite2-flickr8k").resolve()


def test_an_unknown_name_lists_the_shipped_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="no-such-model: no such model folder "
                                              r"\(shipped models: sat-lite2-flickr8k, transformer-lite2-flickr8k\)"):
        Captioner.load("no-such-model", with_encoder=False)
