"""The FastAPI application behind ``captionkit serve``.

    GET  /                 the page: drop a photo, read the caption, hover a word for its attention
    POST /v1/caption       multipart form: ``image`` (the file), optional ``beam``, ``model`` and
                           caption controls (``num_captions``, ``sample``, ``temperature``, ...:
                           captionkit.inference.controls.FIELDS; docs/decoding-controls.md)
                           -> {caption, words, attention, grid, model, beam, elapsed_ms}, and
                           ``captions`` (a list) with num_captions > 1
    GET  /v1/models        the loaded models, the server's limits and its worst-case memory
    GET  /healthz          liveness and queue depth
    GET  /readyz           readiness (serve/lifecycle.py's Gate, in front of this app under serve())
    GET  /app/...          the static pages; /app/index.html is the in-browser ONNX demo
    GET  /onnx-model/...   an ONNX export (``--onnx DIR``) for that demo

Every refused request gets a 4xx JSON body ``{"error": message, "status": code}``: a missing or
wrong API key (401), a client over its rate limit (429, Retry-After), a body over the upload
limit (413), a request that is not multipart or a part whose type is not an accepted image type
(415), a missing or empty file, a file that is no readable image or too large to decode, a bad
``beam`` or control or an unknown ``model`` (400). A busy server answers 503 with Retry-After.

Memory is bounded at each stage (see :func:`memory_bounds` and docs/serving.md): an upload's
pixel count and decoding memory are checked from its header before anything is decoded, large
photos are decoded reduced (``images.decode_reduced``), at most ``decode_workers`` decode at once
and at most ``decode_queue`` uploads wait for them; captioning runs on one worker thread per
model that takes up to ``max_batch`` queued requests of the same beam size and controls at a
time and encodes and decodes them as one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import queue
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..core.errors import ImageError, UserError
from ..data.images import MAX_PIXELS, decode_reduced, to_tensor
from ..encoders.base import Preprocess
from ..inference.captioner import Captioner
from ..inference.controls import FIELDS, Controls, parse_fields
from ..inference.shipped import DEFAULT_MODEL
from .guards import ApiKey, BodyLimit, RateLimit, error_response

ACCEPTED_TYPES = {"image/jpeg": "JPEG", "image/png": "PNG", "image/webp": "WEBP", "image/gif": "GIF",
                  "image/bmp": "BMP", "image/tiff": "TIFF"}
PIL_FORMATS = {"JPEG", "MPO", "PNG", "WEBP", "GIF", "BMP", "TIFF"}  # MPO: multi-picture JPEGs from cameras
WEB_DIR = Path(str(files("captionkit") / "web"))


MiB = 2 ** 20
FIELD_BYTES = 64 * 1024  # the largest text field (beam, model, a control) a form may carry
MAX_FIELDS = 3 + len(FIELDS)  # image, beam, model and the controls
SPOOL_BYTES = 1 * MiB  # Starlette keeps this much of an uploaded file in memory, the rest on disk
CONNECTION_BYTES = 2 * MiB  # a connection sending a request: the spool, 8 fields, uvicorn's buffers


@dataclass
class ServeConfig:
    max_upload_bytes: int = 10 * MiB  # the whole request body
    queue_size: int = 32  # requests waiting for a model, over all clients
    max_batch: int = 8  # requests captioned together
    max_beam: int = 10
    default_beam: int = 3
    onnx_dir: str | None = None  # an ONNX export to host for the in-browser demo
    drain_limit: int = 256 * MiB  # an oversized body is read and dropped up to this size, so
    # the client gets its 413 instead of a reset connection; beyond it the connection is closed
    max_pixels: int = MAX_PIXELS  # an upload's pixel count, read from its header
    max_decode_bytes: int = 512 * MiB  # memory one decode may take, estimated from the header
    decode_workers: int = 2  # uploads decoded at once
    decode_queue: int = 16  # uploads held in memory, read and waiting to be decoded, before 503
    # enforced by the server around the app (serve(); stated in /v1/models)
    max_connections: int = 100  # open connections before uvicorn answers 503
    header_timeout: float = 10.0  # seconds for a connection to send a complete request head
    body_timeout: float = 30.0  # longest silence while a request body arrives
    api_key: str | None = None  # required as "Authorization: Bearer KEY" on /v1/*
    rate_limit: float | None = None  # requests per minute per client to /v1/*
    # the server's life (serve(); serve/lifecycle.py)
    drain_timeout: float = 30.0  # after SIGTERM/SIGINT, the longest wait for requests in flight
    access_log: str | None = None  # a file for JSON access lines, "-" for stdout
    # the caption controls a request gets unless it says otherwise (serve's options; over each model's own)
    controls: dict = field(default_factory=dict)


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


@dataclass
class _Job:
    x: torch.Tensor
    beam: int | None
    controls: Controls
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    queued: float = field(default_factory=time.perf_counter)


def _settle(fut: asyncio.Future, value=None, exc: BaseException | None = None) -> None:
    if fut.done():  # the client went away
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


class ModelWorker:
    """A captioner, its bounded queue, and the thread that empties it in batches."""

    def __init__(self, name: str, captioner: Captioner, config: ServeConfig):
        self.name, self.captioner, self.config = name, captioner, config
        self.queue: queue.Queue[_Job | None] = queue.Queue(maxsize=max(1, config.queue_size))
        self.served = 0
        self.thread = threading.Thread(target=self._run, name=f"captionkit-{name}", daemon=True)
        self.thread.start()

    def submit(self, x: torch.Tensor, beam: int | None, controls: Controls | None = None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        job = _Job(x, beam, controls or self.captioner.controls, loop.create_future(), loop)
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            raise ApiError(503, f"server busy: {self.queue.maxsize} requests are already waiting; retry shortly",
                           {"Retry-After": "1"}) from None
        return job.future

    def stop(self) -> None:
        self.queue.put(None)

    def _run(self) -> None:
        while True:
            first = self.queue.get()
            if first is None:
                return
            jobs, stop = [first], False
            while len(jobs) < self.config.max_batch:
                try:
                    job = self.queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    stop = True
                    break
                jobs.append(job)
            by_beam: dict[tuple, list[_Job]] = {}
            for job in jobs:
                by_beam.setdefault((job.beam, job.controls), []).append(job)
            for (beam, _), group in by_beam.items():
                self._caption(beam, group)
            if stop:
                return

    def _caption(self, beam: int | None, group: list[_Job]) -> None:
        """Caption a group of jobs of one beam width and one set of controls."""
        cap, controls = self.captioner, group[0].controls
        try:
            x = torch.stack([j.x for j in group])
            # a folder's own reranker chooses the caption as `captionkit caption` does
            rerank, nbest = cap.rerank_plan(None, None, controls, beam)
            results = []
            for best, caps in zip(*cap.caption_pixels(x, beam, None, controls, rerank, nbest)):
                res = cap.result(best)
                if controls.num_captions > 1:
                    res.captions = [cap.text(c) for c in caps]
                results.append(res)
        except Exception as e:  # noqa: BLE001  (reported to the waiting requests as a 500)
            for j in group:
                j.loop.call_soon_threadsafe(_settle, j.future, None, e)
            return
        self.served += len(group)
        for j, r in zip(group, results):
            j.loop.call_soon_threadsafe(_settle, j.future, r)


def model_name(path: str | Path | None) -> str:
    return Path(path).name if path else DEFAULT_MODEL.name


def load_models(paths: list[str] | None, device: str | torch.device = "cpu",
                precision: str = "auto") -> dict[str, Captioner]:
    """Load each checkpoint folder once (the shipped model when none is given), keyed by name,
    onto ``device`` (see Captioner.place)."""
    models: dict[str, Captioner] = {}
    for p in paths or [None]:
        name, k = model_name(p), 2
        while name in models:
            name, k = f"{model_name(p)}-{k}", k + 1
        models[name] = Captioner.load(p, device=device, precision=precision)
    return models


def request_controls(form, captioner: Captioner, beam: int | None, config: ServeConfig) -> Controls:
    """A request's caption controls: its form's control fields over the server's (``serve``'s
    options) over the model's own; 400 for a field that is a file, no value of its type, out of
    range, or asks for more than ``max_beam`` captions or groups."""
    texts = {}
    for name in FIELDS:
        value = form.get(name)
        if value is not None and not isinstance(value, str):
            raise ApiError(400, f"'{name}' must be a form field, not a file")
        texts[name] = value
    try:
        controls = captioner.controls.with_options(**{**config.controls, **parse_fields(texts)})
        controls.check(beam if beam is not None or controls.sample else config.default_beam)
    except UserError as e:
        raise ApiError(400, str(e)) from None
    for name in ("num_captions", "beam_groups"):
        if getattr(controls, name) > config.max_beam:
            raise ApiError(400, f"'{name}' must be at most {config.max_beam}, got {getattr(controls, name)}")
    return controls


def _int_field(value, name: str, lo: int, hi: int, default: int | None) -> int | None:
    if value is None or value == "":
        return default
    if not isinstance(value, str):
        raise ApiError(400, f"'{name}' must be a form field, not a file")
    try:
        n = int(value)
    except ValueError:
        raise ApiError(400, f"'{name}' must be an integer, got {value[:20]!r}") from None
    if not lo <= n <= hi:
        raise ApiError(400, f"'{name}' must be between {lo} and {hi}, got {n}")
    return n


TRIM_AFTER_BYTES = 64 * MiB  # after a decode this large, freed memory goes back to the system


@functools.cache
def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_memory() -> None:
    """Give the heap's free pages back to the system (glibc). The command line keeps freed
    memory in the process for speed (core.allocator.tune_allocator), so without this the memory of a huge
    decode would stay resident after it, in each decode thread's arena."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class Slots:
    """A count of things in progress with a hard cap: take() refuses with a 503 instead of
    waiting, so that a burst is answered at once rather than held in memory. Used from the
    event loop only, so no lock."""

    def __init__(self, n: int, busy: str):
        self.n, self.busy, self.used = n, busy, 0

    @contextlib.contextmanager
    def take(self):
        if self.used >= self.n:
            raise ApiError(503, self.busy, {"Retry-After": "1"})
        self.used += 1
        try:
            yield
        finally:
            self.used -= 1


