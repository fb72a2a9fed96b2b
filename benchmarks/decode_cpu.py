"""The default captioner's cost a photo in CPU time, for the tree on PYTHONPATH: beam decoding and the
encoder (both views), each the process's own CPU time (``time.process_time``), one torch thread.

    PYTHONPATH=src python benchmarks/decode_cpu.py [--precision fp32|auto] [--model NAME] [--images 16] [--flops]

CPU time rather than wall time because a shared machine's load stretches wall time by whatever
else runs (docs/speed.md's beam search figures were taken at a load average of 16-18 on 2
cores), while a process's own CPU time moves much less. To compare trees, alternate them in one
shell loop (each run is a fresh process), e.g.::

    for i in 1 2; do for t in ../old . ; do (cd $t && PYTHONPATH=src python $OLDPWD/benchmarks/decode_cpu.py); done; done

The photos are the first ``--images`` of the Flickr8k test split (the repository's samples/
without it), decoded with beam 3 as one batch, as ``captionkit caption`` decodes a batch.

``--flops``: how near the arithmetic's limit beam decoding runs. The floating-point operations
of its matrix products (``torch.utils.flop_counter``: mm, addmm, bmm; the attention energy's
C kernel and the elementwise work are not counted, so the rate is a lower bound), their rate,
and that rate as a share of this thread's float32 matmul peak (``speed.py``'s: the fastest
2048^3 product); then the products' shapes that take the most time, each with its own rate (the
profiler's count). A rate near the peak leaves nothing to win but fewer operations; a low one
is memory or overhead.
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


def report_flops(decode, n: int, dec_ms: float, top: int = 8) -> None:
    """Print beam decoding's matmul GFLOP a photo, their rate and the slowest shapes (--flops)."""
    import sys

    from torch.profiler import ProfilerActivity, profile
    from torch.utils.flop_counter import FlopCounterMode

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from speed import matmul_peak  # (here, not at the top: the old tree's runs need none of speed's imports)

    with FlopCounterMode(display=False) as counter:
        decode()
    gflop = counter.get_total_flops() / n / 1e9  # a photo
    peak = matmul_peak(torch.float32, 7) / 1e9  # speed.py's peak, on this one thread
    rate = gflop / (dec_ms / 1000)
    print(f"  beam decoding's matrix products: {gflop:.2f} GFLOP a photo, {rate:.1f} GFLOP/s = "
          f"{rate / peak:.0%} of this thread's float32 matmul peak (2048^3: {peak:.1f} GFLOP/s)")
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_flops=True) as prof:
        t = time.perf_counter()
        decode()
        wall_us = (time.perf_counter() - t) * 1e6  # the profiled decode (the profiler's overhead included)
    rows = [e for e in prof.key_averages(group_by_input_shape=True) if e.flops]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    in_products = sum(e.self_cpu_time_total for e in rows)
    print(f"  the products take {in_products / wall_us:.0%} of a profiled decode of {n} photos; "
          f"the {top} costliest shapes:")
    for e in rows[:top]:
        us = e.self_cpu_time_total
        shapes = " x ".join(str(tuple(s)) for s in e.input_shapes if s)
        print(f"    {e.key:<11} {shapes:<44} {e.count:4d} calls {us / 1000:8.1f} ms ({us / wall_us:4.0%})"
              f"  {e.flops / us / 1000:6.1f} GFLOP/s")


def main() -> None:
    from captionkit.data.images import load_rgb, to_tensor
    from captionkit.inference.captioner import Captioner

    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--model", help="default: the default model")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--flops", action="store_true", help="beam decoding's matmul GFLOP, their rate, the slowest shapes")
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
    if args.flops:
        report_flops(lambda: cap.decode_features(feats, beam=3), n, dec)


if __name__ == "__main__":
    main()
