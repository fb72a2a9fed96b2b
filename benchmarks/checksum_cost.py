"""What verifying a checkpoint's sha256 costs on load, for the shipped models.

    python benchmarks/checksum_cost.py [--repeat 5]

For each shipped model: the size of model.safetensors, the time to hash it (checkpoint.verify)
and the time of the whole read_weights (verify + safetensors load), best of --repeat warm runs
(the file in the page cache, as on every load after the first), beside a whole
Captioner.load with its encoder, to put the hashing in proportion.
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from captionkit.core.checkpoint import read_weights, verify  # noqa: E402
from captionkit.inference.captioner import Captioner  # noqa: E402
from captionkit.inference.shipped import SHIPPED  # noqa: E402
from timing import min_time  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(f"{'model':32s} {'MB':>6s} {'sha256 ms':>10s} {'MB/s':>6s} {'read_weights ms':>16s} "
          f"{'Captioner.load ms':>18s}")
    for folder in sorted(f.parent for f in SHIPPED.rglob("model.safetensors")):  # an ensemble's members too
        mb = (folder / "model.safetensors").stat().st_size / 1e6
        read_weights(folder)  # warm the page cache
        hashing = min_time(partial(verify, folder, "model.safetensors"), args.repeat)
        loading = min_time(partial(read_weights, folder), args.repeat)
        whole = min_time(partial(Captioner.load, folder, device="cpu"), 1)
        print(f"{str(folder.relative_to(SHIPPED)):32s} {mb:6.1f} {1e3 * hashing:10.1f} {mb / hashing:6.0f} {1e3 * loading:16.1f} "
              f"{1e3 * whole:18.0f}")


if __name__ == "__main__":
    main()
