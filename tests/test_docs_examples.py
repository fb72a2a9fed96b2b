"""The Python examples of README.md and docs/python-api.md run as they are (issue 29, item 3:
the README's example crashed with `'ImageError' object has no attribute 'text'` as soon as a
file was missing). Each ```python block runs from the repository's root in a fresh namespace,
with the real default model; ``https://example.com/NAME`` stands for a server of the reader's
and is served here, from samples/, by a local HTTP server."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import LocalServer, http_body

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


def test_the_pages_have_python_examples():
    assert len(examples("README.md")) == 1 and len(examples("docs/python-api.md")) >= 8


@pytest.mark.slow  # the default model (seconds to load), a few photos each
@pytest.mark.parametrize("page,k", [(page, k) for page in PAGES for k in range(len(examples(page)))],
                         ids=lambda x: str(x))
def test_every_python_example_runs(page, k, samples_server, loaded, monkeypatch, capsys):
    code = examples(page)[k].replace("https://example.com/", samples_server.url("/"))
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(captionkit, "load", loaded)
    exec(compile(code, f"{page} example {k + 1}", "exec"), {"__name__": "__example__"})
    out = capsys.readouterr().out
    assert out.strip(), "the example printed nothing"
    if "missing.jpg" in code:  # the examples that show a bad input: it is reported, and the rest captioned
        assert "missing.jpg: no such file" in out
    if "example.com" in examples(page)[k]:
        assert "HTTP" not in out and "cannot download" not in out  # the URL was captioned
