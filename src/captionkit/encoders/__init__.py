"""Image encoders: photos -> annotation vectors (B, L, D). See :mod:`.base` for the contract."""

from . import clip, efficientnet_lite, hf_pixels, patches, torchvision_cnns, vit_pixels  # noqa: F401  (register encoders)
from .base import Encoder, Preprocess, WeightsUnavailable, create_encoder, list_encoders, load_finetuned

__all__ = ["Encoder", "Preprocess", "WeightsUnavailable", "create_encoder", "list_encoders", "load_finetuned"]
