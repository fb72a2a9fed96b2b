"""The pixels a Hugging Face vision transformer takes, as cached rows: encoder ``vit_pixels``.

This is the image side of the ``vit_gpt2`` family (:mod:`captionkit.models.vit_gpt2`), whose
``VisionEncoderDecoderModel`` holds the ViT itself and runs it, frozen blocks included, on
these rows. The encoder only resizes the photo to the ViT's input size (its ``config.json``:
``image_size``, ``patch_size``) with the resampling filter of its image processor
(``preprocessor_config.json``; bicubic when it names neither bilinear nor bicubic) and cuts it
into the ViT's patches: one row of 3 x p x p pixels in [0, 1] per patch (channel-major, as
:mod:`.patches` does), on the ViT's (S/p) x (S/p) patch grid. The mean/std normalisation is
the family's, read from the same image processor, so a ViT named differently here than in
[model] can at worst change the resampling: a different input geometry is refused there.

``[encoder] weights`` names the ViT (a hub name or a local folder; empty: the family's default,
``google/vit-base-patch16-224-in21k``); only its config and image processor are read here
(``"random"``, which has no meaning for pixels, gives the default ViT's 224 px and 16 px
patches without reading anything: the encoder tests build every encoder that way).
Why pixels and not the ViT's outputs: see the family's module docstring.
"""

from __future__ import annotations

from ..core.hf import DEFAULT_VIT, load_image_processor_dict, load_vit_config, vit_geometry
from .base import Encoder, Preprocess, register_encoder
from .patches import Patches

# Pillow's filter numbers, as image processors store them
_RESAMPLE = {2: "bilinear", 3: "bicubic"}


class ViTPixels(Patches):
    def __init__(self, size: int, patch: int, resample: str):
        super().__init__(size, patch)
        # [0, 1] pixels: the family normalises them with its ViT's own mean and std
        self.preprocess = Preprocess(size=size, mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), resample=resample)
        # the rows depend on the geometry and the filter only, so ViTs that share them share a cache
        self.weights_id = f"patch{patch}"


@register_encoder("vit_pixels")
def vit_pixels(weights: str | None = None) -> Encoder:
    if weights == "random":  # nothing to randomise: the default ViT's geometry, read from nowhere (tests)
        return ViTPixels(224, 16, "bilinear")
    source = weights or DEFAULT_VIT
    size, patch, _ = vit_geometry(load_vit_config(source), source)
    resample = _RESAMPLE.get(load_image_processor_dict(source).get("resample"), "bicubic")
    return ViTPixels(size, patch, resample)
