"""Decoder families, by name: ``create_model(family, config_dict)``, ``list_models()``.

Importing this package registers the built-in families (each module registers itself in
:mod:`captionkit.core.registry`); the contract they implement is :mod:`.base`.
"""

from __future__ import annotations

from ..core.registry import create_model, family_config, family_default, family_fields, list_models, model_class
from . import hf_families, prefix_lm, sat, transformer, vit_gpt2  # noqa: F401  (register the families of these names)
from .base import CaptionModel

DEFAULT_FAMILY = "sat"  # a training config's [model] family when it names none

__all__ = ["CaptionModel", "DEFAULT_FAMILY", "create_model", "family_config", "family_default", "family_fields",
           "list_models", "model_class"]
