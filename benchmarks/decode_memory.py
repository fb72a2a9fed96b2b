"""Memory of the server's image decoding, measured against its own estimate.

    python benchmarks/decode_memory.py [--side 4000] [--model-side 260]

For each format and colour mode the server accepts, writes a --side x --side photo (noise, so it
does not compress away), decodes it with ``images.decode_reduced`` in a fresh process and reports
the rise of that process's peak resident memory (VmHWM, after resetting it) next to the decode
plan's estimate (``DecodePlan.bytes``), which the server uses to refuse uploads and to state its
worst case. Exits 1 if any measured peak is over its estimate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

CHILD = r"""
import json, sys
from captionkit.data.images import decode_reduced

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) * 1024

data, side = open(sys.argv[1], "rb").read(), int(sys.argv[2])
open("/proc/self/clear_refs", "w").write("5")  # reset VmHWM to the current VmRSS
before = status("VmRSS")
out, plan = decode_reduced(data, side, max_pixels=10 ** 9)
print(json.dumps({"size": plan.size, "factor": plan.factor, "estimate": plan.bytes,
                  "peak": status("VmHWM") - before, "out": out.size}))
"""

CASES = [  # format, mode, save options
    ("PNG", "RGBA", {}), ("PNG", "RGB", {}), ("PNG", "LA", {}), ("PNG", "L", {}), ("PNG", "P", {}),
    ("PNG", "I;16", {}), ("PNG", "RGBA", {"interlace": True}),
    ("JPEG", "RGB", {"quality": 90}), ("JPEG", "L", {"quality": 90}), ("JPEG", "CMYK", {"quality": 90}),
    ("JPEG", "RGB", {"quality": 90, "progressive": True}),
    ("JPEG", "RGB", {"quality": 90, "progressive": True, "subsampling": 0}),
    ("WEBP", "RGBA", {"quality": 80}), ("WEBP", "RGB", {"quality": 80}),
    ("TIFF", "RGB", {}), ("TIFF", "RGB", {"compression": "tiff_deflate"}),
    ("TIFF", "RGB", {"compression": "tiff_deflate", "strip_size": 2 ** 30}), ("TIFF", "F", {}), ("TIFF", "I;16", {}),
    ("BMP", "RGB", {}), ("GIF", "P", {}),
]


def photo(mode: str, side: int, rng: np.random.Generator) -> Image.Image:
    """Noise, smoothed for JPEG so that its encoder's buffer suffices."""
    if mode in ("I;16", "F"):
        arr = (rng.integers(0, 65535, (side, side), dtype=np.uint16) if mode == "I;16"
               else rng.random((side, side), dtype=np.float32))
        return Image.fromarray(arr)
    base = Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), "RGB")
    if mode == "RGBA":
        base.putalpha(Image.fromarray(rng.integers(0, 256, (side, side), dtype=np.uint8), "L"))
        return base
    return base.convert("L").convert("P") if mode == "P" else base.convert(mode)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--side", type=int, default=4000, help="photo width and height")
    ap.add_argument("--model-side", type=int, default=260, help="the model's input side (the shipped model's is 260)")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = True
    print(f"{args.side}x{args.side} photos, model input {args.model_side} px")
    with tempfile.TemporaryDirectory() as tmp:
        for fmt, mode, opts in CASES:
            im = photo(mode, args.side, rng)
            if fmt == "JPEG":  # smooth it (noise overflows libjpeg's buffer in some modes)
                im = im.resize((args.side // 8,) * 2).resize((args.side,) * 2, Image.Resampling.BICUBIC)
            path = Path(tmp) / f"photo.{fmt.lower()}"
            im.save(path, fmt, **opts)
            r = subprocess.run([sys.executable, "-c", CHILD, str(path), str(args.model_side)],
                               capture_output=True, text=True, env=env, check=False)
            if r.returncode:
                print(f"{fmt} {mode} {opts}: failed\n{r.stderr[-800:]}")
                ok = False
                continue
            d = json.loads(r.stdout)
            fine = d["peak"] <= d["estimate"]
            ok &= fine
            print(f"{fmt:5s} {mode:5s} {json.dumps(opts):52s} decoded {d['size'][0]}x{d['size'][1]}, "
                  f"reduced {d['factor'][0]}x: peak {d['peak'] / 2 ** 20:6.1f} MiB, estimate "
                  f"{d['estimate'] / 2 ** 20:6.1f} MiB ({d['peak'] / d['estimate']:.2f})"
                  f"{'' if fine else '   <-- OVER'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
