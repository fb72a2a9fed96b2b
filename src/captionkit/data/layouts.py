"""What the layouts people keep their own data in share (an ``imagefolder``, WebDataset
shards, a ``datasets`` object; :mod:`.imagefolder`, :mod:`.webdataset`, :mod:`.hf_datasets`):
split names, caption values, rows joined into a :class:`~captionkit.data.datasets.CaptionDataset`,
and the cache folders that WebDataset shards and ``datasets`` objects are unpacked into.

A row is one image with one or several captions and maybe a split, read from a metadata line,
a tar sample or a dataset row; ``where`` names it in messages (``data/metadata.jsonl:4``,
``train-000.tar: sample 'img001'``). Rows of the same image in the same split are joined, their
captions in row order. Without any split, the images are split as the Kaggle layout's are
(seeded: 1,000 dev and test images from 5,000 images on, else 10% each), and one line says so.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..core.diskspace import disk_errors
from ..core.errors import DatasetError
from .items import CaptionDataset, ImageItem, _deterministic_splits, _warn

# split names as people write them -> captionkit's (train, dev, test); any other is kept as written
SPLIT_ALIASES = {"train": "train", "restval": "train", "validation": "dev", "valid": "dev", "val": "dev",
                 "dev": "dev", "test": "test"}
SPLIT_ORDER = ("train", "dev", "test")
# the fields a caption may be given in, as Hugging Face's image-captioning data names them
CAPTION_FIELDS = ("text", "caption", "captions")


def split_name(value: str) -> str:
    """A split as captionkit names it: ``validation``, ``valid``, ``val`` -> ``dev``, ``restval``
    -> ``train`` (Karpathy's), other names as written."""
    return SPLIT_ALIASES.get(value.strip().lower(), value.strip())


def known_split(value: str) -> str | None:
    """The split a folder's or shard's name stands for (``train``, ``validation``...), else None."""
    return SPLIT_ALIASES.get(value.lower())


def shown(value) -> str:
    """A value as a message shows it: short, quoted where it is text."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def captions_of(value, where: str, field: str) -> list[str]:
    """A caption field's value as captions: a string, or a list of strings (several captions of
    one image); each stripped. Anything else, an empty list or an empty caption is a user's
    mistake, named by ``where`` and ``field``."""
    many = isinstance(value, (list, tuple))
    values = list(value) if many else [value]
    if many and not values:
        raise DatasetError(f"{where}: {field!r} is an empty list (give one caption or several)")
    out = []
    for k, caption in enumerate(values):
        at = f"{field}[{k}]" if many else field
        if not isinstance(caption, str):
            raise DatasetError(f"{where}: {at!r} must be a caption (text) or a list of captions, got {shown(caption)}")
        if not caption.strip():
            raise DatasetError(f"{where}: {at!r} is an empty caption")
        out.append(caption.strip())
    return out


def split_of(value, where: str, field: str = "split") -> str:
    """A row's split field: text naming a split (see :func:`split_name`)."""
    if not isinstance(value, str) or not value.strip():
        raise DatasetError(f"{where}: {field!r} must name a split (train, validation, test), got {shown(value)}")
    return split_name(value)


@dataclass
class Row:
    """One image's captions from one line, sample or dataset row. ``name`` is the image's id
    everywhere (its file name: the feature cache, caption JSON); ``split`` None: not given."""

    where: str
    name: str
    path: Path
    captions: list[str]
    split: str | None


def assemble(label: str, rows: list[Row], source: str) -> CaptionDataset:
    """The dataset of ``rows`` (named ``label``; ``source`` names the data in the one line a
    seeded split prints). An image's rows within one split are joined; two different files may
    not share a name (the name is the image's id, in the feature cache too). Either every row
    gives a split or none does; then the split is seeded (:func:`_deterministic_splits`).
    Splits keep the order of their images' first rows, ``train``, ``dev``, ``test`` first."""
    if not rows:
        raise DatasetError(f"{source}: no images with captions")
    given = [r for r in rows if r.split is not None]
    if given and len(given) < len(rows):
        bare = next(r for r in rows if r.split is None)
        raise DatasetError(f"{bare.where}: no split, where {given[0].where} gives one ({given[0].split!r}); "
                           f"give every row a split, or none")
    first: dict[str, Row] = {}
    items: dict[tuple[str | None, str], ImageItem] = {}
    for r in rows:
        seen = first.setdefault(r.name, r)
        if seen.path != r.path:
            raise DatasetError(f"{r.where}: {r.path} has the file name {r.name!r} of {seen.path} ({seen.where}); "
                               f"an image's file name is its id: rename one of them")
        key = (r.split, r.name)
        if key in items:
            items[key].raw.extend(r.captions)
        else:
            items[key] = ImageItem(r.name, r.path, list(r.captions))
    if given:
        splits: dict[str, list[ImageItem]] = {}
        for (split, _), item in items.items():
            splits.setdefault(split, []).append(item)
        order = [s for s in SPLIT_ORDER if s in splits] + [s for s in splits if s not in SPLIT_ORDER]
        return CaptionDataset(label, {s: splits[s] for s in order})
    by_name = {name: item for (_, name), item in items.items()}
    lists = _deterministic_splits(list(by_name))
    _warn(f"{source}: no split given, so a seeded one: "
          + ", ".join(f"{len(names)} {split}" for split, names in lists.items()) + " images")
    return CaptionDataset(label, {split: [by_name[n] for n in names] for split, names in lists.items()})


def is_file(path: Path) -> bool:
    """Whether an image file is there (a name the file system cannot hold names none)."""
    try:
        return path.is_file()
    except OSError:
        return False


@contextmanager
def building_folder(final: Path, what: str) -> Iterator[Path | None]:
    """A cache folder written whole or not at all: yields a fresh temporary folder beside
    ``final`` to fill, renamed to ``final`` when the block ends -- or None when ``final`` is there
    already (written by an earlier call, or by another process meanwhile: the cache's folders
    are named by their content, so either copy will do). A failure removes the temporary
    folder; a full disk or a read-only cache is one line naming ``what``."""
    if final.is_dir():
        yield None
        return
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # one this process left by dying
    try:
        with disk_errors(final, kept=f"{what} not cached"):
            tmp.mkdir(parents=True)
            yield tmp
            try:
                os.rename(tmp, final)
            except OSError:
                if not final.is_dir():
                    raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
