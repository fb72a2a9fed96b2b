"""An on-disk, memory-mapped cache of encoder features, so decoder training never reruns the CNN.

Layout: ``ROOT/<encoder cache key>/<image-set hash>/`` holding ``feats.npy`` (N, L, D) float16,
``done.npy`` (N,) bool (which rows are written: an interrupted build resumes),
``meta.json`` (image paths, grid, encoder) and captionkit's folder marker. A folder of that
name holding anything else is refused, never written into. The encoder key covers architecture, weights and
preprocessing, so changing any of them never reuses stale features.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

from .cache import cache_root
from .devices import module_device
from .encoders.base import Encoder
from .errors import OutputError
from .image_batches import image_batches
from .outputs import atomic_write_text, check_writable_folder, owner_kind, write_marker


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


def _folder_for(root: Path, encoder: Encoder, paths: list[Path]) -> Path:
    h = hashlib.sha1("\n".join(str(p.resolve()) for p in paths).encode()).hexdigest()[:12]
    return root / encoder.cache_key() / h


def build_features(encoder: Encoder, paths: list[Path], root: Path | None = None,
                   batch_size: int = 16, progress: bool = True, workers: int = 2) -> FeatureStore:
    """Encode every image of ``paths`` once (resuming a partial build) and return the store.

    The encoder runs where it is (``encoder.to(device)`` first), in float32 on every device:
    the cache is shared by every later run whatever device it is on. ``workers`` processes
    decode the images (0: this process; captionkit.image_batches). Unreadable images are
    reported on stderr and left out of the store."""
    root = check_writable_folder(root or default_cache_root())
    folder = _folder_for(root, encoder, paths)
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
        meta = {"paths": [str(p) for p in paths], "grid": list(grid), "encoder": encoder.cache_key()}
        atomic_write_text(meta_path, json.dumps(meta))
    feats = np.load(feats_path, mmap_mode="r+")
    done = np.load(done_path)
    todo = [i for i in range(len(paths)) if not done[i]]
    failed: list[str] = []
    t0, n_done = time.time(), 0
    for start, batch in zip(range(0, len(todo), batch_size),
                            image_batches([paths[i] for i in todo], encoder.preprocess, batch_size, workers,
                                          module_device(encoder))):
        rows = todo[start:start + batch_size]  # the cache rows of this batch's images
        failed += [str(e) for e in batch.errors.values()]
        if batch.good:
            out = encoder.encode(batch.pixels).float().cpu().numpy().astype(np.float16)  # (B, L, D)
            for k, row in zip(batch.good, out):
                feats[rows[k]] = row
                done[rows[k]] = True
        n_done += len(rows)
        if start // batch_size % 20 == 0 or start + batch_size >= len(todo):
            feats.flush()
            np.save(done_path, done)
            if progress:
                rate = n_done / max(time.time() - t0, 1e-9)
                eta = (len(todo) - n_done) / max(rate, 1e-9)
                print(f"\rfeatures {encoder.name}: {n_done}/{len(todo)} "
                      f"{rate:.1f} img/s, ETA {eta / 60:.1f} min", end="", file=sys.stderr, flush=True)
    if progress and todo:
        print(file=sys.stderr)
    for msg in failed:
        print(f"skipped: {msg}", file=sys.stderr)
    return FeatureStore(folder)
