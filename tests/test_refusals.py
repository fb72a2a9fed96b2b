"""A mistake costs nothing (issue 29): what the user gave -- paths, targets, an ONNX folder, the
onnx extra -- is checked before torch is imported and before any model loads, and each refusal
is one line. Most tests run the command in a child process where importing torch raises, so a
refusal that needed torch fails them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import shape_image

from captionkit.cli.main import main

ROOT = Path(__file__).resolve().parents[1]

# a meta-path finder run first in the child: importing any of these modules raises
BLOCK = textwrap.dedent("""
    import sys
    class _Block:
        def __init__(self, names):
            self.names = names
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in self.names:
                raise ImportError(f"blocked for this test: {{name}}")
    sys.meta_path.insert(0, _Block({blocked!r}))
""")


def run_cli(argv: list[str], blocked: tuple[str, ...] = ("torch", "torchvision"), gone: tuple[str, ...] = (),
            cwd: Path = ROOT) -> tuple[int, str, dict]:
    """``captionkit ARGV`` in a child where importing ``blocked`` raises and the modules ``gone``
    are not installed (as find_spec sees it); -> (exit status, stderr, what the child saw)."""
    code = BLOCK.format(blocked=blocked) + textwrap.dedent(f"""
        import json
        for name in {gone!r}:
            sys.modules[name] = None  # how Python spells "not installed"
        from captionkit.cli.main import main
        rc = main({argv!r})
        print("\\n" + json.dumps({{"rc": rc, "torch": "torch" in sys.modules}}))
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)
    assert out.returncode == 0, out.stderr  # main returned (a traceback would end the child with 1)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    return seen["rc"], out.stderr, seen


def test_the_blocker_blocks():
    """The tests below cannot pass by accident: a command that needs torch fails in the child."""
    code = BLOCK.format(blocked=("torch",)) + "import captionkit.inference.captioner\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=120)
    assert out.returncode == 1 and "blocked for this test: torch" in out.stderr


def test_caption_with_an_onnx_folder_that_is_not_there_is_one_line(tmp_path):
    """Issue 29, item 1: was a FileNotFoundError traceback (exit 1), after torch loaded."""
    photo = tmp_path / "a.jpg"
    shape_image(0, size=64).save(photo)
    rc, err, _ = run_cli(["caption", str(photo), "--onnx", str(tmp_path / "nowhere")])
    assert rc == 2 and err.count("\n") == 1, err
    assert err.startswith(f"captionkit caption: error: {tmp_path / 'nowhere'}: no such folder")
    assert "captionkit export onnx --out" in err
    (tmp_path / "empty").mkdir()
    rc, err, _ = run_cli(["caption", str(photo), "--onnx", str(tmp_path / "empty")])
    assert rc == 2 and err == (f"captionkit caption: error: {tmp_path / 'empty' / 'manifest.json'}: no ONNX export "
                               f"here (run `captionkit export onnx --out {tmp_path / 'empty'}`)\n")


def test_export_onnx_without_the_onnx_extra_is_the_pip_hint(tmp_path):
    """Issue 29, item 2: was a ModuleNotFoundError traceback after the model loaded; now the
    one-line hint every other extra gives, before torch."""
    rc, err, seen = run_cli(["export", "onnx", "--out", str(tmp_path / "x")], blocked=(),
                            gone=("onnx", "onnxscript", "onnxruntime"))
    assert rc == 2 and not seen["torch"], err
    assert err == ("captionkit export onnx: error: ONNX export needs the onnx extra (onnx, onnxscript, onnxruntime "
                   "not installed): pip install 'captionkit[onnx]'\n")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow  # child processes: several seconds
