"""Where tensors live.

One place turns the user's ``--device`` / ``[train] device`` into a ``torch.device``, so training,
captioning, feature extraction, serving and zero-shot all read them the same way:

- ``auto`` takes the first CUDA GPU when one is visible, else Apple's MPS, else the CPU.
- ``cpu``, ``cuda``, ``cuda:N`` and ``mps`` name a device; asking for one that is not there is a
  user error (one line), never a silent fall-back to the CPU.
- a CUDA device, once resolved (or placed, :func:`use_device`), becomes the process's current
  CUDA device, so libraries that allocate on "the current device" agree with ``--device cuda:N``.
- precision (``auto``, bf16, fp16, fp32) is resolved for the device by
  :func:`captionkit.core.precision.resolve_precision`.
- tensors go to a device with :func:`to_device`: never a non-blocking copy to the host.
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
            return use_device(torch.device("cuda", torch.cuda.current_device()))
        return torch.device("mps") if _mps_available() else torch.device("cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device {spec!r}: no CUDA GPU is visible here (torch.cuda.is_available() is False)")
        index = 0 if device.index is None else device.index
        if index >= torch.cuda.device_count():
            raise UserError(f"device {spec!r}: only {torch.cuda.device_count()} CUDA GPU(s) are visible")
        return use_device(torch.device("cuda", index))
    if device.type == "mps" and not _mps_available():
        raise UserError(f"device {spec!r}: MPS is not available here")
    return device


def use_device(device: torch.device) -> torch.device:
    """Make a CUDA device with an index the current one (``torch.cuda.set_device``) and return
    it. Without this, ``--device cuda:1`` moves the model to GPU 1 while whatever allocates on
    the current device -- ``torch.cuda`` calls without a device, ``transformers``' and the
    autocast/scaler state, a ``tensor.cuda()`` -- still uses GPU 0: a second CUDA context there
    and, where tensors meet, a device mix. Other devices are returned as they are."""
    import torch

    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device.index)
    return device


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``. The copy is non-blocking only from the host to an accelerator (where
    the stream orders it before any kernel that reads it); a non-blocking copy *to* the host
    returns before the data has arrived, and the CPU would read whatever the buffer held."""
    return t.to(device, non_blocking=t.device.type == "cpu" and device.type != "cpu")


def forked_rng(device: torch.device):
    """torch.random.fork_rng for the CPU's generator and ``device``'s (a GPU's own generator
    is what sampling on it draws from; ``devices=[]`` alone would leave it to move)."""
    import torch

    if device.type in ("cpu", "meta"):
        return torch.random.fork_rng(devices=[])
    index = device.index
    if index is None:  # "cuda" names the current GPU (MPS has one device)
        index = torch.cuda.current_device() if device.type == "cuda" else 0
    return torch.random.fork_rng(devices=[index], device_type=device.type)
