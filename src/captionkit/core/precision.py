"""Which float format the large matmuls should use on a device.

On CUDA, ``"auto"`` is bf16 on GPUs that multiply it natively (compute capability 8.0 and up:
Ampere and newer), else fp16 with a gradient scaler, decided for the GPU in use (not the
current one). ``torch.cuda.is_bf16_supported()`` is not asked: it also says yes where bf16 is
only emulated (V100, T4), which is slower than fp16 there. fp32 on CUDA lets the matmuls use
TF32 (see :func:`autocast`). fp16 is refused elsewhere. On the CPU:

bf16 autocast pays off only where the CPU multiplies bf16 natively (Intel AMX or
AVX512-BF16, Arm's BF16 extension): there it runs several times faster than float32. Elsewhere
PyTorch emulates it and it runs several times *slower* (measured: 29 against 109 GFLOP/s on an
AVX512 CPU without BF16), so ``"auto"`` picks float32 there.
"""

from __future__ import annotations

import contextlib
import functools
import platform
import sys
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
    device = torch.device(device)
    kind = device.type
    if kind == "cuda":
        if precision == "auto":
            return "bf16" if cuda_native_bf16(device) else "fp16"
        return precision
    if precision == "fp16":
        raise UserError(f"precision fp16 needs a CUDA device (this one is {kind}); use bf16, fp32 or auto")
    if precision == "auto":
        return "bf16" if kind == "cpu" and native_bf16() else "fp32"
    if precision == "bf16" and kind == "cpu" and not native_bf16():
        _warn_emulated_bf16()
    return precision


@functools.cache  # once per process: a command resolves its precision more than once
def _warn_emulated_bf16() -> None:
    """bf16 asked for on a CPU that emulates it: it works, several times slower than fp32
    (see the module's docstring), which a user would otherwise only notice as a slow run."""
    print("warning: precision bf16 on a CPU without native bf16 (no AMX, AVX512-BF16 or Arm BF16): PyTorch "
          "emulates it, several times slower than fp32; auto picks fp32 here", file=sys.stderr)


def cuda_native_bf16(device: torch.device) -> bool:
    """Whether the CUDA GPU ``device`` (its index; none: the current GPU) multiplies bf16 in
    hardware: compute capability 8.0 or more."""
    import torch

    major, _ = torch.cuda.get_device_capability(device)
    return major >= 8


def autocast(device: torch.device, precision: str) -> ContextManager:
    """The region the model computes in, for a resolved precision on ``device``: autocast to
    bf16/fp16; for fp32 nothing, except on CUDA, where float32 matmuls may use TF32 inside it
    (:func:`tf32_matmuls`)."""
    import torch

    if precision == "fp32":
        return tf32_matmuls() if device.type == "cuda" else contextlib.nullcontext()
    return torch.autocast(device.type, dtype=getattr(torch, _DTYPES[precision]))


@contextlib.contextmanager
def tf32_matmuls():
    """float32 matmuls on CUDA in TF32 (Ampere and newer; a no-op before), restored on exit.
    TF32 keeps float32's range but rounds the inputs to 10 mantissa bits: several times the
    matmul speed, at a relative error of about 1e-3 per product (docs/devices.md), which the
    training loss does not notice. It is what ``torch.set_float32_matmul_precision("high")``
    sets for CUDA; this sets CUDA's flag alone, so the CPU's float32 matmuls (oneDNN's, which
    "high" would also switch) stay exact, and only for the region, so a program that imports
    captionkit keeps its own setting elsewhere."""
    import torch

    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def grad_scaler(device: torch.device, precision: str) -> torch.amp.GradScaler:
    """A gradient scaler, enabled only for fp16 (bf16 has float32's range and needs none)."""
    import torch

    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")
