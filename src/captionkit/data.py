"""Caption datasets: readers for the common Flickr8k/Flickr30k/COCO layouts, one in-memory form.

Every reader returns a :class:`CaptionDataset`: per split, a list of :class:`ImageItem` with
the image's path and its reference captions (raw text and Karpathy-normalised tokens).
Captions whose image file is missing are skipped and counted in one line on stderr; a
malformed line is reported as ``file:line``.
"""

from __future__ import annotations

import csv
import json
import random
import string
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from .errors import DatasetError

_PUNCT = str.maketrans("", "", string.punctuation)


def normalize(caption: str) -> list[str]:
    """Karpathy's normalisation: lower case, punctuation dropped, split on whitespace."""
    return caption.lower().translate(_PUNCT).split()


@dataclass
class ImageItem:
    name: str  # file name, the image's id everywhere (feature cache, caption JSON)
    path: Path
    raw: list[str] = field(default_factory=list)  # reference captions as written

    @property
    def tokens(self) -> list[list[str]]:
        return [normalize(c) for c in self.raw]


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


class _Malformed:
    """Collects malformed lines: reports the first few as file:line, then a count."""

    def __init__(self, shown: int = 5):
        self.count, self.shown = 0, shown

    def __call__(self, path: Path, lineno: int, why: str) -> None:
        self.count += 1
        if self.count <= self.shown:
            _warn(f"{path}:{lineno}: malformed line skipped ({why})")

    def summary(self) -> None:
        if self.count > self.shown:
            _warn(f"... {self.count - self.shown} more malformed lines skipped")


def _drop_missing(name: str, captions: dict[str, list[str]], folder: Path,
                  paths: dict[str, Path] | None = None) -> dict[str, ImageItem]:
    """Items whose image file exists (at ``paths[img]``, else ``folder / img``)."""
    items, n_caps, n_imgs = {}, 0, 0
    for img, caps in captions.items():
        path = paths[img] if paths else folder / img
        if path.is_file():
            items[img] = ImageItem(img, path, caps)
        else:
            n_caps += len(caps)
            n_imgs += 1
    if n_caps:
        _warn(f"{name}: skipped {n_caps} captions of {n_imgs} images whose files are missing under {folder}")
    return items


def _assign_splits(items: dict[str, ImageItem], lists: dict[str, list[str]]) -> dict[str, list[ImageItem]]:
    return {split: [items[n] for n in names if n in items] for split, names in lists.items()}


