"""ASGI middlewares that refuse a request before the app sees it: a missing or wrong API key
(401), a client over its rate limit (429), a body over the upload limit (413). Each answers with
the server's JSON error body ``{"error": message, "status": code}``."""

from __future__ import annotations

import hmac
import math
import time

from fastapi.responses import JSONResponse

API_PREFIX = "/v1/"


def error_response(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "status": status}, status_code=status, headers=headers)


def _is_api(scope) -> bool:
    return scope["type"] == "http" and scope["path"].startswith(API_PREFIX)


class ApiKey:
    """Require ``Authorization: Bearer KEY`` on /v1/*; the page, static files and /healthz stay
    open (they cost nothing and reveal nothing the page does not). Keys are compared in constant
    time."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if not _is_api(scope):
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        if scheme.lower() != b"bearer" or not token.strip():
            message = "missing API key: send the header 'Authorization: Bearer KEY'"
        elif not hmac.compare_digest(token.strip(), self.key):
            message = "wrong API key"
        else:
            return await self.app(scope, receive, send)
        await error_response(401, message, {"WWW-Authenticate": "Bearer"})(scope, receive, send)


class RateLimit:
    """At most ``per_minute`` requests to /v1/* per client address: a token bucket that holds
    ``per_minute`` tokens (the allowed burst) and refills at ``per_minute / 60`` a second. Over
    it: 429 with Retry-After (whole seconds until the next token)."""

    MAX_CLIENTS = 10_000  # buckets kept before idle (full) ones are forgotten

    def __init__(self, app, per_minute: float, clock=time.monotonic):
        self.app, self.capacity, self.rate, self.clock = app, float(per_minute), per_minute / 60.0, clock
        self.buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, time of last update)

    def take(self, client: str) -> float:
        """Take a token for ``client``: 0 if it had one, else the seconds until it will."""
        now = self.clock()
        tokens, last = self.buckets.get(client, (self.capacity, now))
        tokens = min(self.capacity, tokens + (now - last) * self.rate)
        if tokens >= 1:
            self._forget_idle(now)
            self.buckets[client] = (tokens - 1, now)
            return 0.0
        self.buckets[client] = (tokens, now)
        return (1 - tokens) / self.rate

    def _forget_idle(self, now: float) -> None:
        if len(self.buckets) < self.MAX_CLIENTS:
            return
        full = self.capacity / self.rate  # seconds in which any bucket refills completely
        self.buckets = {c: (t, last) for c, (t, last) in self.buckets.items() if now - last < full}

    async def __call__(self, scope, receive, send):
        if not _is_api(scope):
            return await self.app(scope, receive, send)
        client = (scope.get("client") or ("unknown",))[0]
        wait = self.take(client)
        if wait == 0:
            return await self.app(scope, receive, send)
        retry = max(1, math.ceil(wait))
        per_minute = f"{self.capacity:g}"
        await error_response(429, f"rate limit: {per_minute} requests per minute per client; retry in {retry} s",
                             {"Retry-After": str(retry)})(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


class BodyLimit:
    """Refuse request bodies over the limit with a 413 JSON answer, whether the client declares
    the length or streams it."""

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
                return await error_response(400, "invalid Content-Length header")(scope, receive, send)
            if n > self.limit:
                await self._drain(receive, n)
                return await error_response(413, message)(scope, receive, send)
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
            await error_response(413, message)(scope, receive, send)

    async def _drain(self, receive, already: int) -> None:
        """Read and drop the rest of the body (up to drain_limit), so that the client reads its
        answer instead of a reset connection."""
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
