"""The FastAPI application behind ``captionkit serve``.

    GET  /                 the page: drop a photo, read the caption, hover a word for its attention
    POST /v1/caption       multipart form: ``image`` (the file), optional ``beam`` and ``model``
                           -> {caption, words, attention, grid, model, beam, elapsed_ms}
    GET  /v1/models        the loaded models and the server's limits
    GET  /healthz          liveness and queue depth
    GET  /app/...          the static pages; /app/index.html is the in-browser ONNX demo
    GET  /onnx-model/...   an ONNX export (``--onnx DIR``) for that demo

Every refused request gets a 4xx JSON body ``{"error": message, "status": code}``: a body over
the upload limit (413), a request that is not multipart or a part whose type is not an
accepted image type (415), a missing or empty file, a file that is no readable image, a bad
``beam`` or an unknown ``model`` (400). A full request queue answers 503 with Retry-After.

Captioning runs on one worker thread per model that takes up to ``max_batch`` queued requests
of the same beam size at a time and encodes and decodes them as one batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import torch
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..captioner import DEFAULT_MODEL, Captioner
from ..errors import ImageError
from ..images import decode_rgb, to_tensor

ACCEPTED_TYPES = {"image/jpeg": "JPEG", "image/png": "PNG", "image/webp": "WEBP", "image/gif": "GIF",
                  "image/bmp": "BMP", "image/tiff": "TIFF"}
PIL_FORMATS = {"JPEG", "MPO", "PNG", "WEBP", "GIF", "BMP", "TIFF"}  # MPO: multi-picture JPEGs from cameras
WEB_DIR = Path(str(files("captionkit") / "web"))


@dataclass
class ServeConfig:
    max_upload_bytes: int = 10 * 2 ** 20  # the whole request body
    queue_size: int = 32  # requests waiting for a model, over all clients
    max_batch: int = 8  # requests captioned together
    max_beam: int = 10
    default_beam: int = 3
    onnx_dir: str | None = None  # an ONNX export to host for the in-browser demo
    drain_limit: int = 256 * 2 ** 20  # an oversized body is read and dropped up to this size, so
    # the client gets its 413 instead of a reset connection; beyond it the connection is closed


class ApiError(Exception):
    def __init__(self, status: int, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "status": status}, status_code=status, headers=headers)


@dataclass
class _Job:
    x: torch.Tensor
    beam: int
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

    def submit(self, x: torch.Tensor, beam: int) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        job = _Job(x, beam, loop.create_future(), loop)
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
            by_beam: dict[int, list[_Job]] = {}
            for job in jobs:
                by_beam.setdefault(job.beam, []).append(job)
            for beam, group in by_beam.items():
                self._caption(beam, group)
            if stop:
                return

    def _caption(self, beam: int, group: list[_Job]) -> None:
        cap = self.captioner
        try:
            x = torch.stack([j.x for j in group]).contiguous(memory_format=torch.channels_last)
            with torch.inference_mode():
                feats = cap.encoder(x)
            results = [cap.result(c) for c in cap.decode_features(feats, beam)]
        except Exception as e:  # noqa: BLE001  (reported to the waiting requests as a 500)
            for j in group:
                j.loop.call_soon_threadsafe(_settle, j.future, None, e)
            return
        self.served += len(group)
        for j, r in zip(group, results):
            j.loop.call_soon_threadsafe(_settle, j.future, r)


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """ASGI middleware: refuse request bodies over the limit with a 413 JSON answer, whether
    the client declares the length or streams it."""

    def __init__(self, app, limit: int, drain_limit: int):
        self.app, self.limit, self.drain_limit = app, limit, drain_limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length")
        message = f"upload too large: the limit is {self.limit:,} bytes"
        if declared is not None:
            try:
                n = int(declared)
            except ValueError:
                return await _error(400, "invalid Content-Length header")(scope, receive, send)
            if n > self.limit:
                await self._drain(receive, n)
                return await _error(413, message)(scope, receive, send)
        seen = 0
        started = False
        more = True  # is there more body to come after the last message read?

        async def limited_receive():
            nonlocal seen, more
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                more = bool(msg.get("more_body"))
                if seen > self.limit:
                    raise _BodyTooLarge()
            return msg

        async def tracking_send(msg):
            nonlocal started
            if msg["type"] == "http.response.start":
                started = True
            await send(msg)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _BodyTooLarge:
            if started:
                raise
            if more:
                await self._drain(receive, seen)
            await _error(413, message)(scope, receive, send)

    async def _drain(self, receive, already: int) -> None:
        total = 0
        if already > self.drain_limit:
            return
        while True:
            msg = await receive()
            if msg["type"] != "http.request":
                return
            total += len(msg.get("body", b""))
            if not msg.get("more_body") or total > self.drain_limit:
                return


def model_name(path: str | Path | None) -> str:
    return Path(path).name if path else DEFAULT_MODEL.name


def load_models(paths: list[str] | None) -> dict[str, Captioner]:
    """Load each checkpoint folder once (the shipped model when none is given), keyed by name."""
    models: dict[str, Captioner] = {}
    for p in paths or [None]:
        name, k = model_name(p), 2
        while name in models:
            name, k = f"{model_name(p)}-{k}", k + 1
        models[name] = Captioner.load(p)
    return models


def _int_field(value, name: str, lo: int, hi: int, default: int) -> int:
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


def create_app(models: dict[str, Captioner], config: ServeConfig | None = None) -> FastAPI:
    config = config or ServeConfig()
    if not models:
        raise ValueError("no model to serve")
    default = next(iter(models))
    workers = {name: ModelWorker(name, cap, config) for name, cap in models.items()}
    @contextlib.asynccontextmanager
    async def lifespan(app):
        yield
        for w in workers.values():
            w.stop()

    app = FastAPI(title="captionkit", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.workers = workers
    app.state.config = config

    @app.exception_handler(ApiError)
    async def _api_error(request, exc: ApiError):
        return _error(exc.status, exc.message, exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        status = exc.status_code
        return _error(status, str(exc.detail) if exc.detail else "error", getattr(exc, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        return _error(400, "invalid request: " + "; ".join(str(e.get("msg")) for e in exc.errors())[:300])

    @app.exception_handler(Exception)
    async def _internal_error(request, exc: Exception):  # never a traceback to the client
        return _error(500, f"internal error ({type(exc).__name__})")

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok", "models": list(workers),
                "queued": sum(w.queue.qsize() for w in workers.values()),
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
                           "queue_size": config.queue_size},
                "onnx_demo": "/app/index.html?model=/onnx-model/" if config.onnx_dir else None}

    @app.post("/v1/caption")
    async def caption(request: Request):
        t0 = time.perf_counter()
        ctype = request.headers.get("content-type", "")
        if not ctype.lower().startswith("multipart/form-data"):
            raise ApiError(415, "send a multipart/form-data body with the photo in the field 'image' "
                                f"(got Content-Type {ctype[:60]!r})")
        form = await request.form(max_files=1, max_fields=8)
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
            beam = _int_field(form.get("beam"), "beam", 1, config.max_beam, config.default_beam)
            name = form.get("model") or default
            if not isinstance(name, str) or name not in workers:
                raise ApiError(400, f"unknown model {str(name)[:60]!r}; known: {', '.join(workers)}")
            data = await upload.read()
        finally:
            await form.close()
        if not data:
            raise ApiError(400, f"{upload.filename or 'image'}: empty file")
        worker = workers[name]
        pre = worker.captioner.encoder.preprocess
        label = (upload.filename or "image")[:100]

        def prepare():
            return to_tensor(decode_rgb(data, label, PIL_FORMATS), pre)

        try:
            x = await run_in_threadpool(prepare)
        except ImageError as e:
            raise ApiError(400, str(e)) from None
        res = await worker.submit(x, beam)
        return {"caption": res.text, "words": res.words,
                "attention": [[round(float(v), 5) for v in row] for row in res.attention.tolist()],
                "grid": list(res.grid), "model": name, "beam": beam,
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

    app.add_middleware(BodyLimit, limit=config.max_upload_bytes, drain_limit=config.drain_limit)
    return app


def serve(model_paths: list[str] | None, host: str, port: int, config: ServeConfig,
          threads: int | None = None) -> None:
    import uvicorn
    if threads:
        torch.set_num_threads(threads)
    models = load_models(model_paths)
    app = create_app(models, config)
    print(f"captionkit serve: {', '.join(models)} on http://{host}:{port}/", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
