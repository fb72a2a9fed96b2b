"""What a model folder holds, by name: below both captionkit.inference.shipped (which resolves
``--model``) and captionkit.inference.hub (which ``hub:`` references go through), so neither
imports the other to read them. No torch here."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.errors import CheckpointError

ENSEMBLE_FILE = "ensemble.json"  # captionkit.inference.ensemble's folder file (named here to keep torch out)
SCORES_FILE = "scores.json"  # a shipped model's Flickr8k test scores (x100), as its card's table gives them


def is_ensemble(folder: Path) -> bool:
    return (folder / ENSEMBLE_FILE).is_file()


def read_ensemble_doc(folder: Path) -> object:
    """``folder/ensemble.json`` as JSON (its fields are checked by its readers:
    captionkit.inference.ensemble.read_ensemble, rerank.read_folder_rerank); one CheckpointError
    naming the file when it is no JSON."""
    path = folder / ENSEMBLE_FILE
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
