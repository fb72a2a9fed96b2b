"""The models shipped with captionkit: one folder each under ``captionkit/pretrained/``. Listed
from that folder (never typed by hand), so help texts, ``captionkit models`` and error messages
name exactly what a user can pass to ``--model``. Light on imports (no torch): the command
line's help uses it."""

from __future__ import annotations

from pathlib import Path

from .folders import ENSEMBLE_FILE, SCORES_FILE, is_ensemble  # noqa: F401 (names of this module too)

SHIPPED = Path(__file__).parent.parent / "pretrained"
# the best Flickr8k captioner we have: a self-critical transformer and LSTM decoded as one, each
# photo also mirrored (pretrained/ensemble-lite2-flickr8k/README.md, docs/ensembles.md)
DEFAULT_MODEL = SHIPPED / "ensemble-lite2-flickr8k"
# the best single model, about twice as fast: the default before the ensemble, and what ONNX
# export takes when no --model is given (it exports one model); the Show, Attend and Tell LSTM
# ships too, as --model sat-lite2-flickr8k
FAST_MODEL = SHIPPED / "transformer-lite2-flickr8k"


def list_shipped_models() -> list[str]:
    """The names of the shipped models (the folders of ``pretrained/`` holding a checkpoint's
    config.json or an ensemble's file), the default first, the others in alphabetical order."""
    names = sorted({p.parent.name for pattern in ("*/config.json", f"*/{ENSEMBLE_FILE}") for p in SHIPPED.glob(pattern)})
    return sorted(names, key=lambda n: n != DEFAULT_MODEL.name)


def shipped_models_text() -> str:
    """The shipped models as a help text lists them: ``a (the default), b, c``."""
    return ", ".join(f"{n} (the default)" if n == DEFAULT_MODEL.name else n for n in list_shipped_models())




def model_folder(path: str | Path | None) -> Path:
    """A checkpoint folder from what a user typed: a path, the name of a shipped model,
    ``hub:ORG/NAME[@REVISION]`` (downloaded and checked: captionkit.inference.hub), or nothing
    (the default model). A folder of that name in the working directory wins over a shipped
    name. (Here, without torch, so the command line checks --model before torch loads;
    Captioner.load uses the same rule.)"""
    if path is None:
        return DEFAULT_MODEL
    if isinstance(path, str) and path.startswith("hub:"):
        from .hub import hub_model_folder
        return hub_model_folder(path)
    path = Path(path)
    if not path.exists() and len(path.parts) == 1 and (SHIPPED / path).is_dir():
        return SHIPPED / path
    return path


def existing_model_folder(path: str | Path | None) -> Path:
    """:func:`model_folder`, refused with one line (listing the shipped models) if missing."""
    from ..core.errors import CheckpointError

    folder = model_folder(path)
    if not folder.exists():
        raise CheckpointError(f"{folder}: no such model folder (shipped models: {shipped_models_text()})")
    return folder


def single_models() -> list[str]:
    """The shipped models that are one checkpoint (not an ensemble): what ONNX export takes."""
    return [n for n in list_shipped_models() if not is_ensemble(SHIPPED / n)]


def shipped_model_facts(name: str) -> dict:
    """What ``captionkit models`` shows of a shipped model, read from its folder: its family,
    encoder, size in MB, whether it is the default, and its Flickr8k test scores (x100; {}
    when the folder records none)."""
    import json

    folder = SHIPPED / name
    size = sum(f.stat().st_size for f in folder.rglob("*.safetensors")) / 1e6
    if is_ensemble(folder):
        spec = json.loads((folder / ENSEMBLE_FILE).read_text())
        members = [json.loads((folder / m["path"] / "config.json").read_text()) for m in spec["members"]]
        family = " + ".join(m["family"] for m in members) + " ensemble"
        encoder = members[0]["encoder"]["name"]
    else:
        cfg = json.loads((folder / "config.json").read_text())
        family, encoder = cfg["family"], cfg["encoder"]["name"]
    scores_file = folder / SCORES_FILE
    scores = json.loads(scores_file.read_text())["scores"] if scores_file.is_file() else {}
    return {"name": name, "family": family, "encoder": encoder, "size_mb": size,
            "default": name == DEFAULT_MODEL.name, "scores": scores}


def describe_shipped_model(name: str) -> str:
    """One line about a shipped model: name, family, encoder, size."""
    f = shipped_model_facts(name)
    default = "  (the default)" if f["default"] else ""
    return f"{name}  {f['family']} on {f['encoder']}, {f['size_mb']:.1f} MB{default}"
