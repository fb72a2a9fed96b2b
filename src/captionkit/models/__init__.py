"""Decoder families, by name: ``create_decoder(family, config_dict)``."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Callable

from torch import nn

_FAMILIES: dict[str, tuple[type, Callable[..., nn.Module]]] = {}


def register_family(name: str, config_cls: type):
    def wrap(model_cls):
        _FAMILIES[name] = (config_cls, model_cls)
        return model_cls
    return wrap


def family_config(family: str, cfg: dict):
    """Build the family's config dataclass from a dict, naming unknown fields."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(sorted(_FAMILIES))}")
    config_cls = _FAMILIES[family][0]
    known = {f.name for f in fields(config_cls)}
    unknown = sorted(set(cfg) - known)
    if unknown:
        raise ValueError(f"model config for {family!r} has unknown fields: {', '.join(unknown)}")
    return config_cls(**cfg)


def family_fields(family: str) -> set[str]:
    """The config field names of a family (the trainer fills in the ones it knows, e.g. grid)."""
    if family not in _FAMILIES:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(sorted(_FAMILIES))}")
    return {f.name for f in fields(_FAMILIES[family][0])}


def family_default(family: str, name: str):
    """The default of a family's config field; None for a field the family lacks or must be given."""
    config_cls = _FAMILIES[family][0] if family in _FAMILIES else None
    f = next((f for f in fields(config_cls) if f.name == name), None) if config_cls else None
    return None if f is None or f.default is MISSING else f.default


def create_decoder(family: str, cfg: dict) -> nn.Module:
    return _FAMILIES[family][1](family_config(family, cfg))


from . import prefix_lm, sat, transformer, vit_gpt2  # noqa: E402,F401  (register the families of these names)
