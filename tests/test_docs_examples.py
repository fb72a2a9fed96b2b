"""The Python examples of README.md and docs/python-api.md run as they are (issue 29, item 3:
the README's example crashed with `'ImageError' object has no attribute 'text'` as soon as a
file was missing). Each ```python block runs from the repository's root in a fresh namespace,
with the real default model; ``https://example.com/NAME`` stands for a server of the reader's
and is served here, from samples/, by a local HTTP server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import LocalServer, http_body, place_in_cache

import captionkit

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/python-api.md")
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def examples(page: str) -> list[str]:
    return PYTHON_BLOCK.findall((ROOT / page).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def samples_server():
    routes = {f"/{p.name}": http_body(p.read_bytes()) for p in (ROOT / "samples").glob("*.jpg")}
    with LocalServer(routes) as s:
        yield s


@pytest.fixture(scope="module")
def loaded():
    """captionkit.load once per set of arguments (each example loads its model; loading the
    default one takes seconds)."""
    real, models = captionkit.load, {}

    def load(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in models:
            models[key] = real(*args, **kwargs)
        return models[key]
    return load


HUB_NAMES = ("my-org/my-captioner", "hf:Salesforce/")  # examples that load from the Hugging Face Hub


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory, tiny_hf) -> Path:
    """A huggingface_hub cache holding what the Hub examples name: my-org/my-captioner at main and
    tag v1 (transformer-lite2-flickr8k as ``captionkit push --dry-run`` writes it), and a tiny
    random BLIP saved as Salesforce/blip-image-captioning-base."""
    from captionkit.cli.main import main

    tmp = tmp_path_factory.mktemp("hub_cache")
    assert main(["push", "transformer-lite2-flickr8k", "my-org/my-captioner", "--dry-run", str(tmp / "up")]) == 0
    place_in_cache(tmp / "up", tmp / "cache", "my-org/my-captioner", "a" * 40, refs=("main", "v1"))
    place_in_cache(Path(tiny_hf["blip"]), tmp / "cache", "Salesforce/blip-image-captioning-base", "b" * 40)
    return tmp / "cache"


def test_the_pages_have_python_examples():
    assert len(examples("README.md")) == 1 and len(examples("docs/python-api.md")) >= 8


@pytest.mark.slow  # the default model (seconds to load), a few photos each
@pytest.mark.parametrize("page,k", [(page, k) for page in PAGES for k in range(len(examples(page)))],
                         ids=lambda x: str(x))
def test_every_python_example_runs(page, k, samples_server, loaded, monkeypatch, capsys, request):
    code = examples(page)[k].replace("https://example.com/", samples_server.url("/"))
    if any(name in code for name in HUB_NAMES):  # offline, on the cache of hub_cache: set before huggingface_hub loads
        cache = request.getfixturevalue("hub_cache")
        env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
        env.update(HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join(
            [str(Path(captionkit.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]))
        run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=600, check=False)
        assert run.returncode == 0, run.stderr[-3000:]
        lines = run.stdout.splitlines()
        assert len(lines) == 3 and lines[0] == lines[1] and all(lines), run.stdout  # hub: and from_pretrained agree
        return
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(captionkit, "load", loaded)
    exec(compile(code, f"{page} example {k + 1}", "exec"), {"__name__": "__example__"})
    out = capsys.readouterr().out
    assert out.strip(), "the example printed nothing"
    if "missing.jpg" in code:  # the examples that show a bad input: it is reported, and the rest captioned
        assert "missing.jpg: no such file" in out
    if "example.com" in examples(page)[k]:
        assert "HTTP" not in out and "cannot download" not in out  # the URL was captioned