def test_serve_without_the_serve_extra_is_the_pip_hint_and_a_broken_import_of_ours_is_not():
    """serve without fastapi: the one-line hint. But an import of captionkit's own that breaks
    inside the server's modules is a bug and stays a traceback (it was shown as the hint)."""
    rc, err, _ = run_cli(["serve", "--port", "0"], blocked=(), gone=("fastapi",))
    assert rc == 2 and "the server needs the serve extra: pip install 'captionkit[serve]'" in err, err
    code = BLOCK.format(blocked=("captionkit.serve.guards",)).replace(
        'name.split(".")[0] in self.names', "name in self.names") + textwrap.dedent("""
        from captionkit.cli.main import main
        main(["serve", "--port", "0"])
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "Traceback" in out.stderr and "serve extra" not in out.stderr, out.stderr


def test_caption_with_onnx_but_without_onnxruntime_is_the_pip_hint(tmp_path):
    export = tmp_path / "export"
    export.mkdir()
    (export / "manifest.json").write_text(json.dumps({"format": "captionkit-onnx"}))
    shape_image(0, size=64).save(tmp_path / "a.jpg")
    rc, err, _ = run_cli(["caption", str(tmp_path / "a.jpg"), "--onnx", str(export)], gone=("onnxruntime",))
    assert rc == 2 and err == ("captionkit caption: error: --onnx needs the onnx extra (onnxruntime not installed): "
                               "pip install 'captionkit[onnx]'\n")


def test_a_missing_photo_is_reported_without_torch_or_a_model(tmp_path):
    """Issue 29, item 7: `caption nowhere.jpg` loaded the model (seconds) before saying so."""
    rc, err, _ = run_cli(["caption", str(tmp_path / "nowhere.jpg"), "--json", str(tmp_path / "caps.json")])
    assert rc == 1
    assert err == f"error: {tmp_path / 'nowhere.jpg'}: no such file\n1 of 1 images could not be captioned\n"
    assert json.loads((tmp_path / "caps.json").read_text()) == {}


def test_a_missing_photo_among_others_is_reported_before_the_model_loads(tiny_run, tmp_path, capsys, monkeypatch):
    from captionkit.inference.captioner import Captioner

    real = Captioner.load.__func__

    def load(cls, *a, **k):
        print("MODEL LOADS", file=sys.stderr)
        return real(cls, *a, **k)

    monkeypatch.setattr(Captioner, "load", classmethod(load))
    shape_image(0, size=64).save(tmp_path / "a.jpg")
    assert main(["caption", str(tmp_path / "a.jpg"), str(tmp_path / "gone.jpg"), "--model", str(tiny_run / "best"),
                 "--beam", "1"]) == 1
    out, err = capsys.readouterr()
    assert out.startswith("a.jpg\t")
    assert err.index(f"error: {tmp_path / 'gone.jpg'}: no such file") < err.index("MODEL LOADS")
    assert err.endswith("1 of 2 images could not be captioned\n")


def test_a_url_captionkit_does_not_download_is_one_line_before_torch(tmp_path):
    """Was `https:/example.com/a.jpg: no such file`, after the model loaded; http(s) URLs are
    downloaded now (tests/test_urls.py), any other scheme is refused before torch."""
    rc, err, _ = run_cli(["caption", "ftp://example.com/a.jpg"])
    assert rc == 2 and err == ("captionkit caption: error: ftp://example.com/a.jpg: only http:// and https:// URLs "
                               "are downloaded, not ftp://\n")


@pytest.mark.parametrize("extra,expect", [
    (["--json", "{tmp}/taken.json"], "taken.json: exists; pass --overwrite"),
    (["--model", "{tmp}/no-model"], "no-model: no such model folder"),
    (["--candidates", "{tmp}/taken.json", "--nbest", "2"], "taken.json: exists; pass --overwrite"),
    (["--attention", "{tmp}/theirs"], "theirs: exists and is not empty"),
])
def test_caption_refusals_come_before_torch(tmp_path, extra, expect):
    shape_image(0, size=64).save(tmp_path / "a.jpg")
    (tmp_path / "taken.json").write_text("{}")
    (tmp_path / "theirs").mkdir()
    (tmp_path / "theirs" / "notes.txt").write_text("mine")
    rc, err, _ = run_cli(["caption", str(tmp_path / "a.jpg"), *[a.format(tmp=tmp_path) for a in extra]])
    assert rc == 2 and expect in err and err.count("\n") == 1, err


def test_export_onnx_refusals_come_before_torch(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "notes.txt").write_text("mine")
    rc, err, _ = run_cli(["export", "onnx", "--out", str(tmp_path / "taken")])
    assert rc == 2 and "taken: exists and is not empty" in err
    rc, err, _ = run_cli(["export", "onnx", "--out", str(tmp_path / "x"), "--check", str(tmp_path / "gone.jpg")])
    assert rc == 2 and err == f"captionkit export onnx: error: --check: {tmp_path / 'gone.jpg'}: no such file\n"
    rc, err, _ = run_cli(["export", "onnx", "--out", str(tmp_path / "x"), "--model", "ensemble-lite2-flickr8k"])
    assert rc == 2 and "is an ensemble; ONNX export takes one model" in err


def test_export_onnx_web_without_the_page_runtime_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    """Issue 29, item 8: a wheel has no Makefile; the line says where `make web` is run and how
    the page then reaches an install."""
    import captionkit.export.checks as checks

    monkeypatch.setattr(checks, "WEB_RUNTIME", "not-built.mjs")
    assert main(["export", "onnx", "--out", str(tmp_path / "x"), "--web"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "onnxruntime-web" in err
    assert "in a clone of the repository run `make web`" in err and "pip install -e ." in err


def test_a_closed_stdout_ends_quietly(tmp_path):
    """`captionkit models | head -1` printed a BrokenPipeError traceback; Unix tools end
    quietly with 128 + SIGPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    try:
        out = subprocess.run([sys.executable, "-m", "captionkit", "models"], stdout=write_end, stderr=subprocess.PIPE,
                             text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")}, timeout=120)
    finally:
        os.close(write_end)
    assert out.stderr == "" and out.returncode == 141
