"""Batch captioning of a large folder: `captionkit caption DIR --jsonl OUT` against a
one-image-at-a-time loop, its peak memory, and a kill-and-resume check.

    python benchmarks/batch_caption.py --n 8000 --dataset ../shared/data/flickr8k [--loop-n 200]

Links the first N Flickr8k images (all splits) into a temporary folder, then in one run:
1. a one-image-at-a-time loop in this process (load, encode, beam search per photo) over the
   first --loop-n images: images/s;
2. `captionkit caption DIR --jsonl A` as a child process: images/s (start-up included) and
   its peak resident memory (ru_maxrss);
3. the same command into B, killed with SIGKILL after --kill-after lines, then run again:
   B must equal A line for line.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def run(cmd, env) -> tuple[float, float]:
    """-> (seconds, the child's peak RSS in MB)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, check=False, stdout=subprocess.DEVNULL)
    secs = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return secs, max(peak, before) / 1024  # ru_maxrss of the largest child so far (KB on Linux)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=8000)
    ap.add_argument("--dataset", default=str(ROOT.parent / "shared" / "data" / "flickr8k"))
    ap.add_argument("--loop-n", type=int, default=200, help="images for the one-at-a-time loop")
    ap.add_argument("--beam", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--kill-after", type=int, default=0, help="lines before the kill (default: N / 3)")
    args = ap.parse_args()
    import torch

    from captionkit.cli.main import tune_allocator
    from captionkit.data.images import load_rgb, to_tensor
    from captionkit.inference.captioner import Captioner

    images = sorted((Path(args.dataset) / "Flicker8k_Dataset").glob("*.jpg"))[:args.n]
    tmp = Path(tempfile.mkdtemp(prefix="captionkit-batch-"))
    folder = tmp / "images"
    folder.mkdir()
    for p in images:
        (folder / p.name).symlink_to(p.resolve())
    n = len(images)
    print(f"{n} images in {folder}; beam {args.beam}, batch {args.batch_size}, {args.workers} reader threads, "
          f"torch threads {torch.get_num_threads()}")

    # 1. one image at a time, in this process
    tune_allocator()
    cap = Captioner.load(device="cpu")
    loop = images[:args.loop_n]
    t0 = time.perf_counter()
    for p in loop:
        x = to_tensor(load_rgb(p), cap.encoder.preprocess)
        cap.result(cap.decode_features(cap.encode_batch([x]), beam=args.beam)[0])
    loop_rate = len(loop) / (time.perf_counter() - t0)
    print(f"one image at a time: {loop_rate:.2f} images/s ({len(loop)} images)")
    del cap

    env = {**os.environ}
    cmd = [sys.executable, "-m", "captionkit", "caption", str(folder), "--beam", str(args.beam),
           "--batch-size", str(args.batch_size), "--workers", str(args.workers)]
    # 2. the batch command, uninterrupted
    a = tmp / "a.jsonl"
    secs, peak = run(cmd + ["--jsonl", str(a)], env)
    print(f"captionkit caption --jsonl: {n / secs:.2f} images/s ({secs:.1f} s for {n} images, start-up included), "
          f"{n / secs / loop_rate:.2f}x the one-at-a-time loop; peak RSS {peak:.0f} MB")

    # 3. kill and resume
    b = tmp / "b.jsonl"
    kill_after = args.kill_after or max(1, n // 3)
    p = subprocess.Popen(cmd + ["--jsonl", str(b)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while p.poll() is None and (not b.exists() or b.read_bytes().count(b"\n") < kill_after):
        time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait()
    lines_at_kill = b.read_bytes().count(b"\n")
    torn = b.exists() and not b.read_bytes().endswith(b"\n") and b.stat().st_size > 0
    r = subprocess.run(cmd + ["--jsonl", str(b)], env=env, capture_output=True, text=True)
    same = b.read_bytes() == a.read_bytes()
    total_lines = a.read_bytes().count(b"\n")
    print(f"kill -9 after {lines_at_kill} lines{' (a torn last line)' if torn else ''}, then resumed: "
          f"output {'IDENTICAL to' if same else 'DIFFERENT from'} the uninterrupted run "
          f"({total_lines} lines)")
    print("resume stderr:", r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "")
    print(f"outputs kept in {tmp}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
