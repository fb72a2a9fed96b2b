"""The registries of captionkit's pluggable parts: model families, image encoders, exporters.

The shape is timm's ``_registry.py``: this module holds the tables and imports none of the
parts. Each part's own module imports it at the top and registers itself by name with a
decorator (``@register_family("sat", SATConfig)``, ``@register_encoder("clip_vit_b32")``,
``@register_exporter("onnx", "sat")``); the packages :mod:`captionkit.models` and
:mod:`captionkit.encoders` import their built-in modules, so importing a package fills its
table. Dependencies therefore point one way, parts -> registry, never back, and adding a
family is one new file that registers itself (docs/architecture.md walks through one).

A name registered twice is an error (two modules claiming one name is a bug, not an
override); an unknown name is a one-line error listing the known ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import MISSING, fields
from typing import Any, Generic, TypeVar

from .errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    """Names -> registered objects of one kind ("model family", "encoder", ...)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, item: T) -> T:
        if name in self._items:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._items[name] = item
        return item

    def unregister(self, name: str) -> None:
        """Remove a registration (a test's temporary family); unknown names are an error."""
        self.get(name)
        del self._items[name]

    def get(self, name: str) -> T:
        if name not in self._items:
            raise UserError(f"unknown {self.kind} {name!r}; known: {', '.join(self.names())}")
        return self._items[name]

    def names(self) -> list[str]:
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


# ---- model families ------------------------------------------------------------------------------
# family name -> (its config dataclass, its CaptionModel subclass, see captionkit.models.base)
FAMILIES: Registry[tuple[type, type]] = Registry("model family")


def register_family(name: str, config_cls: type) -> Callable[[type], type]:
    """Class decorator: register a :class:`~captionkit.models.base.CaptionModel` subclass as
    the family ``name``, built from a ``config_cls`` dataclass. Sets ``family`` on the class."""
    def wrap(model_cls: type) -> type:
        FAMILIES.register(name, (config_cls, model_cls))
        model_cls.family = name
        return model_cls
    return wrap


def list_models() -> list[str]:
    """The registered family names, sorted."""
    return FAMILIES.names()


def model_class(family: str) -> type:
    """The family's model class (its declared capabilities are class attributes)."""
    return FAMILIES.get(family)[1]


def family_config(family: str, cfg: dict) -> Any:
    """Build the family's config dataclass from a dict, naming unknown fields."""
    config_cls = FAMILIES.get(family)[0]
    unknown = sorted(set(cfg) - family_fields(family))
    if unknown:
        raise UserError(f"model config for {family!r} has unknown fields: {', '.join(unknown)}")
    return config_cls(**cfg)


def family_fields(family: str) -> set[str]:
    """The config field names of a family (the trainer fills in the ones it knows, e.g. grid)."""
    return {f.name for f in fields(FAMILIES.get(family)[0])}


def family_default(family: str, name: str) -> Any:
    """The default of a family's config field; None for a field the family lacks or must be given."""
    f = next((f for f in fields(FAMILIES.get(family)[0]) if f.name == name), None)
    return None if f is None or f.default is MISSING else f.default


def create_model(family: str, cfg: dict):
    """A new model of ``family`` from its config dict (fields checked by ``family_config``).
    Import :mod:`captionkit.models` (which registers the built-in families) before calling
    this for them; shared code imports ``create_model`` from there."""
    return model_class(family)(family_config(family, cfg))


# ---- image encoders -------------------------------------------------------------------------------
# encoder name -> factory(weights=...) -> Encoder (built through captionkit.encoders.create_encoder)
ENCODERS: Registry[Callable[..., Any]] = Registry("encoder")


def register_encoder(name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Function decorator: register an encoder factory ``fn(weights=None) -> Encoder``."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        return ENCODERS.register(name, fn)
    return wrap


def list_encoders() -> list[str]:
    return ENCODERS.names()


# ---- exporters ------------------------------------------------------------------------------------
# per format, family name -> fn(model, ...) -> the format's export spec (see captionkit.export.exporters)
EXPORT_FORMATS = ("onnx", "transformers")
EXPORTERS: dict[str, Registry[Callable[..., Any]]] = {
    "onnx": Registry("ONNX exporter"), "transformers": Registry("transformers exporter")}


def register_exporter(fmt: str, family: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Function decorator: register how ``family`` is exported to ``fmt`` (one of EXPORT_FORMATS)."""
    if fmt not in EXPORTERS:
        raise ValueError(f"unknown export format {fmt!r}; known: {', '.join(EXPORT_FORMATS)}")

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        return EXPORTERS[fmt].register(family, fn)
    return wrap


def list_exporters(fmt: str) -> list[str]:
    """The families that can be exported to ``fmt``."""
    return EXPORTERS[fmt].names()
