"""The web pages: the JS resize equals Pillow's; headless Chromium drives the served page and the
in-browser ONNX page and gets the captions `captionkit caption` gives."""

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from captionkit.inference.shipped import FAST_MODEL
from helpers import free_port

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "src" / "captionkit" / "web"
SAMPLE = ROOT / "samples" / "astronaut.jpg"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROME_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]

RESIZE_JS = """
import { resizeBicubic } from %s;
import fs from "fs";
const [,, inp, w, h, ow, oh, outp] = process.argv;
fs.writeFileSync(outp, resizeBicubic(new Uint8Array(fs.readFileSync(inp)), +w, +h, +ow, +oh));
"""


def _need(cond: bool, why: str):
    if not cond:
        print(f"skipped: {why}")
        pytest.skip(why)


@pytest.mark.parametrize("w,h,ow,oh", [(500, 375, 260, 260), (333, 500, 260, 260), (100, 80, 260, 260),
                                       (37, 1000, 260, 260), (700, 90, 260, 260), (260, 300, 260, 260),
                                       (57, 190, 380, 338)])
def test_js_bicubic_resize_equals_pillow(tmp_path, w, h, ow, oh):
    _need(shutil.which("node") is not None, "node is not installed")
    script = tmp_path / "resize.mjs"
    script.write_text(RESIZE_JS % json.dumps((WEB / "js" / "preprocess.js").as_uri()))
    a = np.random.default_rng(w * h).integers(0, 256, (h, w, 3), dtype=np.uint8)
    (tmp_path / "in.raw").write_bytes(a.tobytes())
    subprocess.run(["node", str(script), str(tmp_path / "in.raw"), str(w), str(h), str(ow), str(oh),
                    str(tmp_path / "out.raw")], check=True, timeout=60)
    js = np.frombuffer((tmp_path / "out.raw").read_bytes(), np.uint8).reshape(oh, ow, 3)
    py = np.asarray(Image.fromarray(a).resize((ow, oh), Image.Resampling.BICUBIC))
    assert np.array_equal(js, py)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("fastapi")
    pytest.importorskip("onnxruntime")
    _need(Path(CHROMIUM).exists(), "Debian's chromium is not installed (apt-get install chromium)")
    _need((WEB / "vendor" / "ort" / "ort.wasm.min.mjs").exists(), "onnxruntime-web is not built (make web)")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        _need(False, "playwright (python) is not installed")
    export = tmp_path_factory.mktemp("onnx-shipped")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "-m", "captionkit", "export", "onnx", "--out", str(export)],
                   check=True, env=env, capture_output=True, timeout=300)
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "captionkit", "serve", "--port", str(port), "--onnx", str(export)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(url + "/readyz", timeout=1)  # (/healthz answers while the models load)
            break
        except OSError:
            if proc.poll() is not None:
                raise RuntimeError(proc.stdout.read().decode())
            time.sleep(0.1)
    yield url
    proc.terminate()
    proc.wait(20)


@pytest.fixture(scope="module")
def browser(server, tmp_path_factory):
    from playwright.sync_api import sync_playwright
    profile = tmp_path_factory.mktemp("chromium-profile")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, args=CHROME_ARGS,
                                                   headless=True)
        yield ctx
        ctx.close()


def _cli_caption(photo: Path, beam: int, model: str | None = None) -> str:
    """The command line's caption of ``photo`` by ``model`` (None: the default captioner, which
    the server runs; the in-browser page runs what `export onnx` exports when given no --model,
    FAST_MODEL: the default is an ensemble, which ONNX export does not take)."""
    r = subprocess.run([sys.executable, "-m", "captionkit", "caption", str(photo), "--beam", str(beam),
                        *(["--model", model] if model else [])],
                       capture_output=True, text=True, check=True, timeout=300,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    return r.stdout.strip().split("\t")[1]


def _caption_on(page, photo: Path, beam: str) -> str:
    before = int(page.evaluate("document.body.dataset.captioned || 0"))
    page.select_option("#beam", beam)
    page.wait_for_function(f"Number(document.body.dataset.captioned || 0) >= {before}")
    page.set_input_files("#file", str(photo))
    page.wait_for_function(f"Number(document.body.dataset.captioned || 0) > {before}", timeout=120_000)
    # changing the beam may have re-captioned the last file; wait until the page is quiet
    page.wait_for_timeout(300)
    page.wait_for_function("!document.getElementById('status').textContent.startsWith('captioning')",
                           timeout=120_000)
    return page.inner_text("#caption")


def _check_attention_view(page):
    words = page.locator(".word")
    n = words.count()
    assert n >= 2
    for i in (0, n - 1):
        words.nth(i).hover()
        page.wait_for_function(f"document.querySelector('.overlay').dataset.index === '{i}'")
        assert page.eval_on_selector(".overlay", "c => c.dataset.word") == words.nth(i).inner_text()
        # the overlay is drawn over the photo, darker where the model did not look
        alphas = page.eval_on_selector(".overlay", """c => {
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let lo = 255, hi = 0; for (let j = 3; j < d.length; j += 4) { lo = Math.min(lo, d[j]); hi = Math.max(hi, d[j]); }
            return [c.width, lo, hi]; }""")
        assert alphas[0] > 0 and alphas[2] - alphas[1] > 50


def test_served_page_captions_and_shows_attention(server, browser):
    page = browser.new_page()
    page.goto(server + "/")
    page.wait_for_selector("body[data-ready='1']", timeout=60_000)
    text = _caption_on(page, SAMPLE, "3")
    assert text == _cli_caption(SAMPLE, 3)
    assert "beam 3" in page.inner_text("#status")
    _check_attention_view(page)
    page.close()


def test_in_browser_onnx_page_gives_the_cli_caption(server, browser):
    page = browser.new_page()
    page.goto(server + "/onnx")
    page.wait_for_selector("body[data-ready='1']", timeout=120_000)
    for beam in ("3", "1"):
        assert _caption_on(page, SAMPLE, beam) == _cli_caption(SAMPLE, int(beam), FAST_MODEL.name), f"beam {beam}"
    _check_attention_view(page)
    page.close()