def resident_bytes(which: str = "VmHWM") -> int | None:
    """This process's resident memory from /proc (VmHWM: its peak, VmRSS: now); None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(which + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def memory_bounds(models: dict[str, Captioner], config: ServeConfig, baseline: int | None) -> dict:
    """The server's worst-case resident memory: what it held before serving (measured) plus the
    most each stage may add (from the limits)."""
    tensor = max(3 * cap.encoder.preprocess.size ** 2 * 4 for cap in models.values())
    parts = {
        "baseline_bytes": baseline or 0,  # peak before serving: models loaded (and warmed up by serve())
        "decoding_bytes": config.decode_workers * config.max_decode_bytes,
        "uploads_held_bytes": config.decode_queue * (config.max_upload_bytes + SPOOL_BYTES),
        "connections_bytes": config.max_connections * CONNECTION_BYTES,
        "queued_bytes": len(models) * (config.queue_size + config.max_batch) * tensor,
    }
    return {**parts, "worst_case_bytes": sum(parts.values()), "baseline_measured": baseline is not None}


def create_app(models: dict[str, Captioner], config: ServeConfig | None = None) -> FastAPI:
    config = config or ServeConfig()
    if not models:
        raise ValueError("no model to serve")
    default = next(iter(models))
    memory = memory_bounds(models, config, resident_bytes("VmHWM"))
    workers = {name: ModelWorker(name, cap, config) for name, cap in models.items()}
    decoders = ThreadPoolExecutor(config.decode_workers, thread_name_prefix="captionkit-decode")
    held = Slots(config.decode_queue, f"server busy: {config.decode_queue} uploads are already waiting "
                                      "to be decoded; retry shortly")

    def close() -> None:
        for w in workers.values():
            w.stop()
        decoders.shutdown(wait=False, cancel_futures=True)
        # the workers are daemon threads: one still inside a torch call when the interpreter
        # finalises can abort the process (a fresh-clone CI run exited -6 after a clean drain),
        # so they are given a moment to return: after a full drain they have nothing left to do;
        # after a drain cut off at its bound one may be mid-caption, and the exit does not wait
        for w in workers.values():
            w.thread.join(2.0)

    def busy() -> list[str]:
        """What is full now, so that /readyz sends new requests elsewhere."""
        full = [f"model {name}: {w.queue.maxsize} requests queued" for name, w in workers.items() if w.queue.full()]
        if held.used >= held.n:
            full.append(f"{held.n} uploads waiting to be decoded")
        return full

    @contextlib.asynccontextmanager
    async def lifespan(app):  # behind serve()'s Gate the gate calls close() instead
        yield
        close()

    app = FastAPI(title="captionkit", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.workers = workers
    app.state.config = config
    app.state.held = held
    app.state.memory = memory
    app.state.close = close
    app.state.busy = busy

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return error_response(exc.status, exc.message, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        status = exc.status_code
        return error_response(status, str(exc.detail) if exc.detail else "error", getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        return error_response(400, "invalid request: " + "; ".join(str(e.get("msg")) for e in exc.errors())[:300])

    @app.exception_handler(ClientDisconnect)
    async def _gone(request, exc: ClientDisconnect):  # the client left mid-request: nobody to tell
        return error_response(400, "client disconnected")

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):  # never a traceback to the client
        return error_response(500, f"internal error ({type(exc).__name__})")

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "models": list(workers),
                "queued": sum(w.queue.qsize() for w in workers.values()), "decoding": held.used,
                "served": sum(w.served for w in workers.values())}

    @app.get("/v1/models")
    async def list_models():
        out = []
        for name, cap in models.items():
            out.append({"name": name, "family": cap.config.get("family"),
                        "encoder": cap.config["encoder"]["name"], "grid": list(cap.grid),
                        "vocab_size": len(cap.vocab), "max_len": cap.max_len,
                        "length_penalty": cap.length_penalty, "default": name == default})
        return {"models": out, "default": default,
                "limits": {"max_upload_bytes": config.max_upload_bytes, "accepted_types": sorted(ACCEPTED_TYPES),
                           "max_beam": config.max_beam, "default_beam": config.default_beam,
                           "queue_size": config.queue_size, "max_pixels": config.max_pixels,
                           "max_decode_bytes": config.max_decode_bytes, "decode_workers": config.decode_workers,
                           "decode_queue": config.decode_queue, "max_connections": config.max_connections,
                           "header_timeout_s": config.header_timeout, "body_timeout_s": config.body_timeout,
                           "api_key_required": config.api_key is not None,
                           "rate_limit_per_minute": config.rate_limit, "drain_timeout_s": config.drain_timeout},
                "memory": memory,
                "onnx_demo": "/app/index.html?model=/onnx-model/" if config.onnx_dir else None}

    def decode(data: bytes, label: str, pre: Preprocess) -> torch.Tensor:  # on a decode thread
        im, plan = decode_reduced(data, pre.size, label, PIL_FORMATS, config.max_pixels, config.max_decode_bytes)
        x = to_tensor(im, pre)
        if plan.bytes > TRIM_AFTER_BYTES:
            release_free_memory()
        return x

    async def to_input(upload: UploadFile, label: str, pre: Preprocess) -> torch.Tensor:
        """The upload's bytes, read into memory and decoded under the held-uploads cap."""
        with held.take():
            data = await upload.read()
            if not data:
                raise ApiError(400, f"{label}: empty file")
            try:
                return await asyncio.get_running_loop().run_in_executor(decoders, decode, data, label, pre)
            except ImageError as e:
                raise ApiError(400, str(e)) from None

    @app.post("/v1/caption")
    async def caption(request: Request):
        t0 = time.perf_counter()
        ctype = request.headers.get("content-type", "")
        if not ctype.lower().startswith("multipart/form-data"):
            raise ApiError(415, "send a multipart/form-data body with the photo in the field 'image' "
                                f"(got Content-Type {ctype[:60]!r})")
        form = await request.form(max_files=1, max_fields=MAX_FIELDS, max_part_size=FIELD_BYTES)
        try:
            upload = form.get("image")
            if upload is None:
                raise ApiError(400, "no 'image' field: send the photo as the multipart field 'image'")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "'image' must be a file upload, not a text field")
            part_type = (upload.content_type or "").split(";")[0].strip().lower()
            if part_type not in ACCEPTED_TYPES:
                raise ApiError(415, f"'image' has type {part_type or 'none'!r}; accepted: "
                                    f"{', '.join(sorted(ACCEPTED_TYPES))}")
            beam = _int_field(form.get("beam"), "beam", 1, config.max_beam, None)
            name = form.get("model") or default
            if not isinstance(name, str) or name not in workers:
                raise ApiError(400, f"unknown model {str(name)[:60]!r}; known: {', '.join(workers)}")
            worker = workers[name]
            controls = request_controls(form, worker.captioner, beam, config)
            beam = controls.beam(beam) if beam is not None or controls.sample else config.default_beam
            label = (upload.filename or "image")[:100]
            x = await to_input(upload, label, worker.captioner.encoder.preprocess)
        finally:
            await form.close()
        res = await worker.submit(x, beam, controls)
        return {"caption": res.text, "words": res.words,
                "attention": [[round(float(v), 5) for v in row] for row in res.attention.tolist()],
                "grid": list(res.grid), "model": name, "beam": beam,
                **({"captions": res.captions} if res.captions is not None else {}),
                "elapsed_ms": round((time.perf_counter() - t0) * 1000, 1)}

    @app.get("/")
    async def index():
        return FileResponse(WEB_DIR / "serve.html", media_type="text/html")

    @app.get("/onnx")
    async def onnx_demo():
        if not config.onnx_dir:
            raise ApiError(404, "no ONNX export is hosted: start the server with --onnx DIR")
        return RedirectResponse("/app/index.html?model=/onnx-model/")

    app.mount("/app", StaticFiles(directory=WEB_DIR, html=True), name="app")
    if config.onnx_dir:
        app.mount("/onnx-model", StaticFiles(directory=config.onnx_dir), name="onnx-model")

    # the last added runs first: rate, then key, then size; so a request with a wrong key spends
    # its client's rate too, and --rate-limit bounds how fast keys can be guessed
    app.add_middleware(BodyLimit, limit=config.max_upload_bytes, drain_limit=config.drain_limit)
    if config.api_key is not None:
        app.add_middleware(ApiKey, key=config.api_key)
    if config.rate_limit:
        app.add_middleware(RateLimit, per_minute=config.rate_limit)
    return app


