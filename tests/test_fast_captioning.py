"""Captioning throughput without changing captions (issue 31, item 1): the flip views through the
encoder in one pass, the members that are one model decoded as one batch, and EfficientNet-Lite's
padding and ReLU6 without copies. Each is checked against the computation it replaced: the same
captions, log-probabilities within float32 rounding, the same attention."""

from __future__ import annotations

import copy
import json
import threading

import pytest
import torch
import torch.nn.functional as F
from test_beam_search import FEAT, GRID
from test_beam_search import sat as beam_search_sat
from test_beam_search import transformer as beam_search_transformer
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from captionkit.encoders import create_encoder, efficientnet_lite
from captionkit.encoders.efficientnet_lite import MBConv, SameConv2d
from captionkit.inference.decoding import beam_nbest, greedy
from captionkit.inference.ensemble import EnsembleDecoder, with_flip_views



def sat(seed: int = 0):
    return beam_search_sat(seed)  # the beam search tests' peaked tiny decoders


def transformer(seed: int = 1):
    return beam_search_transformer(seed)


def views(n: int = 6) -> torch.Tensor:
    """Two different views of n images (B, 2, L, D)."""
    torch.manual_seed(3)
    return torch.randn(n, 2, GRID[0] * GRID[1], FEAT)


DECODERS = {"sat": lambda: sat(), "transformer": lambda: transformer(),
            "ensemble": lambda: EnsembleDecoder([transformer(), sat()], [0.4, 0.6])}


def per_member(flip: EnsembleDecoder) -> EnsembleDecoder:
    """The same ensemble with every member a module of its own: decoded one member at a time,
    one view at a time, as before members were grouped."""
    return EnsembleDecoder([copy.deepcopy(m) for m in flip.members], flip.weights, flip.combine, flip.views)


def assert_same(got, want) -> None:
    assert [[c.ids for c in n] for n in got] == [[c.ids for c in n] for n in want]
    for g_list, w_list in zip(got, want):
        for g, w in zip(g_list, w_list):
            assert g.logprob == pytest.approx(w.logprob, rel=1e-5, abs=1e-5)
            torch.testing.assert_close(g.attention, w.attention)


def decodes(decoder, x: torch.Tensor) -> list:
    with torch.no_grad():
        return ([[c] for c in greedy(decoder, x, max_len=8)]
                + beam_nbest(decoder, x, 3, beam=3, max_len=8, length_penalty=1.0)
                + beam_nbest(decoder, x, 2, beam=4, max_len=8))


# ---- members that are one model: one batch over their views ----------------------------------------
@pytest.mark.parametrize("family", sorted(DECODERS))
def test_views_decoded_as_one_batch_give_the_per_member_captions(family):
    flip, x = with_flip_views(DECODERS[family]()), views()
    captions = decodes(flip, x)
    assert len({tuple(n[0].ids) for n in captions}) > 3  # captions that differ: the check means something
    assert_same(captions, decodes(per_member(flip), x))


@pytest.mark.parametrize("options, beam", [({"no_repeat_ngram": 2, "min_words": 2}, 3),
                                           ({"sample": True, "num_captions": 3, "seed": 1}, 1),
                                           ({"num_captions": 2, "beam_groups": 2}, 4)],
                         ids=["rules", "sampling", "diverse-beams"])
def test_caption_controls_on_views_decoded_as_one_batch_give_the_per_member_captions(options, beam):
    """The caption controls (captionkit.inference.decoding) shape the ensemble's combined step,
    whichever way its members are batched."""
    from captionkit.inference.controls import Controls
    from captionkit.inference.decoding import decode_lists

    flip, x = with_flip_views(DECODERS["ensemble"]()), views()
    controls = Controls().with_options(**options).check(beam)
    with torch.no_grad():
        got = decode_lists(flip, x, beam=beam, max_len=8, controls=controls)
        want = decode_lists(per_member(flip), x, beam=beam, max_len=8, controls=controls)
    assert_same(got, want)


