"""A Hugging Face ``datasets`` object -- a ``Dataset`` or a ``DatasetDict`` -- or a folder one was
saved to (``save_to_disk``) as a captionkit dataset (``datasets`` must be installed:
``pip install 'captionkit[hf-datasets]'``).

Columns: the image column is the one of ``datasets.Image`` type (or ``image``): the images'
files' bytes, or a column of image paths; the caption column is ``text``, ``caption`` or
``captions`` (a string, or a list of strings for several captions; several rows of one image
also give several). Splits: a ``split`` column where there is one, else a ``DatasetDict``'s
(``validation`` is captionkit's ``dev``), else a seeded split (captionkit.data.layouts.assemble).

Training, features and the Ray engine read image files, so the data is written once as an
imagefolder (captionkit.data.imagefolder) in ``~/.cache/captionkit/datasets/<digest>/``, named
by its content: its images as stored in the dataset (the file's own bytes, never decoded and
encoded again), an image given by path as a link to it, and ``metadata.jsonl``. The same data
again is that folder again, and a dataset saved in it gives the same features as its files.
An image's name (its id) is its file's name where the dataset keeps one, else its row:
``000012.jpg``. Every row is checked (image, caption, split: one :class:`DatasetError` naming
the split and row) before anything is written.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
from pathlib import Path

from ..core.cache import cache_dir
from ..core.errors import DatasetError, UserError
from .items import CaptionDataset, _warn
from .imagefolder import read_imagefolder
from .layouts import CAPTION_FIELDS, building_folder, captions_of, is_file, split_name, split_of

FORMAT = 1  # of the folders written: part of their digest
BATCH = 256  # rows read at a time


def _module():
    try:
        import datasets
    except ImportError:
        raise UserError("reading a Hugging Face dataset needs the 'datasets' package "
                        "(pip install 'captionkit[hf-datasets]')") from None
    return datasets


def is_hf_dataset(obj) -> bool:
    """Whether ``obj`` is a ``datasets`` object (never imports ``datasets`` itself)."""
    return type(obj).__module__.split(".")[0] == "datasets"


def is_saved_dataset(folder: Path) -> bool:
    """A folder written by ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``."""
    return is_file(folder / "dataset_dict.json") or (is_file(folder / "state.json")
                                                      and is_file(folder / "dataset_info.json"))


def read_saved(folder: str | Path) -> CaptionDataset:
    """The dataset saved in ``folder`` by ``save_to_disk``."""
    datasets = _module()
    try:
        ds = datasets.load_from_disk(str(folder))
    except (OSError, ValueError) as e:  # datasets' FileNotFoundError and its own errors about the files
        raise DatasetError(f"{folder}: cannot load the saved dataset ({e})") from None
    return read_imagefolder(as_imagefolder(ds, source=str(folder)), source=str(folder))


def read_hf(ds, image_column: str | None = None, text_column: str | None = None) -> CaptionDataset:
    """A ``Dataset`` or ``DatasetDict`` as a captionkit dataset (see the module's notes)."""
    return read_imagefolder(as_imagefolder(ds, image_column, text_column), source=f"the {type(ds).__name__}")


def _parts(ds, source: str | None) -> list[tuple[str | None, str, object]]:
    """(split or None, how messages name it, Dataset) of each part of ``ds``."""
    datasets = _module()
    if isinstance(ds, datasets.DatasetDict):
        if not len(ds):
            raise DatasetError(f"{source or 'the DatasetDict'}: no splits")
        return [(split_name(k), f"{source or 'the DatasetDict'}'s {k!r} split", d) for k, d in ds.items()]
    if isinstance(ds, datasets.Dataset):
        return [(None, source or "the Dataset", ds)]
    if isinstance(ds, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise UserError("a streaming (iterable) dataset cannot be trained on twice over; load it without "
                        "streaming=True, or save some of it with save_to_disk")
    raise UserError(f"not a dataset: a {type(ds).__module__}.{type(ds).__qualname__}")


def _columns(d, where: str, image_column: str | None, text_column: str | None) -> tuple[str, str]:
    datasets = _module()
    names = list(d.column_names)
    listed = ", ".join(map(repr, names))
    if image_column is None:
        typed = [c for c, f in d.features.items() if isinstance(f, datasets.Image)]
        image_column = typed[0] if len(typed) == 1 else "image" if "image" in names else None
        if image_column is None:
            raise DatasetError(f"{where}: which column holds the images? " + (
                f"{' and '.join(map(repr, typed))} both do; give image_column=" if typed else
                f"none is of datasets.Image type or named 'image' (its columns: {listed}); give image_column="))
    if text_column is None:
        given = [c for c in CAPTION_FIELDS if c in names]
        if len(given) != 1:
            raise DatasetError(f"{where}: " + (f"no caption column 'text' or 'caption' (its columns: {listed}); "
                                               f"give text_column=" if not given else
                                               f"{' and '.join(map(repr, given))} are both caption columns; "
                                               f"give text_column="))
        text_column = given[0]
    for c in (image_column, text_column):
        if c not in names:
            raise DatasetError(f"{where}: no column {c!r} (its columns: {listed})")
    feature = d.features[image_column]
    if not isinstance(feature, datasets.Image) and getattr(feature, "dtype", None) not in (
            "string", "large_string", "binary", "large_binary"):
        raise DatasetError(f"{where}: column {image_column!r} holds {feature}, not images (datasets.Image), "
                           f"their paths or their files' bytes")
    return image_column, text_column


def _rows(d, image_column: str, text_column: str, split_column: str | None):
    """Each row's (image value, caption value, split value) with the images undecoded: an
    Image column's values as {"bytes", "path"}."""
    datasets = _module()
    if isinstance(d.features[image_column], datasets.Image):
        d = d.cast_column(image_column, datasets.Image(decode=False))
    columns = [image_column, text_column] + ([split_column] if split_column else [])
    for batch in d.select_columns(columns).iter(batch_size=BATCH):
        splits = batch[split_column] if split_column else [None] * len(batch[image_column])
        yield from zip(batch[image_column], batch[text_column], splits)


def _image(value, where: str, column: str) -> tuple[bytes | None, Path | None, str | None]:
    """(the file's bytes, or the path of the file, and the file name the dataset keeps)."""
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
    elif isinstance(value, (bytes, str)):
        data, path = (value, None) if isinstance(value, bytes) else (None, value)
    else:
        data = path = None
    if data is None and not path:
        raise DatasetError(f"{where}: no image in {column!r}")
    if data is None and not is_file(Path(path)):
        raise DatasetError(f"{where}: {column!r} is {path!r}: no such image file")
    return data, (None if data is not None else Path(path).resolve()), (Path(path).name if path else None)


def _suffix(data: bytes) -> str:
    """An image file's usual suffix, from its header (.img where Pillow cannot tell)."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            fmt = im.format
    except Exception:  # not an image Pillow reads: the feature pass reports it, named
        return ".img"
    return {"JPEG": ".jpg", "TIFF": ".tif"}.get(fmt, f".{fmt.lower()}" if fmt else ".img")


def as_imagefolder(ds, image_column: str | None = None, text_column: str | None = None,
                   source: str | None = None) -> Path:
    """``ds`` written as an imagefolder in the cache (once: see the module's notes); its folder.
    ``source``: how messages name the data (a saved dataset's folder)."""
    parts = _parts(ds, source)
    plan = []
    for split, where, d in parts:
        img, text = _columns(d, where, image_column, text_column)
        # a split column wins over the DatasetDict's split: datasets' imagefolder puts every row in
        # "train" whatever the metadata's split says; a Hub copy of Flickr30k is one "test" split
        # whose column holds Karpathy's splits
        plan.append((split, where, d, img, text, "split" if "split" in d.column_names else None))
    # the images: one entry per image and split, in order of their first rows; names by image
    entries: dict[tuple[str | None, str], dict] = {}
    names: dict[str, str] = {}  # image identity -> name
    taken: set[str] = set()
    first_rows: dict[tuple[int, int], str] = {}  # (part, row) -> the identity it writes
    links: dict[str, Path] = {}
    for p, (split, where, d, img, text, split_col) in enumerate(plan):
        for i, (image, caption, row_split) in enumerate(_rows(d, img, text, split_col)):
            at = f"{where}, row {i}"
            data, path, file_name = _image(image, at, img)
            captions = captions_of(caption, at, text)
            s = split if split_col is None else split_of(row_split, at, split_col)
            # one image: the same bytes under the same file name (two files may hold the same bytes)
            ident = f"{hashlib.sha256(data).hexdigest()}:{file_name or ''}" if data is not None else f"path:{path}"
            if ident not in names:
                # the dataset's file name where it is one (with room for a row-number prefix)
                kept = file_name and Path(file_name).suffix and len(os.fsencode(file_name)) <= 200
                name = file_name if kept else \
                    f"{i:06d}{_suffix(data) if data is not None else Path(file_name or '').suffix or '.img'}"
                if split is not None and not file_name:
                    name = f"{split}-{name}"
                base, k = name, 0
                while name in taken:  # another image with this file name: the row's number first
                    k += 1
                    name = f"{i:06d}-{base}" if k == 1 else f"{i:06d}-{k}-{base}"
                names[ident] = name
                taken.add(name)
                if data is not None:
                    first_rows[(p, i)] = ident
                else:
                    links[name] = path
            entry = entries.setdefault((s, ident), {"file_name": f"images/{names[ident]}", "text": [],
                                                    **({"split": s} if s is not None else {})})
            entry["text"].extend(captions)
    if not entries:
        raise DatasetError(f"{source or 'the dataset'}: no rows")
    lines = [json.dumps(e, ensure_ascii=False) for e in entries.values()]
    digest = hashlib.sha256(json.dumps({"format": FORMAT, "rows": lines, "identities": sorted(names)}).encode()
                            ).hexdigest()[:16]
    folder = cache_dir("datasets") / digest
    with building_folder(folder, "the dataset's images") as tmp:
        if tmp is not None:
            (tmp / "images").mkdir()
            for name, path in links.items():
                try:
                    os.symlink(path, tmp / "images" / name)
                except OSError:  # a file system without links
                    shutil.copyfile(path, tmp / "images" / name)
            for p, (split, where, d, img, text, split_col) in enumerate(plan):
                for i, (image, _, _) in enumerate(_rows(d, img, text, None)):
                    if (p, i) in first_rows:
                        (tmp / "images" / names[first_rows[(p, i)]]).write_bytes(image["bytes"] if isinstance(
                            image, dict) else image)
            (tmp / "metadata.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
            _warn(f"{source or 'the dataset'}: {len(names)} images written to {folder} (once: the same data reuses it)")
    return folder
