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
"""

from __future__ import annotations

import hashlib
import io
import json
import sys
from pathlib import Path

import numpy as np
import torch

from ..core.cache import cache_root
from ..core.errors import OutputError
from ..core.outputs import atomic_write_bytes, atomic_write_text, check_writable_folder, owner_kind, write_marker
from ..core.progress import progress as progress_bar
from .base import Encoder, module_device
from .image_batches import image_batches

# the feature folders sit directly under the cache root (the layout existing caches use)
default_cache_root = cache_root


class FeatureStore:
    """Read side: ``store.rows(names)`` -> (B, L, D) float16 rows of the memory-mapped array."""

    def __init__(self, folder: Path):
        meta = json.loads((folder / "meta.json").read_text())
        self.folder = folder
        self.grid: tuple[int, int] = tuple(meta["grid"])
        self.encoder: str = meta["encoder"]
        self.feats = np.load(folder / "feats.npy", mmap_mode="r")  # (N, L, D)
        done = np.load(folder / "done.npy")
        self.index = {Path(p).name: i for i, p in enumerate(meta["paths"]) if done[i]}

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def rows(self, names: list[str]) -> np.ndarray:
        idx = [self.index[n] for n in names]
        return self.feats[idx]  # (B, L, D)


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
        wanted = range(self.num_shards) if shards is None else set(shards)
        for s in range(self.num_shards):  # a shard not wanted, or not written yet, reads as empty
            record = shard_file(folder, s, ".json")
            doc = json.loads(record.read_text()) if s in wanted and record.exists() else {"paths": [], "failed": {}}
            start = s * manifest["shard_size"]
            keep = [(i, Path(p).name) for i, p in enumerate(doc["paths"]) if str(start + i) not in doc["failed"]]
            self.shard_names.append([name for _, name in keep])
            self.index.update({name: (s, i) for i, name in keep})
        self._arrays: dict[int, np.ndarray] = {}

    @property
    def complete(self) -> bool:
        return all(shard_file(self.folder, s, ".json").exists() for s in range(self.num_shards))

    def __contains__(self, name: str) -> bool:
        return name in self.index

    def _shard(self, s: int) -> np.ndarray:
        if s not in self._arrays:
            self._arrays[s] = np.load(shard_file(self.folder, s, ".npy"), mmap_mode="r")  # (n, L, D)
        return self._arrays[s]

    def rows(self, names: list[str]) -> np.ndarray:
        out = np.empty((len(names), *self.row_shape), dtype=np.float16)  # (B, L, D)
        for k, (s, i) in enumerate(self.index[n] for n in names):
            out[k] = self._shard(s)[i]
        return out


def write_shard(folder: Path, shard: int, feats: np.ndarray, paths: list[str], failed: dict[int, str]) -> None:
    """Write one shard of a sharded store: its rows (n, L, D) float16 (zeros for the unreadable
    images), then its record (``paths``; ``failed``: global image position -> message), each
    atomically and the record last, so a shard with a record is whole."""
    buf = io.BytesIO()
    np.save(buf, feats.astype(np.float16, copy=False))
    atomic_write_bytes(shard_file(folder, shard, ".npy"), buf.getvalue())
    atomic_write_text(shard_file(folder, shard, ".json"), json.dumps(
        {"paths": paths, "failed": {str(i): msg for i, msg in failed.items()}}) + "\n")


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
    if manifest.exists():
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
                   flip: bool = False, only: list[Path] | None = None) -> FeatureStore | ShardedFeatureStore:
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
    a later call for more of ``paths`` fills in the rest of the same cache."""
    root = check_writable_folder(root or default_cache_root())
    sharded = sharded_folder_for(root, encoder, paths)
    if not flip and (sharded / "manifest.json").exists() and (store := ShardedFeatureStore(sharded)).complete:
        return store
    folder = _folder_for(root, encoder, paths, flip)
    meta_path, feats_path, done_path = folder / "meta.json", folder / "feats.npy", folder / "done.npy"
    if folder.is_dir() and any(folder.iterdir()) and not meta_path.exists() and owner_kind(folder) != "features":
        raise OutputError(f"{folder}: holds files captionkit did not write (no meta.json); "
                          f"refusing to write features into it")
    folder.mkdir(parents=True, exist_ok=True)
    grid = encoder.grid()
    L, D = grid[0] * grid[1], encoder.dim
    if not meta_path.exists():
        write_marker(folder, "features")
        np.lib.format.open_memmap(feats_path, mode="w+", dtype=np.float16, shape=(len(paths), L, D)).flush()
        np.save(done_path, np.zeros(len(paths), dtype=bool))
        meta = {"paths": [str(p) for p in paths], "grid": list(grid), "encoder": encoder.cache_key(),
                **({"flip": True} if flip else {})}
        atomic_write_text(meta_path, json.dumps(meta))
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
    failed: list[str] = []
    # (closed below, or by its finalizer when an error ends the loop)
    bar = progress_bar(total=len(todo), desc=f"features {encoder.name}", unit="image", show=progress and bool(todo))
    for start, batch in zip(range(0, len(todo), batch_size),
                            image_batches([paths[i] for i in todo], encoder.preprocess, batch_size, workers,
                                          module_device(encoder))):
        rows = todo[start:start + batch_size]  # the cache rows of this batch's images
        failed += [str(e) for e in batch.errors.values()]
        if batch.good:
            pixels = batch.pixels.flip(-1) if flip else batch.pixels  # (B, 3, S, S)
            out = encoder.encode(pixels).float().cpu().numpy().astype(np.float16)  # (B, L, D)
            for k, row in zip(batch.good, out):
                feats[rows[k]] = row
                done[rows[k]] = True
        bar.update(len(rows))
        if start // batch_size % 20 == 0 or start + batch_size >= len(todo):
            feats.flush()
            np.save(done_path, done)
    bar.close()
    for msg in failed:
        print(f"skipped: {msg}", file=sys.stderr)
    return FeatureStore(folder)
