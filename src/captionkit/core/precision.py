"""Which float format the large matmuls should use on a device.

On CUDA, ``"auto"`` is bf16 on GPUs that multiply it (Ampere and newer), else fp16 with a gradient
scaler. fp16 is refused elsewhere. On the CPU:

bf16 autocast pays off only where the CPU multiplies bf16 natively (Intel AMX or
AVX512-BF16, Arm's BF16 extension): there it runs several times faster than float32. Elsewhere
PyTorch emulates it and it runs several times *slower* (measured: 29 against 109 GFLOP/s on an
AVX512 CPU without BF16), so ``"auto"`` picks float32 there.
"""

from __future__ import annotations

import contextlib
import functools
import platform
from typing import TYPE_CHECKING, ContextManager

if TYPE_CHECKING:
    import torch

from .errors import UserError

# torch is imported inside the functions: the command line builds its --precision options from
# PRECISIONS, and light commands (captionkit score) never load torch
PRECISIONS = ("auto", "bf16", "fp16", "fp32")
_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # names of torch dtypes
_NATIVE_BF16_FLAGS = {"amx_bf16", "avx512_bf16", "bf16"}  # x86 flags; "bf16" in Arm's Features


@functools.cache
def native_bf16() -> bool:
    """True when /proc/cpuinfo names a native bf16 matmul instruction set (False where it
    cannot be read: float32 is the safe choice)."""
    if platform.system() != "Linux":
        return False
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return False
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return bool(_NATIVE_BF16_FLAGS & set(value.split()))
    return False


def resolve_precision(precision: str, device: torch.device | str = "cpu") -> str:
    """``"auto"`` -> the format that pays on ``device``: "bf16", "fp16" or "fp32"; others are
    checked and returned. fp16 is a CUDA format (trained under a gradient scaler, see
    :func:`grad_scaler`); on the CPU or MPS it is refused rather than emulated."""
    import torch

    if precision not in PRECISIONS:
        raise UserError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    kind = torch.device(device).type
    if kind == "cuda":
        if precision == "auto":
            return "bf16" if torch.cuda.is_bf16_supported() else "fp16"
        return precision
    if precision == "fp16":
        raise UserError(f"precision fp16 needs a CUDA device (this one is {kind}); use bf16, fp32 or auto")
    if precision == "auto":
        return "bf16" if kind == "cpu" and native_bf16() else "fp32"
    return precision


def autocast(device: torch.device, precision: str) -> ContextManager:
    """The autocast region for a resolved precision on ``device`` (a no-op for fp32)."""
    import torch

    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, _DTYPES[precision]))


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """A gradient scaler, enabled only for fp16 (bf16 has float32's range and needs none)."""
    import torch

    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
