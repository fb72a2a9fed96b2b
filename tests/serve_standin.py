"""`captionkit serve` with a shipped model made slow on purpose, for the drain and readiness
tests (tests/test_serve_drain.py): a real server process, its real code path, with

    --load-delay S      seconds added before the models load (so /readyz can be seen at 503)
    --caption-delay S   seconds added to every batch of requests the model captions (so requests stay in flight)

    python tests/serve_standin.py --load-delay 3 --caption-delay 1.5 -- --port 0 [serve options...]

The captions are the model's own; only the time they take is stretched.
"""

from __future__ import annotations

import argparse
import functools
import sys
import threading
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--load-delay", type=float, default=0.0)
    ap.add_argument("--caption-delay", type=float, default=0.0)
    ap.add_argument("serve_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    rest = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args

    import captionkit.serve.app as serve_app
    from captionkit.cli.main import main as cli
    from captionkit.inference.captioner import Captioner

    load_models = serve_app.load_models

    @functools.wraps(load_models)
    def slow_load(*a, **k):
        time.sleep(args.load_delay)
        return load_models(*a, **k)

    decode = Captioner.decode_chosen  # what the server's worker decodes a group with

    @functools.wraps(decode)
    def slow_decode(self, *a, **k):
        if threading.current_thread().name != "captionkit-load":  # not the warm-up: requests only
            time.sleep(args.caption_delay)  # on the model's worker thread, as a slow model would be
        return decode(self, *a, **k)

    serve_app.load_models = slow_load
    Captioner.decode_chosen = slow_decode
    return cli(["serve", *rest])


if __name__ == "__main__":
    sys.exit(main())
