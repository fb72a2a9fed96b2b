"""Soak test of `captionkit serve`: many clients, a mix of good, bad and huge uploads, for minutes.
Loopback only, bounded in time (--minutes) and count (--max-requests).

    python benchmarks/soak.py [--minutes 10] [--clients 8] [--photos samples/] [--server-args "..."]

Starts the server on 127.0.0.1 (OMP_NUM_THREADS=1, an API key) and runs --clients clients, each
sending one request after another, drawn at random (seeded):
  good   the photos in --photos (JPEG or PNG), expected: 200 with a caption
  large  legitimate but huge photos -- a 9400x9400 RGBA PNG (88 Mpx, 370 KB) and a 6000x4000
         JPEG -- expected: 200, or 503 (busy) with its JSON error
  bad    a text file sent as a JPEG, a truncated JPEG, a zero-byte file, a text/plain part, a
         PNG whose header claims 20000x20000, an 11 MB body, a request without the API key --
         expected: the 4xx JSON error each should get
It samples the server's resident memory (VmRSS from /proc/PID/status) every --sample-s seconds
and reports failures, latency percentiles, memory per minute, the peak (VmHWM) and the worst
case the server states in /v1/models. Exits 1 if a good request failed, any request got a wrong
answer, the peak exceeds the stated worst case, or the resident floor (each minute's lowest
sample) grew by more than --drift-mb from the first minute to the last.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import statistics
import struct
import sys
import tempfile
import threading
import time
import zlib
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image
from serve_client import Server, add_client_args, get_json, multipart, percentile, photo_files, post

GB = 1e9
KEY = "soak-" + os.urandom(8).hex()


def png_header(w: int, h: int) -> bytes:
    """A PNG that claims w x h RGBA and holds almost no data (refused from its header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 6, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def build_requests(photos: list[Path], beam: int) -> list[tuple[str, str, float, tuple, int | None]]:
    """(kind, name, weight, (body, content type), expected status or None for 200-or-503)."""
    def upload(name, data, ctype="image/jpeg"):
        return multipart({"beam": beam}, {"image": (name, data, ctype)})
    reqs = [("good", p.name, 80 / len(photos),
             upload(p.name, p.read_bytes(), "image/png" if p.suffix.lower() == ".png" else "image/jpeg"), 200)
            for p in photos]
    with tempfile.TemporaryDirectory() as tmp:
        huge = Path(tmp) / "huge.png"
        Image.new("RGBA", (9400, 9400), (30, 120, 200, 255)).save(huge)
        reqs.append(("large", "9400x9400 RGBA PNG", 1.0, upload("huge.png", huge.read_bytes(), "image/png"), None))
    big = io.BytesIO()
    Image.open(photos[0]).convert("RGB").resize((6000, 4000)).save(big, "JPEG", quality=85)
    reqs.append(("large", "6000x4000 JPEG", 2.0, upload("big.jpg", big.getvalue()), None))
    photo = photos[0].read_bytes()
    reqs += [
        ("bad", "text as image/jpeg", 2.0, upload("a.jpg", b"just some text" * 50), 400),
        ("bad", "truncated JPEG", 2.0, upload("t.jpg", photo[: len(photo) // 3]), 400),
        ("bad", "zero-byte file", 2.0, upload("z.jpg", b""), 400),
        ("bad", "text/plain part", 2.0, upload("a.txt", photo, "text/plain"), 415),
        ("bad", "PNG header 20000x20000", 2.0, upload("bomb.png", png_header(20000, 20000), "image/png"), 400),
        ("bad", "11 MB body", 1.0, upload("big.jpg", os.urandom(11 * 2 ** 20)), 413),
        ("bad", "no API key", 2.0, upload(photos[0].name, photo), 401),
    ]
    return reqs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    add_client_args(ap)
    ap.add_argument("--max-requests", type=int, default=200_000, help="stop after this many requests")
    ap.add_argument("--sample-s", type=float, default=2.0, help="seconds between memory samples")
    ap.add_argument("--drift-mb", type=float, default=100.0, help="allowed growth of the resident floor")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    photos = photo_files(args.photos)
    reqs = build_requests(photos, args.beam)
    weights = [r[2] for r in reqs]
    auth = {"Authorization": f"Bearer {KEY}"}
    results: list[tuple[float, str, str, int, bool, float, str]] = []  # t, kind, name, status, right, s, error
    samples: list[tuple[float, int]] = []  # t, VmRSS
    lock = threading.Lock()
    env = {"OMP_NUM_THREADS": "1", "CAPTIONKIT_API_KEY": KEY}
    with Server(args.server_args.split(), env=env) as server:
        stated = get_json(server.port, "/v1/models", auth)["memory"]["worst_case_bytes"]
        t0 = time.time()
        deadline = t0 + args.minutes * 60
        done = threading.Event()

        def sampler():
            while not done.wait(args.sample_s):
                samples.append((time.time() - t0, server.memory("VmRSS")))

        def client(i: int):
            rng = random.Random(args.seed * 1000 + i)
            while time.time() < deadline:
                with lock:
                    if len(results) >= args.max_requests:
                        return
                kind, name, _, (body, ctype), expected = rng.choices(reqs, weights)[0]
                status, doc, secs = post(server.port, body, ctype, headers={} if expected == 401 else auth)
                is_json = isinstance(doc, dict) and ("caption" in doc or "error" in doc)
                if expected is None:
                    right = is_json and status in (200, 503)
                else:
                    right = is_json and status == expected
                error = "" if status == 200 else str((doc or {}).get("error", "no JSON"))[:100]
                with lock:
                    results.append((time.time() - t0, kind, name, status, right, secs, error))

        samples.append((0.0, server.memory("VmRSS")))
        watcher = threading.Thread(target=sampler, daemon=True)
        watcher.start()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(client, range(args.clients)))
        done.set()
        watcher.join()
        wall = time.time() - t0
        peak = server.memory("VmHWM")
        log = server.output()
    return report(args, results, samples, wall, peak, stated, log)


def report(args, results, samples, wall, peak, stated, log) -> int:
    by_kind = defaultdict(list)
    for r in results:
        by_kind[r[1]].append(r)
    good = by_kind["good"]
    good_failed = [r for r in good if not r[4]]
    wrong = [r for r in results if not r[4]]
    print(f"soak: {args.clients} clients for {wall / 60:.1f} min against captionkit serve on 127.0.0.1 "
          f"(server OMP_NUM_THREADS=1, beam {args.beam}): {len(results)} requests, {len(results) / wall:.2f}/s")
    print(f"  good photos: {len(good)}, failed {len(good_failed)}")
    for kind in ("good", "large"):
        lat = sorted(r[5] * 1000 for r in by_kind[kind] if r[3] == 200)
        if lat:
            print(f"  {kind} latency (200s): p50 {statistics.median(lat):.0f} ms, p95 {percentile(lat, 0.95):.0f} ms, "
                  f"max {lat[-1]:.0f} ms")
    answers = Counter((r[1], r[2], r[3], r[6] if r[3] != 200 else "") for r in results if r[1] != "good")
    for (kind, name, status, error), n in sorted(answers.items()):
        print(f"  {kind:5s} {name:24s} {n:5d} x {status} {error}")
    if wrong:
        print(f"  WRONG ANSWERS: {len(wrong)}, e.g. {wrong[:3]}")
    full = max(1, int(wall // 60))  # whole minutes; the last, partial one counts with the one before

    def minute_of(t: float) -> int:
        return min(int(t // 60), full - 1)
    minutes = defaultdict(list)
    for t, rss in samples:
        minutes[minute_of(t)].append(rss)
    counts = Counter(minute_of(r[0]) for r in results)
    print("  server resident memory (VmRSS) per minute: requests, lowest .. highest sample")
    for m in sorted(minutes):
        print(f"    minute {m + 1:2d}: {counts.get(m, 0):5d} requests, {min(minutes[m]) / GB:.2f} .. "
              f"{max(minutes[m]) / GB:.2f} GB")
    first, last = min(minutes), max(minutes)
    drift = (min(minutes[last]) - min(minutes[first])) / 1e6
    print(f"  resident floor from minute {first + 1} to {last + 1}: {drift:+.0f} MB; peak (VmHWM) "
          f"{peak / GB:.2f} GB; worst case stated in /v1/models {stated / GB:.2f} GB")
    tracebacks = log.count("Traceback")
    print(f"  tracebacks in the server log: {tracebacks}")
    ok = not good_failed and not wrong and peak < stated and drift <= args.drift_mb and tracebacks == 0
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
