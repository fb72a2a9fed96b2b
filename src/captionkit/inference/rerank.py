"""Reranking the beam's n best: by consensus (``mbr``) or by an image-caption matcher (``match``).

``mbr`` (minimum Bayes risk): of each image's candidate captions, choose the one with the
highest expected CIDEr-D against the image's other candidates.

The candidates are plain text, so they can come from any models -- n-best lists of beam search,
several families, several tokenizers, a vision-language model -- and the candidates of one image
act as pseudo-references for each other: a caption that agrees with the rest of the list wins
over an outlier, however probable the outlier was under its own model.

The utility is captionkit's CIDEr-D (:func:`captionkit.scoring.metrics.cider_d_pairs`), on the
candidates tokenised the coco-caption way (Python PTB tokenisation). CIDEr-D weighs n-grams by
their rarity across images (document frequencies), which here come from the candidate lists of
all images reranked together: rerank a set of images at once (the ``rerank`` command, or
``evaluate``), not one photo at a time -- with a single image every n-gram is in every "document"
and every candidate scores 0, so the first (the model's best) is kept.

``match``: each candidate's length-normalised log-probability under the captioner plus
``weight`` times its discriminability under a matcher (captionkit.models.matcher: how much
better the caption fits this photo than the matcher's bank of other photos), plus, with a
``rare_weight`` C, C times its rare-word gain: the sum over its words of what
``--rare-word-bonus 1`` gives them during the search (captionkit.inference.shaping.rare_word_bonus),
so that among captions the matcher finds about as fitting, the one in rarer words wins. It needs
the photo, so it runs where the captioner has the encoder's rows (``caption`` and ``evaluate``),
photo by photo: a caption's choice does not depend on the other photos of the run.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Sequence

import numpy as np

from ..core.errors import CheckpointError, UserError
from ..scoring import metrics as M
from ..scoring.ptb_tokenize import tokenize_python
from .folders import ENSEMBLE_FILE, read_ensemble_doc

RERANKERS = ("mbr", "match")
RERANK_OFF = "none"  # --rerank none: no reranking, not even an ensemble folder's own
MATCHER_DIR = "matcher"  # where an ensemble folder written with a reranker keeps its matcher


def consensus_utilities(candidates: dict[Hashable, Sequence[str]],
                        weights: dict[Hashable, Sequence[float]] | None = None) -> dict[Hashable, np.ndarray]:
    """Each candidate's expected CIDEr-D (x10) against its image's other candidates, weighted
    by their ``weights`` (e.g. probabilities; default equal): {image: (n,) utilities}.

    Document frequencies count images: every image's keys are padded to the same count so the
    per-key counting of :func:`captionkit.scoring.metrics.cider_d_pairs` equals per-image counting."""
    tokens = tokenize_python({k: list(v) for k, v in candidates.items()})
    images = [k for k, v in tokens.items() if v]
    n_max = max((len(tokens[k]) for k in images), default=0)
    if n_max < 2:  # nobody has another candidate to agree with
        return {k: np.zeros(len(v)) for k, v in tokens.items()}
    cands, refs = {}, {}
    for k in images:
        for i in range(n_max):  # key (image, i): candidate i against all of the image's candidates
            cands[(k, i)] = tokens[k][min(i, len(tokens[k]) - 1)]  # padding keys repeat the last one
            refs[(k, i)] = tokens[k]
    pairs = M.cider_d_pairs(cands, refs)  # (sum over keys of n_k,), key by key, in refs' order
    out: dict[Hashable, np.ndarray] = {k: np.zeros(len(v)) for k, v in tokens.items()}
    pos = 0
    for k in images:
        n = len(tokens[k])
        sim = pairs[pos:pos + n_max * n].reshape(n_max, n)[:n]  # (n, n): candidate i vs candidate j
        pos += n_max * n
        w = np.ones(n) if weights is None else np.asarray(weights[k], dtype=np.float64)
        if w.shape != (n,) or not np.all(np.isfinite(w)) or np.any(w < 0):
            raise ValueError(f"{k}: {len(w)} weights for {n} candidates, or not finite and >= 0")
        others = np.where(np.eye(n, dtype=bool), 0.0, w[None, :])  # (n, n): j != i
        mass = others.sum(1)
        out[k] = np.where(mass > 0, (sim * others).sum(1) / np.where(mass > 0, mass, 1.0), 0.0)
    return out


def mbr_choice(candidates: dict[Hashable, Sequence[str]],
               weights: dict[Hashable, Sequence[float]] | None = None) -> dict[Hashable, int]:
    """{image: index of the candidate with the highest expected CIDEr-D}; ties go to the
    earlier candidate (list the candidates best first, and a tie keeps the model's choice)."""
    return {k: int(np.argmax(u)) if len(u) else -1 for k, u in consensus_utilities(candidates, weights).items()}


def sequence_weights(logprobs: Sequence[float]) -> list[float]:
    """One n-best list's candidates weighted by their sequence probabilities, renormalised over
    the list (a softmax of the summed log-probabilities)."""
    lp = np.asarray(logprobs, dtype=np.float64)
    p = np.exp(lp - lp.max())
    return (p / p.sum()).tolist()


def read_candidates(path: str | Path) -> dict[str, list[str]]:
    """A candidates file: JSON {image: [caption, ...]} (an n-best list) or {image: caption}
    (one caption, as ``captionkit caption --json`` writes); one ValueError line naming the file."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"{path}: no such candidates file") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(doc, dict):
        raise UserError(f"{path}: expected a JSON object {{image: [caption, ...]}}")
    out = {}
    for k, v in doc.items():
        v = [v] if isinstance(v, str) else v
        if not isinstance(v, list) or not all(isinstance(c, str) for c in v):
            raise UserError(f"{path}: {k!r} must map to a caption or a list of captions")
        out[k] = v
    return out


def union_candidates(lists: Sequence[dict[str, list[str]]], names: Sequence[str]) -> dict[str, list[str]]:
    """Every image's candidates from several sources, source by source in the order given (so a
    tie goes to the first source's best). Each source must cover the same images."""
    keys = set(lists[0])
    for src, name in zip(lists[1:], names[1:]):
        if set(src) != keys:
            only = sorted(set(src) ^ keys)
            raise UserError(f"{name}: covers other images than {names[0]} (e.g. {only[:3]})")
    return {k: [c for src in lists for c in src[k]] for k in lists[0]}


def rerank_files(paths: Sequence[str], out: str | None, overwrite: bool) -> dict[str, str]:
    """The ``captionkit rerank`` command's work: the union of the files' candidates, one caption
    chosen per image by MBR, written to ``out`` as {image: caption} (the write rule of
    captionkit.core.outputs: an existing file needs ``overwrite``)."""
    from ..core.outputs import atomic_write_text, check_file_target

    target = check_file_target(out, overwrite=overwrite) if out else None
    union = union_candidates([read_candidates(p) for p in paths], list(paths))
    choice = mbr_choice(union)
    chosen = {k: union[k][i] for k, i in choice.items() if i >= 0}
    if len(chosen) != len(union):
        empty = sorted(set(union) - set(chosen))
        raise UserError(f"{paths[0]}: {len(empty)} images have no candidate (e.g. {empty[:3]})")
    if target:
        atomic_write_text(target, json.dumps(chosen, indent=1, ensure_ascii=False))
    return chosen


def match_choice(logprobs: Sequence[Sequence[float]], lengths: Sequence[Sequence[int]],
                 disc: Sequence[Sequence[float]], weight: float, length_penalty: float,
                 gains: Sequence[Sequence[float]] | None = None, rare_weight: float = 0.0) -> list[int]:
    """Each n-best list's choice under ``--rerank match``: the argmax of
    logprob / (length + 1) ** length_penalty + weight * disc [+ rare_weight * gain] (the beam's
    own ranking when both weights are 0 and no rule shaped the beam); ties go to the earlier
    candidate. ``gains``: each candidate's rare-word gain (:func:`rare_word_gains`), needed
    when ``rare_weight`` is not 0."""
    if rare_weight and gains is None:
        raise ValueError("a rare_weight needs the candidates' gains")
    out = []
    for i, (lp, n, d) in enumerate(zip(logprobs, lengths, disc, strict=True)):
        lp, n, d = (np.asarray(x, dtype=np.float64) for x in (lp, n, d))
        g = np.asarray(gains[i], dtype=np.float64) if rare_weight else np.zeros_like(lp)
        if not (lp.shape == n.shape == d.shape == g.shape):
            raise ValueError(f"{len(lp)} log-probabilities, {len(n)} lengths, {len(d)} scores and {len(g)} "
                             f"gains for one list")
        norm = lp / (n + 1) ** length_penalty if length_penalty else lp
        # (the terms added in the order benchmarks/rerank_dev.py adds them, so its dev rows hold here)
        out.append(int(np.argmax(norm + (weight * d + rare_weight * g))) if len(lp) else -1)
    return out


def rare_word_gains(lists: Sequence[Sequence[Sequence[int]]], vocab_size: int) -> list[list[float]]:
    """Each listed caption's rare-word gain (``lists``: n-best lists of captions as word ids in a
    frequency-ordered vocabulary, controls.RANKED_TOKENS): the sum over its words of what
    ``--rare-word-bonus 1`` adds to them in the search (shaping.rare_word_bonus; the table built
    once for all the lists)."""
    import torch

    from .shaping import rare_word_bonus

    gain = rare_word_bonus(1.0, vocab_size, torch.device("cpu")).tolist()
    return [[sum(gain[i] for i in c) for c in ids] for ids in lists]


# ---- an ensemble folder's own reranker -------------------------------------------------------
@dataclass(frozen=True)
class FolderRerank:
    """An ensemble folder's own ``--rerank match``: ``ensemble.json``'s ``rerank`` table
    ``{"method": "match", "matcher": PATH, "nbest": N, "weight": W, "rare_weight": C}``, the
    matcher a checkpoint folder inside the ensemble folder (PATH relative to it), chosen among
    the beam's N best by captionkit.inference.rerank.match_choice at W and C. ``matcher`` here:
    the matcher folder's path (for :func:`write_ensemble`: the one to copy in)."""

    matcher: Path
    nbest: int
    weight: float
    rare_weight: float = 0.0
    method: str = "match"

    def entry(self) -> dict:
        """The ``rerank`` table :func:`write_ensemble` writes (the matcher copied to MATCHER_DIR)."""
        return {"method": self.method, "matcher": MATCHER_DIR, "nbest": self.nbest, "weight": self.weight,
                "rare_weight": self.rare_weight}


def folder_rerank(path: Path, doc: dict) -> FolderRerank | None:
    """The ``rerank`` table of ``doc``, the ensemble.json at ``path``, checked (one
    CheckpointError naming the field), or None."""
    r = doc.get("rerank")
    if r is None:
        return None
    fields = ("method", "matcher", "nbest", "weight", "rare_weight")
    if not isinstance(r, dict) or set(r) - set(fields) or not {"method", "matcher", "nbest", "weight"} <= set(r):
        raise CheckpointError(f"{path}: 'rerank' must be a table of {', '.join(fields)} (rare_weight optional)")
    if r["method"] != "match":
        raise CheckpointError(f"{path}: rerank.method must be 'match', not {r['method']!r}")
    nbest, weight, rare = r["nbest"], r["weight"], r.get("rare_weight", 0.0)
    if isinstance(nbest, bool) or not isinstance(nbest, int) or nbest < 2:
        raise CheckpointError(f"{path}: rerank.nbest must be a whole number >= 2, not {nbest!r}")
    for name, w in (("weight", weight), ("rare_weight", rare)):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise CheckpointError(f"{path}: rerank.{name} must be a number >= 0, not {w!r}")
    rel = r["matcher"]
    if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in Path(rel).parts:
        raise CheckpointError(f"{path}: rerank.matcher must be a folder inside the ensemble folder, not {rel!r}")
    if not (path.parent / rel / "config.json").is_file():
        raise CheckpointError(f"{path}: rerank.matcher: {path.parent / rel} is not a checkpoint folder "
                              f"(no config.json)")
    return FolderRerank(path.parent / rel, nbest, float(weight), float(rare))


def read_folder_rerank(folder: Path) -> FolderRerank | None:
    """An ensemble folder's own reranker (its ``ensemble.json``'s ``rerank``), or None; read
    without torch, for the command line's checks before anything loads (the folder's other
    fields are checked when it loads: captionkit.inference.ensemble.read_ensemble)."""
    doc = read_ensemble_doc(folder)
    return folder_rerank(folder / ENSEMBLE_FILE, doc) if isinstance(doc, dict) else None
