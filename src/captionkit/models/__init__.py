"""Decoder families, by name: ``create_decoder(family, config_dict)``."""

from __future__ import annotations

from dataclasses import fields
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


def create_decoder(family: str, cfg: dict) -> nn.Module:
    return _FAMILIES[family][1](family_config(family, cfg))


from . import prefix_lm, sat, transformer  # noqa: E402,F401  (register "prefix_lm", "sat", "transformer")
