"""The HTTP API: captions with attention, and a 4xx JSON answer for every bad request."""

import io
import threading

import pytest
from conftest import shape_image

pytest.importorskip("fastapi")
pytest.importorskip("multipart")
from fastapi.testclient import TestClient  # noqa: E402

from captionkit.captioner import DEFAULT_MODEL, Captioner  # noqa: E402
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
    # the same caption as the library gives for the same bytes and beam
    from captionkit.images import decode_rgb, to_tensor
    x = to_tensor(decode_rgb(_jpeg()), shipped.encoder.preprocess)[None]
    ref = shipped.result(shipped.decode_features(shipped.encoder(x), beam=2)[0])
    assert body["caption"] == ref.text


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


def test_full_queue_answers_503_and_recovers(shipped):
    app = create_app({"m": shipped}, ServeConfig(queue_size=1, max_batch=1))
    worker = app.state.workers["m"]
    gate = threading.Event()
    real = worker._caption

    def slow(beam, group):
        gate.wait(30)
        real(beam, group)
    worker._caption = slow
    with TestClient(app) as c:
        results = []
        threads = [threading.Thread(target=lambda: results.append(
            c.post("/v1/caption", files={"image": ("x.jpg", _jpeg(), "image/jpeg")}).status_code)) for _ in range(4)]
        for t in threads:
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