def warm_up(models: dict[str, Captioner], config: ServeConfig) -> None:
    """Caption one full batch at the largest beam with each model, as the worker captions a
    request (its own reranker, matcher included, where it has one), so that the memory measured
    before serving includes the models' working memory and no first request pays a first call."""
    gen = torch.Generator().manual_seed(0)
    for cap in models.values():
        side = cap.encoder.preprocess.size
        x = torch.randn(config.max_batch, 3, side, side, generator=gen)
        rerank, nbest = cap.rerank_plan(None, None, cap.controls, config.max_beam)
        cap.caption_pixels(x, config.max_beam, None, cap.controls, rerank, nbest)


def make_server(app, config: ServeConfig, gate=None, **uvicorn_options):
    """The uvicorn server for ``app``: the guarded protocol (header and body deadlines) and the
    connection limit; given the ``gate`` that wraps ``app`` (serve/lifecycle.py), one that drains
    within ``config.drain_timeout`` on SIGTERM/SIGINT. Run it with ``.run(sockets=[bind(host, port)])``."""
    import uvicorn

    from .protocol import GuardedH11Protocol
    protocol = functools.partial(GuardedH11Protocol, header_timeout=config.header_timeout,
                                 body_timeout=config.body_timeout)
    options = {"log_level": "warning", "timeout_graceful_shutdown": config.drain_timeout, **uvicorn_options}
    uconfig = uvicorn.Config(app, http=protocol, limit_concurrency=config.max_connections, **options)
    if gate is None:
        return uvicorn.Server(uconfig)
    from .lifecycle import DrainingServer
    return DrainingServer(uconfig, gate)


