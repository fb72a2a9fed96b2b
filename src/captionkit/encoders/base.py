"""The encoder contract.

An encoder turns a batch of preprocessed images ``(B, 3, S, S)`` into annotation vectors
``(B, L, D)``: one ``D``-dimensional vector per cell of a ``grid = (H, W)`` over the image,
``L = H * W``, row-major. Everything an encoder needs to be reproduced (its input size and
normalisation) lives in its :class:`~captionkit.data.images.Preprocess`, which is also the feature
cache's key. Encoders register by name in :mod:`captionkit.core.registry` (``@register_encoder``).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from ..core.devices import to_device
from ..core.errors import CheckpointError, UserError, WeightsUnavailable  # noqa: F401  (re-exported for the encoder modules)
from ..core.registry import ENCODERS, list_encoders, register_encoder  # noqa: F401  (re-exported for the encoder modules)
from ..data.images import Preprocess

IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
# Images per encoder pass on the CPU. A larger batch is no faster there (each layer is already
# milliseconds of work), and its activation maps outgrow the size above which glibc maps fresh
# memory for every tensor (128 MiB once captionkit.core.allocator.tune_allocator has run, at most 32 MiB
# by default), whose page faults then cost every pass: EfficientNet-Lite2's largest map is 6.6 MB
# an image at 260 px, and 32 images a pass took 1.2x the time of 16 an image (docs/speed.md).
CPU_PASS_IMAGES = 16


def module_device(module: torch.nn.Module) -> torch.device:
    """Where a module computes: its first parameter's (or buffer's) device; the CPU for a module
    that holds no tensors. Every :class:`Encoder` holds one (its ``device_anchor``), so an encoder
    without weights (``patches``, ``vit_pixels``) is where it was last moved."""
    for t in module.parameters():
        return t.device
    for t in module.buffers():
        return t.device
    return torch.device("cpu")


class Encoder(nn.Module):
    """Base class: subclasses implement ``features(x) -> (B, D, H, W)``."""

    name: str
    preprocess: Preprocess
    dim: int
    weights_id: str  # what weights were loaded: "random", or a file name / package name

    def __init__(self):
        super().__init__()
        # An empty tensor that moves with the module: where an encoder is, even one without
        # weights (module_device). Such an encoder would otherwise say "CPU" wherever it was
        # moved, and encode() would copy a GPU's pixels to the host. Not persistent: no
        # checkpoint or state dict holds it.
        self.register_buffer("device_anchor", torch.empty(0), persistent=False)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fmap = self.features(x)  # (B, D, H, W)
        return fmap.flatten(2).transpose(1, 2)  # (B, L, D)

    def encode_batch(self, images: list[torch.Tensor]) -> torch.Tensor:
        """Preprocessed images, each (3, S, S) -> annotation vectors (B, L, D), without autograd."""
        return self.encode(torch.stack(images))

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Preprocessed pixels (B, 3, S, S) on any device -> annotation vectors (B, L, D) on the
        encoder's device, without autograd. The one place a batch of photos goes through an
        encoder (captioning, serving, the feature cache); on the CPU, CPU_PASS_IMAGES at a time."""
        x = to_device(pixels, module_device(self)).contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            if x.device.type != "cpu" or x.shape[0] <= CPU_PASS_IMAGES:
                return self(x)
            return torch.cat([self(part) for part in x.split(CPU_PASS_IMAGES)])  # (B, L, D)

    def grid(self) -> tuple[int, int]:
        with torch.no_grad():
            size = self.preprocess.size
            fmap = self.features(torch.zeros(1, 3, size, size, device=module_device(self)))
        return int(fmap.shape[2]), int(fmap.shape[3])

    def split(self, blocks: int) -> tuple["Encoder", nn.Module]:
        """(trunk, tail) for fine-tuning the last ``blocks`` blocks: the trunk is a frozen
        encoder of its own (its output can be cached), the tail maps the trunk's (B, L, C)
        to this encoder's (B, L, D) and shares this encoder's parameters."""
        raise UserError(f"encoder {self.name!r} does not support fine-tuning its last blocks")

    def cache_key(self) -> str:
        """A short stable id of (architecture, weights, preprocessing) for feature caches."""
        blob = json.dumps({"name": self.name, "weights": self.weights_id,
                           "pre": asdict(self.preprocess)}, sort_keys=True)
        return f"{self.name}-{hashlib.sha1(blob.encode()).hexdigest()[:10]}"


def create_encoder(name: str, weights: str | None = None) -> Encoder:
    """Build a frozen encoder in eval mode.

    weights: None for the pretrained weights (an error names what is missing when they are
        not on this machine), ``"random"`` for random weights (tests only), or a file path.
    """
    factory = ENCODERS.get(name)
    if weights == "random":  # seeded, so a "random" encoder gives the same features in every process
        with torch.random.fork_rng():
            torch.manual_seed(0)
            enc = factory(weights=weights)
    else:
        enc = factory(weights=weights)
    enc.name = name
    enc.eval()
    for p in enc.parameters():
        p.requires_grad_(False)
    return enc


def load_state_file(path: str) -> dict[str, torch.Tensor]:
    """A weights file's tensors (safetensors, or a PyTorch state dict loaded with
    ``weights_only``: nothing but tensors is ever unpickled). A file that cannot be read that way
    -- damaged, or holding other objects, which can run code when unpickled -- is one
    CheckpointError line; it is never loaded by other means."""
    if not Path(path).is_file():
        raise WeightsUnavailable(f"{path}: weights file not found")
    try:
        if str(path).endswith(".safetensors"):
            from safetensors.torch import load_file
            return load_file(path)
        with warnings.catch_warnings():  # torch warns about the pickle protocol of files it refuses anyway
            warnings.simplefilter("ignore")
            sd = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch and safetensors raise many types here; their advice is not for users
        raise CheckpointError(f"{path}: not a readable weights file ({type(e).__name__}): captionkit loads "
                              f"safetensors and PyTorch state dicts of tensors only") from None
    if isinstance(sd, dict) and isinstance(sd.get("state_dict"), dict):
        sd = sd["state_dict"]
    tensors = {k: v for k, v in sd.items() if torch.is_tensor(v)} if isinstance(sd, dict) else {}
    if not tensors:
        raise CheckpointError(f"{path}: holds no state dict of tensors ({type(sd).__name__})")
    return tensors


def load_finetuned(encoder: Encoder, weights: dict[str, torch.Tensor], where: str) -> None:
    """Put fine-tuned tensors (a subset of the encoder's state dict, e.g. its last blocks) into
    ``encoder``; its ``weights_id`` then names them, so feature caches never mix the two."""
    own = encoder.state_dict()
    bad = [k for k in weights if k not in own or own[k].shape != weights[k].shape]
    if bad:
        raise CheckpointError(f"{where}: fine-tuned encoder weights do not fit {encoder.name} ({', '.join(bad[:3])})")
    encoder.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()}, strict=False)
    digest = hashlib.sha1()
    for k in sorted(weights):
        digest.update(k.encode())
        digest.update(weights[k].float().numpy().tobytes())
    encoder.weights_id = f"{encoder.weights_id}+finetuned-{digest.hexdigest()[:10]}"
