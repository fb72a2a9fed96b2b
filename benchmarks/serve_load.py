"""Load check of `captionkit serve`, loopback only, bounded in size and time.

    python benchmarks/serve_load.py --requests 400 --clients 8 [--photos DIR]

Starts the server on 127.0.0.1 (a free port), sends --requests caption requests from --clients
concurrent clients (photos from --photos, default samples/), and reports failures, p50/p95
latency and requests/s. Then, while one client keeps sending good requests, it sends bad
ones -- non-images, truncated files, zero-byte files, a 60 MB upload, wrong part and body
content types -- and checks each gets a 4xx JSON error and every good request still succeeds.
Last, it opens a connection that sends nothing and times how long the server keeps it open.
Exits 1 if any check fails (or the idle connection stays open 60 s).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from serve_client import Server, add_client_args, multipart, percentile, photo_files, post


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400)
    add_client_args(ap)
    ap.add_argument("--big-mb", type=float, default=60.0, help="size of the oversized upload")
    args = ap.parse_args()
    photos = photo_files(args.photos)
    blobs = [(p.name, p.read_bytes()) for p in photos]
    ok = True
    with Server(args.server_args.split()) as server:
        port = server.port
        good_bodies = [multipart({"beam": args.beam}, {"image": (n, d, "image/jpeg")}) for n, d in blobs]

        # 1. throughput and latency
        def one(i):
            return post(port, *good_bodies[i % len(good_bodies)])
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            res = list(pool.map(one, range(args.requests)))
        wall = time.perf_counter() - t0
        failed = [r for r in res if r[0] != 200 or not r[1] or "caption" not in r[1]]
        lat = sorted(r[2] * 1000 for r in res)
        p95 = percentile(lat, 0.95)
        print(f"{args.requests} requests, {args.clients} concurrent clients, beam {args.beam}: "
              f"{len(failed)} failed; latency p50 {statistics.median(lat):.0f} ms, p95 {p95:.0f} ms; "
              f"{args.requests / wall:.2f} requests/s")
        ok &= not failed

        # 2. bad requests while a good client keeps going
        photo = blobs[0][1]
        bad = {
            "non-image (text as image/jpeg)": multipart({}, {"image": ("a.jpg", b"just some text" * 50, "image/jpeg")}),
            "truncated JPEG": multipart({}, {"image": ("t.jpg", photo[: len(photo) // 3], "image/jpeg")}),
            "zero-byte file": multipart({}, {"image": ("z.jpg", b"", "image/jpeg")}),
            f"{args.big_mb:g} MB upload": multipart({}, {"image": ("big.jpg", os.urandom(int(args.big_mb * 2 ** 20)),
                                                                   "image/jpeg")}),
            "part type text/plain": multipart({}, {"image": ("a.txt", photo, "text/plain")}),
            "part type application/pdf": multipart({}, {"image": ("a.pdf", b"%PDF-1.4", "application/pdf")}),
            "body application/json": (b'{"image": "x"}', "application/json"),
            "body text/plain": (b"hello", "text/plain"),
            "multipart without boundary": (b"xyz", "multipart/form-data"),
        }
        stop = threading.Event()
        good_results = []

        def good_client():
            while not stop.is_set():
                good_results.append(post(port, *good_bodies[len(good_results) % len(good_bodies)]))
        t = threading.Thread(target=good_client)
        t.start()
        for name, (body, ctype) in bad.items():
            status, doc, secs = post(port, body, ctype)
            fine = 400 <= status < 500 and isinstance(doc, dict) and "error" in doc
            ok &= fine
            print(f"  {name:32s} -> {status} {'JSON' if doc else 'not JSON'} in {secs * 1000:.0f} ms: "
                  f"{(doc or {}).get('error', '')[:70]}{'' if fine else '   <-- FAIL'}")
        time.sleep(1.0)
        stop.set()
        t.join()
        good_ok = sum(r[0] == 200 for r in good_results)
        print(f"concurrent good client: {good_ok} of {len(good_results)} requests succeeded meanwhile")
        ok &= good_ok == len(good_results) and good_ok > 0
        status, doc, _ = post(port, *good_bodies[0])
        ok &= status == 200
        print(f"after the bad requests: {status}, {'server still serving' if status == 200 else 'FAIL'}")

        # 3. a connection that sends nothing is closed (the server's --header-timeout)
        with socket.create_connection(("127.0.0.1", port)) as idle:
            idle.settimeout(120)
            t0 = time.perf_counter()
            closed = idle.recv(1) == b""
            secs = time.perf_counter() - t0
        print(f"idle connection: {'closed' if closed else 'answered'} after {secs:.1f} s"
              f"{'' if closed and secs < 60 else '   <-- FAIL'}")
        ok &= closed and secs < 60
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
