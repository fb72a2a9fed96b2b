"""The form every dataset reader gives (:class:`CaptionDataset`: per split, :class:`ImageItem`
with the image's path and its captions), how captions become training words, and the few
helpers every reader uses (a message on stderr, a text file read, the seeded split of a layout
without an official one). The readers: :mod:`captionkit.data.datasets` (Flickr8k, Kaggle,
Karpathy, COCO, title CSVs, and the dispatcher ``load_dataset``), :mod:`captionkit.data.imagefolder`,
:mod:`captionkit.data.webdataset`, :mod:`captionkit.data.hf_datasets`."""

from __future__ import annotations

import random
import re
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import DatasetError, UserError

_PUNCT = str.maketrans("", "", string.punctuation)


# how reference captions become training words: "karpathy" (lower case, punctuation dropped:
# the usual captioning set-up) or "cased" (case and in-word hyphens and apostrophes kept, other
# punctuation dropped: for subword tokenizers on titles, where "Miso-Butter" is worth keeping)
WORD_STYLES = ("karpathy", "cased")
# a word: letters or digits, joined by in-word hyphens or apostrophes ("Mom's", "Stir-Fried")
_CASED_WORD = re.compile(r"[^\W_]+(?:[-'\u2019][^\W_]+)*")


def normalize(caption: str) -> list[str]:
    """Karpathy's normalisation: lower case, punctuation dropped, split on whitespace."""
    return caption.lower().translate(_PUNCT).split()


def cased_words(caption: str) -> list[str]:
    """Words as written: case, in-word hyphens and apostrophes kept, other punctuation dropped."""
    return _CASED_WORD.findall(caption)


# what a photo's mirror image changes in its captions (training's train.flip): the two sides
_MIRRORED = {"left": "right", "right": "left", "Left": "Right", "Right": "Left", "LEFT": "RIGHT", "RIGHT": "LEFT"}


def mirror_words(words: list[str]) -> list[str]:
    """A caption's words as they describe the photo mirrored left to right: "left" and "right"
    swapped (in the case they are written in), every other word as it is."""
    return [_MIRRORED.get(w, w) for w in words]


@dataclass
class ImageItem:
    name: str  # file name, the image's id everywhere (feature cache, caption JSON)
    path: Path
    raw: list[str] = field(default_factory=list)  # reference captions as written

    @property
    def tokens(self) -> list[list[str]]:
        return [normalize(c) for c in self.raw]

    def words(self, style: str = "karpathy") -> list[list[str]]:
        """The reference captions as training words, in one of WORD_STYLES."""
        if style not in WORD_STYLES:
            raise UserError(f"word style must be one of {', '.join(WORD_STYLES)}, not {style!r}")
        return self.tokens if style == "karpathy" else [cased_words(c) for c in self.raw]


@dataclass
class CaptionDataset:
    name: str
    splits: dict[str, list[ImageItem]]

    def split(self, name: str) -> list[ImageItem]:
        aliases = {"val": "dev", "dev": "val", "valid": "dev", "validation": "dev"}
        if name in self.splits:
            return self.splits[name]
        if aliases.get(name) in self.splits:
            return self.splits[aliases[name]]
        raise DatasetError(f"dataset {self.name} has no split {name!r} "
                           f"(it has: {', '.join(self.splits)})")

    def all_items(self) -> list[ImageItem]:
        """Every image once, sorted by name (the order of feature caches)."""
        seen = {it.name: it for items in self.splits.values() for it in items}
        return [seen[k] for k in sorted(seen)]


def _warn(msg: str) -> None:
    print(msg, file=sys.stderr)


def _read_text(path: Path) -> str:
    """A dataset's text file; one DatasetError naming it when it is not UTF-8."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror})") from None


def _deterministic_splits(names: list[str], seed: int = 0) -> dict[str, list[str]]:
    """Train/dev/test when a layout has no official split: 1,000 test and dev images for
    corpora of at least 5,000 images, else 10% each; seeded, so always the same."""
    names = sorted(names)
    random.Random(seed).shuffle(names)
    k = 1000 if len(names) >= 5000 else max(1, len(names) // 10)
    return {"train": sorted(names[2 * k:]), "dev": sorted(names[k:2 * k]), "test": sorted(names[:k])}
