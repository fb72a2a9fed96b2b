"""WebDataset tar shards: each sample is the tar members sharing a key (the member's path up to
the first dot of its file name, as ``webdataset`` groups them): one image (``.jpg``, ``.png``,
...) and its caption -- a ``.txt`` (the whole text is one caption) or a ``.json`` with
``captions`` (a list), ``caption`` or ``text`` (a string or a list); the ``.json``'s wins where a
sample has both. Other members (``.cls``, ...) are ignored. Read with the standard library's
``tarfile`` (plain or compressed tars).

The dataset is a shard file (``.tar``, ``.tar.gz``, ``.tgz``) or a folder of them. A shard's split
is its folder's name (``train/``, ``validation/``, ``test/``) or the split word in its file name
(``train-000000.tar``, ``flickr8k-validation-0.tar``); shards with neither are split by a seed,
sample by sample (captionkit.data.layouts.assemble).

The image pipeline reads files (features, batch captioning, the Ray engine's workers), so a
shard's images are unpacked once into ``~/.cache/captionkit/webdataset/<shard stamp>/`` -- named
by the shard's path, size and modification time, so a changed shard is unpacked anew -- with
its samples' captions in ``index.json``; later reads use that folder and do not open the tar.
Every shard is checked (one :class:`DatasetError` naming the shard and the sample) before any
is unpacked. An image's name (its id) is its key's last part and extension: ``img001.jpg``.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tarfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..core.cache import cache_dir
from ..core.errors import DatasetError
from .items import CaptionDataset
from .layouts import Row, assemble, building_folder, captions_of, is_file, known_split, shown

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")
IMAGE_EXTENSIONS = {"jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff", "gif"}
INDEX = "index.json"
FORMAT = 1  # of index.json
MAX_TEXT = 1 << 20  # bytes of a .txt/.json member read: a caption file, not data
NAME_MAX = 255  # bytes of a file name on the usual file systems


def is_shard(path: Path) -> bool:
    return path.name.lower().endswith(SHARD_SUFFIXES)


def find_shards(path: Path) -> list[tuple[Path, str | None]]:
    """The shards of a dataset path, sorted, each with the split its place names (or None)."""
    if path.is_file():
        return [(path, _name_split(path))] if is_shard(path) else []
    if not path.is_dir():
        return []
    found = []
    try:
        for p in sorted(path.iterdir()):
            if p.is_file() and is_shard(p):
                found.append((p, _name_split(p)))
            elif p.is_dir() and (split := known_split(p.name)) is not None:
                found += [(s, split) for s in sorted(p.iterdir()) if s.is_file() and is_shard(s)]
    except OSError as e:
        raise DatasetError(f"{path}: cannot list the folder ({e.strerror})") from None
    return found


def is_webdataset(path: Path) -> bool:
    return bool(find_shards(path))


def _name_split(shard: Path) -> str | None:
    """The split word of a shard's file name: train-000.tar, coco_val_3.tar.gz -> train, dev."""
    stem = shard.name[:-len(next(s for s in SHARD_SUFFIXES if shard.name.lower().endswith(s)))]
    return next((s for w in re.split(r"[-_.\s]+", stem) if (s := known_split(w)) is not None), None)


@dataclass
class Sample:
    key: str
    image: str | None = None  # its image member's name
    text: str | None = None  # the .txt member's text
    meta: dict | None = None  # the .json member's object
    captions: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The image's id: the key's last part and the image member's extension."""
        return PurePosixPath(self.key).name + "." + _split_member(self.image)[1]


def _split_member(name: str) -> tuple[str, str]:
    """A member's (key, extension), as webdataset splits them: at the first dot of the file name."""
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext


def _open(shard: Path) -> tarfile.TarFile:
    try:
        return tarfile.open(shard, "r:*")
    except (tarfile.TarError, EOFError, OSError) as e:
        raise DatasetError(f"{shard}: not a readable tar file ({e})") from None


