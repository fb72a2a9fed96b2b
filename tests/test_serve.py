"""The HTTP API: captions with attention, and a 4xx JSON answer for every bad request."""

import io
import threading

import pytest
from helpers import shape_image

pytest.importorskip("fastapi")
pytest.importorskip("multipart")
from fastapi.testclient import TestClient  # noqa: E402

from captionkit.inference.captioner import Captioner  # noqa: E402
from captionkit.inference.shipped import DEFAULT_MODEL  # noqa: E402
from captionkit.serve import ServeConfig, create_app  # noqa: E402

LIMIT = 200_000


@pytest.fixture(scope="module")
def shipped():
    return Captioner.load()


@pytest.fixture(scope="module")
def client(shipped):
    app = create_app({DEFAULT_MODEL.name: shipped}, ServeConfig(max_upload_bytes=LIMIT, queue_size=4))
    with TestClient(app) as c:
        yield c


def _jpeg(size=96) -> bytes:
    buf = io.BytesIO()
    shape_image(1, size=size).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def test_caption_has_words_and_attention(client, shipped):
    r = client.post("/v1/caption", files={"image": ("x.jpg", _jpeg(), "image/jpeg")}, data={"beam": "2"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["caption"] == " ".join(body["words"]) and body["words"]
    assert body["grid"] == [9, 9] and body["model"] == DEFAULT_MODEL.name and body["beam"] == 2
    assert len(body["attention"]) == len(body["words"])
    assert all(len(row) == 81 and abs(sum(row) - 1) < 1e-3 for row in body["attention"])
    assert body["elapsed_ms"] > 0
    # the same caption as the library gives for the same bytes and beam: every view, and the
    # default's own reranker choosing among its beams as `captionkit caption` does
    assert body["caption"] == shipped(_jpeg(), beam=2).text
    from captionkit.data.images import decode_rgb, to_tensor
    x = to_tensor(decode_rgb(_jpeg()), shipped.encoder.preprocess)
    feats = shipped.encode_batch([x])  # (1, V, L, D): every view
    lists = shipped.nbest_features(feats, 3, beam=2)
    assert body["caption"] == shipped.text(shipped.match(lists, feats)[0])
    assert body["caption"] != shipped.text(lists[0][0])  # (on this photo the matcher's choice is not the beam's)


def test_models_health_and_page(client):
    m = client.get("/v1/models").json()
    assert m["default"] == DEFAULT_MODEL.name and m["models"][0]["grid"] == [9, 9]
    assert m["limits"]["max_upload_bytes"] == LIMIT
    assert client.get("/healthz").json()["status"] == "ok"
    page = client.get("/")
    assert page.status_code == 200 and "/v1/caption" in client.get("/app/js/serve-app.js").text
    assert client.get("/onnx").status_code == 404  # no --onnx export hosted


def _png_truncated() -> bytes:
    buf = io.BytesIO()
    shape_image(0, size=120).save(buf, "PNG")
    return buf.getvalue()[:300]


BAD = [
    ("not an image", dict(files={"image": ("a.jpg", b"hello, not a photo", "image/jpeg")}), 400, "cannot read image"),
    ("truncated", dict(files={"image": ("t.png", _png_truncated(), "image/png")}), 400, "cannot read image"),
    ("zero bytes", dict(files={"image": ("z.jpg", b"", "image/jpeg")}), 400, "empty file"),
    ("too large", dict(files={"image": ("big.jpg", b"\xff" * (LIMIT + 10), "image/jpeg")}), 413, "too large"),
    ("text part type", dict(files={"image": ("a.txt", b"hello", "text/plain")}), 415, "accepted"),
    ("no image field", dict(files={"photo": ("a.jpg", b"x", "image/jpeg")}), 400, "'image'"),
    ("image as text field", dict(data={"image": "abc"}, files={"other": ("o.jpg", b"x", "image/jpeg")}), 400,
     "file upload"),
    ("beam not a number", dict(files={"image": ("x.jpg", b"x", "image/jpeg")}, data={"beam": "three"}), 400, "beam"),
    ("beam too large", dict(files={"image": ("x.jpg", b"x", "image/jpeg")}, data={"beam": "99"}), 400, "beam"),
    ("unknown model", dict(files={"image": ("x.jpg", b"x", "image/jpeg")}, data={"model": "nope"}), 400,
     "unknown model"),
]


@pytest.mark.parametrize("what,kwargs,status,words", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_get_4xx_json(client, what, kwargs, status, words):
    r = client.post("/v1/caption", **kwargs)
    assert r.status_code == status, r.text
    body = r.json()
    assert words in body["error"] and body["status"] == status and "Traceback" not in r.text


def test_bad_bodies_and_methods_get_4xx_json(client):
    for r, status in [
        (client.post("/v1/caption", content=b"{}", headers={"content-type": "application/json"}), 415),
        (client.post("/v1/caption", content=b"--x\r\ngarbage", headers={"content-type": "multipart/form-data; boundary=x"}), 400),
        (client.post("/v1/caption", content=b"abc", headers={"content-type": "multipart/form-data"}), 400),
        (client.get("/v1/caption"), 405),
        (client.get("/nowhere"), 404),
    ]:
        assert r.status_code == status, r.text
        assert "error" in r.json()


def test_streamed_body_over_limit_is_413(client):
    def chunks():
        for _ in range(5):
            yield b"x" * (LIMIT // 2)
    r = client.post("/v1/caption", content=chunks(), headers={"content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 413 and "too large" in r.json()["error"]
    # and the server still captions
    assert client.post("/v1/caption", files={"image": ("x.jpg", _jpeg(), "image/jpeg")}).status_code == 200


@pytest.mark.slow  # a live server
def test_full_queue_answers_503_and_recovers(shipped):
    app = create_app({"m": shipped}, ServeConfig(queue_size=1, max_batch=1))
    worker = app.state.workers["m"]
    gate, busy = threading.Event(), threading.Event()
    real = worker._caption

    def slow(beam, group):
        busy.set()
        gate.wait(30)
        real(beam, group)
    worker._caption = slow
    with TestClient(app) as c:
        results = []

        def post():
            results.append(c.post("/v1/caption", files={"image": ("x.jpg", _jpeg(), "image/jpeg")}).status_code)
        threads = [threading.Thread(target=post) for _ in range(4)]
        threads[0].start()
        # the first request inside the worker before the others come (on a loaded machine all
        # four could otherwise reach the queue before the worker takes one: three refused)
        assert busy.wait(60)
        for t in threads[1:]:
            t.start()
        for _ in range(200):  # one request in the worker, one queued, the others refused
            if results.count(503) >= 2:
                break
            threading.Event().wait(0.05)
        gate.set()
        for t in threads:
            t.join(60)
        assert sorted(results) == [200, 200, 503, 503]
        assert c.post("/v1/caption", files={"image": ("x.jpg", _jpeg(), "image/jpeg")}).status_code == 200


# --- decoding uploads with bounded memory -------------------------------------------------------

def _png_header(w: int, h: int) -> bytes:
    """A PNG whose header says w x h RGBA, followed by a few bytes of (not enough) pixel data:
    opening it works, decoding it would fail."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 6, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b""))


def test_pixel_count_and_decode_memory_are_checked_from_the_header():
    from captionkit.core.errors import ImageError
    from captionkit.data.images import decode_reduced
    with pytest.raises(ImageError, match=r"2000x2000 image is too large \(over 1,000,000 pixels\)"):
        decode_reduced(_png_header(2000, 2000), 260, "h.png", max_pixels=1_000_000)
    # 9400 x 9400 RGBA: 353 MB decoded, more than allowed -> refused before a pixel is decoded
    with pytest.raises(ImageError, match=r"9400x9400 RGBA PNG image would need 3\d\d MiB to decode; the limit is 100 MiB"):
        decode_reduced(_png_header(9400, 9400), 260, "h.png", max_bytes=100 * 2 ** 20)
    with pytest.raises(ImageError, match="cannot read image"):  # allowed: decoding it fails on the bad data
        decode_reduced(_png_header(200, 200), 260, "h.png")


def _photo(mode: str, w: int = 403, h: int = 211):
    """Gradients in every band (and in alpha), so that averaging and conversion both matter."""
    import numpy as np
    from PIL import Image
    y, x = np.mgrid[0:h, 0:w]

    def ramp(k: int):
        return ((x * (3 + k) + y * (5 - k)) % 256).astype(np.uint8)
    if mode in ("RGB", "RGBA", "CMYK", "LA"):
        bands = {"RGB": 3, "RGBA": 4, "CMYK": 4, "LA": 2}[mode]
        return Image.fromarray(np.stack([ramp(k) for k in range(bands)], -1), mode)
    if mode in ("L", "P"):
        im = Image.fromarray(ramp(0), "L")
        return im.convert("P") if mode == "P" else im
    if mode == "I;16":
        return Image.fromarray(ramp(0).astype(np.uint16) * 200 + y.astype(np.uint16))
    if mode == "I":
        return Image.fromarray(ramp(1).astype(np.int32) * 3000 - 7)
    return Image.fromarray(ramp(2).astype(np.float32) / 7.0 - 3.0)  # F


@pytest.mark.parametrize("mode,fmt", [("RGBA", "PNG"), ("LA", "PNG"), ("RGB", "PNG"), ("L", "PNG"), ("P", "PNG"),
                                      ("I;16", "PNG"), ("I", "TIFF"), ("F", "TIFF"), ("CMYK", "TIFF")])
def test_reduced_decode_equals_converting_then_reducing(monkeypatch, mode, fmt):
    """Strip by strip (reduce before conversion where the mode allows) gives what converting the
    whole image and then reducing it gives, up to rounding."""
    import numpy as np
    from PIL import Image

    from captionkit.data import images
    monkeypatch.setattr(images, "STRIP_PIXELS", 403 * 8)  # many strips, the last one partial
    buf = io.BytesIO()
    _photo(mode).save(buf, fmt)
    out, plan = images.decode_reduced(buf.getvalue(), 16)  # goal 48 px: reduced 8 x 4
    assert plan.factor == (8, 4) and plan.size == (403, 211) and out.mode == "RGB" and out.size == (51, 53)
    ref = images.to_rgb(Image.open(io.BytesIO(buf.getvalue()))).reduce(plan.factor)
    diff = np.abs(np.asarray(out, dtype=int) - np.asarray(ref, dtype=int))
    assert diff.max() <= 2, (mode, diff.max())


def test_big_jpeg_is_decoded_in_draft_mode_and_small_photos_as_before():
    import numpy as np

    from captionkit.data.images import decode_reduced, decode_rgb
    buf = io.BytesIO()
    shape_image(1, size=1000).save(buf, "JPEG", quality=90)
    out, plan = decode_reduced(buf.getvalue(), 16)  # goal 48: the decoder scales 1000 px by 1/8
    assert plan.size == (125, 125) and plan.factor == (2, 2) and out.size == (63, 63)
    full = np.asarray(decode_rgb(buf.getvalue()).reduce(16), dtype=float)
    assert np.abs(np.asarray(out, dtype=float)[:62, :62] - full[:62, :62]).mean() < 3
    small, plan = decode_reduced(_jpeg(96), 260)  # smaller than 3 x 260: exactly what decode_rgb gives
    assert plan.factor == (1, 1) and small.tobytes() == decode_rgb(_jpeg(96)).tobytes()


def _rgba_png(side: int) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGBA", (side, side), (30, 120, 200, 255)).save(buf, "PNG")
    return buf.getvalue()


def test_upload_over_the_decode_limits_gets_400(shipped):
    app = create_app({"m": shipped}, ServeConfig(max_decode_bytes=8 * 2 ** 20, max_pixels=5_000_000))
    with TestClient(app) as c:
        big = c.post("/v1/caption", files={"image": ("big.png", _rgba_png(2000), "image/png")})
        assert big.status_code == 400 and "would need" in big.json()["error"] and "limit is 8 MiB" in big.json()["error"]
        huge = c.post("/v1/caption", files={"image": ("huge.png", _png_header(3000, 3000), "image/png")})
        assert huge.status_code == 400 and "over 5,000,000 pixels" in huge.json()["error"]
        memory = c.get("/v1/models").json()["memory"]
        assert memory["decoding_bytes"] == 2 * 8 * 2 ** 20 and memory["baseline_bytes"] > 0
        assert memory["worst_case_bytes"] == sum(v for k, v in memory.items() if k.endswith("_bytes") and k != "worst_case_bytes")


@pytest.mark.slow  # a flood of uploads to a live server
def test_flood_of_big_uploads_is_answered_within_the_decode_bounds(shipped, monkeypatch):
    """Eight big PNGs at once, one decoder, three uploads held: every request is answered (a
    caption, or 503 busy), never more than one decode runs, never more than three are held."""
    import captionkit.serve.app as serve_app
    app = create_app({"m": shipped}, ServeConfig(decode_workers=1, decode_queue=3))
    held = app.state.held
    real, lock = serve_app.decode_reduced, threading.Lock()
    seen = {"running": 0, "most_running": 0, "most_held": 0}

    def counted(*args, **kwargs):
        with lock:
            seen["running"] += 1
            seen["most_running"] = max(seen["most_running"], seen["running"])
            seen["most_held"] = max(seen["most_held"], held.used)
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                seen["running"] -= 1
    monkeypatch.setattr(serve_app, "decode_reduced", counted)
    png = _rgba_png(2000)
    with TestClient(app) as c:
        answers = []

        def send():
            r = c.post("/v1/caption", files={"image": ("big.png", png, "image/png")})
            answers.append((r.status_code, r.json(), r.headers.get("retry-after")))
        threads = [threading.Thread(target=send) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert len(answers) == 8
    for status, body, retry in answers:
        assert (status == 200 and body["caption"]) or (status == 503 and "busy" in body["error"] and retry == "1")
    assert any(a[0] == 200 for a in answers)
    assert seen["most_running"] == 1 and 1 <= seen["most_held"] <= 3 and held.used == 0


# --- a live server: deadlines, disconnects, the API key ------------------------------------------

KEY = "sesame-0123"


@pytest.fixture(scope="module")
def live(shipped):
    """The app under uvicorn with the guarded protocol, in a thread, on a free loopback port;
    1 s deadlines. Its log goes to the root logger (caplog)."""
    from captionkit.serve.app import make_server
    from captionkit.serve.net import bind
    config = ServeConfig(max_upload_bytes=LIMIT, header_timeout=1.0, body_timeout=1.0, api_key=KEY)
    server = make_server(create_app({DEFAULT_MODEL.name: shipped}, config), config, log_config=None)
    sock = bind("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        threading.Event().wait(0.05)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def _connect(port: int):
    import socket
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    return s


def _read_until_closed(s) -> tuple[bytes, float]:
    import time
    t0, data = time.perf_counter(), b""
    while chunk := s.recv(65536):
        data += chunk
    return data, time.perf_counter() - t0


def _caption_head(length: int, key: str | None = KEY) -> bytes:
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST /v1/caption HTTP/1.1\r\nHost: x\r\n{auth}Content-Type: multipart/form-data; boundary=b\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


PART = b'--b\r\nContent-Disposition: form-data; name="image"; filename="x.jpg"\r\nContent-Type: image/jpeg\r\n\r\n'


@pytest.mark.slow  # waits for the header timeout
def test_idle_connection_is_closed_after_the_header_timeout(live):
    s = _connect(live)  # sends nothing
    data, secs = _read_until_closed(s)
    assert data == b"" and 0.8 < secs < 5
    s = _connect(live)  # one request, then idle: closed again, the deadline restarts after a response
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    data, secs = _read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 200") and b'"status":"ok"' in data and 0.8 < secs < 5


def test_slow_head_gets_408_when_its_deadline_passes(live):
    import select
    import time
    s = _connect(live)
    t0 = time.perf_counter()
    for ch in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 40:  # a byte every 0.2 s
        if select.select([s], [], [], 0)[0]:  # answered: stop sending (into a closed socket)
            break
        s.sendall(bytes([ch]))
        time.sleep(0.2)
    data, _ = _read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 408") and b"no complete request head within 1 s" in data
    assert time.perf_counter() - t0 < 5


def test_a_client_sending_across_its_deadline_reads_the_408_and_a_clean_end(live):
    """A client still sending when its head deadline passes must read the 408 and then an orderly
    end of stream. Closing a socket with unread bytes in it makes the kernel send a reset instead,
    and the client's next read fails with ECONNRESET; so the server half-closes and reads on."""
    import select
    import time
    s = _connect(live)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ")
    t0 = time.perf_counter()
    while not select.select([s], [], [], 0)[0] and time.perf_counter() - t0 < 5:
        s.sendall(b"a")  # a byte every 0.2 ms: some are in flight when the deadline passes
        time.sleep(0.0002)
    data, _ = _read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 408") and b"no complete request head within 1 s" in data


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= 40 or r.exc_info]


def test_stalled_body_gets_408_and_leaves_no_traceback(live, caplog):
    s = _connect(live)
    s.sendall(_caption_head(100_000) + PART + b"x" * 1000)  # then nothing
    data, secs = _read_until_closed(s)
    assert data.startswith(b"HTTP/1.1 408") and b"request body stalled for 1 s" in data and secs < 5
    threading.Event().wait(0.3)  # the app has seen the disconnect
    assert _errors(caplog) == []


def test_client_leaving_mid_request_leaves_no_traceback(live, caplog):
    import http.client
    s = _connect(live)
    s.sendall(_caption_head(100_000) + PART + b"x" * 1000)
    threading.Event().wait(0.2)
    s.close()  # mid-body
    threading.Event().wait(0.3)
    c = http.client.HTTPConnection("127.0.0.1", live, timeout=10)  # and the server still answers
    c.request("GET", "/healthz")
    assert c.getresponse().status == 200
    assert _errors(caplog) == []


def _post_photo(port: int, headers: dict) -> tuple[int, dict, dict]:
    import http.client
    import json
    body = PART + _jpeg() + b"\r\n--b--\r\n"
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    c.request("POST", "/v1/caption", body=body, headers={"Content-Type": "multipart/form-data; boundary=b", **headers})
    r = c.getresponse()
    return r.status, json.loads(r.read()), dict(r.getheaders())


def test_api_key_is_required_on_v1(live):
    import http.client
    status, body, headers = _post_photo(live, {})
    assert status == 401 and "missing API key" in body["error"] and headers["www-authenticate"] == "Bearer"
    status, body, _ = _post_photo(live, {"Authorization": "Bearer not-the-key"})
    assert status == 401 and body["error"] == "wrong API key"
    status, body, _ = _post_photo(live, {"Authorization": "Basic " + KEY})
    assert status == 401
    status, body, _ = _post_photo(live, {"Authorization": f"Bearer {KEY}"})
    assert status == 200 and body["caption"]
    c = http.client.HTTPConnection("127.0.0.1", live, timeout=10)
    for path, status in [("/v1/models", 401), ("/healthz", 200), ("/", 200)]:  # the page and health stay open
        c.request("GET", path)
        r = c.getresponse()
        r.read()
        assert r.status == status, path


def test_rate_limit_answers_429_with_retry_after(shipped):
    app = create_app({"m": shipped}, ServeConfig(rate_limit=2))
    with TestClient(app) as c:
        assert [c.get("/v1/models").status_code for _ in range(2)] == [200, 200]
        r = c.get("/v1/models")
        assert r.status_code == 429 and "2 requests per minute" in r.json()["error"]
        assert 1 <= int(r.headers["retry-after"]) <= 30
        assert c.get("/healthz").status_code == 200  # only /v1/ is limited


def test_wrong_api_keys_count_toward_the_rate_limit(shipped):
    """Issue 29, item 16: 401 answers did not count toward --rate-limit, so keys could be
    guessed as fast as the server answers."""
    app = create_app({"m": shipped}, ServeConfig(rate_limit=2, api_key=KEY))
    with TestClient(app) as c:
        wrong = {"Authorization": "Bearer not-the-key"}
        assert [c.get("/v1/models", headers=wrong).status_code for _ in range(2)] == [401, 401]
        assert c.get("/v1/models", headers=wrong).status_code == 429
        assert c.get("/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 429  # same client


def test_rate_limit_bucket_refills_and_forgets_idle_clients():
    from captionkit.serve.guards import RateLimit
    now = [0.0]
    rl = RateLimit(None, per_minute=6, clock=lambda: now[0])  # a token every 10 s, bursts of 6
    assert [rl.take("a") for _ in range(6)] == [0.0] * 6
    assert rl.take("a") == pytest.approx(10.0) and rl.take("b") == 0.0  # per client
    now[0] = 25.0
    assert rl.take("a") == 0.0 and rl.take("a") == 0.0 and rl.take("a") == pytest.approx(5.0)
    rl.MAX_CLIENTS = 3
    now[0] = 200.0  # a and b are full again: forgotten when the table is full
    rl.take("c"), rl.take("d")
    assert set(rl.buckets) <= {"c", "d"}


# --- the command line: bad values fail before the models load --------------------------------------

@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if anything loads a model; record what serve() would have been given."""
    import captionkit.serve.app as serve_app
    calls = []
    monkeypatch.setattr(Captioner, "load", classmethod(lambda *a, **k: pytest.fail("a model was loaded")))
    monkeypatch.setattr(serve_app, "serve", lambda model, sock, cfg, threads=None, **where: calls.append((sock, cfg)))
    monkeypatch.delenv("CAPTIONKIT_API_KEY", raising=False)
    return calls


@pytest.mark.parametrize("args,message", [
    (["--port", "99999"], "--port must be between 0 and 65535, got 99999"),
    (["--port", "-1"], "--port must be between 0 and 65535"),
    (["--host", "192.0.2.1", "--port", "0"], "cannot listen on --host 192.0.2.1 --port 0: Cannot assign requested address"),
    (["--header-timeout", "0"], "--header-timeout must be positive, got 0"),
    (["--rate-limit", "-5"], "--rate-limit must be positive"),
    (["--api-key", "two words"], "--api-key (or CAPTIONKIT_API_KEY) must be printable ASCII"),
    (["--drain-timeout", "0"], "--drain-timeout must be positive, got 0"),
    (["--access-log", "/nonexistent-dir/a.jsonl"], "--access-log /nonexistent-dir/a.jsonl: cannot write: No such file"),
])
def test_bad_serve_options_are_one_line_before_any_model(no_model_load, capsys, args, message):
    from captionkit.cli.main import main
    assert main(["serve", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("captionkit serve: error: ") and message in err and err.count("\n") == 1
    assert no_model_load == []


def test_port_in_use_is_one_line(no_model_load, capsys):
    import socket

    from captionkit.cli.main import main
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--port", str(port)]) == 2
    assert f"cannot listen on --host 127.0.0.1 --port {port}: Address already in use" in capsys.readouterr().err


def test_listening_beyond_loopback_without_a_key_warns(no_model_load, capsys, monkeypatch):
    from captionkit.cli.main import main
    assert main(["serve", "--host", "0.0.0.0", "--port", "0"]) == 0
    assert "warning: listening on all interfaces without an API key" in capsys.readouterr().err
    monkeypatch.setenv("CAPTIONKIT_API_KEY", KEY)
    assert main(["serve", "--host", "0.0.0.0", "--port", "0", "--rate-limit", "30"]) == 0
    assert "warning" not in capsys.readouterr().err
    sock, cfg = no_model_load[-1]
    assert cfg.api_key == KEY and cfg.rate_limit == 30
    assert main(["serve", "--port", "0"]) == 0 and "warning" not in capsys.readouterr().err  # loopback
    for sock, _ in no_model_load:
        sock.close()


def test_every_serve_option_reaches_the_server(monkeypatch, tmp_path):
    """Each of serve's options, given a value other than its default, is what the server is
    started with (its ServeConfig, models, threads, device and precision)."""
    import captionkit.serve.app as serve_app
    from captionkit.cli.main import main
    started = []
    monkeypatch.setattr(Captioner, "load", classmethod(lambda *a, **k: pytest.fail("a model was loaded")))
    monkeypatch.setattr(serve_app, "serve", lambda model, sock, cfg, **kw: started.append((model, sock, cfg, kw)))
    monkeypatch.delenv("CAPTIONKIT_API_KEY", raising=False)
    (tmp_path / "manifest.json").write_text('{"format": "captionkit-onnx"}')
    given = {"max_upload_bytes": 3 * 2 ** 20, "queue_size": 5, "max_batch": 2, "onnx_dir": str(tmp_path),
             "api_key": KEY, "rate_limit": 30.0, "max_pixels": 1000, "decode_workers": 3,
             "max_decode_bytes": 64 * 2 ** 20, "decode_queue": 4, "max_connections": 7, "header_timeout": 2.0,
             "body_timeout": 3.0, "drain_timeout": 4.0, "access_log": str(tmp_path / "access.jsonl")}
    assert all(getattr(ServeConfig(), k) != v for k, v in given.items())
    assert main(["serve", "--port", "0", "--model", "a", "--model", "b", "--max-upload-mb", "3", "--queue-size", "5",
                 "--max-batch", "2", "--onnx", str(tmp_path), "--api-key", KEY, "--rate-limit", "30",
                 "--max-pixels", "1000", "--decode-workers", "3", "--decode-memory-mb", "64", "--decode-queue", "4",
                 "--max-connections", "7", "--header-timeout", "2", "--body-timeout", "3", "--drain-timeout", "4",
                 "--access-log", str(tmp_path / "access.jsonl"), "--threads", "1",
                 "--device", "cpu", "--precision", "fp32"]) == 0
    (model, sock, cfg, kw), = started
    sock.close()
    assert {k: getattr(cfg, k) for k in given} == given
    assert model == ["a", "b"] and kw["threads"] == 1 and str(kw["device"]) == "cpu" and kw["precision"] == "fp32"
