"""The server's life around the app, for load balancers and log readers (``captionkit serve``).

``Gate`` is the ASGI app uvicorn runs; the FastAPI app (``create_app``) sits behind it once the
models are loaded. It

- answers ``/healthz`` (alive: 200 while the process runs) and ``/readyz`` (200 once the models
  are loaded and no queue is full; 503 while loading, full or draining) itself, and every other
  request 503 ("loading") until the models are in;
- gives every answer a request id (header ``X-Request-ID``: the client's own when it sends a
  printable one of at most 128 characters, else a new one), puts it in every log line written
  while the request runs (a log record factory) and in the access log; the protocol's 408
  (serve/protocol.py) carries the id too, read from the scope;
- writes a JSON line per request to the access log when asked (``--access-log FILE|-``):
  time, id, method, path, status (499: the client left before its answer), ms, bytes, client;
- counts the requests in flight, which the drain waits for.

``DrainingServer`` is uvicorn's server with a drain on SIGTERM or SIGINT: it stops accepting
connections at once, closes idle kept-alive ones, answers the requests in flight (each with
``Connection: close``), waits for them for at most ``drain_timeout`` seconds, cancels what is
left, and then returns, so the command exits 0 (1 when the bound cut requests off). A second
SIGINT cuts the drain short. uvicorn's own answer, re-raising the signal once done, is not kept:
the process would then die of the signal instead of exiting with a status that says how the
drain went.
"""

from __future__ import annotations

import asyncio
import contextvars
import json
import logging
import re
import signal
import sys
import time
import uuid
from datetime import UTC, datetime

import uvicorn

from .guards import error_response

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("captionkit_request_id", default=None)
CLIENT_ID = re.compile(r"[!-~]{1,128}")  # a client's own id is echoed only when printable and short
SCOPE_ID = "captionkit.request_id"  # in the ASGI scope: the request's id
SCOPE_STATUS = "captionkit.status"  # in the ASGI scope: an answer the protocol sent itself (408)
CLIENT_LEFT = 499  # the access log's status for a request whose client left before its answer
PROBES = ("/healthz", "/readyz")  # not counted in flight: a probe must not hold up a drain
log = logging.getLogger("captionkit.serve")


def new_request_id() -> str:
    return uuid.uuid4().hex


def install_log_ids() -> None:
    """Prefix every log record created while a request runs with its id (``[id] message``), in
    whichever logger writes it (uvicorn's, the app's). Idempotent."""
    old = logging.getLogRecordFactory()
    if getattr(old, "captionkit_ids", False):
        return

    def factory(*args, **kwargs):
        record = old(*args, **kwargs)
        rid = REQUEST_ID.get()
        record.request_id = rid or "-"
        if rid:
            record.msg = f"[{rid}] {record.msg}"
        return record
    factory.captionkit_ids = True
    logging.setLogRecordFactory(factory)


