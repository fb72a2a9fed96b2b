"""The export wing's parts that need no torch: whether the ``onnx`` extra is installed, an ONNX
export's manifest, and the in-browser page's files. The command line calls these first, so a
missing package, a folder that holds no export or a page that was never built is one line
before torch and a model load (seconds) are paid for."""

from __future__ import annotations

import json
from importlib.util import find_spec
from pathlib import Path

from ..core.errors import UserError
from ..core.outputs import ONNX_FORMAT

ONNX_EXTRA = ("onnx", "onnxscript", "onnxruntime")  # pyproject.toml's [project.optional-dependencies] onnx
ONNX_INSTALL = "pip install 'captionkit[onnx]'"
WEB_RUNTIME = "ort.wasm.min.mjs"  # the onnxruntime-web file the page loads (web/build.mjs writes it)
WEB_HELP = ("the in-browser page needs onnxruntime-web, which this install lacks: in a clone of the "
            "repository run `make web` (needs npm), then install from that clone (pip install -e .)")


def _installed(module: str) -> bool:
    try:
        return find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails, or a module without a spec
        return False


def check_onnx_extra(what: str, modules: tuple[str, ...] = ONNX_EXTRA) -> None:
    """One line (a UserError) when a module of the onnx extra is not installed; ``what`` names
    what needs it ("ONNX export"). Looks for the modules without importing them."""
    missing = [m for m in modules if not _installed(m)]
    if missing:
        raise UserError(f"{what} needs the onnx extra ({', '.join(missing)} not installed): {ONNX_INSTALL}")


def read_manifest(folder: str | Path) -> dict:
    """An ONNX export's manifest.json; one line naming the folder when there is no captionkit
    export there."""
    folder = Path(folder)
    path = folder / "manifest.json"
    if not folder.is_dir():
        what = "no such folder" if not folder.exists() else "not a folder"
        raise UserError(f"{folder}: {what}; an ONNX export is a folder written by "
                        f"`captionkit export onnx --out {folder}`")
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no ONNX export here (run `captionkit export onnx --out {folder}`)") from None
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: cannot read the manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != ONNX_FORMAT:
        raise UserError(f"{path}: not a captionkit ONNX export")
    return manifest


def web_demo_source() -> Path:
    """The in-browser page's folder in the package; one line saying how to build its
    onnxruntime-web files when they are not there (they are built by npm, not committed)."""
    from importlib.resources import files

    src = Path(str(files("captionkit") / "web"))
    if not (src / "vendor" / "ort" / WEB_RUNTIME).exists():
        raise UserError(WEB_HELP)
    return src
