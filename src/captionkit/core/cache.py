"""Where captionkit keeps what it computes once per machine: ``$CAPTIONKIT_CACHE``, by default
``~/.cache/captionkit``. Encoder features go in folders named by the encoder's cache key
directly under the root (:mod:`captionkit.encoders.features`); everything else in a named folder:
``lm`` (converted language models), ``kernels`` (the compiled attention kernel), ``splits``
(title-CSV splits), ``wordnet`` (METEOR's word lists). The one place these paths are computed;
no torch import here, so the dataset readers can use it cheaply."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache folder: ``$CAPTIONKIT_CACHE`` or ``~/.cache/captionkit`` (not created here)."""
    return Path(os.environ.get("CAPTIONKIT_CACHE", Path.home() / ".cache" / "captionkit"))


def cache_dir(name: str) -> Path:
    """The cache's folder for one kind of thing (``lm``, ``kernels``, ``splits``, ...)."""
    return cache_root() / name
