"""The default captioner's cost a photo in CPU time, for the tree on PYTHONPATH: beam decoding and the
encoder (both views), each the process's own CPU time (``time.process_time``), one torch thread.

    PYTHONPATH=src python benchmarks/decode_cpu.py [--precision fp32|auto] [--model NAME] [--images 16]

CPU time rather than wall time because a shared machine's load stretches wall time by whatever
else runs (docs/speed.md's beam search figures were taken at a load average of 16-18 on 2
cores), while a process's own CPU time moves much less. To compare trees, alternate them in one
shell loop (each run is a fresh process), e.g.::

    for i in 1 2; do for t in ../old . ; do (cd $t && PYTHONPATH=src python $OLDPWD/benchmarks/decode_cpu.py); done; done

The photos are the first ``--images`` of the Flickr8k test split (the repository's samples/
without it), decoded with beam 3 as one batch, as ``captionkit caption`` decodes a batch.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def photos(n: int) -> list[Path]:
    test = ROOT.parent / "shared" / "data" / "flickr8k"
    if (test / "Flickr_8k.testImages.txt").is_file():
        return [test / "Flicker8k_Dataset" / x for x in (test / "Flickr_8k.testImages.txt").read_text().split()[:n]]
    found = sorted((ROOT / "samples").glob("*.jpg"))
    return [found[i % len(found)] for i in range(n)]


def cpu_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return 1000 * statistics.median(times)


def main() -> None:
    from captionkit.data.images import load_rgb, to_tensor
    from captionkit.inference.captioner import Captioner

    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--model", help="default: the default model")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cap = Captioner.load(args.model, device="cpu", precision=args.precision)
    x = [to_tensor(load_rgb(p), cap.encoder.preprocess) for p in photos(args.images)]
    feats = cap.encode_batch(x)
    n = len(x)
    enc = cpu_ms(lambda: cap.encode_batch(x), max(1, args.repeats // 2)) / n
    dec = cpu_ms(lambda: cap.decode_features(feats, beam=3), args.repeats) / n
    print(f"{args.model or 'default model'}, {cap.precision}, {n} photos, one thread: "
          f"beam decoding {dec:.1f} CPU ms/photo, encoder {enc:.1f} CPU ms/photo")


if __name__ == "__main__":
    main()
