"""Soak test of `captionkit serve`: many clients, a mix of good, bad, huge and slow uploads, for minutes.
Loopback only, bounded in time (--minutes) and count (--max-requests).

    python benchmarks/soak.py [--minutes 10] [--clients 8] [--photos samples/] [--server-args "..."]

Starts the server on 127.0.0.1 (OMP_NUM_THREADS=1, an API key) and runs --clients clients, each
sending one request after another, drawn at random (seeded):
  good   the photos in --photos (JPEG or PNG), expected: 200 with a caption
  large  legitimate but huge photos -- a 9400x9400 RGBA PNG (88 Mpx, 370 KB) and a 6000x4000
         JPEG -- expected: 200, or 503 (busy) with its JSON error
  bad    a text file sent as a JPEG, a truncated JPEG, a zero-byte file, a text/plain part, a
         PNG whose header claims 20000x20000, an 11 MB body (oversize), a request without the
         API key, one with a wrong key -- expected: the 4xx JSON error each should get
  slow   a good photo sent in 8 pieces 0.4 s apart (expected: 200), and a body that stops
         half-way (expected: 408 once the server's --body-timeout, 30 s, passes)
  probe  GET /healthz (expected 200) and /readyz (200, or 503 when a queue is full)
Every answer must carry an X-Request-ID. It samples the server's resident memory (VmRSS), open
file descriptors (/proc/PID/fd) and threads (/proc/PID/status) every --sample-s seconds and
reports them at the start and the end and per minute, the requests and their status counts,
failures, latency percentiles, the peak (VmHWM) and the worst case the server states in
/v1/models. Exits 1 (FAIL) if a good request failed, any request got a wrong answer, any answer
was a 5xx other than the documented 503, the peak exceeds the stated worst case, the resident
floor (each minute's lowest sample) grew by more than --drift-mb from the first minute to the
last, or the descriptors or threads at the end exceed those at the start by more than
--fd-slack or --thread-slack.
"""

from __future__ import annotations

import argparse
import http.client
import io
import json
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
from serve_client import Server, add_client_args, get_json, multipart, percentile, photo_files

GB = 1e9
KEY = "soak-" + os.urandom(8).hex()


