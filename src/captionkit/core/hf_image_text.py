"""Hugging Face image-to-text captioners (BLIP, GIT, VisionEncoderDecoderModel, Idefics3/SmolVLM) as
sources: what the ``hf_pixels`` encoder and the ``hf_*`` families (:mod:`captionkit.models.hf_captioner`)
both read of one -- its config, the input geometry of its vision side and its image processor's
settings -- loaded as :mod:`captionkit.core.hf` loads everything (a folder, or the local Hugging
Face cache, before the Hub; a one-line error naming the model otherwise). Cheap to import:
transformers is imported when a source is read."""

from __future__ import annotations

from .errors import UserError
from .hf import load_image_processor_dict, load_pretrained, require_transformers

WHAT = "image-to-text model"  # how errors name such a source


def hf_transformers():
    """The ``transformers`` module, or a one-line error naming the extra that installs it."""
    return require_transformers("a Hugging Face captioner (hf: models, the hf_* families)", "hf")


def captioner_config(source: str):
    """The transformers config of an image-to-text model (a folder or a Hub name)."""
    return load_pretrained(hf_transformers().AutoConfig, source, WHAT)


def vision_config(config):
    """The config of a captioner's vision side: ``vision_config`` (BLIP, GIT, Idefics3) or
    ``encoder`` (a VisionEncoderDecoderModel); None when it has neither."""
    for name in ("vision_config", "encoder"):
        sub = getattr(config, name, None)
        if sub is not None and hasattr(sub, "image_size"):
            return sub
    return None


def pixel_geometry(config, source: str) -> tuple[int, int]:
    """(image side, patch side) the captioner's vision side takes: square images of square
    patches, or a one-line error."""
    vision = vision_config(config)
    size, patch = getattr(vision, "image_size", None), getattr(vision, "patch_size", None)
    size = size[0] if isinstance(size, (list, tuple)) and len(set(size)) == 1 else size
    patch = patch[0] if isinstance(patch, (list, tuple)) and len(set(patch)) == 1 else patch
    if not isinstance(size, int) or not isinstance(patch, int) or size % patch:
        raise UserError(f"{WHAT} {source!r} ({config.model_type}) has no vision side of square images cut into "
                         f"square patches (image_size {size}, patch_size {patch})")
    return size, patch


def image_settings(source: str) -> dict:
    """The image processor's settings of a captioner (its ``preprocessor_config.json``, or the
    image processor inside its ``processor_config.json``) as a dict."""
    return load_image_processor_dict(source)


def normalisation(settings: dict) -> tuple[list[float], list[float]]:
    """(mean, std) the model's pixels in [0, 1] are normalised with (none when the processor
    does not normalise)."""
    if not settings.get("do_normalize", True):
        return [0.0] * 3, [1.0] * 3
    mean, std = settings.get("image_mean", [0.5] * 3), settings.get("image_std", [0.5] * 3)
    mean = [float(mean)] * 3 if isinstance(mean, (int, float)) else [float(m) for m in mean]
    std = [float(std)] * 3 if isinstance(std, (int, float)) else [float(s) for s in std]
    return mean, std
