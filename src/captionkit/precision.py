"""Which float format the large matmuls should use on this CPU.

bf16 autocast pays off only where the CPU multiplies bf16 natively (Intel AMX or
AVX512-BF16, Arm's BF16 extension): there it runs several times faster than float32. Elsewhere
PyTorch emulates it and it runs several times *slower* (measured: 29 against 109 GFLOP/s on an
AVX512 CPU without BF16), so ``"auto"`` picks float32 there.
"""

from __future__ import annotations

import functools
import platform

PRECISIONS = ("auto", "bf16", "fp32")
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


def resolve_precision(precision: str) -> str:
    """"auto" -> "bf16" on CPUs with native bf16 matmuls, else "fp32"; others unchanged."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, not {precision!r}")
    if precision == "auto":
        return "bf16" if native_bf16() else "fp32"
    return precision
