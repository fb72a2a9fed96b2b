"""What checking a feature shard's digest costs, on a real-size shard.

    OMP_NUM_THREADS=1 python benchmarks/shard_verify_cost.py [--images 1000] [--dir /tmp]

A shard of the default --shard-size (1,000 images) of efficientnet_lite2 features ((9*9, 1280)
float16 a row: 207 MB), random values, written with ``write_shard`` into a temporary folder.
Timed, best of 3: writing it (which now hashes the file it wrote), the first open of the
shard in a process as it was (``np.load`` memory-mapped: the header only) and as it is now
(its size, then its sha256: a read of the whole file, then ``np.load``), and the single-file
store's check of the same rows (one sha256 per 1,000-row block). The page cache is warm (the
file was just written); from a cold network file system the read is bounded by its bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from captionkit.encoders import features as F  # noqa: E402
from timing import min_time  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=1000)
    ap.add_argument("--dir", default=None, help="where to write the shard (default the temp folder)")
    args = ap.parse_args()
    L, D = 81, 1280  # efficientnet_lite2's (9 x 9) grid and width
    rows = np.random.default_rng(0).standard_normal((args.images, L, D)).astype(np.float16)  # (n, L, D)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp)
        paths = [f"im{i}.jpg" for i in range(args.images)]
        npy = F.shard_file(folder, 0, ".npy")
        bare = min_time(lambda: F._write_file(npy, F._npy_bytes(rows)), 3)  # its rows alone, as before digests
        write = min_time(lambda: F.write_shard(folder, 0, rows, paths, {}), 3)
        record = json.loads(F.shard_file(folder, 0, ".json").read_text())
        mb = npy.stat().st_size / 1e6
        before = min_time(lambda: np.load(npy, mmap_mode="r"), 3)
        after = min_time(lambda: (F.shard_fault(folder, 0, record, full=True), np.load(npy, mmap_mode="r")), 3)
        size_only = min_time(lambda: F.shard_fault(folder, 0, record, full=False), 3)
        mm = np.load(npy, mmap_mode="r")
        blocks = min_time(lambda: [F._block_sha256(mm, b, F.BLOCK_ROWS) for b in range(-(-len(mm) // F.BLOCK_ROWS))], 3)
    print(f"shard: {args.images} images, {mb:.0f} MB")
    print(f"writing its rows (no digest)       {bare * 1e3:8.0f} ms")
    print(f"write_shard (with its sha256)      {write * 1e3:8.0f} ms")
    print(f"first open, before digests         {before * 1e3:8.1f} ms")
    print(f"first open, size + sha256          {after * 1e3:8.0f} ms  ({mb / after:.0f} MB/s)")
    print(f"size check alone (every build)     {size_only * 1e3:8.2f} ms")
    print(f"single-file blocks, same rows      {blocks * 1e3:8.0f} ms")


if __name__ == "__main__":
    main()
