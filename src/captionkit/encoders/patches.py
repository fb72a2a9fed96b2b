"""Image patches as annotation vectors: the parameter-free first step of a vision transformer
trained from scratch (Dosovitskiy et al. 2021).

The photo is resized to 128x128 and cut into a 16x16 grid of 8x8 patches; each patch's pixels
(3 x 8 x 8 = 192 numbers, channel-major, normalised to [-1, 1]) are one annotation vector.
The learned part -- the patch embedding (a Linear 192 -> width, the same as ViT's strided
convolution), the positions and the encoder layers -- lives in the transformer decoder family
(:mod:`captionkit.models.transformer`), so the patches are cached like any CNN's features and
the decoder trains on them without reading the JPEGs again.
"""

from __future__ import annotations

import torch

from ..core.errors import UserError
from .base import Encoder, Preprocess, register_encoder


class Patches(Encoder):
    def __init__(self, size: int = 128, patch: int = 8):
        super().__init__()
        if size % patch:
            raise ValueError(f"patches: image size {size} is not a multiple of the patch size {patch}")
        self.patch = patch
        self.dim = 3 * patch * patch
        self.preprocess = Preprocess(size=size, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
        self.weights_id = "none"

    def features(self, x: torch.Tensor) -> torch.Tensor:
        B, C, S, _ = x.shape
        p, n = self.patch, S // self.patch
        x = x.reshape(B, C, n, p, n, p)  # (B, 3, rows, p, cols, p)
        return x.permute(0, 1, 3, 5, 2, 4).reshape(B, C * p * p, n, n)  # (B, 3*p*p, rows, cols)


@register_encoder("patches")
def patches(weights: str | None = None) -> Encoder:
    if weights not in (None, "random"):
        raise UserError(f"the patches encoder has no weights to load (encoder.weights = {weights!r})")
    return Patches()
