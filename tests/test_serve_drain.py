"""The server's life for load balancers: /readyz false while loading and when full, a drain on
SIGTERM that answers every request in flight and exits within its bound, a request id on every
answer and log line, JSON access lines.

The process tests run a real `captionkit serve` (tests/serve_standin.py: the fast shipped model,
`transformer-lite2-flickr8k`, its loading and captioning slowed on purpose) and real concurrent
clients over loopback. What is tested is the server's life, not the model's captions (those are
tests/test_serve.py's, with the default), so the quickest shipped model serves here."""

from __future__ import annotations

import http.client
import io
import json
import logging
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from helpers import shape_image

pytest.importorskip("fastapi")
pytest.importorskip("multipart")
from fastapi.testclient import TestClient  # noqa: E402

from captionkit.inference.captioner import Captioner  # noqa: E402
from captionkit.inference.shipped import FAST_MODEL  # noqa: E402
from captionkit.serve import ServeConfig, create_app  # noqa: E402
from captionkit.serve.lifecycle import Gate, install_log_ids  # noqa: E402

STANDIN = Path(__file__).with_name("serve_standin.py")
HEX_ID = re.compile(r"[0-9a-f]{32}")


def _jpeg(seed: int = 1) -> bytes:
    buf = io.BytesIO()
    shape_image(seed, size=96).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _multipart(data: bytes) -> tuple[bytes, str]:
    head = (b'--b\r\nContent-Disposition: form-data; name="image"; filename="x.jpg"\r\n'
            b"Content-Type: image/jpeg\r\n\r\n")
    return head + data + b"\r\n--b--\r\n", "multipart/form-data; boundary=b"


