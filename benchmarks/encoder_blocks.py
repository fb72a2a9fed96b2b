"""EfficientNet-Lite2's inverted-residual blocks, one at a time, float32: each block's 1x1
expansion and depthwise convolution as oneDNN's two fused passes against conv.c's one pass
(``kernels.expand_depthwise``), on the same activations, with how far apart their outputs are.

    python benchmarks/encoder_blocks.py [--threads 1] [--views 16] [--repeats 5] [--photos]

Per block: the input map's side, the expanded channels M, the depthwise kernel and stride, the
expanded map's bytes a view, "max |diff|" between the two outputs (0: bit for bit the same), the
best of ``--repeats`` times a view for each, and whether the encoder runs that block in one pass
(``RING_MIN_BYTES``). The activations come from random pixels, or with ``--photos`` from
Flickr8k test photos (``../shared/data/flickr8k``). The command's allocator settings apply.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from timing import min_time  # noqa: E402

from captionkit import kernels  # noqa: E402
from captionkit.cli.main import tune_allocator  # noqa: E402
from captionkit.encoders.efficientnet_lite import MBConv, _ring_pays, efficientnet_lite2  # noqa: E402


def best_ms(f, views: int, repeats: int) -> float:
    """The fastest of ``repeats`` calls after one unmeasured, in ms a view."""
    f()
    return min_time(f, repeats) * 1e3 / views


def one_pass(block: MBConv, x: torch.Tensor) -> torch.Tensor:
    return block._one_pass(x, block._depthwise_conv.same_padding(*x.shape[-2:]))


def onednn(block: MBConv, x: torch.Tensor) -> torch.Tensor:
    return block._expand_depthwise(x, torch.float32, block._depthwise_conv.same_padding(*x.shape[-2:]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--views", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--photos", action="store_true", help="Flickr8k test photos instead of random pixels")
    args = ap.parse_args()
    tune_allocator()
    torch.set_num_threads(args.threads)
    if not kernels.expand_depthwise_available():
        sys.exit("conv.c's kernel is not built here (needs a C compiler, AVX2 and FMA)")
    enc = efficientnet_lite2()
    if args.photos:
        from speed import sample_photos
        from captionkit.data.images import load_rgb, to_tensor
        x = torch.stack([to_tensor(load_rgb(p), enc.preprocess) for p in sample_photos(args.views)])
    else:
        x = torch.rand(args.views, 3, enc.preprocess.size, enc.preprocess.size) * 4 - 2
    x = x.contiguous(memory_format=torch.channels_last)
    print(f"torch {torch.__version__}, {args.threads} thread(s), {args.views} views, best of {args.repeats}")
    print(f"{'block':>5} {'side':>4} {'M':>5} {'k':>2} {'s':>2} {'MB a view':>9} {'max |diff|':>10} "
          f"{'oneDNN ms':>9} {'1 pass ms':>9} {'speed-up':>8}  encoder runs")
    totals = [0.0, 0.0]
    with torch.no_grad():
        y = enc._trunk(x, 0)  # the stem
        for i, block in enumerate(enc._blocks):
            if block.expand:
                dw = block._depthwise_conv
                m = block._expand_conv.out_channels
                a, b = onednn(block, y), one_pass(block, y)
                t_a = best_ms(lambda: onednn(block, y), args.views, args.repeats)
                t_b = best_ms(lambda: one_pass(block, y), args.views, args.repeats)
                ours = _ring_pays(y, m)
                if ours:
                    totals[0] += t_a
                    totals[1] += t_b
                print(f"{i:5d} {y.shape[-1]:4d} {m:5d} {dw.kernel_size[0]:2d} {dw.stride[0]:2d} "
                      f"{y.shape[-2] * y.shape[-1] * m * 4 / 2**20:9.2f} {(a - b).abs().max().item():10.2e} "
                      f"{t_a:9.2f} {t_b:9.2f} {t_a / t_b:7.2f}x  {'one pass' if ours else 'oneDNN'}", flush=True)
            y = block(y)
    print(f"blocks the encoder runs in one pass: oneDNN {totals[0]:.2f} ms a view, one pass {totals[1]:.2f} "
          f"({totals[0] / max(totals[1], 1e-9):.2f}x)")


if __name__ == "__main__":
    main()
