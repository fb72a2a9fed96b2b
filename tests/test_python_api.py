"""The Python API (issue 29, items 3 and 10; docs/python-api.md): ``captionkit.load()`` on the
command line's "auto" device, and ``cap(images)`` on every kind of input -- a path, a str, an
http(s) URL (served here by a local server), a PIL image, a numpy array, bytes, a list mixing
them -- each giving the caption the same photo gets as a file; bad inputs come back as error
results in their place. On the picky decoder (tests/helpers.py), whose captions follow the
pixels, so a photo read differently would show in its caption."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from helpers import LocalServer, http_body, http_silent, http_trickle
from PIL import Image

import captionkit
from captionkit.inference.captioner import CaptionResult, Captioner


@pytest.fixture(scope="module")
def cap(picky_models) -> Captioner:
    return captionkit.load(str(picky_models[0]))


@pytest.fixture(scope="module")
def photos(picky_data) -> list[Path]:
    return sorted((picky_data / "Flicker8k_Dataset").iterdir())


@pytest.fixture(scope="module")
def by_file(cap, photos) -> dict[Path, tuple[str, float]]:
    """Each photo's caption and log-probability as caption_files gives them for its file."""
    out = {}
    for path, res in cap.caption_files(photos, workers=0):
        (best,) = cap.decode_features(cap.encode_batch([_pixels(cap, path)]))  # for its log-probability
        assert cap.text(best) == res.text
        out[path] = (res.text, best.logprob)
    return out


def _pixels(cap, path):
    from captionkit.data.images import load_rgb, to_tensor
    return to_tensor(load_rgb(path), cap.encoder.preprocess)


@pytest.fixture(scope="module")
def server(photos):
    routes = {f"/photos/{p.name}": http_body(p.read_bytes()) for p in photos}
    routes["/chunked.png"] = http_body(photos[0].read_bytes(), length=False)
    routes["/big.png"] = http_body(photos[0].read_bytes())
    routes["/slow.png"] = http_trickle(photos[0].read_bytes(), every=0.05)
    routes["/silent.png"] = http_silent(5)
    routes["/text"] = http_body(b"<html>not a photo</html>")
    with LocalServer(routes) as s:
        yield s


KINDS = {
    "Path": lambda p, server: p,
    "str": lambda p, server: str(p),
    "URL": lambda p, server: server.url(f"/photos/{p.name}"),
    "PIL": lambda p, server: Image.open(p),
    "PIL RGBA": lambda p, server: Image.open(p).convert("RGBA"),  # opaque: composited on white, as a file is
    "numpy": lambda p, server: np.asarray(Image.open(p).convert("RGB")),
    "numpy view": lambda p, server: np.asarray(Image.open(p).convert("RGBA"))[:, :, :3],  # not contiguous
    "bytes": lambda p, server: p.read_bytes(),
    "bytearray": lambda p, server: bytearray(p.read_bytes()),
}


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_of_input_gets_the_caption_of_its_file(kind, cap, photos, by_file, server):
    for path in photos[:4]:
        res = cap(KINDS[kind](path, server))
        assert isinstance(res, CaptionResult) and res.ok and res.error is None
        assert (res.text, res.logprob) == pytest.approx(by_file[path], abs=1e-4)
        assert res.words == res.text.split()
        assert res.attention is None and res.grid is None  # not asked for


def test_a_list_mixing_every_kind_gives_a_list_in_its_order(cap, photos, by_file, server):
    items = [KINDS[k](p, server) for k, p in zip(KINDS, photos)]
    for batch_size in (1, 3, 16):
        results = cap(items, batch_size=batch_size)
        assert isinstance(results, list) and len(results) == len(items)
        assert [r.text for r in results] == [by_file[p][0] for p in photos[:len(items)]]
    assert [r.source for r in results] == [str(photos[0]), str(photos[1]), server.url(f"/photos/{photos[2].name}"),
                                           *(f"images[{i}]" for i in range(3, len(items)))]
    assert cap(tuple(items[:2]))[1].text == results[1].text  # a tuple is a list too
    assert cap([]) == []


def test_batches_are_encoded_together(cap, photos, monkeypatch):
    calls = []
    real = Captioner.encode

    def encode(self, pixels):
        calls.append(pixels.shape[0])
        return real(self, pixels)

    monkeypatch.setattr(Captioner, "encode", encode)
    cap([*photos[:5], "missing.jpg", *photos[5:7]], batch_size=3)
    assert calls == [3, 2, 2]  # batches of 3 inputs; the missing file leaves its batch one short


