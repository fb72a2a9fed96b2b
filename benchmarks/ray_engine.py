"""The Ray engine against the local engine: ``captionkit caption FOLDER --jsonl`` on Flickr8k images,
each engine as the user runs it (a fresh command, start-up included), in one run on this machine.

    python benchmarks/ray_engine.py [--images N] [--model M] [--precision P] [--replicas R] [--threads T]
                                    [--old-src OLD/src]

Prints, per engine: wall seconds (start-up included), images/s, the peak memory of all its
processes together, and the Ray/local ratios; whether the two JSONL files are identical; then
(unless --no-costs) the per-image encoder and decoder costs (benchmarks/speed.py's captioning
measurement) that docs/scale.md's cost model uses.

Memory: every second the command's process and all its descendants (for Ray: the driver, the
GCS, the raylet, Ray's agents and monitors, and the replica workers, all started by the
command) are read from /proc (psutil ``memory_full_info``) and their proportional set sizes
(PSS) summed: pages shared by several processes (libtorch, Ray's object store) are counted
once, split between them. The peak of that sum is reported, with the processes it was made
of. --old-src runs the Ray engine a second time from another checkout's src/ (e.g. a
``git worktree add /tmp/old HEAD~N``), so the old figure stands beside the new in the same run.
The model is the shipped default (the flip-averaged ensemble) unless --model says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
FLICKR = ROOT.parent / "shared" / "data" / "flickr8k" / "Flicker8k_Dataset"
if not FLICKR.is_dir():
    FLICKR = Path("/work/shared/data/flickr8k/Flicker8k_Dataset")


def kind(p: psutil.Process) -> str:
    """A short name for a process of the tree (what it is to Ray)."""
    try:
        cmd = " ".join(p.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    for key in ("gcs_server", "raylet", "log_monitor.py", "monitor.py", "dashboard.py", "DashboardAgent",
                "RuntimeEnvAgent", "MapWorker", "Replica", "IDLE", "captionkit.cli.main"):
        if key in cmd:
            return key
    return cmd.split()[0].rsplit("/", 1)[-1][:30] if cmd else "?"


def tree_pss(proc: psutil.Process) -> tuple[int, Counter]:
    """Bytes of proportional set size of ``proc`` and all its descendants, and per kind."""
    parts: Counter = Counter()
    for p in [proc, *proc.children(recursive=True)]:
        try:
            parts[kind(p)] += p.memory_full_info().pss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return sum(parts.values()), parts


def run(cmd: list[str], src: Path, threads: int | None) -> tuple[float, int, Counter]:
    """(wall seconds, peak PSS bytes of the process tree, its parts at the peak) of ``cmd``."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    ps, peak, at_peak = psutil.Process(proc.pid), 0, Counter()
    while proc.poll() is None:
        total, parts = tree_pss(ps)
        if total > peak:
            peak, at_peak = total, parts
        time.sleep(1.0)
    wall = time.perf_counter() - t0
    err = proc.stderr.read()
    if proc.returncode not in (0, 1):  # 1: some images unreadable (recorded in the JSONL)
        sys.exit(f"{' '.join(cmd[:6])} ... failed ({proc.returncode}):\n{err[-2000:]}")
    return wall, peak, at_peak


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=8000, help="the first N Flickr8k images, sorted (default all)")
    ap.add_argument("--replicas", type=int, help="--replicas of the Ray engine (default: its own default)")
    ap.add_argument("--batch-size", type=int, help="--batch-size of both engines (default: their default, 16)")
    ap.add_argument("--threads", type=int, help="OMP_NUM_THREADS for both engines (default: unset, torch's own)")
    ap.add_argument("--model", help="the model both engines run (default: the shipped default captioner)")
    ap.add_argument("--precision", help="--precision of both engines (default: the command's, auto)")
    ap.add_argument("--old-src", type=Path, help="also run the Ray engine from this src/ (an older checkout's)")
    ap.add_argument("--only", choices=("local", "ray"), help="run one engine only (no ratios)")
    ap.add_argument("--no-costs", action="store_true", help="skip the per-image encoder/decoder costs")
    ap.add_argument("--out", type=Path, help="keep the JSONL files and each engine's figures here; a rerun skips the "
                                             "engines already measured (an engine cut short is run again whole)")
    args = ap.parse_args()
    if not FLICKR.is_dir():
        sys.exit(f"{FLICKR}: not found (the Flickr8k images)")
    everything = sorted(FLICKR.glob("*.jpg"))
    images = everything[:args.images]
    print(f"{len(images)} Flickr8k images, model {args.model or 'the default'}, batch {args.batch_size or 16}, "
          f"precision {args.precision or 'auto'}, "
          f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={args.threads or 'unset'}, load average "
          f"{os.getloadavg()[0]:.1f} at start", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        keep = args.out or Path(tmp)
        keep.mkdir(parents=True, exist_ok=True)
        done_file = keep / "figures.json"
        done = json.loads(done_file.read_text()) if done_file.exists() else {}
        listing = [str(FLICKR)] if len(images) == len(everything) else list(map(str, images))
        base = [sys.executable, "-m", "captionkit.cli.main", "caption", *listing,
                *(["--model", args.model] if args.model else []),
                *(["--batch-size", str(args.batch_size)] if args.batch_size else []),
                *(["--precision", args.precision] if args.precision else [])]
        ray = ["--engine", "ray", *(["--replicas", str(args.replicas)] if args.replicas else [])]
        engines = [("local", [], ROOT / "src"), ("ray", ray, ROOT / "src")]
        if args.old_src:
            engines.append(("ray old", ray, args.old_src.resolve()))
        if args.only:
            engines = [e for e in engines if e[0] == args.only]
        rows = {}
        for engine, extra, src in engines:
            out = keep / f"{engine.replace(' ', '-')}.jsonl"
            if engine in done and out.exists() and done[engine]["images"] == len(images):
                wall, peak, parts = done[engine]["wall"], done[engine]["peak"], Counter(done[engine]["parts"])
                print(f"{engine:>7}: measured before ({done_file})")
            else:
                for stale in (out, Path(str(out) + ".shards")):  # a run cut short: its timing is lost, start again
                    if stale.is_dir():
                        shutil.rmtree(stale)
                    elif stale.exists():
                        stale.unlink()
                wall, peak, parts = run([*base, "--jsonl", str(out), *extra], src, args.threads)
                done[engine] = {"wall": wall, "peak": peak, "parts": dict(parts), "images": len(images),
                                "load_average_at_end": os.getloadavg()[0]}
                done_file.write_text(json.dumps(done, indent=1))
            rows[engine] = (wall, peak, out.read_text())
            print(f"{engine:>7}: {wall:7.1f} s, {len(images) / wall:6.2f} images/s, peak memory {peak / 2**20:7.0f} MiB"
                  f" (all processes, PSS; load average {done[engine]['load_average_at_end']:.1f} at the end)",
                  flush=True)
            print("         at the peak: " + ", ".join(f"{k} {v / 2**20:.0f}" for k, v in parts.most_common()),
                  flush=True)
        if "local" in rows:
            lw, lp, ltext = rows["local"]
            for engine in (e for e in rows if e != "local"):
                rw, rp, rtext = rows[engine]
                print(f"{engine} / local: {lw / rw:.2f}x the images/s, {rp / lp:.2f}x the peak memory; "
                      f"identical JSONL: {ltext == rtext} ({len(ltext.splitlines())} lines)", flush=True)
    if not args.no_costs:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        sys.path.insert(0, str(ROOT / "src"))
        import torch
        from speed import bench_captioning

        if args.threads:
            torch.set_num_threads(args.threads)
        c = bench_captioning(64, **({"model": args.model} if args.model else {}))
        print(f"per image, {torch.get_num_threads()} threads, batch 16: encoder {c['encoder ms/image']:.1f} ms, "
              f"decoder {c['decoding ms/image']:.1f} ms; end to end {c['images/s']:.2f} images/s")


if __name__ == "__main__":
    main()
