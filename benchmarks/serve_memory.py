"""The server's memory under a flood of huge photos, loopback only, bounded in size and time.

    python benchmarks/serve_memory.py [--count 10] [--side 9400] [--limit-gb 2] [--server-args "..."]

Writes a --side x --side RGBA PNG of one colour (9400 x 9400: 88 million pixels, 370 KB, 353 MB
once decoded), starts `captionkit serve` on 127.0.0.1, sends --count uploads of it at once and
reports how each was answered and the server's peak resident memory (VmHWM from
/proc/PID/status) before and after, next to the worst case the server states in /v1/models.
Then checks that a sample photo is still captioned. Exits 1 if a request got no answer (no
status, or not the server's JSON), a good request failed, or the peak is over --limit-gb.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from PIL import Image
from serve_client import ROOT, Server, get_json, multipart, post

GB = 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=10, help="uploads sent at once")
    ap.add_argument("--side", type=int, default=9400)
    ap.add_argument("--limit-gb", type=float, default=2.0, help="the peak resident memory allowed")
    ap.add_argument("--server-args", default="", help="extra arguments for captionkit serve")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "huge.png"
        Image.new("RGBA", (args.side, args.side), (30, 120, 200, 255)).save(path)
        png = path.read_bytes()
    photo = (ROOT / "samples" / "chelsea.jpg").read_bytes()
    ok = True
    with Server(args.server_args.split(), env={"OMP_NUM_THREADS": "1"}) as server:
        stated = get_json(server.port, "/v1/models")["memory"]["worst_case_bytes"]
        before = server.memory("VmHWM")
        body = multipart({}, {"image": ("huge.png", png, "image/png")})
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.count) as pool:
            results = list(pool.map(lambda _: post(server.port, *body, timeout=600), range(args.count)))
        wall = time.perf_counter() - t0
        peak = server.memory("VmHWM")
        answers = Counter()
        for status, doc, _ in results:
            said = "caption" if status == 200 and doc and "caption" in doc else (doc or {}).get("error", "no JSON")
            answers[(status, said[:90])] += 1
            ok &= status == 200 and "caption" in (doc or {}) or (status in (400, 413, 503) and "error" in (doc or {}))
        print(f"{args.count} concurrent uploads of a {args.side}x{args.side} RGBA PNG ({len(png) / 1e3:.0f} KB), "
              f"answered in {wall:.1f} s:")
        for (status, said), n in sorted(answers.items()):
            print(f"  {n} x {status}: {said}")
        print(f"server peak resident memory (VmHWM): {before / GB:.2f} GB before, {peak / GB:.2f} GB after "
              f"(limit {args.limit_gb:g} GB; worst case stated in /v1/models: {stated / GB:.2f} GB); "
              f"now {server.memory('VmRSS') / GB:.2f} GB resident")
        ok &= peak < args.limit_gb * GB
        status, doc, secs = post(server.port, *multipart({}, {"image": ("chelsea.jpg", photo, "image/jpeg")}))
        print(f"then a sample photo: {status} {(doc or {}).get('caption', (doc or {}).get('error'))!r} "
              f"in {secs * 1000:.0f} ms")
        ok &= status == 200
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
