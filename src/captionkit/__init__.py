"""captionkit: train, evaluate, inspect and use image captioning models.

The public face, for scripts and notebooks::

    import captionkit

    cap = captionkit.load()                          # the shipped default model (or a folder, a name)
    for r in cap(["photo.jpg", "https://example.org/x.jpg"]):   # paths, URLs, PIL images, arrays, bytes
        print(r.source, r.text if r.ok else f"error: {r.error}")
    report = captionkit.score({"img1": "a dog runs"}, {"img1": ["a dog is running", "a brown dog"]})
    print(report.scores)

docs/python-api.md is the guide. ``Captioner``, ``load`` and ``score`` are imported when first used, so ``import captionkit`` (and
``captionkit.scoring``, which never needs torch) stays cheap. The wings below are the library's
layers (docs/architecture.md): ``core``, ``data``, ``encoders``, ``models``, ``kernels``,
``scoring``, ``inference``, ``training``, ``experiments``, ``export``, ``serve``, ``cli``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .core.version import __version__

if TYPE_CHECKING:
    from .inference.captioner import CaptionResult, Captioner
    from .scoring.evaluation import Report

__all__ = ["CaptionResult", "Captioner", "UserError", "__version__", "load", "score"]


def load(model=None, *, device: str = "auto", precision: str = "auto", tta: str | None = None,
         weights=None) -> "Captioner":
    """A :class:`Captioner` ready to caption (call it: ``cap(images)``): ``model`` is a checkpoint
    or ensemble folder, a shipped model's name (``captionkit models`` lists them) or None for the
    default one; a list of several is decoded as one ensemble (``weights``: one per member).
    ``device`` is a name as ``--device`` takes it (``auto``, the default as on the command line:
    the first CUDA GPU, else Apple's MPS, else the CPU; ``cpu``, ``cuda``, ``cuda:1``, ``mps``);
    ``precision`` and ``tta`` as the command line's ``--precision`` and ``--tta``."""
    from .inference.captioner import Captioner

    place = {"tta": tta, "device": device, "precision": precision}
    if isinstance(model, (list, tuple)):
        if len(model) > 1:
            return Captioner.load_ensemble(list(model), weights, **place)
        model = model[0] if model else None
    return Captioner.load(model, **place)


def score(captions, references, **options) -> "Report":
    """coco-caption's scores of ``captions`` ({image: caption}, or the path of such a JSON file)
    against ``references`` ({image: [caption, ...]}, or a path): a Report whose ``scores`` are the
    corpus scores. ``options``: those of :func:`captionkit.scoring.evaluation.score_captions`
    (``metrics``, ``tokenizer``, ``meteor``, ``brevity_penalty``)."""
    from pathlib import Path

    from .scoring.evaluation import score_captions
    from .scoring.score_inputs import read_captions, read_references

    names = {}
    if isinstance(captions, (str, Path)):
        captions, names["source"] = read_captions(captions), str(captions)
    if isinstance(references, (str, Path)):
        references, names["refs_source"] = read_references(references), str(references)
    return score_captions(captions, references, **names, **options)


def __getattr__(name: str):
    # PEP 562: the heavy names are imported on first use, so `import captionkit` needs no torch
    if name in ("Captioner", "CaptionResult"):
        from .inference import captioner
        return getattr(captioner, name)
    if name == "UserError":
        from .core.errors import UserError
        return UserError
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
