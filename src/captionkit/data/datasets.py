"""Caption datasets: readers for the common Flickr8k/Flickr30k/COCO layouts and for title CSVs
(one title per image, e.g. recipe photos), one in-memory form (:mod:`captionkit.data.items`),
and :func:`load_dataset`, the one place a dataset path (or object) picks its reader -- these,
or the layouts people keep their own data in: an imagefolder (:mod:`captionkit.data.imagefolder`),
WebDataset shards (:mod:`captionkit.data.webdataset`), a Hugging Face dataset
(:mod:`captionkit.data.hf_datasets`).

Every reader returns a :class:`CaptionDataset`: per split, a list of :class:`ImageItem` with
the image's path and its reference captions (raw text, and words in one of
:data:`WORD_STYLES`). Here, captions whose image file is missing are skipped and counted in
one line on stderr (per split; an image that is in no split is left out silently, missing or
not); a malformed line is reported as ``file:line``. The other layouts' readers refuse a
missing file or a malformed row in one line naming it, as the formats they follow do.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import random
from collections import Counter, defaultdict
from pathlib import Path

from ..core.cache import cache_dir
from ..core.errors import DatasetError, UserError
from ..core.outputs import atomic_write_text
from .hf_datasets import is_hf_dataset, is_saved_dataset, read_hf, read_saved
from .imagefolder import is_imagefolder, read_imagefolder
from .items import (  # noqa: F401 (WORD_STYLES, cased_words, normalize: these names were this module's first)
    WORD_STYLES,
    CaptionDataset,
    ImageItem,
    _deterministic_splits,
    _read_text,
    _warn,
    cased_words,
    normalize,
)
from .webdataset import is_webdataset, read_webdataset


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


def _is_file(path: Path) -> bool:
    """Whether an image file is there. A name too long for the file system names no file
    (Path.is_file raises for it, where it answers False for a NUL byte): such images count as
    missing, like absent ones."""
    try:
        return path.is_file()
    except OSError:
        return False


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" + ("" if n == 1 else "s")


def _drop_missing(name: str, captions: dict[str, list[str]], folder: Path,
                  paths: dict[str, Path] | None = None, split_of: dict[str, str] | None = None) -> dict[str, ImageItem]:
    """Items whose image file exists (at ``paths[img]``, else ``folder / img``); the captions
    of the others are skipped and counted in one line. ``split_of``: each image's split, where
    the layout lists them: a missing image that is in no split is left out without a word (it
    would be in no split if it were there: Flickr8k's 91 unlisted images and its bogus key),
    and the line counts the missing ones per split."""
    items, n_caps, per_split = {}, 0, Counter()
    for img, caps in captions.items():
        path = paths[img] if paths else folder / img
        if _is_file(path):
            items[img] = ImageItem(img, path, caps)
        elif split_of is None or img in split_of:
            n_caps += len(caps)
            per_split[split_of[img] if split_of else None] += 1
    if n_caps:
        n_imgs = sum(per_split.values())
        where = ", ".join(f"{split} {n:,}" for split, n in per_split.items() if split is not None)
        _warn(f"{name}: skipped {_plural(n_caps, 'caption')} of {_plural(n_imgs, 'image')} whose "
              f"{'file is' if n_imgs == 1 else 'files are'} missing under {folder}" + (f" ({where})" if where else ""))
    return items


def _assign_splits(items: dict[str, ImageItem], lists: dict[str, list[str]]) -> dict[str, list[ImageItem]]:
    return {split: [items[n] for n in names if n in items] for split, names in lists.items()}


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
    for lineno, line in enumerate(_read_text(token_file).splitlines(), 1):
        if not line.strip():
            continue
        key, tab, caption = line.partition("\t")
        img, hash_, num = key.rpartition("#")[0], "#" in key, key.rpartition("#")[2]
        if not tab or not hash_ or not num.isdigit() or not img or not caption.strip():
            bad(token_file, lineno, "expected IMAGE#N<TAB>caption")
            continue
        captions[img].append(caption.strip())
    bad.summary()
    return _flickr8k_splits(root, "flickr8k", captions, folder)


def _flickr8k_splits(root: Path, name: str, captions: dict[str, list[str]], folder: Path) -> CaptionDataset:
    """The images whose files are there, in the splits of the official
    Flickr_8k.{train,dev,test}Images.txt beside the captions, or of a seeded split when there
    are none (then every missing image counts as missing from a split)."""
    lists = {}
    for split in ("train", "dev", "test"):
        f = root / f"Flickr_8k.{split}Images.txt"
        if f.is_file():
            lists[split] = [ln.strip() for ln in _read_text(f).splitlines() if ln.strip()]
    split_of = {img: split for split, names in lists.items() for img in names} if lists else None
    items = _drop_missing(name, captions, folder, split_of=split_of)
    return CaptionDataset("flickr8k", _assign_splits(items, lists or _deterministic_splits(list(items))))


def read_kaggle_flickr(root: str | Path) -> CaptionDataset:
    """Kaggle's Flickr8k layout: Images/ and captions.txt with ``image,caption`` rows.
    Uses the official split files when they lie beside it, else a seeded split."""
    root = Path(root)
    cap_file = root / "captions.txt"
    folder = _find_image_folder(root, ("Images", "images"))
    bad = _Malformed()
    captions: dict[str, list[str]] = defaultdict(list)
    reader = csv.reader(io.StringIO(_read_text(cap_file), newline=""))
    try:
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
    except csv.Error as e:  # e.g. a field over csv's size limit (an unclosed quote)
        raise DatasetError(f"{cap_file}:{reader.line_num}: not a readable CSV row ({e})") from None
    bad.summary()
    return _flickr8k_splits(root, "flickr8k (kaggle)", captions, folder)


def _load_json(path: Path) -> dict:
    text = _read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    except RecursionError:
        raise DatasetError(f"{path}: JSON nested too deeply to read") from None


def read_karpathy(json_path: str | Path, images: str | Path, doc: dict | None = None) -> CaptionDataset:
    """Karpathy's split files (dataset_flickr8k.json, dataset_flickr30k.json, dataset_coco.json).
    ``restval`` images join train, as is customary; ``val`` is the dev split."""
    json_path, images = Path(json_path), Path(images)
    doc = doc if doc is not None else _load_json(json_path)
    if not isinstance(doc.get("images"), list):
        raise DatasetError(f"{json_path}: no 'images' list (not a Karpathy split file)")
    captions, split_of, paths = {}, {}, {}
    for i, im in enumerate(doc["images"]):
        im = im if isinstance(im, dict) else {}
        name, folder, split, sentences = im.get("filename"), im.get("filepath", ""), im.get("split"), im.get("sentences")
        if not all(isinstance(v, str) for v in (name, folder, split)) or not isinstance(sentences, list) or \
                not all(isinstance(x, dict) and isinstance(x.get("raw"), str) for x in sentences):
            raise DatasetError(f"{json_path}: images[{i}] needs a 'filename', a 'split' and 'sentences' "
                               f"with a 'raw' caption each (text)")
        paths[name] = images / folder / name  # the file name is unique in all three corpora: the image's id
        split_of[name] = {"restval": "train", "val": "dev"}.get(split, split)
        captions[name] = [x["raw"] for x in sentences]
    corpus = doc["dataset"] if isinstance(doc.get("dataset"), str) else json_path.stem
    items = _drop_missing(corpus, captions, images, paths, split_of)
    splits: dict[str, list[ImageItem]] = defaultdict(list)
    for name, item in items.items():
        splits[split_of[name]].append(item)
    return CaptionDataset(corpus, dict(splits))


def read_coco(json_path: str | Path, images: str | Path, split: str | None = None,
              doc: dict | None = None) -> CaptionDataset:
    """A COCO caption annotation file (captions_train2014.json style) as one split, named
    ``split`` or after the file (train2014 -> train, val2014 -> dev)."""
    json_path, images = Path(json_path), Path(images)
    doc = doc if doc is not None else _load_json(json_path)
    if not isinstance(doc.get("annotations"), list) or not isinstance(doc.get("images"), list):
        raise DatasetError(f"{json_path}: needs 'images' and 'annotations' lists (COCO captions format)")
    files = {}
    for i, im in enumerate(doc["images"]):
        if not isinstance(im, dict) or not isinstance(im.get("id"), (int, str)) or not isinstance(im.get("file_name"), str):
            raise DatasetError(f"{json_path}: images[{i}] needs an 'id' (a number or text) and a 'file_name'")
        files[im["id"]] = im["file_name"]
    captions: dict[str, list[str]] = defaultdict(list)
    for i, ann in enumerate(doc["annotations"]):
        if not isinstance(ann, dict) or not isinstance(ann.get("image_id"), (int, str)) or \
                ann["image_id"] not in files or not isinstance(ann.get("caption"), str):
            raise DatasetError(f"{json_path}: annotations[{i}] needs an image_id of a listed image and a caption")
        captions[files[ann["image_id"]]].append(ann["caption"].strip())
    items = _drop_missing("coco", captions, images)
    if split is None:
        split = "dev" if "val" in json_path.stem else "test" if "test" in json_path.stem else "train"
    return CaptionDataset("coco", {split: [items[k] for k in sorted(items)]})


SPLIT_FRACTIONS = {"train": 0.8, "dev": 0.1, "test": 0.1}
_SHOWN = 3  # examples per problem in a cleaning report


def _read_title_rows(csv_path: Path, image_column: str, title_column: str) -> list[tuple[int, str, str]]:
    """(line where the row starts, image name, title) of every data row."""
    rows: list[tuple[int, str, str]] = []
    line = 1
    try:
        with csv_path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            header = reader.fieldnames
            if not header:
                raise DatasetError(f"{csv_path}: empty file (expected a CSV with a header row)")
            for column, what in ((image_column, "image-name"), (title_column, "title")):
                if column not in header:
                    shown = ", ".join(repr(h) for h in header[:8]) + (", ..." if len(header) > 8 else "")
                    raise DatasetError(f"{csv_path}: no {what} column {column!r} (its columns: {shown})")
            line = reader.line_num + 1
            for row in reader:
                rows.append((line, (row[image_column] or "").strip(), (row[title_column] or "").strip()))
                line = reader.line_num + 1
    except FileNotFoundError:
        raise DatasetError(f"{csv_path}: no such file") from None
    except UnicodeDecodeError:
        raise DatasetError(f"{csv_path}: not a CSV file (not UTF-8 text)") from None
    except csv.Error as e:
        raise DatasetError(f"{csv_path}:{line}: not a readable CSV row ({e})") from None
    return rows


def _split_new_images(names: list[str], saved: dict[str, str], seed: int) -> dict[str, str]:
    """Every name's split: the saved one if it has one; the others are shuffled (seeded) and
    fill test, then dev, up to their shares of all ``names``, the rest going to train. With
    nothing saved this is a plain seeded 80/10/10 split."""
    out = {n: saved[n] for n in names if n in saved}
    new = sorted(n for n in names if n not in saved)
    random.Random(seed).shuffle(new)
    have = Counter(out.values())
    for split in ("test", "dev"):
        want = round(len(names) * SPLIT_FRACTIONS[split])
        if len(names) >= 3:  # a tiny dataset still gets one dev and one test image
            want = max(1, want)
        take = max(0, min(want - have[split], len(new)))
        out.update((n, split) for n in new[:take])
        new = new[take:]
    out.update((n, "train") for n in new)
    return out


def _write_json_first(doc: dict, places: list[Path]) -> Path | None:
    """Write ``doc`` atomically to the first writable place; None if none is."""
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    for place in places:
        try:
            return atomic_write_text(place, text)  # removes its temporary file if it fails
        except OSError:
            continue
    return None


def _title_splits(csv_path: Path, names: list[str], seed: int) -> tuple[dict[str, list[str]], str]:
    """The saved split of a title CSV, extended to images it does not know yet (see
    read_title_csv); returns the splits and a line saying where they come from."""
    beside = csv_path.with_name(f"{csv_path.stem}.split.json")
    digest = hashlib.sha1(str(csv_path.resolve()).encode()).hexdigest()[:12]
    cached = cache_dir("splits") / f"{csv_path.stem}-{digest}.split.json"
    source = next((f for f in (beside, cached) if f.is_file()), None)
    saved: dict[str, str] = {}
    if source is not None:
        doc = _load_json(source)
        lists = doc.get("splits") if isinstance(doc, dict) else None
        if not isinstance(lists, dict) or set(lists) - set(SPLIT_FRACTIONS) or \
                not all(isinstance(ns, list) and all(isinstance(n, str) for n in ns) for ns in lists.values()):
            raise DatasetError(f"{source}: not a split file (needs 'splits' with train, dev and test lists)")
        if doc.get("seed") != seed:
            raise DatasetError(f"{source}: made with seed {doc.get('seed')}, not {seed}; delete it to split anew")
        saved = {n: split for split, ns in lists.items() for n in ns}
    split_of = _split_new_images(names, saved, seed)
    new = sum(n not in saved for n in names)
    if source is not None and not new:
        note = f"split from {source}"
    else:
        every = {**saved, **split_of}  # images gone from the CSV keep their place in the file
        doc = {"csv": csv_path.name, "seed": seed, "fractions": SPLIT_FRACTIONS,
               "splits": {s: sorted(n for n, t in every.items() if t == s) for s in SPLIT_FRACTIONS}}
        written = _write_json_first(doc, [cached] if source == cached else [beside, cached])
        where = f"saved in {written}" if written else "not saved (no writable place)"
        note = (f"split from {source}, {new} new images assigned, {where}" if source
                else f"new seeded split (seed {seed}), {where}")
    splits = {s: sorted(n for n in names if split_of[n] == s) for s in SPLIT_FRACTIONS}
    return splits, note


def read_title_csv(csv_path: str | Path, images: str | Path, image_column: str = "Image_Name",
                   title_column: str = "Title", image_suffix: str = ".jpg", seed: int = 0) -> CaptionDataset:
    """A CSV of one title per image, e.g. Epicurious' "Food Ingredients and Recipe Dataset with
    Image Name Mapping" (columns ``Title`` and ``Image_Name``; image files ``Image_Name + .jpg``
    in ``images``). Other columns are ignored.

    Cleaning drops rows without a title, rows whose image file does not exist and rows whose
    image is listed again (the first row is kept: one reference per image), and prints a report
    on stderr: counts and a few examples (CSV line numbers) per problem, one line each.

    Splits: 80/10/10 train/dev/test, seeded, saved as ``<csv stem>.split.json`` beside the
    CSV (in the captionkit cache when that folder is not writable) and reused from then on.
    When the CSV changes, images already in the file keep their split (a test image never
    moves to train); images no longer usable are left out, and stay recorded; new images are
    shuffled (seeded) into test and dev up to 10% each of all images, the rest into train, and
    the file is updated. Delete the file to split anew."""
    csv_path, images = Path(csv_path), Path(images)
    rows = _read_title_rows(csv_path, image_column, title_column)
    titles: dict[str, str] = {}  # image file name -> title, in CSV order
    first_line: dict[str, int] = {}
    untitled, missing, repeated = [], [], []
    for line, image, title in rows:
        name = image + image_suffix
        if not title:
            untitled.append(f"line {line}" + (f" ({name})" if image else ""))
        elif not image:
            missing.append(f"line {line} (no image name)")
        elif name in first_line:
            repeated.append(f"line {line} ({name}, first on line {first_line[name]})")
        else:
            first_line[name] = line  # also for a missing image, so its repeats count as repeats
            if _is_file(images / name):
                titles[name] = title
            else:
                missing.append(f"line {line} ({name})")
    _warn(f"{csv_path}: {len(rows)} rows, {len(titles)} images with a title kept")
    for problem, found in (("without a title", untitled), (f"whose image does not exist under {images}", missing),
                           ("repeating an image (the first row is kept)", repeated)):
        if found:
            more = ", ..." if len(found) > _SHOWN else ""
            _warn(f"  {len(found)} {'row' if len(found) == 1 else 'rows'} {problem}: {', '.join(found[:_SHOWN])}{more}")
    if not titles:
        raise DatasetError(f"{csv_path}: no usable row (is {images} the image folder, and {image_suffix!r} "
                           f"the image files' suffix?)")
    splits, note = _title_splits(csv_path, list(titles), seed)
    _warn(f"  {', '.join(f'{len(v)} {k}' for k, v in splits.items())}: {note}")
    items = {n: ImageItem(n, images / n, [t]) for n, t in titles.items()}
    return CaptionDataset(csv_path.stem, _assign_splits(items, splits))


def load_dataset(path, images: str | Path | None = None, image_column: str = "Image_Name",
                 title_column: str = "Title", image_suffix: str = ".jpg") -> CaptionDataset:
    """Pick the reader from what ``path`` holds (a Flickr8k or Kaggle folder, a Karpathy or
    COCO JSON file, a title CSV; JSON and CSV files need ``images``, the folder their image
    names are relative to; an imagefolder, WebDataset shards or a folder a Hugging Face
    dataset was saved to). The column and suffix arguments are read_title_csv's. ``path`` may
    also be a ``datasets.Dataset`` or ``DatasetDict`` (captionkit.data.hf_datasets) or a
    CaptionDataset."""
    if isinstance(path, CaptionDataset):
        return path
    if not isinstance(path, (str, Path)):
        if is_hf_dataset(path):
            return read_hf(path)
        raise UserError(f"not a dataset: a {type(path).__qualname__}; give a path, a datasets.Dataset or DatasetDict")
    path = Path(path)
    if path.suffix.lower() == ".csv" and path.is_file():
        if images is None:
            raise DatasetError(f"{path}: a CSV dataset needs --images, the folder of its image files")
        return read_title_csv(path, images, image_column, title_column, image_suffix)
    if path.is_dir():
        if (path / "Flickr8k.token.txt").is_file():
            return read_flickr8k(path)
        if (path / "captions.txt").is_file():
            return read_kaggle_flickr(path)
        if is_imagefolder(path):
            return read_imagefolder(path)
        if is_saved_dataset(path):
            return read_saved(path)
        if is_webdataset(path):
            return read_webdataset(path)
        raise DatasetError(f"{path}: not a dataset folder (no Flickr8k.token.txt, captions.txt, metadata.jsonl or "
                           f"metadata.csv, saved Hugging Face dataset or .tar shards)")
    if path.is_file() and is_webdataset(path):
        return read_webdataset(path)
    if path.suffix == ".json" and path.is_file():
        if images is None:
            raise DatasetError(f"{path}: a JSON dataset needs --images, the folder of its image files")
        doc = _load_json(path)
        if isinstance(doc, dict) and "annotations" in doc:
            return read_coco(path, images, doc=doc)
        if not isinstance(doc, dict):
            raise DatasetError(f"{path}: expected a JSON object")
        return read_karpathy(path, images, doc=doc)
    raise DatasetError(f"{path}: no such dataset folder, JSON, CSV or .tar file")
