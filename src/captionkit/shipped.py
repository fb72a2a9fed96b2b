"""The models shipped with captionkit: one folder each under ``captionkit/pretrained/``. Listed
from that folder (never typed by hand), so help texts, ``captionkit models`` and error messages
name exactly what a user can pass to ``--model``. Light on imports (no torch): the command
line's help uses it."""

from __future__ import annotations

from pathlib import Path

SHIPPED = Path(__file__).parent / "pretrained"
# the best Flickr8k model we have (docs, "The shipped model"); the Show, Attend and Tell LSTM
# that was the default before it ships too, as --model sat-lite2-flickr8k
DEFAULT_MODEL = SHIPPED / "transformer-lite2-flickr8k"


def list_shipped_models() -> list[str]:
    """The names of the shipped models (the folders of ``pretrained/`` holding a config.json),
    the default first, the others in alphabetical order."""
    names = sorted(p.parent.name for p in SHIPPED.glob("*/config.json"))
    return sorted(names, key=lambda n: n != DEFAULT_MODEL.name)


def shipped_models_text() -> str:
    """The shipped models as a help text lists them: ``a (the default), b, c``."""
    return ", ".join(f"{n} (the default)" if n == DEFAULT_MODEL.name else n for n in list_shipped_models())


def describe_shipped_model(name: str) -> str:
    """One line about a shipped model, read from its folder: name, family, encoder, size."""
    import json

    folder = SHIPPED / name
    cfg = json.loads((folder / "config.json").read_text())
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 1e6
    default = "  (the default)" if name == DEFAULT_MODEL.name else ""
    return f"{name}  {cfg['family']} on {cfg['encoder']['name']}, {size:.1f} MB{default}"
