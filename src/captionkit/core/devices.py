"""Where tensors live.

One place turns the user's ``--device`` / ``[train] device`` into a ``torch.device``, so training,
captioning, feature extraction, serving and zero-shot all read them the same way:

- ``auto`` takes the first CUDA GPU when one is visible, else Apple's MPS, else the CPU.
- ``cpu``, ``cuda``, ``cuda:N`` and ``mps`` name a device; asking for one that is not there is a
  user error (one line), never a silent fall-back to the CPU.
- precision (``auto``, bf16, fp16, fp32) is resolved for the device by
  :func:`captionkit.core.precision.resolve_precision`.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from .errors import UserError

# torch is imported inside the functions: the command line builds its --device options from
# this module, and light commands (captionkit score) never load torch
DEVICE_HELP = "auto (a GPU when there is one), cpu, cuda, cuda:N or mps"
_DEVICE_RE = re.compile(r"^(auto|cpu|mps|cuda(:\d+)?)$")


def check_device_name(spec: str) -> str:
    """The spelling alone (no hardware probe): config loading and argparse call this so a typo is
    reported before any work."""
    if not isinstance(spec, str) or not _DEVICE_RE.match(spec):
        raise UserError(f"device must be {DEVICE_HELP}, not {spec!r}")
    return spec


def _mps_available() -> bool:
    import torch

    backend = getattr(torch.backends, "mps", None)  # absent from some builds of torch
    return bool(backend is not None and backend.is_available())


def resolve_device(spec: str = "auto") -> torch.device:
    """``spec`` -> a ``torch.device`` that exists on this machine (ValueError naming it if not)."""
    import torch

    check_device_name(spec)
    if spec == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {spec!r}: no CUDA GPU is visible here (torch.cuda.is_available() is False)")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise UserError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
        return torch.device("cuda", index)
    if device.type == "mps" and not _mps_available():
        raise UserError(f"device {spec!r}: MPS is not available here")
    return device