def _scan(shard: Path) -> list[Sample]:
    """The shard's samples, checked: read its members' names and its caption files."""
    samples: dict[str, Sample] = {}
    try:
        with _open(shard) as tar:
            for m in tar:
                key, ext = _split_member(m.name)
                base = m.name.rsplit("/", 1)[-1]
                # not a sample's file: folders, links, webdataset's __meta__ members, hidden files
                # (macOS's ._photo.jpg beside photo.jpg in a tar made there)
                if not m.isfile() or not ext or base.startswith(".") or (base.startswith("__") and base.endswith("__")):
                    continue
                s = samples.setdefault(key, Sample(key))
                kind = ext.lower()  # the whole extension: x.seg.png is another kind of file than x.png
                where = f"{shard}: sample {key!r}"
                if kind in IMAGE_EXTENSIONS:
                    if s.image is not None:
                        raise DatasetError(f"{where}: two images ({s.image}, {m.name}); a sample has one")
                    s.image = m.name
                elif kind in ("txt", "json"):
                    if m.size > MAX_TEXT:
                        raise DatasetError(f"{where}: {m.name} is {m.size:,} bytes, not a caption file")
                    raw = tar.extractfile(m).read()
                    try:
                        text = raw.decode("utf-8")
                    except UnicodeDecodeError:
                        raise DatasetError(f"{where}: {m.name} is not UTF-8 text") from None
                    if kind == "txt":
                        s.text = text
                    else:
                        try:
                            s.meta = json.loads(text)
                        except json.JSONDecodeError as e:
                            raise DatasetError(f"{where}: {m.name}: invalid JSON ({e.msg})") from None
    except (tarfile.TarError, EOFError, OSError) as e:  # a truncated or corrupt shard
        raise DatasetError(f"{shard}: cannot read the tar ({e})") from None
    out = []
    for s in samples.values():
        where = f"{shard}: sample {s.key!r}"
        if s.image is None:
            raise DatasetError(f"{where}: no image (.jpg, .png, ...) among its files")
        if len(os.fsencode(s.name)) > NAME_MAX:  # unpacked under its name: a file name the disk takes
            raise DatasetError(f"{where}: its image's name is over {NAME_MAX} bytes, too long for a file name")
        given = [f for f in ("captions", "caption", "text") if isinstance(s.meta, dict) and f in s.meta]
        if len(given) > 1:
            raise DatasetError(f"{where}: its .json has both {given[0]!r} and {given[1]!r}; keep one")
        if given:
            s.captions = captions_of(s.meta[given[0]], f"{where}: .json", given[0])
        elif s.text is not None:
            s.captions = captions_of(s.text, where, ".txt")
        else:
            what = f" (its .json has no 'caption', 'captions' or 'text': {shown(s.meta)})" if s.meta is not None else ""
            raise DatasetError(f"{where}: no caption: give a .txt, or a .json with 'caption' or 'captions'{what}")
        out.append(s)
    if not out:
        raise DatasetError(f"{shard}: no samples (no files named KEY.EXT)")
    return out


def _stamp(shard: Path) -> tuple[str, dict]:
    """The shard's cache folder name and what it is named by (path, size, modification time)."""
    st = shard.stat()
    source = {"path": str(shard.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    digest = hashlib.sha1(json.dumps(source, sort_keys=True).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return f"{shard.name}-{digest}", source


def _cached(folder: Path, source: dict) -> list[Sample] | None:
    """The samples of an unpacked shard, when its index is this shard's; else None."""
    index = folder / INDEX
    if not is_file(index):
        return None
    try:
        doc = json.loads(index.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("source") != source:
        return None
    return [Sample(s["key"], s["image"], captions=s["captions"]) for s in doc["samples"]]


def _unpack(shard: Path, samples: list[Sample], source: dict, folder: Path) -> None:
    """Write the shard's images (named by :attr:`Sample.name`) and index into ``folder``."""
    with building_folder(folder, f"{shard}'s images") as tmp:
        if tmp is None:
            return
        wanted = {s.image: s.name for s in samples}
        try:
            with _open(shard) as tar:
                for m in tar:
                    if m.name in wanted and m.isfile():
                        (tmp / wanted.pop(m.name)).write_bytes(tar.extractfile(m).read())
        except (tarfile.TarError, EOFError) as e:
            raise DatasetError(f"{shard}: cannot read the tar ({e})") from None
        if wanted:  # the shard changed between the two reads
            raise DatasetError(f"{shard}: changed while it was read ({next(iter(wanted))} went missing); try again")
        doc = {"format": FORMAT, "source": source,
               "samples": [{"key": s.key, "image": s.image, "captions": s.captions} for s in samples]}
        (tmp / INDEX).write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")


def read_webdataset(path: str | Path) -> CaptionDataset:
    """The samples of the shard or folder of shards at ``path`` (see the module's notes)."""
    path = Path(path)
    shards = find_shards(path)
    if not shards:
        raise DatasetError(f"{path}: no WebDataset shards (.tar, .tar.gz, .tgz) there")
    root = cache_dir("webdataset")
    plan = []  # (shard, split, samples, folder, source, cached?)
    for shard, split in shards:  # every shard checked before any is unpacked
        name, source = _stamp(shard)
        cached = _cached(root / name, source)
        if cached is None and (root / name).is_dir():  # (no index of this shard's: broken; unpacked again)
            shutil.rmtree(root / name, ignore_errors=True)
        samples = cached if cached is not None else _scan(shard)
        plan.append((shard, split, samples, root / name, source, cached is not None))
    rows, where_of = [], {}
    for shard, split, samples, folder, source, cached in plan:
        for s in samples:
            if s.name in where_of:
                raise DatasetError(f"{shard}: sample {s.key!r} is named {s.name}, as a sample of {where_of[s.name]} "
                                   f"is; an image's name is its id: give the samples different keys")
            where_of[s.name] = shard
            rows.append(Row(f"{shard}: sample {s.key!r}", s.name, folder / s.name, s.captions, split))
    splits = [p[1] for p in plan]
    if None in splits and any(splits):
        bare, named = plan[splits.index(None)], next(p for p in plan if p[1] is not None)
        raise DatasetError(f"{bare[0]}: names no split (in a train/, validation/ or test/ folder, or as "
                           f"train-000.tar), where {named[0]} does ({named[1]}); name every shard's split, or none")
    for shard, _, samples, folder, source, cached in plan:
        if not cached:
            _unpack(shard, samples, source, folder)
    return assemble(path.name, rows, str(path))