def _deterministic_splits(names: list[str], seed: int = 0) -> dict[str, list[str]]:
    """Train/dev/test when a layout has no official split: 1,000 test and dev images for
    corpora of at least 5,000 images, else 10% each; seeded, so always the same."""
    names = sorted(names)
    random.Random(seed).shuffle(names)
    k = 1000 if len(names) >= 5000 else max(1, len(names) // 10)
    return {"train": sorted(names[2 * k:]), "dev": sorted(names[k:2 * k]), "test": sorted(names[:k])}


def _find_image_folder(root: Path, candidates: tuple[str, ...]) -> Path:
    for c in candidates:
        if (root / c).is_dir():
            return root / c
    raise DatasetError(f"{root}: no image folder (looked for {', '.join(candidates)})")


def read_flickr8k(root: str | Path) -> CaptionDataset:
    """The original download: Flickr8k.token.txt, Flickr_8k.{train,dev,test}Images.txt and an
    image folder (Flicker8k_Dataset, Flickr8k_Dataset or Images)."""
    root = Path(root)
    token_file = root / "Flickr8k.token.txt"
    if not token_file.is_file():
        raise DatasetError(f"{token_file}: not found")
    folder = _find_image_folder(root, ("Flicker8k_Dataset", "Flickr8k_Dataset", "Images", "images"))
    bad = _Malformed()
    captions: dict[str, list[str]] = defaultdict(list)
    for lineno, line in enumerate(token_file.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        key, tab, caption = line.partition("\t")
        img, hash_, num = key.rpartition("#")[0], "#" in key, key.rpartition("#")[2]
        if not tab or not hash_ or not num.isdigit() or not img or not caption.strip():
            bad(token_file, lineno, "expected IMAGE#N<TAB>caption")
            continue
        captions[img].append(caption.strip())
    bad.summary()
    return _flickr8k_splits(root, _drop_missing("flickr8k", captions, folder))


def _flickr8k_splits(root: Path, items: dict[str, ImageItem]) -> CaptionDataset:
    """Splits from the official Flickr_8k.{train,dev,test}Images.txt beside the captions,
    or a seeded split when there are none."""
    lists = {}
    for split in ("train", "dev", "test"):
        f = root / f"Flickr_8k.{split}Images.txt"
        if f.is_file():
            lists[split] = [ln.strip() for ln in f.read_text().splitlines() if ln.strip()]
    return CaptionDataset("flickr8k", _assign_splits(items, lists or _deterministic_splits(list(items))))


def read_kaggle_flickr(root: str | Path) -> CaptionDataset:
    """Kaggle's Flickr8k layout: Images/ and captions.txt with ``image,caption`` rows.
    Uses the official split files when they lie beside it, else a seeded split."""
    root = Path(root)
    cap_file = root / "captions.txt"
    folder = _find_image_folder(root, ("Images", "images"))
    bad = _Malformed()
    captions: dict[str, list[str]] = defaultdict(list)
    with cap_file.open(newline="", encoding="utf-8") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None or [h.strip().lower() for h in header[:2]] != ["image", "caption"]:
            raise DatasetError(f"{cap_file}:1: expected the header 'image,caption'")
        for row in reader:
            lineno = reader.line_num
            if not row:
                continue
            if len(row) < 2 or not row[0].strip() or not ",".join(row[1:]).strip():
                bad(cap_file, lineno, "expected image,caption")
                continue
            captions[row[0].strip()].append(",".join(row[1:]).strip())
    bad.summary()
    return _flickr8k_splits(root, _drop_missing("flickr8k (kaggle)", captions, folder))


def _load_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None


def read_karpathy(json_path: str | Path, images: str | Path, doc: dict | None = None) -> CaptionDataset:
    """Karpathy's split files (dataset_flickr8k.json, dataset_flickr30k.json, dataset_coco.json).
    ``restval`` images join train, as is customary; ``val`` is the dev split."""
    json_path, images = Path(json_path), Path(images)
    doc = doc if doc is not None else _load_json(json_path)
    if not isinstance(doc.get("images"), list):
        raise DatasetError(f"{json_path}: no 'images' list (not a Karpathy split file)")
    captions, split_of, paths = {}, {}, {}
    for i, im in enumerate(doc["images"]):
        try:
            name = im["filename"]  # unique in all three corpora; the image's id
            paths[name] = images / im.get("filepath", "") / name
            split_of[name] = {"restval": "train", "val": "dev"}.get(im["split"], im["split"])
            captions[name] = [s["raw"] for s in im["sentences"]]
        except (KeyError, TypeError) as e:
            raise DatasetError(f"{json_path}: images[{i}] lacks field {e}") from None
    items = _drop_missing(doc.get("dataset", json_path.stem), captions, images, paths)
    splits: dict[str, list[ImageItem]] = defaultdict(list)
    for name, item in items.items():
        splits[split_of[name]].append(item)
    return CaptionDataset(doc.get("dataset", json_path.stem), dict(splits))


def read_coco(json_path: str | Path, images: str | Path, split: str | None = None,
              doc: dict | None = None) -> CaptionDataset:
    """A COCO caption annotation file (captions_train2014.json style) as one split, named
    ``split`` or after the file (train2014 -> train, val2014 -> dev)."""
    json_path, images = Path(json_path), Path(images)
    doc = doc if doc is not None else _load_json(json_path)
    if not isinstance(doc.get("annotations"), list) or not isinstance(doc.get("images"), list):
        raise DatasetError(f"{json_path}: needs 'images' and 'annotations' lists (COCO captions format)")
    try:
        files = {im["id"]: im["file_name"] for im in doc["images"]}
    except (KeyError, TypeError) as e:
        raise DatasetError(f"{json_path}: an image entry lacks field {e}") from None
    captions: dict[str, list[str]] = defaultdict(list)
    for i, ann in enumerate(doc["annotations"]):
        if not isinstance(ann, dict) or ann.get("image_id") not in files or not isinstance(ann.get("caption"), str):
            raise DatasetError(f"{json_path}: annotations[{i}] needs an image_id of a listed image and a caption")
        captions[files[ann["image_id"]]].append(ann["caption"].strip())
    items = _drop_missing("coco", captions, images)
    if split is None:
        split = "dev" if "val" in json_path.stem else "test" if "test" in json_path.stem else "train"
    return CaptionDataset("coco", {split: [items[k] for k in sorted(items)]})


def load_dataset(path: str | Path, images: str | Path | None = None) -> CaptionDataset:
    """Pick the reader from what ``path`` holds (a Flickr8k or Kaggle folder, a Karpathy or
    COCO JSON file; JSON files need ``images``, the folder their file names are relative to)."""
    path = Path(path)
    if path.is_dir():
        if (path / "Flickr8k.token.txt").is_file():
            return read_flickr8k(path)
        if (path / "captions.txt").is_file():
            return read_kaggle_flickr(path)
        raise DatasetError(f"{path}: neither Flickr8k.token.txt nor captions.txt found")
    if path.suffix == ".json" and path.is_file():
        if images is None:
            raise DatasetError(f"{path}: a JSON dataset needs --images, the folder of its image files")
        doc = _load_json(path)
        if isinstance(doc, dict) and "annotations" in doc:
            return read_coco(path, images, doc=doc)
        if not isinstance(doc, dict):
            raise DatasetError(f"{path}: expected a JSON object")
        return read_karpathy(path, images, doc=doc)
    raise DatasetError(f"{path}: no such dataset folder or JSON file")