def test_bad_inputs_are_error_results_in_their_place(cap, photos, by_file, server, tmp_path):
    (tmp_path / "empty.jpg").write_bytes(b"")
    (tmp_path / "junk.jpg").write_bytes(b"not a photo")
    grey = np.asarray(Image.open(photos[1]).convert("RGB"))
    bad = {
        str(tmp_path / "missing.jpg"): f"{tmp_path / 'missing.jpg'}: no such file",
        tmp_path / "junk.jpg": f"{tmp_path / 'junk.jpg'}: cannot read image",
        tmp_path / "empty.jpg": f"{tmp_path / 'empty.jpg'}: empty file",
        b"GIF89a not really": "images[4] (bytes): cannot read image",  # (images[0] is a good photo)
        b"": "images[5] (bytes): empty file",
        server.url("/missing.png"): f"{server.url('/missing.png')}: HTTP 404",
        server.url("/text"): f"{server.url('/text')}: cannot read image",
        "ftp://example.com/x.jpg": "ftp://example.com/x.jpg: only http:// and https:// URLs are downloaded",
        "http://127.0.0.1:1/x.jpg": "http://127.0.0.1:1/x.jpg: cannot download",  # nothing listens on port 1
        "channels first": "images[10] (numpy array): shape 3x64x64 looks channels-first",
        "floats": "images[11] (numpy array): a float32 array; give uint8 pixels 0-255",
        "two channels": "images[12] (numpy array): shape 64x64x2",
        "tiny array": "images[13] (numpy array): 4x4 image is too small",
        "an int": "images[14]: cannot caption a value of type int",
        "tiny PIL": "images[15] (PIL image): 4x4 image is too small",
    }
    items = list(bad)
    items[9:] = [grey.transpose(2, 0, 1).copy(), grey.astype(np.float32) / 255, grey[:, :, :2],
                 grey[:4, :4], 7, Image.new("RGB", (4, 4))]
    good = [photos[0], photos[1]]
    results = cap([good[0], *items, good[1]])
    assert [r.ok for r in results] == [True] + [False] * len(items) + [True]
    assert [results[0].text, results[-1].text] == [by_file[p][0] for p in good]  # the others go on
    for res, (source, message) in zip(results[1:-1], bad.items()):
        assert res.text is None and res.words is None and res.logprob is None and res.attention is None
        assert message in res.error and "\n" not in res.error, (source, res.error)
    # a single bad input is one error result, never an exception
    single = cap(str(tmp_path / "missing.jpg"))
    assert not single.ok and single.error == f"{tmp_path / 'missing.jpg'}: no such file"


def test_a_url_over_the_size_limit_or_the_timeout_is_an_error_result(cap, photos, by_file, server, monkeypatch):
    size = photos[0].stat().st_size
    big, chunked = server.url("/big.png"), server.url("/chunked.png")
    # Content-Length over the limit: refused before the body is read; without one, while reading
    results = cap([big, chunked], url_max_bytes=size - 1)
    assert [r.error for r in results] == [f"{big}: {size:,} bytes is over the {size - 1:,} bytes limit "
                                          f"(CAPTIONKIT_URL_MAX_BYTES)",
                                          f"{chunked}: over the {size - 1:,} bytes limit (CAPTIONKIT_URL_MAX_BYTES)"]
    assert [r.text for r in cap([big, chunked], url_max_bytes=size)] == [by_file[photos[0]][0]] * 2
    monkeypatch.setenv("CAPTIONKIT_URL_MAX_BYTES", str(size - 1))  # the limit from the environment
    assert "over the" in cap(big).error
    monkeypatch.delenv("CAPTIONKIT_URL_MAX_BYTES")
    # the timeout bounds the whole download: a server trickling its bytes is stopped at it, and so
    # is one that never answers
    for path in ("/slow.png", "/silent.png"):
        t0 = time.perf_counter()
        res = cap(server.url(path), url_timeout=0.5)
        took = time.perf_counter() - t0
        assert res.error == f"{server.url(path)}: no complete answer within 0.5 s (the timeout, CAPTIONKIT_URL_TIMEOUT)"
        assert took < 2.0, took
    monkeypatch.setenv("CAPTIONKIT_URL_TIMEOUT", "0.3")
    assert "within 0.3 s" in cap(server.url("/silent.png")).error


def test_attention_when_asked(cap, photos):
    plain, with_attention = cap(photos[0]), cap(photos[0], attention=True)
    assert with_attention.text == plain.text and plain.attention is None
    rows, cols = with_attention.grid
    assert with_attention.attention.shape == (len(with_attention.words), rows * cols)
    assert with_attention.attention.sum(1).numpy() == pytest.approx(1.0, abs=1e-3)  # weights over the grid
    (_, res), = cap.caption_files([photos[0]], workers=0)
    assert (with_attention.attention == res.attention).all()  # what the attention figures show


def test_decoding_options_are_those_of_caption_files(cap, photos):
    from helpers import direct_captions

    for options in ({"beam": 1}, {"beam": 5, "length_penalty": 1.0}):
        want = direct_captions(cap, photos, **options)
        assert [r.text for r in cap(photos, **options)] == [want[p.name] for p in photos]


def test_load_takes_the_command_lines_auto_device(picky_models, monkeypatch):
    """Captioner.load and captionkit.load default to --device's "auto" (core.devices: a CUDA GPU,
    else MPS, else the CPU); they were on the CPU whatever the machine had."""
    import captionkit.inference.captioner as captioner_module

    asked = []
    real = captioner_module.resolve_device
    monkeypatch.setattr(captioner_module, "resolve_device", lambda spec: asked.append(spec) or real(spec))
    captionkit.load(str(picky_models[0]))
    Captioner.load(picky_models[0], with_encoder=False)
    Captioner.load_ensemble(list(picky_models), with_encoder=False)
    captionkit.load([str(m) for m in picky_models])
    assert asked == ["auto"] * 4


def test_options_that_make_no_sense_are_refused(cap, photos):
    for options in ({"batch_size": 0}, {"workers": 0}):
        with pytest.raises(captionkit.UserError, match="batch_size and workers must be at least 1"):
            cap(photos[0], **options)


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")
def test_on_a_gpu_load_goes_there_and_calls_caption_as_caption_files(picky_models, photos):
    """"auto" is the GPU where there is one; cap(images) encodes and decodes there, giving what
    caption_files gives on it (float32: the picky decoder's captions flip under bf16 rounding)."""
    cap = captionkit.load(str(picky_models[0]), precision="fp32")
    assert cap.device.type == "cuda"
    want = {p.name: r.text for p, r in cap.caption_files(photos, workers=0)}
    results = cap([*photos, "missing.jpg"], batch_size=5, attention=True)
    assert [r.text for r in results[:-1]] == [want[p.name] for p in photos] and not results[-1].ok
    assert all(r.attention.device.type == "cpu" for r in results[:-1])  # results live on the host
