"""Do big photos get the same caption from the server as from `captionkit caption`?

    python benchmarks/reduced_captions.py [--n 100] [--scale 8] [--images DIR]

The server decodes a photo larger than 3x the model's input side reduced (a JPEG in draft mode,
other formats box-reduced strip by strip: images.decode_reduced); `captionkit caption` decodes it
in full (images.load_rgb). Both then resize to the model's input with the same bicubic filter.
This takes --n photos (the first of the Flickr8k test split when --images is the Flickr8k folder,
else every photo in the folder), enlarges each --scale times (bicubic, so a 500x375 photo becomes
4000x3000 like a phone's), saves it as JPEG (quality 92) and as PNG, captions it both ways with
the shipped model (beam 3) and counts identical captions and the largest pixel difference of the
model inputs; for scale, also how many captions JPEG compression alone changes (the JPEG and the
PNG, both decoded in full).
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import torch
from PIL import Image

from captionkit.data.images import decode_reduced, decode_rgb, to_tensor
from captionkit.inference.captioner import Captioner

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
    cap = Captioner.load(device="cpu")
    pre = cap.encoder.preprocess
    paths = photos(Path(args.images), args.n)
    captions, worst, examples = {}, {"JPEG": 0.0, "PNG": 0.0}, []
    for path in paths:
        im = Image.open(path).convert("RGB")
        big = im.resize((im.width * args.scale, im.height * args.scale), Image.Resampling.BICUBIC)
        inputs = {}
        for fmt in ("JPEG", "PNG"):
            buf = io.BytesIO()
            big.save(buf, fmt, **({"quality": 92} if fmt == "JPEG" else {"compress_level": 1}))
            full = to_tensor(decode_rgb(buf.getvalue()), pre)
            reduced = to_tensor(decode_reduced(buf.getvalue(), pre.size)[0], pre)
            worst[fmt] = max(worst[fmt], float((full - reduced).abs().max() * max(pre.std) * 255))  # in pixel units
            inputs[(fmt, "full")], inputs[(fmt, "reduced")] = full, reduced
        with torch.inference_mode():
            texts = [cap.result(c).text for c in cap.decode_features(cap.encode_batch(list(inputs.values())), args.beam)]
        got = dict(zip(inputs, texts))
        captions[path] = got
        if got[("JPEG", "full")] != got[("JPEG", "reduced")] and len(examples) < 3:
            examples.append((path.name, got[("JPEG", "full")], got[("JPEG", "reduced")]))
    print(f"{len(paths)} photos enlarged {args.scale}x (e.g. 500x375 -> {500 * args.scale}x{375 * args.scale}), "
          f"shipped model, beam {args.beam}; identical captions:")
    for fmt in ("JPEG", "PNG"):
        same = sum(c[(fmt, "full")] == c[(fmt, "reduced")] for c in captions.values())
        print(f"  {fmt}, reduced decoding (server) vs full decoding (captionkit caption): {same} of {len(paths)}; "
              f"largest input difference {worst[fmt]:.1f} of 255")
    same = sum(c[("JPEG", "full")] == c[("PNG", "full")] for c in captions.values())
    print(f"  for scale: full decoding of the JPEG vs of the PNG (JPEG compression alone): {same} of {len(paths)}")
    for name, full, reduced in examples:
        print(f"  e.g. {name}: {full!r} / {reduced!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