def test_each_model_steps_once_per_decoding_step_over_all_its_views():
    """With flip averaging, an ensemble of two models is four members; each step calls each model
    once, with the rows of both views (it called each member: four calls of half the rows)."""
    flip, x = with_flip_views(DECODERS["ensemble"]()), views(3)
    calls = []
    for model in {id(m): m for m in flip.members}.values():
        step = model.step

        def counted(tokens, state, mem, _step=step, _name=type(model).__name__):
            calls.append((_name, tokens.shape[0]))
            return _step(tokens, state, mem)

        model.step = counted
    with torch.no_grad():
        beam_nbest(flip, x, 1, beam=3, max_len=4)
    steps = len(calls) // 2
    assert sorted(calls[:2]) == [("SoftAttentionDecoder", 3 * 3 * 2), ("TransformerCaptioner", 3 * 3 * 2)]
    assert len(calls) == 2 * steps


# ---- the encoder: both views in one pass; padding and ReLU6 without copies --------------------------
def test_flip_views_go_through_the_encoder_in_one_pass():
    from captionkit.inference.captioner import Captioner

    encoder = create_encoder("efficientnet_lite0", weights="random")
    cap = Captioner(sat(), None, {"encoder": {"grid": [7, 7]}}, encoder, tta="flip").place("cpu", "fp32")
    torch.manual_seed(0)
    pixels = torch.randn(3, 3, 224, 224)
    batches = []
    forward = encoder.forward
    encoder.forward = lambda x: batches.append(x.shape[0]) or forward(x)
    feats = cap.encode(pixels)
    assert batches == [6] and feats.shape == (3, 2, 49, 1280)
    # what two passes gave (the photos, then their mirror images)
    torch.testing.assert_close(feats[:, 0], encoder.encode(pixels), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(feats[:, 1], encoder.encode(pixels.flip(-1)), rtol=1e-4, atol=1e-4)


def reference_same_conv(conv: SameConv2d, x: torch.Tensor) -> torch.Tensor:
    """SameConv2d as it was: every input padded by F.pad, then convolved without padding."""
    ih, iw = x.shape[-2:]
    k, s = conv.kernel_size[0], conv.stride[0]
    pad_h = max((-(-ih // s) - 1) * s + k - ih, 0)
    pad_w = max((-(-iw // s) - 1) * s + k - iw, 0)
    x = F.pad(x, [pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2])
    return F.conv2d(x, conv.weight, conv.bias, conv.stride, 0, conv.dilation, conv.groups)


@pytest.mark.parametrize("k,stride", [(3, 1), (5, 1), (3, 2), (5, 2)])
@pytest.mark.parametrize("size", [16, 17])
@pytest.mark.parametrize("channels_last", [False, True])
def test_same_padding_is_tensorflows(k, stride, size, channels_last):
    torch.manual_seed(0)
    conv = SameConv2d(6, 6, k, stride, groups=6, bias=False)
    x = torch.randn(2, 6, size, size)
    if channels_last:
        conv, x = conv.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        assert torch.equal(conv(x), reference_same_conv(conv, x))


class Pads(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += func is F.pad
        return func(*args, **(kwargs or {}))


def test_same_convolutions_pad_without_f_pad():
    """None of the 22 SAME convolutions of EfficientNet-Lite2 goes through F.pad (which fills a padded copy
    with zeros and then copies the input over them): those that pad symmetrically pad inside the
    convolution, the two that pad one pixel more on one side (stride 2) write the zeros around a
    copy (it called F.pad 22 times)."""
    encoder = create_encoder("efficientnet_lite2", weights="random")
    convs = [m for m in encoder.modules() if isinstance(m, SameConv2d)]
    with Pads() as pads, torch.no_grad():
        encoder.encode(torch.zeros(1, 3, 260, 260))
    assert len(convs) == 22 and pads.count == 0


def test_in_place_relu6_and_residual_keep_outputs_and_gradients():
    """MBConv computes in place what it computed out of place, forward and backward (the
    fine-tuned blocks train through it)."""
    torch.manual_seed(0)
    block = MBConv(8, 8, 6, 3, 1)
    x = torch.randn(2, 8, 9, 9, requires_grad=True)

    def reference(x):
        y = F.relu6(block._bn0(block._expand_conv(x)))
        y = F.relu6(block._bn1(block._depthwise_conv(y)))
        return block._bn2(block._project_conv(y)) + x

    for train in (True, False):
        block.train(train)
        got, want = block(x), reference(x)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        (g_got,) = torch.autograd.grad(got.square().sum(), x)
        (g_want,) = torch.autograd.grad(want.square().sum(), x)
        torch.testing.assert_close(g_got, g_want)


class Ops(TorchDispatchMode):
    """The names of the operators a block of code runs."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name,size,photos", [("efficientnet_lite0", 224, 2), ("efficientnet_lite1", 240, 2),
                                              ("efficientnet_lite2", 260, 2), ("efficientnet_lite2", 231, 2),
                                              ("efficientnet_lite2", 260, 1)])
@pytest.mark.parametrize("bf16", [False, True])
def test_fused_encoder_passes_give_the_layer_by_layer_features(name, size, photos, bf16):
    """Inference (no autograd) runs EfficientNet-Lite in oneDNN's fused convolutions (ReLU6
    applied as each output is written, the stride-2 padding around the narrow block input) and
    gives the layer-by-layer path's features to float32 (or bf16) rounding, at the encoders' own
    sizes (whose stride-2 convolutions pad one side more), an odd one, and a photo alone (oneDNN
    may choose another kernel for a small map's fused 1x1 convolution, which rounds otherwise;
    elsewhere they are bit for bit the same here). With autograd on (fine-tuning) it is the
    layer-by-layer path."""
    encoder = create_encoder(name, weights="random")
    torch.manual_seed(0)
    x = torch.rand(photos, 3, size, size).contiguous(memory_format=torch.channels_last) * 4 - 2
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        with torch.enable_grad(), Ops() as layered:
            want = encoder(x)
        with torch.inference_mode(), Ops() as fused:
            got = encoder(x)
    assert got.dtype == want.dtype == (torch.bfloat16 if bf16 else torch.float32)
    if bf16:
        torch.testing.assert_close(got, want)  # bf16's tolerances: an accumulator that rounds to the next bf16
    else:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert not any("_convolution_pointwise" in op for op in layered.names)
    if bf16 and not efficientnet_lite._FUSED_BF16:  # a CPU whose oneDNN has no bf16 convolution
        assert not any("_convolution_pointwise" in op for op in fused.names)
        return
    assert sum("_convolution_pointwise" in op for op in fused.names) > len(encoder._blocks)
    assert not any(op.startswith(("aten.clamp", "aten.hardtanh")) for op in fused.names)  # ReLU6 fused


def test_bf16_without_onednn_bf16_convolutions_is_layer_by_layer(monkeypatch):
    """On a CPU whose oneDNN has no bf16 convolution (AVX2 only: its fused bf16 operator
    raises), bf16 autocast runs the layer-by-layer path, the same features as with autograd on;
    float32 stays fused. Simulated here on any CPU."""
    monkeypatch.setattr(efficientnet_lite, "_FUSED_BF16", False)
    encoder = create_encoder("efficientnet_lite0", weights="random")
    x = torch.rand(2, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode():
        with Ops() as ops, torch.autocast("cpu", dtype=torch.bfloat16):
            got = encoder(x)
        with Ops() as fp32:
            encoder(x)
    with torch.enable_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        want = encoder(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not any("_convolution_pointwise" in op for op in ops.names)
    assert any("_convolution_pointwise" in op for op in fp32.names)


# tracing warns that it is deprecated and that SAME padding reads the input's shape: the trace
# is of one shape, and the ONNX exporter's own tracing is what this stands for
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning", "ignore:`torch.jit.trace:FutureWarning")
def test_a_traced_encoder_is_layer_by_layer():
    """Traced (the ONNX exporter traces), even in channels_last without autograd, the encoder is
    the layer-by-layer path: a graph has no oneDNN fused convolution."""
    encoder = create_encoder("efficientnet_lite0", weights="random")
    x = torch.rand(1, 3, 64, 64).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        graph = torch.jit.trace(encoder, x)
    assert "_convolution_pointwise" not in str(graph.inlined_graph)
    with torch.enable_grad():
        assert torch.equal(graph(x), encoder(x))


def test_the_encoder_outside_float32_and_bf16_autocast_is_layer_by_layer():
    """fp16 autocast on the CPU, or float64 pixels: the layer-by-layer path (the fused one would
    compute in another precision than the one asked for)."""
    encoder = create_encoder("efficientnet_lite0", weights="random").double()
    x = torch.rand(1, 3, 64, 64, dtype=torch.float64).contiguous(memory_format=torch.channels_last)
    with torch.inference_mode(), Ops() as ops:
        encoder(x)
    assert not any("_convolution_pointwise" in op for op in ops.names)


class TorchCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.add(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_to_tensor_computes_in_numpy_the_numbers_torch_computed():
    """The reader threads' preprocessing does its arithmetic in numpy (torch's would start an
    OpenMP team in each reader thread, beside the model's): bit for bit what torch's (x / 255 -
    mean) / std gave, in the same (3, S, S) layout."""
    import numpy as np
    from helpers import shape_image

    from captionkit.data.images import Preprocess, to_tensor

    pre = Preprocess(size=40, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    for k in range(3):
        im = shape_image(k, size=64, jitter=k)
        small = im.resize((pre.size, pre.size), 3)  # Image.Resampling.BICUBIC
        x = torch.from_numpy(np.asarray(small, dtype=np.float32).copy()).permute(2, 0, 1) / 255.0
        want = (x - torch.tensor(pre.mean).view(3, 1, 1)) / torch.tensor(pre.std).view(3, 1, 1)
        with TorchCalls() as calls:
            got = to_tensor(im, pre)
        assert torch.equal(got, want) and got.stride() == want.stride()
        assert calls.names == {"permute"}  # no torch arithmetic


def test_the_cpu_encodes_sixteen_images_a_pass():
    from captionkit.encoders.base import CPU_PASS_IMAGES

    encoder = create_encoder("efficientnet_lite0", weights="random")
    batches = []
    forward = encoder.forward
    encoder.forward = lambda x: batches.append(x.shape[0]) or forward(x)
    torch.manual_seed(0)
    pixels = torch.randn(CPU_PASS_IMAGES + 3, 3, 32, 32)
    out = encoder.encode(pixels)
    assert batches == [CPU_PASS_IMAGES, 3] and out.shape[0] == CPU_PASS_IMAGES + 3
    torch.testing.assert_close(out[-3:], encoder.encode(pixels[-3:]), rtol=1e-4, atol=1e-4)


# ---- the fast single model by one flag -------------------------------------------------------------
def test_caption_fast_is_the_fast_single_model(tmp_path, monkeypatch, capsys):
    from helpers import shape_image

    import captionkit.cli.caption as caption_cli
    from captionkit.cli.main import main
    from captionkit.inference.shipped import FAST_MODEL

    shape_image(0, size=64).save(tmp_path / "a.jpg")
    assert main(["caption", str(tmp_path / "a.jpg"), "--fast", "--model", "sat-lite2-flickr8k"]) == 2
    assert "--fast is --model transformer-lite2-flickr8k" in capsys.readouterr().err

    class Loaded(Exception):
        pass

    def load(models, weights, *placement):  # (_load_captioner's: tta, device, precision, matcher, ...)
        raise Loaded(models)

    monkeypatch.setattr(caption_cli, "_load_captioner", load)
    with pytest.raises(Loaded) as e:
        main(["caption", str(tmp_path / "a.jpg"), "--fast", "--jsonl", str(tmp_path / "out.jsonl")])
    assert e.value.args == ([FAST_MODEL.name],)
    assert json.loads((tmp_path / "out.jsonl.meta.json").read_text())["settings"]["model"] == FAST_MODEL.name


def test_the_api_reads_the_next_batch_while_it_captions_one(picky_models, picky_data, monkeypatch):
    """cap(images) reads batch k + 1 while batch k is encoded and decoded (it read each batch only
    after the one before was captioned): the first encode waits for a read of the second batch."""
    import captionkit.inference.captioner as captioner_module
    from captionkit.inference.captioner import Captioner

    cap = Captioner.load(picky_models[0])
    photos = sorted((picky_data / "Flicker8k_Dataset").iterdir())[:4]
    second = threading.Event()
    read, encode = captioner_module.read_input, Captioner.encode

    def reading(item, *a):
        if item in photos[2:]:
            second.set()
        return read(item, *a)

    def encoding(self, pixels):
        assert second.wait(10), "the second batch was not being read while the first was captioned"
        return encode(self, pixels)

    monkeypatch.setattr(captioner_module, "read_input", reading)
    monkeypatch.setattr(Captioner, "encode", encoding)
    results = cap(photos, batch_size=2)
    assert [r.ok for r in results] == [True] * 4
