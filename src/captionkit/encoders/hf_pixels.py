"""The pixels a Hugging Face image-to-text captioner takes, as cached rows: encoder ``hf_pixels``.

The image side of the ``hf_*`` families (:mod:`captionkit.models.hf_captioner`: BLIP, GIT,
VisionEncoderDecoderModel, Idefics3/SmolVLM), whose transformers model holds its own vision
tower and runs it on these rows, as ``vit_pixels`` is for ``vit_gpt2``: the photo resized to the
square input of the model's vision side (its config: ``image_size``, ``patch_size``) with its image
processor's filter (bicubic unless the processor names bilinear) and cut into the vision side's
patches, one row of 3 x p x p pixels in [0, 1] per patch. The model normalises them with its
processor's mean and std.

``[encoder] weights`` names the model (a Hub name or a folder, the same as ``[model] source``);
only its config and image processor are read here. ``"random"`` (the encoder tests build every
encoder that way) gives 224 px in 16 px patches without reading anything.

The photo is squashed to the square, as every captionkit encoder does; a model's own processor may
crop it (GIT's CLIP processor: the shorter side to the size, then the centre) or keep its aspect
ratio (Idefics3), so on photos far from square the captions can differ from the processor's.
"""

from __future__ import annotations

from ..core.hf_image_text import captioner_config, image_settings, pixel_geometry
from .base import Encoder, UserError, register_encoder
from .vit_pixels import ViTPixels

_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # Pillow's filter numbers, as image processors store them


@register_encoder("hf_pixels")
def hf_pixels(weights: str | None = None) -> Encoder:
    if weights == "random":  # nothing to randomise: a common geometry, read from nowhere (tests)
        return ViTPixels(224, 16, "bicubic")
    if not weights:
        raise UserError("encoder hf_pixels needs weights: the Hugging Face model it feeds (a Hub name or a folder, "
                         "as [model] source)")
    size, patch = pixel_geometry(captioner_config(weights), weights)
    return ViTPixels(size, patch, _RESAMPLE.get(image_settings(weights).get("resample"), "bicubic"))