def _request(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
             timeout: float = 60) -> tuple[int, dict, dict | None]:
    """(status, headers with lower-case names, JSON body or None)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        r = conn.getresponse()
        raw = r.read()
        try:
            doc = json.loads(raw)
        except ValueError:
            doc = None
        return r.status, {k.lower(): v for k, v in r.getheaders()}, doc
    finally:
        conn.close()


def _caption(port: int, seed: int = 1, headers: dict | None = None, timeout: float = 60):
    body, ctype = _multipart(_jpeg(seed))
    return _request(port, "POST", "/v1/caption", body, {"Content-Type": ctype, **(headers or {})}, timeout)


class Standin:
    """A `captionkit serve` process (tests/serve_standin.py) on a free loopback port."""

    def __init__(self, tmp: Path, load_delay: float, caption_delay: float, *serve_args: str):
        self.log = tmp / "server.log"
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(STANDIN), "--load-delay", str(load_delay), "--caption-delay", str(caption_delay),
                 "--", "--port", "0", "--threads", "1", "--model", FAST_MODEL.name, *serve_args],
                stdout=out, stderr=subprocess.STDOUT)
        self.port = 0
        deadline = time.time() + 60
        while not self.port:
            m = re.search(r"listening at http://127\.0\.0\.1:(\d+)/", self.output())
            if m:
                self.port = int(m.group(1))
            elif self.proc.poll() is not None or time.time() > deadline:
                self.close()
                pytest.fail(f"the server did not start:\n{self.output()[-2000:]}")
            else:
                time.sleep(0.05)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, limit: float = 120) -> float:
        t0 = time.time()
        while _request(self.port, "GET", "/readyz")[0] != 200:
            assert self.proc.poll() is None and time.time() - t0 < limit, self.output()[-2000:]
            time.sleep(0.1)
        return time.time() - t0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def standin(tmp_path):
    servers = []

    def start(*args, **kwargs) -> Standin:
        servers.append(Standin(tmp_path, *args, **kwargs))
        return servers[-1]
    yield start
    for s in servers:
        s.close()


@pytest.mark.slow  # a server process
def test_readyz_is_503_while_loading_then_200_and_answers_carry_request_ids(standin, tmp_path):
    access = tmp_path / "access.jsonl"
    server = standin(4.0, 0.0, "--access-log", str(access), "--body-timeout", "1")
    # loading (4 s on purpose): alive, not ready, and every other request is a 503 with an id
    status, headers, doc = _request(server.port, "GET", "/readyz")
    assert status == 503 and doc["state"] == "loading" and not doc["ready"], doc
    assert _request(server.port, "GET", "/healthz")[0] == 200
    status, headers, doc = _caption(server.port)
    assert status == 503 and "loading" in doc["error"] and headers["retry-after"] == "1"
    assert HEX_ID.fullmatch(headers["x-request-id"])
    waited = server.wait_ready()
    assert waited > 1.0  # it was not ready at once: the delay was seen from outside
    status, _, doc = _request(server.port, "GET", "/readyz")
    assert status == 200 and doc == {"ready": True, "state": "ready", "in_flight": 0}

    # ids: the client's own echoed, else a new one per request; on errors too
    status, headers, doc = _caption(server.port, headers={"X-Request-ID": "lb-7f3a.42"})
    assert status == 200 and doc["caption"] and headers["x-request-id"] == "lb-7f3a.42"
    first = _caption(server.port)[1]["x-request-id"]
    second = _request(server.port, "POST", "/v1/caption", b"{}", {"Content-Type": "application/json"})
    assert second[0] == 415 and HEX_ID.fullmatch(first) and HEX_ID.fullmatch(second[1]["x-request-id"])
    assert first != second[1]["x-request-id"]
    bad_id = _request(server.port, "GET", "/healthz", headers={"X-Request-ID": "x" * 200})[1]["x-request-id"]
    assert HEX_ID.fullmatch(bad_id)  # too long to echo: replaced

    # a body that stalls: the protocol's 408 carries the id the request was given
    body, ctype = _multipart(_jpeg())
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(f"POST /v1/caption HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
                  f"Content-Length: {len(body)}\r\nX-Request-ID: stalled-1\r\n\r\n".encode() + body[:100])
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert got.startswith(b"HTTP/1.1 408") and b"x-request-id: stalled-1\r\n" in got
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:  # leaves mid-body
        s.sendall(f"POST /v1/caption HTTP/1.1\r\nHost: x\r\nContent-Type: {ctype}\r\n"
                  f"Content-Length: {len(body)}\r\nX-Request-ID: left-1\r\n\r\n".encode() + body[:100])
        time.sleep(0.3)

    # the access log: one JSON line per request, with the same ids (written once the answer is sent)
    t0 = time.time()
    while not all(i in access.read_text() for i in ("stalled-1", "left-1")) and time.time() - t0 < 10:
        time.sleep(0.02)
    lines = [json.loads(line) for line in access.read_text().splitlines()]
    assert all(set(line) == {"time", "id", "method", "path", "status", "ms", "bytes", "client"} for line in lines)
    by_id = {line["id"]: line for line in lines}
    mine = by_id["lb-7f3a.42"]
    assert (mine["method"], mine["path"], mine["status"], mine["client"]) == ("POST", "/v1/caption", 200, "127.0.0.1")
    assert mine["bytes"] > 100 and mine["ms"] > 0 and mine["time"].endswith("Z")
    assert by_id[second[1]["x-request-id"]]["status"] == 415 and by_id[bad_id]["path"] == "/healthz"
    assert by_id["stalled-1"]["status"] == 408  # what the client got, not the app's dropped answer
    assert by_id["left-1"]["status"] == 499 and by_id["left-1"]["bytes"] == 0  # nobody got an answer
    assert [line["status"] for line in lines[:3]] == [503, 200, 503]  # readyz, healthz, caption while loading


@pytest.mark.slow  # a server process and 20 clients
def test_sigterm_during_20_requests_answers_all_then_exits_within_the_bound(standin):
    bound = 30.0
    server = standin(0.0, 1.0, "--drain-timeout", str(bound), "--decode-queue", "32", "--max-batch", "8")
    server.wait_ready()
    answers: list = [None] * 20

    def client(i: int) -> None:
        try:
            answers[i] = _caption(server.port, seed=i % 4, timeout=120)
        except OSError as e:
            answers[i] = e
    threads = [threading.Thread(target=client, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    t0 = time.time()
    while _request(server.port, "GET", "/readyz")[2]["in_flight"] < 20:  # all 20 are in the server
        assert time.time() - t0 < 60, "the 20 requests never were in flight together"
        time.sleep(0.02)

    sent = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    refused_while_draining = False
    while server.proc.poll() is None and not refused_while_draining:
        try:
            socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
            time.sleep(0.02)
        except ConnectionRefusedError:
            refused_while_draining = server.proc.poll() is None
    rc = server.proc.wait(bound + 30)
    took = time.perf_counter() - sent
    for t in threads:
        t.join(10)
    print(f"SIGTERM with 20 requests in flight: exit {rc} after {took:.1f} s (bound {bound:g} s)")
    assert refused_while_draining  # new connections refused while the in-flight ones were answered
    assert [a[0] if isinstance(a, tuple) else a for a in answers] == [200] * 20
    assert all(a[2]["caption"] for a in answers)
    log = server.output()
    assert rc == 0 and took < bound, (rc, took, log[-3000:])
    assert "SIGTERM: no new connections; answering 20 request(s) in flight" in log
    assert "every request answered" in log and "Traceback" not in log


@pytest.mark.slow  # a server process
def test_drain_is_cut_off_at_its_bound_with_exit_status_1(standin):
    server = standin(0.0, 20.0, "--drain-timeout", "1")  # a 20 s caption against a 1 s bound
    server.wait_ready()
    answer: list = []
    t = threading.Thread(target=lambda: answer.append(_safe_caption(server.port)))
    t.start()
    t0 = time.time()
    while _request(server.port, "GET", "/readyz")[2]["in_flight"] < 1:
        assert time.time() - t0 < 30
        time.sleep(0.02)
    sent = time.perf_counter()
    server.proc.send_signal(signal.SIGTERM)
    rc = server.proc.wait(30)
    took = time.perf_counter() - sent
    t.join(10)
    assert rc == 1 and took < 10, (rc, took)
    assert "1 request(s) cut off at the 1 s bound" in server.output()
    status, headers, doc = answer[0]  # the documented 503, with its id, not a reset or a 500
    assert status == 503 and "drain timeout" in doc["error"] and HEX_ID.fullmatch(headers["x-request-id"])
    assert "Traceback" not in server.output()


def _safe_caption(port: int):
    try:
        return _caption(port, timeout=60)
    except OSError as e:
        return e


# --- in one process: readiness when full, ids on every kind of answer and in the log ------------

@pytest.fixture(scope="module")
def gated():
    cap = Captioner.load(FAST_MODEL.name)
    config = ServeConfig(max_upload_bytes=50_000, api_key="k-123", decode_queue=2)
    gate = Gate()
    gate.ready(create_app({FAST_MODEL.name: cap}, config))
    with TestClient(gate) as c:
        yield gate, c


def test_readyz_is_503_when_full_or_draining(gated):
    gate, c = gated
    r = c.get("/readyz")
    assert r.status_code == 200 and r.json()["ready"]
    held = gate.app.state.held
    held.used = held.n  # every decode slot taken: a new upload would get 503
    try:
        r = c.get("/readyz")
        assert r.status_code == 503 and r.json()["state"] == "full"
        assert r.json()["full"] == ["2 uploads waiting to be decoded"]
    finally:
        held.used = 0
    assert c.get("/readyz").status_code == 200


def test_every_answer_has_a_request_id(gated):
    _, c = gated
    answers = [
        c.post("/v1/caption", files={"image": ("x.jpg", _jpeg(), "image/jpeg")}),  # 401: the key middleware
        c.post("/v1/caption", headers={"Authorization": "Bearer k-123"},
               files={"image": ("x.jpg", b"\xff" * 60_000, "image/jpeg")}),  # 413: the size middleware
        c.get("/nothing-here"),  # 404 from the router
        c.get("/healthz"),
    ]
    assert [r.status_code for r in answers] == [401, 413, 404, 200]
    ids = [r.headers["x-request-id"] for r in answers]
    assert all(HEX_ID.fullmatch(i) for i in ids) and len(set(ids)) == 4


def test_an_internal_error_is_logged_with_the_request_id(gated, caplog, monkeypatch):
    gate, c = gated
    worker = next(iter(gate.app.state.workers.values()))

    def broken(*a, **k):
        raise RuntimeError("model fell over")
    monkeypatch.setattr(worker, "submit", broken)
    old = logging.getLogRecordFactory()
    install_log_ids()
    try:
        with caplog.at_level(logging.ERROR, logger="captionkit.serve"):
            r = c.post("/v1/caption", headers={"Authorization": "Bearer k-123", "X-Request-ID": "trace-me-1"},
                       files={"image": ("x.jpg", _jpeg(), "image/jpeg")})
    finally:
        logging.setLogRecordFactory(old)
    assert r.status_code == 500 and r.headers["x-request-id"] == "trace-me-1"
    logged = [rec for rec in caplog.records if rec.name == "captionkit.serve"]
    assert len(logged) == 1 and logged[0].getMessage().startswith("[trace-me-1] POST /v1/caption failed")
    assert "model fell over" in caplog.text  # its traceback, once
