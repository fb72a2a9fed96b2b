"""conv.c's one-pass expansion + depthwise convolution (kernels.expand_depthwise), which
EfficientNet-Lite's large-map blocks run in float32 inference: the two convolutions' values to
float32 rounding, every image's result independent of its batch and of the thread count, and
the encoder's features with it those of oneDNN's two passes."""

import pytest
import torch
import torch.nn.functional as F

from captionkit import kernels
from captionkit.encoders import create_encoder, efficientnet_lite

pytestmark = pytest.mark.skipif(not kernels.expand_depthwise_available(),
                                reason="conv.c's kernel is not built here (needs AVX2 and FMA)")


def same_pads(size: int, k: int, s: int) -> tuple[int, int]:
    total = max((-(-size // s) - 1) * s + k - size, 0)
    return total // 2, total - total // 2


def reference(x, we, be, wd, bd, s, pads):
    """The two convolutions as PyTorch computes them, in float64."""
    top, left, bottom, right = pads
    e = F.relu6(F.conv2d(x.double(), we.double(), be.double()))
    e = F.pad(e, (left, right, top, bottom))  # the expanded map's zeros
    return F.relu6(F.conv2d(e, wd.double(), bd.double(), stride=s, groups=wd.shape[0]))


def block(c, m, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, c, 1, 1, generator=g) / c ** 0.5, torch.randn(m, generator=g),
            torch.randn(m, 1, k, k, generator=g) / k, torch.randn(m, generator=g))


@pytest.mark.parametrize("c,m,k,s,h,w", [(16, 96, 3, 2, 20, 17), (8, 48, 5, 2, 13, 13), (24, 144, 3, 1, 9, 11),
                                         (8, 24, 5, 1, 7, 6), (8, 24, 3, 2, 1, 2), (4, 48, 5, 1, 3, 4)])
def test_the_two_convolutions_to_float32_rounding(c, m, k, s, h, w):
    """Odd and even maps (whose stride-2 "SAME" padding puts one more zero below and right),
    maps smaller than the kernel, both kernel sizes and strides; values around ReLU6's bounds."""
    we, be, wd, bd = block(c, m, k)
    x = (torch.randn(3, c, h, w, generator=torch.Generator().manual_seed(1)) * 3).contiguous(
        memory_format=torch.channels_last)
    (top, bottom), (left, right) = same_pads(h, k, s), same_pads(w, k, s)
    pads = (top, left, bottom, right)
    with torch.no_grad():
        got = kernels.expand_depthwise(x, we, be, wd, bd, s, pads)
    want = reference(x, we, be, wd, bd, s, pads)
    assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
    if got.numel() > 1000:  # both bounds of ReLU6 reached
        assert 0 < (got == 0).float().mean() < 1 and (got == 6).any()
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_an_image_is_the_same_alone_in_a_batch_and_on_any_number_of_threads():
    """Work is split over images, and over row ranges of an image where there are fewer images
    than threads; each output is the same sum either way: bit for bit."""
    we, be, wd, bd = block(16, 96, 3)
    x = torch.randn(3, 16, 23, 19).contiguous(memory_format=torch.channels_last)
    pads = (0, 0, 1, 1)
    threads = torch.get_num_threads()
    try:
        with torch.no_grad():
            torch.set_num_threads(1)
            want = kernels.expand_depthwise(x, we, be, wd, bd, 2, pads)
            for n in (2, 3, 7):
                torch.set_num_threads(n)
                assert torch.equal(kernels.expand_depthwise(x, we, be, wd, bd, 2, pads), want)
                assert torch.equal(kernels.expand_depthwise(x[1:2], we, be, wd, bd, 2, pads), want[1:2])
    finally:
        torch.set_num_threads(threads)


def test_not_the_kernels_case_is_left_to_the_caller():
    we, be, wd, bd = block(8, 48, 3)
    x = torch.randn(1, 8, 9, 9).contiguous(memory_format=torch.channels_last)
    args = (we, be, wd, bd, 1, (1, 1, 1, 1))
    with torch.no_grad():
        assert kernels.expand_depthwise(x, *args) is not None
        assert kernels.expand_depthwise(x.contiguous(), *args) is None  # not channels_last
        assert kernels.expand_depthwise(x.double(), *(a.double() for a in args[:4]), *args[4:]) is None
        we40, be40, wd40, bd40 = block(8, 40, 3)  # 40 channels: not a multiple of 24
        assert kernels.expand_depthwise(x, we40, be40, wd40, bd40, 1, (1, 1, 1, 1)) is None
        we7, be7, wd7, bd7 = block(8, 48, 7)
        assert kernels.expand_depthwise(x, we7, be7, wd7, bd7, 1, (3, 3, 3, 3)) is None
    assert kernels.expand_depthwise(x, *args) is None  # autograd on: the caller's convolutions
    with torch.no_grad():  # no images: an empty result, as oneDNN's
        assert kernels.expand_depthwise(x[:0], *args).shape == (0, 48, 9, 9)
    with torch.no_grad(), pytest.raises(ValueError, match="depthwise"):  # a caller's bug: loud
        kernels.expand_depthwise(x, we, be, torch.randn(48, 2, 3, 3), bd, 1, (1, 1, 1, 1))


@pytest.mark.parametrize("name,size,blocks", [("efficientnet_lite0", 224, 3), ("efficientnet_lite2", 260, 7),
                                              ("efficientnet_lite2", 231, 4)])
def test_the_encoder_runs_its_large_blocks_in_one_pass(name, size, blocks, monkeypatch):
    """In float32 inference the blocks whose expanded map (a view's) reaches RING_MIN_BYTES run
    conv.c's pass instead of oneDNN's two fused convolutions: Lite0 at 224, its 16->96 block at
    112x112 and its 24->144 ones at 56x56 (4.8 and 1.8 MB); Lite2 at 260, also its 48->288 ones
    at 33x33 (1.25 MB), which at 231 px are 29x29 (0.97 MB: oneDNN's). The features are oneDNN's
    to float32 rounding; with the size out of reach the blocks are oneDNN's again."""
    from test_fast_captioning import Ops

    encoder = create_encoder(name, weights="random")
    torch.manual_seed(0)
    with torch.no_grad():  # biases too (random weights have none), so that their order counts
        for m in encoder.modules():
            if isinstance(m, torch.nn.Conv2d):
                m.bias.normal_(0.0, 0.5)
    x = (torch.rand(2, 3, size, size) * 4 - 2).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        with Ops() as ours:
            got = encoder(x)
        monkeypatch.setattr(efficientnet_lite, "RING_MIN_BYTES", float("inf"))
        with Ops() as onednn:
            want = encoder(x)
    pointwise = [sum("_convolution_pointwise" in op for op in ops.names) for ops in (ours, onednn)]
    assert pointwise[1] - pointwise[0] == 2 * blocks  # two oneDNN operators fewer a block
    # (bit for bit on the CPUs measured, conv.c's header; not asserted: oneDNN's order is its own)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
