"""An on-disk, memory-mapped cache of encoder features, so decoder training never reruns the CNN.

Layout: ``ROOT/<encoder cache key>/<image-set hash>/`` holding ``feats.npy`` (N, L, D) float16,
``done.npy`` (N,) bool (which rows are written: an interrupted build resumes),
``meta.json`` (image paths, grid, encoder) and captionkit's folder marker. A folder of that
name holding anything else is refused, never written into. The encoder key covers architecture, weights and
preprocessing, so changing any of them never reuses stale features.

The sharded layout (written by ``captionkit features --engine ray``, read by the same trainer):
``ROOT/<encoder cache key>/<image-set hash>.shards/`` holding ``manifest.json`` (encoder, grid,
dim, dtype, shard size, image count), and per shard ``shard-NNNNN.npy`` ((n, L, D) float16, a
zero row for an unreadable image) and ``shard-NNNNN.json`` (its image paths and the unreadable
ones with their message). The .json is written last, atomically: a shard with one is complete,
and a rerun computes only the shards without one. :class:`ShardedFeatureStore` reads it lazily
(one memory-mapped .npy per shard, opened on first use) and :func:`shards_for_rank` splits the
shards among DDP ranks. See docs/scale.md for its size per encoder.

The trainer reads a store through :class:`FeatureRows`: the rows of its images, in its order,
read only when a batch asks for them (a COCO-sized store is never loaded whole, and the
processes of a machine share the memory-mapped pages through the page cache).

Integrity (docs/robustness.md, "Feature shards"): a shard's record holds its .npy's size and
sha256, checked when a process first opens the shard; the single file's ``digests.json`` holds
a sha256 per BLOCK_ROWS rows, checked when a process first reads a row of the block. A bad one
is a :class:`CorruptFeatures` naming the file. Every build checks sizes and, with
``verify`` (``captionkit features --verify``), digests, and computes a bad shard (block) again,
alone. Stores from before digests are read unchecked. An entry is built under its lock
(:func:`building`); a full disk leaves the store as it was, in one line.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import numpy as np
import torch

from ..core.cache import cache_root
from ..core.checkpoint import file_sha256
from ..core.diskspace import disk_errors
from ..core.errors import OutputError, UserError
from ..core.locks import Locked, hold_lock
from ..core.outputs import atomic_write_bytes, atomic_write_text, check_writable_folder, owner_kind, write_marker
from ..core.progress import progress as progress_bar
from .base import Encoder, module_device
from .image_batches import image_batches

# the feature folders sit directly under the cache root (the layout existing caches use)
default_cache_root = cache_root

BLOCK_ROWS = 1000  # rows of the single-file store per recorded digest (what a bad block costs to redo)
DIGESTS = "digests.json"  # the single-file store's {"block_rows", "bytes", "sha256": [per block]}
WAIT_S = 0.25  # how often a build retries the lock of a cache entry another process is building
KEPT = "the feature store is as it was (what is done is kept: run again once there is room)"
TELL_AFTER_S = 1.0  # a wait longer than this is said (DDP ranks taking turns on a built store are not)


class CorruptFeatures(UserError):
    """A feature-store file that is truncated, or whose bytes differ from the sha256 recorded
    when it was written; the message names the file and how to rebuild it."""


def _rebuild_hint(encoder_key: str) -> str:
    """The command that rebuilds a store of ``encoder_key`` (its name is the key less its hash)."""
    flip = encoder_key.endswith(FLIP_SUFFIX)
    name = encoder_key.removesuffix(FLIP_SUFFIX).rpartition("-")[0] or encoder_key
    return (f"rebuild it with `captionkit features --dataset DATASET --encoder {name}{' --flip' * flip} "
            f"--verify` (the dataset it was built for), or delete it")


def _write_file(path: Path, data: bytes) -> None:
    """``atomic_write_bytes``, with a full disk or a read-only folder said in one line naming the
    path and the bytes (captionkit.core.diskspace); the temporary file is gone, ``path`` as it was."""
    with disk_errors(path, len(data), KEPT):
        atomic_write_bytes(path, data)


def _npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def _npy_whole(path: Path) -> bool:
    """Whether the .npy file at ``path`` is as long as its header says (a truncated one is not)."""
    try:
        with open(path, "rb") as fh:
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(np.lib.format.read_magic(fh))
            if read_header is None:  # a header version np.save does not write for these arrays
                return True
            shape, _, dtype = read_header(fh)
            return os.fstat(fh.fileno()).st_size == fh.tell() + int(np.prod(shape)) * dtype.itemsize
    except (OSError, ValueError, EOFError):
        return False


@contextmanager
def building(folder: Path, what: str):
    """Hold the lock of the cache entry ``folder`` (captionkit.core.locks, beside it) while it
    is built. A second process building the same entry waits for the first instead of being
    refused (one line saying whom it waits for, once the wait passes TELL_AFTER_S): it would
    compute the same features, and once the first is done it finds them on disk and uses them
    (two jobs sharing a cache -- a `features` run and a `train`, or the ranks of one machine --
    just go on). A holder that died releases its lock with it, so nothing stale ever blocks."""
    with ExitStack() as held:
        told, start = False, time.monotonic()
        while True:
            try:
                held.enter_context(hold_lock(folder, what))
                break
            except Locked as e:
                if not told and time.monotonic() - start >= TELL_AFTER_S:
                    print(f"{folder}: being built by pid {e.pid or '?'} on {e.host or '?'} ({what}); waiting "
                          f"for it to finish, then using its features", file=sys.stderr, flush=True)
                    told = True
                time.sleep(WAIT_S)
        yield


class FeatureStore:
    """Read side: ``store.rows(names)`` -> (B, L, D) float16 rows of the memory-mapped array.

    A store with a digests file (every store built or extended since digests exist) checks its
    size when opened and each block of BLOCK_ROWS rows against its sha256 the first time a row
    of the block is read in this process; a store from before them is read unchecked."""

    def __init__(self, folder: Path):
        meta = json.loads((folder / "meta.json").read_text())
        self.folder = folder
        self.grid: tuple[int, int] = tuple(meta["grid"])
        self.encoder: str = meta["encoder"]
        feats_path = folder / "feats.npy"
        self._digests = _read_digests(folder)
        if not _npy_whole(feats_path) or (self._digests and feats_path.stat().st_size != self._digests["bytes"]):
            raise CorruptFeatures(f"{feats_path}: truncated ({feats_path.stat().st_size:,} bytes, not what its "
                                  f"header and {DIGESTS} say); {_rebuild_hint(self.encoder)}")
        self.feats = np.load(feats_path, mmap_mode="r")  # (N, L, D)
        done = np.load(folder / "done.npy")
        self.index = {Path(p).name: i for i, p in enumerate(meta["paths"]) if done[i]}
        self._verified: set[int] = set()  # blocks checked in this process

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def rows(self, names: list[str]) -> np.ndarray:
        idx = [self.index[n] for n in names]
        if self._digests:
            for block in sorted({i // self._digests["block_rows"] for i in idx} - self._verified):
                if self._digests:  # (None once a build extending the store has removed them)
                    self._verify(block)
        return self.feats[idx]

    def _verify(self, block: int) -> None:
        k = self._digests["block_rows"]
        if _block_sha256(self.feats, block, k) != self._digests["sha256"][block]:
            now = _read_digests(self.folder)
            if now != self._digests:  # a build extended the store since it was opened: its digests now
                self._digests = now
                self._verified.clear()
                return self._verify(block) if now else None
            last = min((block + 1) * k, len(self.feats)) - 1
            raise CorruptFeatures(f"{self.folder / 'feats.npy'}: corrupted (rows {block * k}-{last}: "
                                  f"their sha256 differs from the one {self.folder / DIGESTS} records); "
                                  f"{_rebuild_hint(self.encoder)}")
        self._verified.add(block)


def _block_sha256(feats: np.ndarray, block: int, block_rows: int) -> str:
    return hashlib.sha256(feats[block * block_rows:(block + 1) * block_rows]).hexdigest()  # of a (k, L, D) view


def _read_digests(folder: Path) -> dict | None:
    """The single-file store's digests; None for a store from before them (or being extended)."""
    try:
        return json.loads((folder / DIGESTS).read_text())
    except FileNotFoundError:
        return None


