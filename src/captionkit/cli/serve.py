"""The serve command: the HTTP API and web page (captionkit.serve), its options and the checks of
its limits, API key and listening socket before anything heavy loads."""

from __future__ import annotations

import argparse
import os
import sys

from ..inference.shipped import shipped_models_text
from .common import UsageError, _add_control_opts, _add_device_opts, _controls, _device


def _check_serve_limits(port: int, **limits: float | None) -> None:
    """serve's numeric options, each positive when given (by its option name in the message)."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {port}")
    for name, value in limits.items():
        if value is not None and not value > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value:g}")


def _serve_api_key(api_key: str | None) -> str | None:
    """--api-key, or $CAPTIONKIT_API_KEY when it is not given; printable ASCII without spaces."""
    import re

    if api_key is None:
        api_key = os.environ.get("CAPTIONKIT_API_KEY")
    if api_key is not None and not re.fullmatch(r"[!-~]+", api_key):
        raise UsageError("--api-key (or CAPTIONKIT_API_KEY) must be printable ASCII without spaces, and not empty")
    return api_key


def _listen(host: str, port: int, api_key: str | None):
    """The server's listening socket; a warning on stderr when it is reachable without a key."""
    from ..serve.net import bind, exposure_warning

    try:
        sock = bind(host, port)
    except OSError as e:
        raise UsageError(f"cannot listen on --host {host} --port {port}: {e.strerror or e}") from None
    warning = exposure_warning(sock, api_key)
    if warning:
        print(f"captionkit serve: {warning}", file=sys.stderr)
    return sock


def _check_access_log(path: str | None) -> None:
    """--access-log: a file that can be appended to (created if missing), before anything loads."""
    if path is None or path == "-":
        return
    try:
        with open(path, "a", encoding="utf-8"):
            pass
    except OSError as e:
        raise UsageError(f"--access-log {path}: cannot write: {e.strerror or e}") from None


def add_serve(sub: argparse._SubParsersAction) -> None:
    v = sub.add_parser("serve", help="HTTP API and web page (FastAPI)")
    v.set_defaults(func=cmd_serve)
    v.add_argument("--model", action="append",
                   help=f"checkpoint folder or shipped model name ({shipped_models_text()}); repeat for several")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    v.add_argument("--max-upload-mb", type=float, default=10.0, help="largest upload accepted (default 10)")
    v.add_argument("--queue-size", type=int, default=32, help="requests waiting per model before 503")
    v.add_argument("--max-batch", type=int, default=8, help="queued requests captioned together")
    v.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    v.add_argument("--onnx", metavar="DIR", help="host this ONNX export for the in-browser demo at /onnx")
    v.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ (default: $CAPTIONKIT_API_KEY; "
                                     "prefer the variable: arguments are visible to other users)")
    v.add_argument("--rate-limit", type=float, metavar="N", help="requests per minute per client to /v1/ (429 beyond)")
    v.add_argument("--max-pixels", type=int, help="largest upload in pixels, read from its header (default 89,478,485)")
    v.add_argument("--decode-workers", type=int, default=2, help="uploads decoded at once")
    v.add_argument("--decode-memory-mb", type=float, default=512, help="memory one decode may take (estimated "
                                                                        "from the header; larger uploads get 400)")
    v.add_argument("--decode-queue", type=int, default=16, help="uploads waiting to be decoded before 503")
    v.add_argument("--max-connections", type=int, default=100, help="open connections before 503")
    v.add_argument("--header-timeout", type=float, default=10.0, help="seconds a connection has to send a request head")
    v.add_argument("--body-timeout", type=float, default=30.0, help="longest silence while a request body arrives")
    v.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on SIGTERM/SIGINT: stop accepting, answer the requests in flight for at most this many "
                        "seconds, then exit (default 30)")
    v.add_argument("--access-log", metavar="FILE", help="write a JSON line per request to FILE ('-': stdout)")
    _add_control_opts(v, default="the model's; a request's form fields of the same names, in snake_case, "
                                 "override these")
    _add_device_opts(v)


def cmd_serve(model: list[str] | None, host: str, port: int, max_upload_mb: float, queue_size: int,
              max_batch: int, threads: int | None, onnx: str | None, api_key: str | None = None,
              rate_limit: float | None = None, max_pixels: int | None = None, decode_workers: int = 2,
              decode_memory_mb: float = 512, decode_queue: int = 16, max_connections: int = 100,
              header_timeout: float = 10.0, body_timeout: float = 30.0, drain_timeout: float = 30.0,
              access_log: str | None = None, device: str = "auto", precision: str = "auto", **controls) -> int:
    """``controls``: the caption controls' options, None where not given: the requests' defaults."""
    _check_serve_limits(port, max_upload_mb=max_upload_mb, queue_size=queue_size, max_batch=max_batch,
                        threads=threads, rate_limit=rate_limit, max_pixels=max_pixels, decode_workers=decode_workers,
                        decode_memory_mb=decode_memory_mb, decode_queue=decode_queue, max_connections=max_connections,
                        header_timeout=header_timeout, body_timeout=body_timeout, drain_timeout=drain_timeout)
    _check_access_log(access_log)
    given, _ = _controls(controls, None)
    api_key = _serve_api_key(api_key)
    if onnx:
        from ..export.checks import read_manifest
        read_manifest(onnx)
    where, precision = _device(device, precision)
    sock = _listen(host, port, api_key)  # before anything heavy: a bad --host or --port fails at once
    try:
        from ..serve.app import ServeConfig, serve
    except ModuleNotFoundError as e:
        sock.close()
        if (e.name or "").split(".")[0] == "captionkit":  # our own import broke: a bug, not a missing extra
            raise
        raise UsageError(f"the server needs the serve extra: pip install 'captionkit[serve]' ({e})") from None
    limits = {"max_pixels": max_pixels} if max_pixels is not None else {}
    cfg = ServeConfig(max_upload_bytes=int(max_upload_mb * 2 ** 20), queue_size=queue_size,
                      max_batch=max_batch, onnx_dir=onnx, api_key=api_key, rate_limit=rate_limit,
                      decode_workers=decode_workers, max_decode_bytes=int(decode_memory_mb * 2 ** 20),
                      decode_queue=decode_queue, max_connections=max_connections,
                      header_timeout=header_timeout, body_timeout=body_timeout, drain_timeout=drain_timeout,
                      access_log=access_log, controls=given, **limits)
    cut_off = serve(model, sock, cfg, threads=threads, device=where, precision=precision)
    return 1 if cut_off else 0  # 1: the drain's bound cut requests off (said on stderr)
