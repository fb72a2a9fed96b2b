"""CLIP's image tower through open_clip, on a tiny random vision transformer (no weights are
downloaded), and the error when pretrained weights are not on the machine."""

import json

import pytest
import torch

open_clip = pytest.importorskip("open_clip",
                                reason="CLIP encoders need open_clip_torch (pip install 'captionkit[test]')")

from safetensors.torch import save_file  # noqa: E402

from captionkit.encoders import WeightsUnavailable, create_encoder  # noqa: E402
from captionkit.encoders import clip as clip_module  # noqa: E402
from captionkit.encoders.clip import create_clip_encoder  # noqa: E402

TINY = {"embed_dim": 8,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 16, "head_width": 8, "patch_size": 8},
        "text_cfg": {"context_length": 8, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1}}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("clipcfg") / "captionkit-tiny-vit.json"
    path.write_text(json.dumps(TINY))
    open_clip.add_model_config(path)
    return "captionkit-tiny-vit"


def test_tiny_tower_gives_its_patch_tokens_as_a_grid(tiny_model):
    enc = create_clip_encoder(tiny_model, weights="random")
    assert enc.grid() == (4, 4) and enc.dim == 16 and enc.preprocess.size == 32
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        out = enc(x)
        _, tokens = enc.visual(x)  # open_clip's own patch tokens, class token left out
    assert out.shape == (2, 16, 16)
    torch.testing.assert_close(out, tokens)


def test_weights_from_an_open_clip_state_dict_file(tiny_model, tmp_path):
    torch.manual_seed(3)
    full = open_clip.create_model(tiny_model, pretrained=None)
    path = tmp_path / "tiny.safetensors"
    save_file({k: v.contiguous() for k, v in full.state_dict().items()}, path)
    enc = create_clip_encoder(tiny_model, weights=str(path))
    assert enc.weights_id == "tiny.safetensors"
    full.visual.output_tokens = True
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(enc(x), full.visual(x)[1])
    bad = tmp_path / "bad.safetensors"
    save_file({"visual.conv1.weight": torch.zeros(1)}, bad)
    with pytest.raises(ValueError, match=f"{bad}: not {tiny_model} weights"):
        create_clip_encoder(tiny_model, weights=str(bad))


def test_missing_pretrained_weights_give_a_clear_error(tiny_model, monkeypatch):
    with pytest.raises(WeightsUnavailable, match=f"open_clip model '{tiny_model}': no pretrained tag"):
        create_clip_encoder(tiny_model)
    monkeypatch.setattr(clip_module, "_cached_file", lambda hf_hub: None)

    def offline(*a, **k):
        raise OSError("network unreachable")

    monkeypatch.setattr(open_clip.pretrained, "download_pretrained", offline)
    with pytest.raises(WeightsUnavailable, match=r"CLIP ViT-B-32 \(openai\): open_clip's weights are not in the "
                                                 r"Hugging Face cache .*vit_base_patch32_clip_224"):
        create_encoder("clip_vit_b32")
    with pytest.raises(ValueError, match="open_clip knows no model 'ViT-Q-99'"):
        create_clip_encoder("ViT-Q-99", weights="random")