def _open_access_log(where: str | None):
    if where is None:
        return None
    if where == "-":
        return sys.stdout
    return open(where, "a", buffering=1, encoding="utf-8")  # noqa: SIM115  (open while serving)


def serve(model_paths: list[str] | None, sock: socket.socket, config: ServeConfig,
          threads: int | None = None, device: str | torch.device = "cpu", precision: str = "auto") -> int:
    """Serve on ``sock`` (from serve.net.bind) until SIGTERM or SIGINT, then drain (see
    serve/lifecycle.py); returns how many requests the drain's bound cut off.

    The socket listens at once: while the models load onto ``device`` and warm up, in a thread,
    /healthz answers 200, /readyz 503 and every other request 503 ("loading"). A failed load
    stops the server and is raised here."""
    from .lifecycle import Gate, install_log_ids

    if threads:
        torch.set_num_threads(threads)
    install_log_ids()
    access = _open_access_log(config.access_log)
    gate = Gate(access_log=access)
    server = make_server(gate, config, gate=gate)
    host, port = sock.getsockname()[:2]
    url = f"http://{f'[{host}]' if ':' in host else host}:{port}/"
    failed: list[BaseException] = []

    def load() -> None:
        try:
            models = load_models(model_paths, device, precision)
            warm_up(models, config)
            app = create_app(models, config)
        except BaseException as e:  # noqa: BLE001  (raised again in serve's thread, after the server stops)
            failed.append(e)
            server.should_exit = True
            return
        gate.ready(app)
        worst = app.state.memory["worst_case_bytes"] / 2 ** 30
        print(f"captionkit serve: {', '.join(models)} on {url} (worst-case memory {worst:.2f} GiB)", flush=True)

    sock.listen(2048)  # from now on connections wait for uvicorn instead of being refused
    print(f"captionkit serve: loading the models; listening at {url} (/readyz: 503 until they are loaded)",
          flush=True)
    loader = threading.Thread(target=load, name="captionkit-load", daemon=True)  # daemon: a signal may end the load
    loader.start()
    try:
        server.run(sockets=[sock])
    finally:
        if access not in (None, sys.stdout):
            access.close()
    if failed:
        raise failed[0]
    return gate.cut_off