def png_header(w: int, h: int) -> bytes:
    """A PNG that claims w x h RGBA and holds almost no data (refused from its header)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 6, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def build_requests(photos: list[Path], beam: int) -> list[tuple[str, str, float, tuple, str, int | None]]:
    """(kind, name, weight, (body, content type), how it is sent, expected status or None for
    200-or-503). How: "key" (the right API key), "no-key", "wrong-key", "slow" (in pieces),
    "stall" (half the body, then silence), "get" (body is the path)."""
    def upload(name, data, ctype="image/jpeg"):
        return multipart({"beam": beam}, {"image": (name, data, ctype)})
    reqs = [("good", p.name, 80 / len(photos),
             upload(p.name, p.read_bytes(), "image/png" if p.suffix.lower() == ".png" else "image/jpeg"), "key", 200)
            for p in photos]
    with tempfile.TemporaryDirectory() as tmp:
        huge = Path(tmp) / "huge.png"
        Image.new("RGBA", (9400, 9400), (30, 120, 200, 255)).save(huge)
        reqs.append(("large", "9400x9400 RGBA PNG", 1.0, upload("huge.png", huge.read_bytes(), "image/png"), "key",
                     None))
    big = io.BytesIO()
    Image.open(photos[0]).convert("RGB").resize((6000, 4000)).save(big, "JPEG", quality=85)
    reqs.append(("large", "6000x4000 JPEG", 2.0, upload("big.jpg", big.getvalue()), "key", None))
    photo = photos[0].read_bytes()
    good = upload(photos[0].name, photo)
    reqs += [
        ("bad", "text as image/jpeg", 2.0, upload("a.jpg", b"just some text" * 50), "key", 400),
        ("bad", "truncated JPEG", 2.0, upload("t.jpg", photo[: len(photo) // 3]), "key", 400),
        ("bad", "zero-byte file", 2.0, upload("z.jpg", b""), "key", 400),
        ("bad", "text/plain part", 2.0, upload("a.txt", photo, "text/plain"), "key", 415),
        ("bad", "PNG header 20000x20000", 2.0, upload("bomb.png", png_header(20000, 20000), "image/png"), "key", 400),
        ("bad", "11 MB body", 1.0, upload("big.jpg", os.urandom(11 * 2 ** 20)), "key", 413),
        ("bad", "no API key", 2.0, good, "no-key", 401),
        ("bad", "wrong API key", 2.0, good, "wrong-key", 401),
        ("slow", "photo in 8 pieces", 2.0, good, "slow", 200),
        ("slow", "body stalls half-way", 0.3, good, "stall", 408),
        ("probe", "/healthz", 1.0, (b"/healthz", ""), "get", 200),
        ("probe", "/readyz", 1.0, (b"/readyz", ""), "get", None),
    ]
    return reqs


def send(port: int, body: bytes, ctype: str, how: str) -> tuple[int, dict | None, float, str | None]:
    """(status, JSON answer or None, seconds, X-Request-ID or None); status 0 when the connection
    failed."""
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    try:
        if how == "get":
            conn.request("GET", body.decode())
        else:
            conn.putrequest("POST", "/v1/caption")
            key = {"key": KEY, "slow": KEY, "stall": KEY, "wrong-key": "not-" + KEY}.get(how)
            if key:
                conn.putheader("Authorization", f"Bearer {key}")
            conn.putheader("Content-Type", ctype)
            conn.putheader("Content-Length", str(len(body)))
            conn.endheaders()
            if how == "slow":
                step = -(-len(body) // 8)
                for i in range(0, len(body), step):
                    conn.send(body[i:i + step])
                    time.sleep(0.4)
            elif how == "stall":
                conn.send(body[: len(body) // 2])  # and then nothing: the server's body timeout answers
            else:
                conn.send(body)
        r = conn.getresponse()
        raw = r.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        return r.status, doc, time.perf_counter() - t0, r.getheader("x-request-id")
    except OSError as e:
        return 0, {"error": f"connection failed: {e}"}, time.perf_counter() - t0, None
    finally:
        conn.close()


def proc_figures(pid: int) -> tuple[int, int, int]:
    """The server's (VmRSS bytes, open file descriptors, threads), from /proc."""
    rss = threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd")), threads


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0)
    add_client_args(ap)
    ap.add_argument("--max-requests", type=int, default=200_000, help="stop after this many requests")
    ap.add_argument("--sample-s", type=float, default=2.0, help="seconds between samples of the server")
    ap.add_argument("--drift-mb", type=float, default=100.0, help="allowed growth of the resident floor")
    ap.add_argument("--fd-slack", type=int, default=8, help="allowed growth of open descriptors, start to end")
    ap.add_argument("--thread-slack", type=int, default=4, help="allowed growth of threads, start to end "
                                                                "(the decode threads start on first use)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    photos = photo_files(args.photos)
    reqs = build_requests(photos, args.beam)
    weights = [r[2] for r in reqs]
    auth = {"Authorization": f"Bearer {KEY}"}
    results: list[tuple] = []  # t, kind, name, status, right, s, error, request id
    samples: list[tuple[float, int, int, int]] = []  # t, VmRSS, fds, threads
    lock = threading.Lock()
    env = {"OMP_NUM_THREADS": "1", "CAPTIONKIT_API_KEY": KEY}
    with Server(args.server_args.split(), env=env) as server:
        stated = get_json(server.port, "/v1/models", auth)["memory"]["worst_case_bytes"]
        pid = server.proc.pid
        start = proc_figures(pid)
        t0 = time.time()
        deadline = t0 + args.minutes * 60
        done = threading.Event()

        def sampler():
            while not done.wait(args.sample_s):
                samples.append((time.time() - t0, *proc_figures(pid)))

        def client(i: int):
            rng = random.Random(args.seed * 1000 + i)
            while time.time() < deadline:
                with lock:
                    if len(results) >= args.max_requests:
                        return
                kind, name, _, (body, ctype), how, expected = rng.choices(reqs, weights)[0]
                status, doc, secs, rid = send(server.port, body, ctype, how)
                is_json = isinstance(doc, dict) and ("caption" in doc or "error" in doc or kind == "probe")
                if expected is None:
                    right = is_json and status in (200, 503)
                else:
                    right = is_json and status == expected
                right = right and bool(rid)  # every answer carries its request id
                error = "" if status == 200 else str((doc or {}).get("error", doc or "no JSON"))[:100]
                with lock:
                    results.append((time.time() - t0, kind, name, status, right, secs, error, rid))

        samples.append((0.0, *start))
        watcher = threading.Thread(target=sampler, daemon=True)
        watcher.start()
        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(client, range(args.clients)))
        done.set()
        watcher.join()
        wall = time.time() - t0
        time.sleep(1.0)  # the last connections close
        end = proc_figures(pid)
        peak = server.memory("VmHWM")
        log = server.output()
    return report(args, results, samples, wall, peak, stated, log, start, end)


