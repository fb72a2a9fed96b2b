"""What the feature store needs per image, per encoder, and for COCO and 10M images.

    OMP_NUM_THREADS=1 python benchmarks/feature_store_bytes.py

Each registered encoder is built with random weights (the grid and width do not depend on the
weights) and asked for its grid (H, W) and width D. The store keeps (H*W, D) float16 per image
(2 bytes a value); "pooled" is the one mean vector per image (D values) a global-feature
decoder would need; float8 / int8 would halve the float16 figures again. COCO: 123,287 images
(train2014 + val2014, the Karpathy splits' pool).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

COCO = 123_287
TEN_M = 10_000_000


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} PB"


def main() -> None:
    from captionkit.encoders import create_encoder, list_encoders

    print(f"{'encoder':<20} {'grid':>7} {'D':>5} {'float16/image':>14} {'COCO':>9} {'10M':>9} "
          f"{'pooled/image':>13} {'pooled 10M':>11}")
    for name in list_encoders():
        try:
            enc = create_encoder(name, weights="random")
        except ImportError as e:  # an optional package missing: say so, go on with the others
            print(f"{name:<20} not measured: {type(e).__name__}: {str(e).splitlines()[0][:80]}")
            continue
        h, w = enc.grid()
        per = h * w * enc.dim * 2
        pooled = enc.dim * 2
        print(f"{name:<20} {f'{h}x{w}':>7} {enc.dim:>5} {human(per):>14} {human(per * COCO):>9} "
              f"{human(per * TEN_M):>9} {human(pooled):>13} {human(pooled * TEN_M):>11}")


if __name__ == "__main__":
    main()