class Gate:
    """The outermost ASGI app: probes, the loading and draining states, request ids, the access
    log, the count of requests in flight. ``ready(app)`` is called (from the loading thread)
    once the FastAPI app exists; until then only the probes are answered."""

    def __init__(self, access_log=None):
        self.app = None  # the FastAPI app, once the models are loaded
        self.state = "loading"  # then "ready", then "draining"
        self.in_flight = 0  # requests other than probes being answered
        self.cut_off = 0  # requests cancelled when the drain ran past its bound
        self.access_log = access_log  # a text stream, or None

    def ready(self, app) -> None:
        self.app = app
        if self.state == "loading":
            self.state = "ready"

    def drain(self) -> None:
        self.state = "draining"

    def readiness(self) -> tuple[int, dict]:
        doc = {"ready": False, "state": self.state, "in_flight": self.in_flight}
        if self.state != "ready":
            return 503, doc
        busy = self.app.state.busy()
        if busy:
            return 503, {**doc, "state": "full", "full": busy}
        return 200, {**doc, "ready": True}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            return await self._lifespan(receive, send)
        if scope["type"] != "http":  # no websocket routes: the app refuses them if it is there
            if self.app is not None:
                await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"x-request-id", b"").decode("latin-1")
        rid = given if CLIENT_ID.fullmatch(given) else new_request_id()
        token = REQUEST_ID.set(rid)
        scope[SCOPE_ID] = rid  # for the protocol's own answer (a 408) to carry it too
        t0, status, sent, gone, finished = time.perf_counter(), 0, 0, False, False

        async def receive_watched():
            nonlocal gone
            msg = await receive()
            gone = gone or (msg["type"] == "http.disconnect" and not finished)  # before its whole answer
            return msg

        async def send_with_id(msg):
            nonlocal status, sent, finished
            if msg["type"] == "http.response.start":
                status = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", ()), (b"x-request-id", rid.encode())]}
            elif msg["type"] == "http.response.body":
                sent += len(msg.get("body", b""))
                finished = not msg.get("more_body", False)
            await send(msg)

        path = scope.get("path", "")
        counted = path not in PROBES
        self.in_flight += counted
        try:
            if path == "/readyz":
                code, doc = self.readiness()
                await _json(code, doc)(scope, receive, send_with_id)
            elif self.app is not None:
                await self.app(scope, receive_watched, send_with_id)
            elif path == "/healthz":
                await _json(200, {"status": "ok", "state": self.state})(scope, receive, send_with_id)
            else:
                await error_response(503, "loading the models; retry shortly",
                                     {"Retry-After": "1"})(scope, receive, send_with_id)
        except asyncio.CancelledError:  # the drain's bound passed while this request ran
            self.cut_off += counted
            if status == 0:  # the documented 503, not uvicorn's plain 500 and a traceback
                await error_response(503, "the server stopped before answering (drain timeout); retry",
                                     {"Retry-After": "1", "Connection": "close"})(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001  (logged here, with the id, instead of by uvicorn without it)
            log.exception("%s %s failed", scope.get("method"), path)
            if status == 0:
                await error_response(500, "internal error")(scope, receive, send_with_id)
        finally:
            self.in_flight -= counted
            if self.access_log is not None:
                # what the client got: the protocol's 408, or nothing (499, as nginx logs it) when it
                # left, though the app's answer to the disconnect was "sent" (and dropped)
                told = scope.get(SCOPE_STATUS) or (CLIENT_LEFT if gone else status)
                self._access(scope, rid, told, sent if told == status else 0, time.perf_counter() - t0)
            REQUEST_ID.reset(token)

    def _access(self, scope, rid: str, status: int, sent: int, secs: float) -> None:
        client = scope.get("client")
        line = {"time": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                "id": rid, "method": scope.get("method"), "path": scope.get("path"),
                "status": status,  # 0: no answer; 499: the client left first; 408: it was too slow
                "ms": round(secs * 1000, 1), "bytes": sent, "client": client[0] if client else None}
        try:
            self.access_log.write(json.dumps(line) + "\n")
            self.access_log.flush()
        except (OSError, ValueError) as e:  # a full disk or a closed pipe must not stop the serving
            log.warning("access log: %s; no more access lines", e)
            self.access_log = None

    async def _lifespan(self, receive, send) -> None:
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                if self.app is not None:
                    self.app.state.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _json(status: int, doc: dict):
    from fastapi.responses import JSONResponse
    return JSONResponse(doc, status_code=status)


class DrainingServer(uvicorn.Server):
    """uvicorn's server that drains on SIGTERM/SIGINT and exits instead of re-raising the signal
    (see the module's docstring). ``drain_timeout`` is uvicorn's ``timeout_graceful_shutdown``."""

    def __init__(self, config: uvicorn.Config, gate: Gate):
        super().__init__(config)
        self.gate = gate
        self.signal_name: str | None = None
        self.drain_seconds: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # as uvicorn's, without recording the signal for re-raising; nothing is printed here (a
        # signal handler may interrupt a print): shutdown() says what happens
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        self.signal_name = self.signal_name or signal.Signals(sig).name
        self.gate.drain()

    async def shutdown(self, sockets=None) -> None:
        self.gate.drain()
        if self.signal_name is None:  # not a signal: a failed load, said in one line by the caller
            return await super().shutdown(sockets)
        bound = self.config.timeout_graceful_shutdown
        print(f"captionkit serve: {self.signal_name}: no new connections; answering {self.gate.in_flight} "
              f"request(s) in flight (at most {bound:g} s)", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        await super().shutdown(sockets)
        self.drain_seconds = time.perf_counter() - t0
        await asyncio.sleep(0)  # let cancelled requests count themselves
        end = (f"{self.gate.cut_off} request(s) cut off at the {bound:g} s bound" if self.gate.cut_off
               else "every request answered")
        print(f"captionkit serve: drained in {self.drain_seconds:.1f} s: {end}", file=sys.stderr, flush=True)
