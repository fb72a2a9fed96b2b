"""The models shipped with captionkit: one folder each under ``captionkit/pretrained/``. Listed
from that folder (never typed by hand), so help texts, ``captionkit models`` and error messages
name exactly what a user can pass to ``--model``. Light on imports (no torch): the command
line's help uses it."""

from __future__ import annotations

from pathlib import Path

SHIPPED = Path(__file__).parent.parent / "pretrained"
# the best Flickr8k captioner we have: a self-critical transformer and LSTM decoded as one, each
# photo also mirrored (pretrained/ensemble-lite2-flickr8k/README.md, docs/ensembles.md)
DEFAULT_MODEL = SHIPPED / "ensemble-lite2-flickr8k"
# the best single model, about twice as fast: the default before the ensemble, and what ONNX
# export takes when no --model is given (it exports one model); the Show, Attend and Tell LSTM
# ships too, as --model sat-lite2-flickr8k
FAST_MODEL = SHIPPED / "transformer-lite2-flickr8k"
ENSEMBLE_FILE = "ensemble.json"  # captionkit.inference.ensemble's folder file (named here to keep torch out)


def list_shipped_models() -> list[str]:
    """The names of the shipped models (the folders of ``pretrained/`` holding a checkpoint's
    config.json or an ensemble's file), the default first, the others in alphabetical order."""
    names = sorted({p.parent.name for pattern in ("*/config.json", f"*/{ENSEMBLE_FILE}") for p in SHIPPED.glob(pattern)})
    return sorted(names, key=lambda n: n != DEFAULT_MODEL.name)


def shipped_models_text() -> str:
    """The shipped models as a help text lists them: ``a (the default), b, c``."""
    return ", ".join(f"{n} (the default)" if n == DEFAULT_MODEL.name else n for n in list_shipped_models())


def describe_shipped_model(name: str) -> str:
    """One line about a shipped model, read from its folder: name, family, encoder, size."""
    import json

    folder = SHIPPED / name
    size = sum(f.stat().st_size for f in folder.rglob("*.safetensors")) / 1e6
    default = "  (the default)" if name == DEFAULT_MODEL.name else ""
    if (folder / ENSEMBLE_FILE).exists():
        spec = json.loads((folder / ENSEMBLE_FILE).read_text())
        members = [json.loads((folder / m["path"] / "config.json").read_text()) for m in spec["members"]]
        what = " + ".join(m["family"] for m in members) + f" ensemble on {members[0]['encoder']['name']}"
        return f"{name}  {what}, {size:.1f} MB{default}"
    cfg = json.loads((folder / "config.json").read_text())
    return f"{name}  {cfg['family']} on {cfg['encoder']['name']}, {size:.1f} MB{default}"
