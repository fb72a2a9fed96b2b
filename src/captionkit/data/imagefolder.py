"""The ``imagefolder`` layout, as Hugging Face's ``datasets`` reads it: a folder of images and a
``metadata.jsonl`` or ``metadata.csv`` whose ``file_name`` is an image's path relative to it and
whose ``text`` or ``caption`` column holds its caption -- a string, or in JSON Lines a list of
strings for several; several rows per file also give several captions.

Splits: a ``split`` column (``train``, ``validation``/``valid``/``val``/``dev``, ``test``; any
other name is kept as written), or per-split subfolders ``train/``, ``validation/``, ``test/``
each with its own metadata file; with neither, a seeded split (captionkit.data.layouts.assemble).

Every row is checked as it is read, before any image is opened: a missing ``file_name`` or
caption column, a ``file_name`` naming no file, an empty caption is one :class:`DatasetError`
naming the file and its line.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from ..core.errors import DatasetError
from .items import CaptionDataset, _read_text
from .layouts import CAPTION_FIELDS, Row, assemble, captions_of, is_file, known_split, shown, split_of

METADATA = ("metadata.jsonl", "metadata.csv")


def metadata_file(folder: Path) -> Path | None:
    """The folder's metadata file; one of each kind is ambiguous, as it is to ``datasets``."""
    found = [folder / m for m in METADATA if is_file(folder / m)]
    if len(found) > 1:
        raise DatasetError(f"{folder}: both metadata.jsonl and metadata.csv; keep one")
    return found[0] if found else None


def split_folders(root: Path) -> dict[str, Path]:
    """The split subfolders of ``root`` that hold a metadata file: {train/dev/test/...: folder}."""
    found: dict[str, Path] = {}
    try:
        subs = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError as e:
        raise DatasetError(f"{root}: cannot list the folder ({e.strerror})") from None
    for sub in subs:
        split = known_split(sub.name)
        if split is None or metadata_file(sub) is None:
            continue
        if split in found:
            raise DatasetError(f"{root}: {found[split].name}/ and {sub.name}/ are both the {split} split; keep one")
        found[split] = sub
    return found


def is_imagefolder(root: Path) -> bool:
    return root.is_dir() and (metadata_file(root) is not None or bool(split_folders(root)))


def read_imagefolder(root: str | Path, source: str | None = None) -> CaptionDataset:
    """The imagefolder at ``root`` (see the module's notes); ``source`` names the data in the
    line a seeded split prints (default: the metadata file)."""
    root = Path(root)
    top, subs = metadata_file(root), split_folders(root)
    if top is not None and subs:
        raise DatasetError(f"{root}: a {top.name} at the top and split folders with their own "
                           f"({', '.join(p.name + '/' for p in subs.values())}); keep one of the two layouts")
    if top is not None:
        rows = read_metadata(top)
    else:
        if not subs:
            raise DatasetError(f"{root}: no metadata.jsonl or metadata.csv (nor train/, validation/, test/ "
                               f"folders with one)")
        rows = [r for split, sub in subs.items() for r in read_metadata(metadata_file(sub), split)]
    return assemble(root.name, rows, source or str(top or root))


def read_metadata(path: Path, folder_split: str | None = None) -> list[Row]:
    """The rows of one metadata file; ``folder_split``: the split its folder stands for (a
    ``split`` column there must agree with it)."""
    rows = _jsonl_rows(path) if path.suffix == ".jsonl" else _csv_rows(path)
    out = []
    for where, fields in rows:
        row = _row(path, where, fields)
        if folder_split is not None:
            if row.split is not None and row.split != folder_split:
                raise DatasetError(f"{where}: 'split' is {row.split!r} in the {path.parent.name}/ folder")
            row.split = folder_split
        out.append(row)
    if not out:
        raise DatasetError(f"{path}: no rows")
    return out


def _jsonl_rows(path: Path) -> list[tuple[str, dict]]:
    rows = []
    for lineno, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line)
        except json.JSONDecodeError as e:
            raise DatasetError(f"{path}:{lineno}: invalid JSON ({e.msg})") from None
        except RecursionError:
            raise DatasetError(f"{path}:{lineno}: JSON nested too deeply to read") from None
        if not isinstance(fields, dict):
            raise DatasetError(f"{path}:{lineno}: expected a JSON object with 'file_name' and 'text', "
                               f"got {shown(fields)}")
        rows.append((f"{path}:{lineno}", fields))
    return rows


def _csv_rows(path: Path) -> list[tuple[str, dict]]:
    rows, line = [], 1
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames or []
            if "file_name" not in header:
                raise DatasetError(f"{path}: no 'file_name' column (its columns: {_columns(header)})")
            text = [c for c in CAPTION_FIELDS if c in header]
            if not text:
                raise DatasetError(f"{path}: no caption column (give 'text' or 'caption'; its columns: "
                                   f"{_columns(header)})")
            if len(text) > 1:
                raise DatasetError(f"{path}: {' and '.join(map(repr, text))} are both caption columns; keep one")
            line = reader.line_num + 1
            for row in reader:
                if None in row:  # more fields than the header names
                    raise DatasetError(f"{path}:{line}: {len(header) + len(row[None])} fields, the header names "
                                       f"{len(header)}")
                rows.append((f"{path}:{line}", {k: v for k, v in row.items() if v is not None}))
                line = reader.line_num + 1
    except UnicodeDecodeError:
        raise DatasetError(f"{path}: not a CSV file (not UTF-8 text)") from None
    except csv.Error as e:
        raise DatasetError(f"{path}:{line}: not a readable CSV row ({e})") from None
    except OSError as e:
        raise DatasetError(f"{path}: cannot read ({e.strerror})") from None
    return rows


def _columns(header: list[str]) -> str:
    return ", ".join(repr(h) for h in header[:8]) + (", ..." if len(header) > 8 else "") if header else "none"


def _row(path: Path, where: str, fields: dict) -> Row:
    name = fields.get("file_name")
    if not isinstance(name, str) or not name.strip():
        raise DatasetError(f"{where}: " + ("no 'file_name'" if name is None else
                                           f"'file_name' must be an image's path, got {shown(name)}"))
    text = [c for c in CAPTION_FIELDS if c in fields]
    if len(text) != 1:
        raise DatasetError(f"{where}: " + ("no caption: give 'text' or 'caption'" if not text else
                                           f"{' and '.join(map(repr, text))} both given; keep one"))
    captions = captions_of(fields[text[0]], where, text[0])
    split = split_of(fields["split"], where) if "split" in fields else None
    image = path.parent / name.strip()
    if not is_file(image):
        raise DatasetError(f"{where}: file_name {name.strip()!r}: no such image file under {path.parent}")
    return Row(where, image.name, image, captions, split)
