"""What a model folder holds, by name: below both captionkit.inference.shipped (which resolves
``--model``) and captionkit.inference.hub (which ``hub:`` references go through), so neither
imports the other to read them. No torch here."""

from __future__ import annotations

from pathlib import Path

ENSEMBLE_FILE = "ensemble.json"  # captionkit.inference.ensemble's folder file (named here to keep torch out)
SCORES_FILE = "scores.json"  # a shipped model's Flickr8k test scores (x100), as its card's table gives them


def is_ensemble(folder: Path) -> bool:
    return (folder / ENSEMBLE_FILE).is_file()
