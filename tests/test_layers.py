"""The package's shape: the wings and what each may import (import-linter's contracts in
pyproject.toml, which `make lint` runs; here shown to bite on a wrong import), scoring without
torch, a cheap `import captionkit`, the public face (`Captioner`, `load`, `score`), and no module
past the size a reader can hold."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import captionkit

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "src" / "captionkit"
WINGS = ["core", "data", "encoders", "models", "kernels", "scoring", "inference", "training", "experiments",
         "export", "serve", "cli"]
MAX_LINES = 700
# modules allowed past MAX_LINES, each with its reason (none today)
LONG_MODULES: dict[str, str] = {}

# a meta-path finder run first in a child process: importing torch (or torchvision) raises
BLOCK_TORCH = textwrap.dedent("""
    import sys
    class _NoTorch:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "torchvision"):
                raise ImportError(f"blocked for this test: {name}")
    sys.meta_path.insert(0, _NoTorch())
""")


def run_python(code: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env, timeout=120)


def test_every_wing_is_a_package_that_says_what_it_may_import():
    folders = sorted(p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    assert folders == sorted(WINGS)
    loose = sorted(p.name for p in PKG.glob("*.py"))
    assert loose == ["__init__.py", "__main__.py"], "modules belong in a wing"
    for wing in WINGS:
        doc = (PKG / wing / "__init__.py").read_text()
        assert doc.startswith('"""'), wing
    layered = {"core", "data", "inference", "scoring", "training", "experiments", "export"}
    for wing in layered:
        assert "May import" in (PKG / wing / "__init__.py").read_text(), wing


def test_no_module_is_past_the_size_a_reader_can_hold():
    sizes = {str(p.relative_to(PKG)): len(p.read_text().splitlines()) for p in PKG.rglob("*.py")}
    long = {name: n for name, n in sizes.items() if n > MAX_LINES and name not in LONG_MODULES}
    assert long == {}
    assert all(name in sizes for name in LONG_MODULES)


def test_scoring_runs_with_torch_unimportable():
    """Every scoring module imports, and scores, in a process where importing torch raises; the
    package root and its `score` too."""
    modules = sorted(p.stem for p in (PKG / "scoring").glob("*.py") if p.stem != "__init__")
    code = BLOCK_TORCH + textwrap.dedent(f"""
        import importlib, json, sys
        for m in {modules!r}:
            importlib.import_module("captionkit.scoring." + m)
        import captionkit
        rep = captionkit.score({{"a": "a dog runs on the grass", "b": "a red car"}},
                               {{"a": ["a dog is running on grass", "the dog runs"], "b": ["a red car parked", "a car"]}},
                               metrics=("bleu", "rouge", "cider"), tokenizer="python")
        print(json.dumps({{"torch": "torch" in sys.modules, "scores": rep.scores}}))
    """)
    out = run_python(code)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["torch"] is False
    assert set(got["scores"]) >= {"Bleu_4", "ROUGE_L", "CIDEr"} and got["scores"]["Bleu_1"] > 0


def test_the_torch_blocker_does_block():
    """The check above cannot pass by accident: the same blocker makes a torch wing fail."""
    out = run_python(BLOCK_TORCH + "import captionkit.inference.decoding\n")
    assert out.returncode != 0 and "blocked for this test: torch" in out.stderr


def test_import_captionkit_needs_no_torch():
    out = run_python("import sys, captionkit; print(captionkit.__version__, 'torch' in sys.modules)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [captionkit.__version__, "False"]


def test_score_reads_files_and_names_them_in_errors(tmp_path):
    caps, refs = tmp_path / "caps.json", tmp_path / "refs.json"
    caps.write_text(json.dumps({"a": "a dog runs", "b": "a red car"}))
    refs.write_text(json.dumps({"a": ["a dog is running", "the dog runs"], "b": ["a red car", "a car"]}))
    from captionkit.scoring.evaluation import score_captions
    want = score_captions({"a": "a dog runs", "b": "a red car"}, json.loads(refs.read_text()),
                          metrics=("bleu", "cider"), tokenizer="python").scores
    assert captionkit.score(caps, str(refs), metrics=("bleu", "cider"), tokenizer="python").scores == want
    caps.write_text(json.dumps({"a": "a dog runs"}))
    with pytest.raises(captionkit.UserError, match=str(caps)):
        captionkit.score(caps, refs, metrics=("bleu",), tokenizer="python")


def test_public_face_names():
    assert set(captionkit.__all__) == {"CaptionResult", "Captioner", "UserError", "__version__", "load", "score"}
    from captionkit.core.errors import UserError
    from captionkit.inference.captioner import CaptionResult, Captioner
    assert captionkit.Captioner is Captioner and captionkit.UserError is UserError
    assert captionkit.CaptionResult is CaptionResult
    with pytest.raises(AttributeError, match="no_such_name"):
        captionkit.no_such_name  # noqa: B018


@pytest.mark.slow  # loads two shipped models and their encoder
def test_load_gives_the_captioner_the_command_line_gets():
    """captionkit.load passes the model, --tta and the ensemble on: the same captions as
    Captioner.load, and flip averaging where asked."""
    from captionkit.inference.captioner import Captioner

    photo = ROOT / "samples" / "coffee.jpg"
    one = captionkit.load("transformer-lite2-flickr8k", precision="fp32")
    ref = Captioner.load("transformer-lite2-flickr8k", precision="fp32")
    [(_, a)], [(_, b)] = list(one.caption_files([str(photo)])), list(ref.caption_files([photo]))
    assert a.text == b.text and a.text
    flip = captionkit.load(["transformer-lite2-flickr8k"], tta="flip", precision="fp32")
    assert flip.tta == "flip" and one.tta is None
    both = captionkit.load(["transformer-lite2-flickr8k", "sat-lite2-flickr8k"], weights=[2.0, 1.0])
    assert len(both.decoder.members) == 2 and list(both.decoder.weights) == pytest.approx([2 / 3, 1 / 3])


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        pytest.skip("import-linter is not installed (make installs it with the test extra)")
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    return subprocess.run([str(exe), "--no-cache", "--config", str(tree / "pyproject.toml")], capture_output=True,
                          text=True, cwd=tree, env=env, timeout=300)


@pytest.mark.slow  # copies the package and runs import-linter twice
def test_import_linter_contracts_hold_and_bite_on_a_wrong_import(tmp_path):
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert {c["id"] for c in config["contracts"]} == {"wings", "cli-groups", "scoring-numpy-only"}
    tree = tmp_path / "tree"
    shutil.copytree(PKG, tree / "src" / "captionkit", ignore=shutil.ignore_patterns("pretrained", "web", "__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tree)
    ok = lint_imports(tree)
    assert ok.returncode == 0 and "3 kept, 0 broken" in ok.stdout, ok.stdout + ok.stderr
    # an upward import (core -> inference), and a torch wing reached from scoring
    with open(tree / "src" / "captionkit" / "core" / "cache.py", "a") as f:
        f.write("\nfrom ..inference import decoding  # noqa\n")
    bad = lint_imports(tree)
    assert bad.returncode != 0 and "1 kept, 2 broken" in bad.stdout
    assert "captionkit.core is not allowed to import captionkit.inference" in bad.stdout
    assert "captionkit.scoring is not allowed to import torch" in bad.stdout
