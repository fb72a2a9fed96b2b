"""The Ray engine against the local engine: ``captionkit caption --jsonl`` on Flickr8k images,
each engine as the user runs it (a fresh command, start-up included), in one run on this machine.

    OMP_NUM_THREADS=1 nice python benchmarks/ray_engine.py [--images N] [--replicas R]

Prints, per engine: wall seconds (start-up included), images/s, the peak memory of all its
processes together (the sum of their proportional set sizes, PSS, sampled every 0.5 s: shared
pages such as Ray's object store are counted once), and the Ray/local ratios; whether the two
JSONL files are identical; then the per-image encoder and decoder costs
(benchmarks/speed.py's captioning measurement) that docs/scale.md's cost model uses.
On 2 CPU cores the Ray engine shows its overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
FLICKR = ROOT.parent / "shared" / "data" / "flickr8k" / "Flicker8k_Dataset"


def tree_pss(proc: psutil.Process) -> int:
    """Bytes of proportional set size of ``proc`` and all its descendants (Ray's raylet, GCS
    and workers are the driver's descendants)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def run(cmd: list[str]) -> tuple[float, int, int]:
    """(wall seconds, peak PSS bytes of the process tree, exit status) of ``cmd``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ps, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        peak = max(peak, tree_pss(ps))
        time.sleep(0.5)
    wall = time.perf_counter() - t0
    err = proc.stderr.read()
    if proc.returncode not in (0, 1):  # 1: some images unreadable (recorded in the JSONL)
        sys.exit(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{err[-2000:]}")
    return wall, peak, proc.returncode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=8000, help="the first N Flickr8k images, sorted (default all)")
    ap.add_argument("--replicas", type=int, default=1, help="--replicas of the Ray engine")
    ap.add_argument("--no-costs", action="store_true", help="skip the per-image encoder/decoder costs")
    ap.add_argument("--model", default="transformer-lite2-flickr8k",
                    help="the model both engines run (default the fast single model, which the figures in "
                         "docs/scale.md used; the default captioner is an ensemble at about 2.2x its cost)")
    args = ap.parse_args()
    if not FLICKR.is_dir():
        sys.exit(f"{FLICKR}: not found (the Flickr8k images)")
    images = sorted(FLICKR.glob("*.jpg"))[:args.images]
    print(f"{len(images)} Flickr8k images, model {args.model}, beam 3, batch 16, {os.cpu_count()} CPUs")
    with tempfile.TemporaryDirectory() as tmp:
        listing = [str(FLICKR)] if args.images >= len(list(FLICKR.glob("*.jpg"))) else list(map(str, images))
        base = [sys.executable, "-m", "captionkit.cli.main", "caption", *listing, "--model", args.model]
        rows = {}
        for engine, extra in (("local", []), ("ray", ["--engine", "ray", "--replicas", str(args.replicas)])):
            out = Path(tmp) / f"{engine}.jsonl"
            wall, peak, _ = run([*base, "--jsonl", str(out), *extra])
            rows[engine] = (wall, peak, out.read_text())
            print(f"{engine:>5}: {wall:7.1f} s, {len(images) / wall:6.2f} images/s, peak memory {peak / 2**20:7.0f} MiB"
                  f" (all processes, PSS)", flush=True)
        (lw, lp, ltext), (rw, rp, rtext) = rows["local"], rows["ray"]
        print(f"ray / local: {lw / rw:.2f}x the images/s, {rp / lp:.2f}x the peak memory")
        print(f"identical JSONL: {ltext == rtext} ({len(ltext.splitlines())} lines)")
    if not args.no_costs:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        sys.path.insert(0, str(ROOT / "src"))
        import torch
        from speed import bench_captioning

        torch.set_num_threads(1)
        c = bench_captioning(64, model=args.model)
        print(f"per image, 1 thread, batch 16, beam 3: encoder {c['encoder ms/image']:.1f} ms, "
              f"decoder {c['decoding ms/image']:.1f} ms; end to end {c['images/s']:.2f} images/s")


if __name__ == "__main__":
    main()
