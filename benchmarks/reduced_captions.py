"""Do big photos get the same caption from the server as from `captionkit caption`?

    python benchmarks/reduced_captions.py [--n 100] [--scale 8] [--images DIR]

The server decodes a photo larger than 3x the model's input side reduced (a JPEG in draft mode,
other formats box-reduced strip by strip: images.decode_reduced); `captionkit caption` decodes it
in full (images.load_rgb). Both then resize to the model's input with the same bicubic filter.
This takes --n photos (the first of the Flickr8k test split when --images is the Flickr8k folder,
else every photo in the folder), enlarges each --scale times (bicubic, so a 500x375 photo becomes
4000x3000 like a phone's), saves it as JPEG (quality 92) and as PNG, captions it both ways with
the shipped model (beam 3) and counts identical captions and the largest pixel difference of the
model inputs.
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import torch
from PIL import Image

from captionkit.captioner import Captioner
from captionkit.images import decode_reduced, decode_rgb, to_tensor

ROOT = Path(__file__).resolve().parents[1]


def photos(folder: Path, n: int) -> list[Path]:
    split = folder / "Flickr_8k.testImages.txt"
    if split.exists():
        return [folder / "Flicker8k_Dataset" / name for name in split.read_text().split()[:n]]
    return sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))[:n]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--scale", type=int, default=8)
    ap.add_argument("--images", default=str(ROOT / "samples"), help="a photo folder, or the Flickr8k folder")
    ap.add_argument("--beam", type=int, default=3)
    args = ap.parse_args()
    cap = Captioner.load()
    pre = cap.encoder.preprocess
    paths = photos(Path(args.images), args.n)
    for fmt in ("JPEG", "PNG"):
        same, worst, sizes = 0, 0.0, set()
        for path in paths:
            im = Image.open(path).convert("RGB")
            big = im.resize((im.width * args.scale, im.height * args.scale), Image.Resampling.BICUBIC)
            buf = io.BytesIO()
            big.save(buf, fmt, **({"quality": 92} if fmt == "JPEG" else {"compress_level": 1}))
            data = buf.getvalue()
            reduced, plan = decode_reduced(data, pre.size)
            x = torch.stack([to_tensor(decode_rgb(data), pre), to_tensor(reduced, pre)])
            worst = max(worst, float((x[0] - x[1]).abs().max() * max(pre.std) * 255))  # in 0..255 pixel units
            with torch.inference_mode():
                full_cap, reduced_cap = (cap.result(c).text for c in cap.decode_features(cap.encoder(x), args.beam))
            same += full_cap == reduced_cap
            sizes.add((big.size, plan.size, plan.factor))
        how = ", ".join(f"{s[0][0]}x{s[0][1]} decoded at {s[1][0]}x{s[1][1]} then reduced {s[2][0]}x{s[2][1]}"
                        for s in sorted(sizes)[:2])
        print(f"{fmt}: {same} of {len(paths)} captions identical (beam {args.beam}); largest input pixel "
              f"difference {worst:.1f} of 255 ({how}{', ...' if len(sizes) > 2 else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
