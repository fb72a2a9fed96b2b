"""A small Flickr8k copy in the official layout, for a machine the full dataset cannot reach.

    python benchmarks/flickr8k_subset.py ../shared/data/flickr8k OUT --train 1000 --dev 200 --test 100

Takes the first N images of each official split file, resizes them to 260x260 (bicubic: what
the EfficientNet-Lite2 encoder does to every photo itself, so its features barely change) and
saves them as JPEG quality 75, with the matching lines of Flickr8k.token.txt. About 16 KB an
image: 1,300 images make 21 MB, small enough to travel with the repository to a GPU machine
(benchmarks/gpu_check.sh).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image

SPLITS = {"train": "Flickr_8k.trainImages.txt", "dev": "Flickr_8k.devImages.txt", "test": "Flickr_8k.testImages.txt"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", type=Path, help="the Flickr8k folder (official layout)")
    ap.add_argument("out", type=Path, help="a new folder for the subset")
    ap.add_argument("--train", type=int, default=1000)
    ap.add_argument("--dev", type=int, default=200)
    ap.add_argument("--test", type=int, default=100)
    ap.add_argument("--size", type=int, default=260)
    ap.add_argument("--quality", type=int, default=75)
    args = ap.parse_args()
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out}: not empty; give a new folder")
    (args.out / "Flicker8k_Dataset").mkdir(parents=True, exist_ok=True)
    keep: set[str] = set()
    for split, name in SPLITS.items():
        images = [line.strip() for line in (args.src / name).read_text().splitlines() if line.strip()]
        images = images[:getattr(args, split)]
        (args.out / name).write_text("".join(f"{im}\n" for im in images))
        keep.update(images)
    tokens = [line for line in (args.src / "Flickr8k.token.txt").read_text().splitlines()
              if line.split("#")[0] in keep]
    (args.out / "Flickr8k.token.txt").write_text("".join(f"{line}\n" for line in tokens))
    for name in sorted(keep):
        im = Image.open(args.src / "Flicker8k_Dataset" / name).convert("RGB")
        im.resize((args.size, args.size), Image.Resampling.BICUBIC).save(
            args.out / "Flicker8k_Dataset" / name, quality=args.quality)
    print(f"{len(keep)} images, {len(tokens)} captions in {args.out}")


if __name__ == "__main__":
    main()