def _write_digests(folder: Path, feats: np.ndarray) -> None:
    """Record the sha256 of each block of the store's rows, once they are written and flushed."""
    _write_file(folder / DIGESTS, (json.dumps({
        "block_rows": BLOCK_ROWS, "bytes": (folder / "feats.npy").stat().st_size,
        "sha256": [_block_sha256(feats, b, BLOCK_ROWS) for b in range(-(-len(feats) // BLOCK_ROWS))]}) + "\n").encode())


def _check_single(folder: Path, full: bool) -> bool:
    """Before a build of the single-file store in ``folder``: a truncated feats.npy or done.npy
    (always checked: a stat and a header) is removed with its meta.json, so the build starts it
    again; with ``full``, every block is hashed and a bad block's rows are marked not done, so
    the build computes those rows alone. One line on stderr per bad part. True if any was bad."""
    feats_path, done_path = folder / "feats.npy", folder / "done.npy"
    if not (folder / "meta.json").exists():
        return False
    digests = _read_digests(folder)
    size_wrong = digests is not None and feats_path.stat().st_size != digests["bytes"]
    if size_wrong or not _npy_whole(feats_path) or not _npy_whole(done_path):
        bad = feats_path if size_wrong or not _npy_whole(feats_path) else done_path
        print(f"{bad}: truncated; computing this store's features again", file=sys.stderr)
        for f in (DIGESTS, "meta.json", "feats.npy", "done.npy"):
            (folder / f).unlink(missing_ok=True)
        return True
    if not full or digests is None:
        return False
    feats, done = np.load(feats_path, mmap_mode="r"), np.load(done_path)
    k = digests["block_rows"]
    bad_blocks = [b for b, want in enumerate(digests["sha256"]) if _block_sha256(feats, b, k) != want]
    for b in bad_blocks:
        print(f"{feats_path}: rows {b * k}-{min((b + 1) * k, len(feats)) - 1} corrupted (their sha256 differs "
              f"from {folder / DIGESTS}); computing them again", file=sys.stderr)
        done[b * k:(b + 1) * k] = False
    if bad_blocks:
        (folder / DIGESTS).unlink()
        _write_file(done_path, _npy_bytes(done))
    return bool(bad_blocks)


class ArrayStore:
    """A store held in memory: ``rows(names)`` of an (N, L, D) array whose rows are ``names``'
    (features computed from another store's, e.g. by frozen encoder blocks)."""

    def __init__(self, names: list[str], feats: np.ndarray):
        self.feats = feats  # (N, L, D)
        self.index = {n: i for i, n in enumerate(names)}

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def rows(self, names: list[str]) -> np.ndarray:
        return self.feats[[self.index[n] for n in names]]  # (B, L, D)


class FeatureRows:
    """The features of a list of images (``names``, in that order) as rows 0..N-1, read from
    ``store`` (anything with ``rows(names) -> (B, L, D)``) only when asked for: what the trainer
    holds instead of an (N, L, D) tensor, so that a process's memory holds a batch's rows, not
    the store's. The rows come as the store keeps them (float16), as a CPU tensor."""

    def __init__(self, store: FeatureStore | ShardedFeatureStore | ArrayStore, names: list[str]):
        self.store, self.names = store, list(names)

    def __len__(self) -> int:
        return len(self.names)

    def select(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` (a 1-d index tensor) -> (B, L, D), like ``tensor.index_select(0, rows)``."""
        return self._read([self.names[i] for i in rows.tolist()])

    def __getitem__(self, span: slice) -> torch.Tensor:
        """A contiguous span of rows, ``rows[i:j]`` -> (j - i, L, D)."""
        return self._read(self.names[span])

    def in_memory(self) -> FeatureRows:
        """These rows read once, all together, into memory: how the trainer held its features
        before it read them lazily (benchmarks/trainer_memory.py compares the two)."""
        return FeatureRows(ArrayStore(self.names, self.store.rows(self.names)), self.names)

    def _read(self, names: list[str]) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(self.store.rows(names)))


FEATURE_SHARDS_KIND = "feature-shards"  # the outputs.MARKER kind of a sharded store
SHARDED_FORMAT = "captionkit-features-sharded"


def shard_file(folder: Path, shard: int, suffix: str) -> Path:
    return folder / f"shard-{shard:05d}{suffix}"


class ShardedFeatureStore:
    """The read side of the sharded layout, with :class:`FeatureStore`'s interface
    (``grid``, ``encoder``, ``folder``, ``index``, ``in``, ``rows``). Only complete shards are
    read; each shard's array is memory-mapped when a row of it is first asked for."""

    def __init__(self, folder: Path, shards: list[int] | None = None):
        """``shards``: index only these (a DDP rank's, :func:`shards_for_rank`); default all."""
        manifest = json.loads((folder / "manifest.json").read_text())
        self.folder = folder
        self.grid: tuple[int, int] = tuple(manifest["grid"])
        self.encoder: str = manifest["encoder"]
        self.num_shards: int = manifest["shards"]
        self.row_shape = (self.grid[0] * self.grid[1], int(manifest["dim"]))  # (L, D)
        self.shard_names: list[list[str]] = []  # each shard's readable images, by file name
        self.index: dict[str, tuple[int, int]] = {}  # file name -> (shard, row)
        self._records: list[dict] = []  # each shard's .json (its "sha256" and "bytes" since digests exist)
        wanted = range(self.num_shards) if shards is None else set(shards)
        for s in range(self.num_shards):  # a shard not wanted, or not written yet, reads as empty
            record = shard_file(folder, s, ".json")
            doc = json.loads(record.read_text()) if s in wanted and record.exists() else {"paths": [], "failed": {}}
            start = s * manifest["shard_size"]
            keep = [(i, Path(p).name) for i, p in enumerate(doc["paths"]) if str(start + i) not in doc["failed"]]
            self.shard_names.append([name for _, name in keep])
            self.index.update({name: (s, i) for i, name in keep})
            self._records.append(doc)
        self._arrays: dict[int, np.ndarray] = {}

    @property
    def complete(self) -> bool:
        return all(shard_file(self.folder, s, ".json").exists() for s in range(self.num_shards))

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def _shard(self, s: int) -> np.ndarray:
        if s not in self._arrays:  # first open in this process: checked against its record
            if (bad := shard_fault(self.folder, s, self._records[s], full=True)) is not None:
                record = shard_file(self.folder, s, ".json")
                now = json.loads(record.read_text()) if record.exists() else None
                if now is not None and now != self._records[s]:  # rebuilt (features --verify) since opened
                    self._records[s] = now
                    return self._shard(s)
                raise CorruptFeatures(f"{bad}; {_rebuild_hint(self.encoder)}")
            self._arrays[s] = np.load(shard_file(self.folder, s, ".npy"), mmap_mode="r")  # (n, L, D)
        return self._arrays[s]

    def rows(self, names: list[str]) -> np.ndarray:
        out = np.empty((len(names), *self.row_shape), dtype=np.float16)  # (B, L, D)
        for k, (s, i) in enumerate(self.index[n] for n in names):
            out[k] = self._shard(s)[i]
        return out


def write_shard(folder: Path, shard: int, feats: np.ndarray, paths: list[str], failed: dict[int, str]) -> None:
    """Write one shard of a sharded store: its rows (n, L, D) float16 (zeros for the unreadable
    images), then its record (``paths``; ``failed``: global image position -> message; the
    .npy's size and sha256 as written on disk), each atomically and the record last, so a shard
    with a record is whole. A full disk leaves the shard unwritten and unrecorded (one line)."""
    npy = shard_file(folder, shard, ".npy")
    _write_file(npy, _npy_bytes(feats.astype(np.float16, copy=False)))
    record = json.dumps({"paths": paths, "failed": {str(i): msg for i, msg in failed.items()},
                         "bytes": npy.stat().st_size, "sha256": file_sha256(npy)}) + "\n"
    _write_file(shard_file(folder, shard, ".json"), record.encode())


def shard_fault(folder: Path, shard: int, record: dict, full: bool) -> str | None:
    """What is wrong with a recorded shard's .npy, in words naming it, or None: its size against
    the record's (a stat), and with ``full`` its sha256 (a read of the whole file). A record from
    before digests checks only that the file is as long as its header says."""
    npy = shard_file(folder, shard, ".npy")
    if not npy.exists():
        return f"{npy}: missing (its record {npy.with_suffix('.json').name} is there)"
    size = npy.stat().st_size
    if "bytes" not in record:
        return None if _npy_whole(npy) else f"{npy}: truncated ({size:,} bytes, shorter than its header says)"
    if size != record["bytes"]:
        return f"{npy}: truncated or overwritten ({size:,} bytes, {record['bytes']:,} recorded in its .json)"
    if full and file_sha256(npy) != record["sha256"]:
        return f"{npy}: corrupted ({size:,} bytes; its sha256 differs from the one its .json records)"
    return None


def _check_shards(folder: Path, full: bool) -> list[int]:
    """Before a build of the sharded store in ``folder``: each recorded shard checked (sizes
    always, digests with ``full``); a bad shard's record is removed, so the build computes that
    shard alone. One line on stderr per bad shard. The bad shards."""
    manifest = json.loads((folder / "manifest.json").read_text())
    bad = []
    for s in range(manifest["shards"]):
        record = shard_file(folder, s, ".json")
        if record.exists() and (fault := shard_fault(folder, s, json.loads(record.read_text()), full)):
            print(f"{fault}; computing this shard again", file=sys.stderr)
            record.unlink()
            bad.append(s)
    return bad


def verify_sharded(encoder: Encoder, paths: list[Path], root: Path | None = None) -> list[int]:
    """``features --engine ray --verify``: check every shard of the sharded store of ``paths``
    (if there is one) against its digest, and remove the bad ones' records so that the Ray
    run that follows computes them with any other missing shard. The bad shards."""
    folder = sharded_folder_for(check_writable_folder(root or default_cache_root()), encoder, paths)
    if not (folder / "manifest.json").exists():
        return []
    with building(folder, f"features {encoder.name} --verify"):
        return _check_shards(folder, full=True)


def _fill_shards(encoder: Encoder, paths: list[Path], folder: Path, shards: list[int], batch_size: int,
                 workers: int) -> None:
    """Compute ``shards`` of the sharded store in ``folder`` here (the local engine's share of a
    sharded store: the shards a check found bad), each written with :func:`write_shard`."""
    manifest = json.loads((folder / "manifest.json").read_text())
    size, (L, D) = manifest["shard_size"], ShardedFeatureStore(folder, shards=[]).row_shape
    for s in shards:
        part = paths[s * size:(s + 1) * size]
        rows = np.zeros((len(part), L, D), dtype=np.float16)  # (n, L, D): zeros for unreadable images
        failed: dict[int, str] = {}
        for start, batch in zip(range(0, len(part), batch_size),
                                image_batches(part, encoder.preprocess, batch_size, workers, module_device(encoder))):
            failed.update({s * size + start + k: str(e) for k, e in batch.errors.items()})
            if batch.good:
                out = encoder.encode(batch.pixels).float().cpu().numpy().astype(np.float16)  # (B, L, D)
                rows[[start + k for k in batch.good]] = out
        write_shard(folder, s, rows, [str(p) for p in part], failed)


def shards_for_rank(num_shards: int, rank: int, world: int) -> list[int]:
    """The shards DDP rank ``rank`` of ``world`` reads: every world-th one from ``rank`` (the
    ranks' shard counts differ by at most one; the trainer evens out the steps)."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    return list(range(rank, num_shards, world))


def sharded_folder_for(root: Path, encoder: Encoder, paths: list[Path]) -> Path:
    folder = _folder_for(root, encoder, paths)
    return folder.with_name(folder.name + ".shards")


def open_sharded(encoder: Encoder, paths: list[Path], root: Path | None, shard_size: int) -> tuple[Path, int]:
    """The sharded store's folder for ``paths`` under ``root``, created (marker, manifest) if
    new; its shard size (the one it was started with, when resumed). A folder of that name
    holding files captionkit did not write is refused."""
    root = check_writable_folder(root or default_cache_root())
    folder = sharded_folder_for(root, encoder, paths)
    manifest = folder / "manifest.json"
    if folder.is_dir() and any(folder.iterdir()) and owner_kind(folder) != FEATURE_SHARDS_KIND:
        raise OutputError(f"{folder}: holds files captionkit did not write; refusing to write features into it")
    if manifest.exists():  # resumed: a shard whose size is not its record's is computed again
        _check_shards(folder, full=False)
        return folder, int(json.loads(manifest.read_text())["shard_size"])
    folder.mkdir(parents=True, exist_ok=True)
    write_marker(folder, FEATURE_SHARDS_KIND)
    grid = encoder.grid()
    atomic_write_text(manifest, json.dumps({
        "format": SHARDED_FORMAT, "encoder": encoder.cache_key(), "grid": list(grid), "dim": encoder.dim,
        "dtype": "float16", "shard_size": shard_size, "images": len(paths),
        "shards": -(-len(paths) // shard_size)}, indent=1) + "\n")
    return folder, shard_size


FLIP_SUFFIX = "-hflip"  # the cache key of mirror-image features: the encoder's, marked


def _folder_for(root: Path, encoder: Encoder, paths: list[Path], flip: bool = False) -> Path:
    h = hashlib.sha1("\n".join(str(p.resolve()) for p in paths).encode()).hexdigest()[:12]
    return root / (encoder.cache_key() + (FLIP_SUFFIX if flip else "")) / h


def build_features(encoder: Encoder, paths: list[Path], root: Path | None = None,
                   batch_size: int = 16, progress: bool = True, workers: int = 2,
                   flip: bool = False, only: list[Path] | None = None,
                   verify: bool = False) -> FeatureStore | ShardedFeatureStore:
    """Encode every image of ``paths`` once (resuming a partial build) and return the store:
    the complete sharded store of these images when ``--engine ray`` wrote one, else the
    single memory-mapped file (built here). ``flip``: encode each image's horizontal mirror
    image instead (test-time flip averaging, captionkit.inference.ensemble.with_flip_views), cached apart
    from the photos' features (in the single-file layout only).

    The encoder runs where it is (``encoder.to(device)`` first), in float32 on every device:
    the cache is shared by every later run whatever device it is on. ``workers`` processes
    decode the images (0: this process; captionkit.encoders.image_batches). Unreadable images are
    reported on stderr and left out of the store.

    ``only``: encode just these images of ``paths`` (a run on part of a dataset, e.g.
    train.train_max_images). The store is still the one of all ``paths`` (the same folder), with
    the other rows left unwritten (``done`` False: never read, and not in the store's index), so
    a later call for more of ``paths`` fills in the rest of the same cache.

    The store's entry is locked while it is built (:func:`building`: a second process waits,
    then uses it). Its files' sizes are checked on every call and, with ``verify`` (``captionkit
    features --verify``), their digests: a bad shard (or block of rows) is computed again, alone.
    A full disk is one line, the store left as it was."""
    root = check_writable_folder(root or default_cache_root())
    sharded = sharded_folder_for(root, encoder, paths)
    if not flip and (sharded / "manifest.json").exists():
        with building(sharded, f"features {encoder.name}"):
            if (store := ShardedFeatureStore(sharded)).complete:  # (an unfinished one is --engine ray's to finish)
                if bad := _check_shards(sharded, full=verify):
                    _fill_shards(encoder, paths, sharded, bad, batch_size, workers)
                    store = ShardedFeatureStore(sharded)
                return store
    folder = _folder_for(root, encoder, paths, flip)
    meta_path = folder / "meta.json"
    if folder.is_dir() and any(folder.iterdir()) and not meta_path.exists() and owner_kind(folder) != "features":
        raise OutputError(f"{folder}: holds files captionkit did not write (no meta.json); "
                          f"refusing to write features into it")
    with building(folder, f"features {encoder.name}"):
        return _build_file(encoder, paths, folder, batch_size, progress, workers, flip, verify, only)


def _create_rows(path: Path, shape: tuple[int, int, int]) -> None:
    """A new (N, L, D) float16 .npy of zeros, its blocks allocated now: a disk without room for it
    is one line here, not a SIGBUS when a memory-mapped row is written later."""
    try:
        with disk_errors(path, int(np.prod(shape)) * 2 + 128, KEPT):  # (N*L*D float16 and the header)
            np.lib.format.open_memmap(path, mode="w+", dtype=np.float16, shape=shape).flush()
            if hasattr(os, "posix_fallocate"):
                with open(path, "r+b") as fh:
                    os.posix_fallocate(fh.fileno(), 0, os.fstat(fh.fileno()).st_size)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def _build_file(encoder: Encoder, paths: list[Path], folder: Path, batch_size: int, progress: bool,
                workers: int, flip: bool, verify: bool, only: list[Path] | None) -> FeatureStore:
    """The single-file store of ``paths`` in ``folder``, built or resumed (under its lock)."""
    meta_path, feats_path, done_path = folder / "meta.json", folder / "feats.npy", folder / "done.npy"
    _check_single(folder, full=verify)
    folder.mkdir(parents=True, exist_ok=True)
    grid = encoder.grid()
    L, D = grid[0] * grid[1], encoder.dim
    if not meta_path.exists():
        write_marker(folder, "features")
        _create_rows(feats_path, (len(paths), L, D))
        _write_file(done_path, _npy_bytes(np.zeros(len(paths), dtype=bool)))
        meta = {"paths": [str(p) for p in paths], "grid": list(grid), "encoder": encoder.cache_key(),
                **({"flip": True} if flip else {})}
        _write_file(meta_path, json.dumps(meta).encode())
    feats = np.load(feats_path, mmap_mode="r+")
    done = np.load(done_path)
    wanted = range(len(paths))
    if only is not None:
        position = {p: i for i, p in enumerate(paths)}
        strangers = [p for p in only if p not in position]
        if strangers:  # a caller's bug: these rows could never be written
            raise ValueError(f"{len(strangers)} of the images to encode are not in the store's list, "
                             f"e.g. {strangers[0]}")
        wanted = sorted({position[p] for p in only})
    todo = [i for i in wanted if not done[i]]
    wrote = False  # whether any row changed (not so when the todo rows are unreadable images only)
    failed: list[str] = []
    # (closed below, or by its finalizer when an error ends the loop)
    bar = progress_bar(total=len(todo), desc=f"features {encoder.name}", unit="image", show=progress and bool(todo))
    for start, batch in zip(range(0, len(todo), batch_size),
                            image_batches([paths[i] for i in todo], encoder.preprocess, batch_size, workers,
                                          module_device(encoder))):
        rows = todo[start:start + batch_size]  # the cache rows of this batch's images
        failed += [str(e) for e in batch.errors.values()]
        if batch.good:
            if not wrote:  # rows are about to change: their digests are recorded again once written
                (folder / DIGESTS).unlink(missing_ok=True)
                wrote = True
            pixels = batch.pixels.flip(-1) if flip else batch.pixels  # (B, 3, S, S)
            out = encoder.encode(pixels).float().cpu().numpy().astype(np.float16)  # (B, L, D)
            for k, row in zip(batch.good, out):
                feats[rows[k]] = row
                done[rows[k]] = True
        bar.update(len(rows))
        if start // batch_size % 20 == 0 or start + batch_size >= len(todo):
            feats.flush()
            _write_file(done_path, _npy_bytes(done))
    bar.close()
    if wrote:
        _write_digests(folder, feats)
    for msg in failed:
        print(f"skipped: {msg}", file=sys.stderr)
    return FeatureStore(folder)