def report(args, results, samples, wall, peak, stated, log, start, end) -> int:
    by_kind = defaultdict(list)
    for r in results:
        by_kind[r[1]].append(r)
    good = by_kind["good"]
    good_failed = [r for r in good if not r[4]]
    wrong = [r for r in results if not r[4]]
    server_errors = [r for r in results if r[3] >= 500 and r[3] != 503]
    print(f"soak: {args.clients} clients for {wall / 60:.1f} min against captionkit serve on 127.0.0.1 "
          f"(server OMP_NUM_THREADS=1, beam {args.beam}): {len(results)} requests, {len(results) / wall:.2f}/s")
    print(f"  status counts: {', '.join(f'{s} x {n}' for s, n in sorted(Counter(r[3] for r in results).items()))}")
    print(f"  good photos: {len(good)}, failed {len(good_failed)}")
    for kind in ("good", "large", "slow"):
        lat = sorted(r[5] * 1000 for r in by_kind[kind] if r[3] == 200)
        if lat:
            print(f"  {kind} latency (200s): p50 {statistics.median(lat):.0f} ms, p95 {percentile(lat, 0.95):.0f} ms, "
                  f"max {lat[-1]:.0f} ms")
    answers = Counter((r[1], r[2], r[3], r[6] if r[3] != 200 else "") for r in results if r[1] != "good")
    for (kind, name, status, error), n in sorted(answers.items()):
        print(f"  {kind:5s} {name:24s} {n:5d} x {status} {error}")
    print(f"  answers without an X-Request-ID: {sum(1 for r in results if not r[7])}")
    if wrong:
        print(f"  WRONG ANSWERS: {len(wrong)}, e.g. {wrong[:3]}")
    if server_errors:
        print(f"  5xx OTHER THAN 503: {len(server_errors)}, e.g. {server_errors[:3]}")
    full = max(1, int(wall // 60))  # whole minutes; the last, partial one counts with the one before

    def minute_of(t: float) -> int:
        return min(int(t // 60), full - 1)
    minutes = defaultdict(list)
    for sample in samples:
        minutes[minute_of(sample[0])].append(sample[1:])
    counts = Counter(minute_of(r[0]) for r in results)
    print("  server per minute: requests; resident memory (VmRSS) lowest .. highest sample; most open fds; "
          "most threads")
    for m in sorted(minutes):
        rss = [s[0] for s in minutes[m]]
        print(f"    minute {m + 1:2d}: {counts.get(m, 0):5d} requests, {min(rss) / GB:.2f} .. {max(rss) / GB:.2f} GB, "
              f"{max(s[1] for s in minutes[m])} fds, {max(s[2] for s in minutes[m])} threads")
    first, last = min(minutes), max(minutes)
    drift = (min(s[0] for s in minutes[last]) - min(s[0] for s in minutes[first])) / 1e6
    print(f"  server at start / at end: VmRSS {start[0] / GB:.2f} / {end[0] / GB:.2f} GB, open fds {start[1]} / "
          f"{end[1]}, threads {start[2]} / {end[2]}")
    print(f"  resident floor from minute {first + 1} to {last + 1}: {drift:+.0f} MB; peak (VmHWM) "
          f"{peak / GB:.2f} GB; worst case stated in /v1/models {stated / GB:.2f} GB")
    tracebacks = log.count("Traceback")
    print(f"  tracebacks in the server log: {tracebacks}")
    flat = end[1] <= start[1] + args.fd_slack and end[2] <= start[2] + args.thread_slack
    ok = (not good_failed and not wrong and not server_errors and peak < stated and drift <= args.drift_mb
          and tracebacks == 0 and flat)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
