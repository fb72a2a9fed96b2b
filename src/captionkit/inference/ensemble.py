"""Ensembles at decode time: several checkpoints of one tokenizer decoded as one model.

:class:`EnsembleDecoder` keeps the decoder step contract (``prepare`` / ``init_state`` /
``step``, see :mod:`captionkit.inference.decoding`), so greedy and beam search decode an ensemble as they
decode one model: every member keeps its own memory and state, and each step combines the
members' next-word log-probabilities. Members that are one model over several views of the image
(flip averaging) keep theirs as rows of one batch, which that model steps once per step.

How they are combined (``combine``):

- ``"loglinear"`` (the default): the weighted mean of the members' log-probabilities,
  renormalised over the vocabulary -- a product of experts, p(w) ~ prod_i p_i(w) ** w_i.
  Chosen as the default because a word must be plausible to every member to win: one member's
  confident mistake (the wrong object or colour, the kind of error that differs between
  families) is vetoed by the others instead of keeping half its probability, and beam search,
  which sums log-probabilities, sees each member's score enter additively. Renormalising keeps
  each step a distribution, so length normalisation and <end> mean what they mean for one model.
- ``"linear"``: the weighted arithmetic mean of the probabilities (a mixture), which the
  ensemble benchmark (``benchmarks/ensemble_dev.py``) compares on the Flickr8k dev split.

Members must share the tokenizer (identical vocabularies) and the encoder (same name, weights
and grid, and no fine-tuned encoder tensors or identical ones), so one encoder pass serves all;
the attention shown with a caption is the first member's.

An ensemble ships as a folder holding ``ensemble.json`` (see :func:`write_ensemble`) and the
``.captionkit.json`` marker of kind ``"ensemble"``; ``Captioner.load`` accepts such a folder.
This module does not import the captioner (which imports it): member folders are resolved by
the caller, which knows where the shipped models live.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn

from ..core.checkpoint import atomic_folder
from ..core.errors import CheckpointError, UserError
from ..core.outputs import atomic_write_text, owner_kind, write_marker
from .controls import MODEL_DEFAULTS, model_controls
from .rerank import MATCHER_DIR, FolderRerank, folder_rerank
from .folders import read_ensemble_doc
from .shipped import ENSEMBLE_FILE

FORMAT, VERSION = "captionkit-ensemble", 1
KIND = "ensemble"  # the outputs.MARKER kind of an ensemble folder
COMBINE = ("loglinear", "linear")


# ---- the decoder ----------------------------------------------------------------------------
@dataclass(frozen=True)
class EnsembleConfig:
    """What shared code reads of a decoder's config: the members' common sizes."""

    vocab_size: int
    feat_dim: int


class EnsembleMemory:
    """The memories of the ensemble's distinct decoders (one per group, see
    :class:`EnsembleDecoder`), and how many tensors of the flat decoding state belong to each
    (recorded by ``init_state``; carried through ``index_select``, so beam search's selection
    of memory rows and of state rows stay independent of each other).

    A decoder that several members share (the same model over several views of the image)
    holds one memory of ``views`` rows per image, image-major: row ``b * views + j`` is image
    b's view j, so that the ensemble's row b is ``views`` consecutive rows of the decoder's."""

    def __init__(self, members: list[Any], views: tuple[int, ...], state_sizes: tuple[int, ...] | None = None):
        self.members = members
        self.views = views  # per group: how many rows of its memory make one row of the ensemble's
        self.state_sizes = state_sizes

    def index_select(self, idx: torch.Tensor) -> "EnsembleMemory":
        out = []
        for m, n in zip(self.members, self.views):
            if n > 1:  # ensemble row i -> the decoder's rows i * n .. i * n + n - 1
                idx_n = (idx.unsqueeze(1) * n + torch.arange(n, device=idx.device)).view(-1)  # (len(idx) * n,)
                out.append(m.index_select(idx_n))
            else:
                out.append(m.index_select(idx))
        return EnsembleMemory(out, self.views, self.state_sizes)


def normalised_weights(weights: Sequence[float] | None, n: int) -> list[float]:
    """Member weights summing to 1 (equal weights when None). Each must be a finite positive
    number, one per member; a ValueError says which is wrong."""
    if weights is None:
        return [1.0 / n] * n
    weights = list(weights)
    if len(weights) != n:
        raise UserError(f"{len(weights)} weights for {n} members: give one weight per member")
    for i, w in enumerate(weights):
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w <= 0:
            raise UserError(f"weight {i + 1} is {w!r}: weights must be finite positive numbers")
    total = float(sum(weights))
    return [float(w) / total for w in weights]


def combine_logprobs(logprobs: Sequence[torch.Tensor], weights: Sequence[float] | torch.Tensor,
                     combine: str) -> torch.Tensor:
    """Members' log-probabilities (each (B, V)) -> the ensemble's (B, V), normalised.
    ``weights``: numbers, or a tensor of them on the log-probabilities' device."""
    stacked = torch.stack(list(logprobs))  # (M, B, V)
    if isinstance(weights, torch.Tensor):
        w = weights.to(stacked.dtype).view(-1, 1, 1)  # (M, 1, 1)
    else:
        w = torch.tensor(weights, dtype=stacked.dtype, device=stacked.device).view(-1, 1, 1)
    if combine == "loglinear":
        mixed = (w * stacked).sum(0)
        return mixed - torch.logsumexp(mixed, dim=-1, keepdim=True)
    if combine == "linear":
        return torch.logsumexp(stacked + w.log(), dim=0)
    raise UserError(f"unknown combine {combine!r} (known: {', '.join(COMBINE)})")


class EnsembleDecoder(nn.Module):
    """Several decoders of one vocabulary and one encoder, decoded as one (module docstring)."""

    def __init__(self, members: Sequence[nn.Module], weights: Sequence[float] | None = None,
                 combine: str = "loglinear", views: Sequence[int] | None = None):
        """``views``: which view of the image each member reads, when ``prepare`` is given
        several (feats (B, V, L, D), e.g. the photo and its mirror image, see
        :func:`with_flip_views`); None: every member reads the one view (B, L, D)."""
        super().__init__()
        if not members:
            raise UserError("an ensemble needs at least one member")
        if combine not in COMBINE:
            raise UserError(f"unknown combine {combine!r} (known: {', '.join(COMBINE)})")
        sizes = {(m.cfg.vocab_size, m.cfg.feat_dim) for m in members}
        if len(sizes) != 1:
            raise UserError(f"ensemble members differ in (vocab_size, feat_dim): {sorted(sizes)}")
        self.members = nn.ModuleList(members)
        self.weights = normalised_weights(weights, len(members))
        self.combine = combine
        self.views = None if views is None else [int(v) for v in views]
        if self.views is not None and len(self.views) != len(members):
            raise ValueError(f"{len(self.views)} views for {len(members)} members: give one view per member")
        self.cfg = EnsembleConfig(*sizes.pop())
        # Members that are one module (the same model over several views: with_flip_views)
        # are decoded as one batch: one call of that module per step over all its views'
        # rows, instead of one call per view -- half the per-step calls with flip averaging,
        # and each matmul reads the weights once for twice the rows. A group: the module's
        # member indices, in member order.
        groups: dict[int, list[int]] = {}
        for i, m in enumerate(members):
            groups.setdefault(id(m), []).append(i)
        self.groups = list(groups.values())
        # the weights as a tensor, made once per device the ensemble decodes on (not at every
        # step: on a GPU, torch.tensor(numbers) is a host-to-device copy)
        self._weight_tensors: dict[torch.device, torch.Tensor] = {}

    def weight_tensor(self, device: torch.device) -> torch.Tensor:
        """The members' weights (M,) float32 on ``device``: each filled in on the device from
        its Python number (the float32 torch.tensor(weights) would hold), no host memory copied."""
        if device not in self._weight_tensors:
            self._weight_tensors[device] = torch.stack(
                [torch.full((), w, dtype=torch.float32, device=device) for w in self.weights])
        return self._weight_tensors[device]

    @property
    def attention_view(self) -> str:
        """How figures show the attention: the first member's (the model contract's name)."""
        return self.members[0].attention_view

    def prepare(self, feats: torch.Tensor) -> EnsembleMemory:
        """feats (B, L, D), or (B, V, L, D) when the members read views of the image."""
        if self.views is not None and (feats.dim() != 4 or feats.shape[1] <= max(self.views)):
            raise ValueError(f"this ensemble reads {max(self.views) + 1} views of each image: feats must be "
                             f"(B, {max(self.views) + 1}, L, D), got {tuple(feats.shape)}")
        mems = []
        for group in self.groups:
            rows = [feats if self.views is None else feats[:, self.views[i]] for i in group]  # (B, L, D) each
            x = rows[0] if len(rows) == 1 else torch.stack(rows, 1).flatten(0, 1)  # (B * n, L, D), image-major
            mems.append(self.members[group[0]].prepare(x))
        return EnsembleMemory(mems, tuple(len(g) for g in self.groups))

    def init_state(self, mem: EnsembleMemory) -> tuple[torch.Tensor, ...]:
        """The groups' states, concatenated into one flat tuple of batch-first tensors (what
        decoding selects rows of); ``mem`` records where each group's part begins. A group of
        n members' tensors are (B, n, ...): a view of the decoder's (B * n, ...)."""
        states = []
        for group, m in zip(self.groups, mem.members):
            state = self.members[group[0]].init_state(m)
            states.append(state if len(group) == 1 else tuple(t.unflatten(0, (-1, len(group))) for t in state))
        mem.state_sizes = tuple(len(s) for s in states)
        return tuple(t for s in states for t in s)

    def step(self, tokens: torch.Tensor, state: tuple[torch.Tensor, ...], mem: EnsembleMemory):
        if mem.state_sizes is None:
            raise RuntimeError("EnsembleDecoder.step needs a memory that init_state has seen")
        logprobs: list[Any] = [None] * len(self.members)  # (B, V) each, in member order
        attentions: list[Any] = [None] * len(self.members)  # (B, L) each
        new_state, start = [], 0
        for group, group_mem, size in zip(self.groups, mem.members, mem.state_sizes):
            part, n = state[start:start + size], len(group)
            start += size
            member = self.members[group[0]]
            if n == 1:
                logp, st, att = member.step(tokens, tuple(part), group_mem)
                logprobs[group[0]], attentions[group[0]] = logp.float(), att
                new_state += st
                continue
            rows = tokens.unsqueeze(1).expand(-1, n).reshape(-1)  # (B * n,): each row's word, once per view
            logp, st, att = member.step(rows, tuple(t.flatten(0, 1) for t in part), group_mem)
            logp, att = logp.float().unflatten(0, (-1, n)), att.unflatten(0, (-1, n))  # (B, n, V), (B, n, L)
            for j, i in enumerate(group):
                logprobs[i], attentions[i] = logp[:, j], att[:, j]
            new_state += (t.unflatten(0, (-1, n)) for t in st)
        weights = self.weight_tensor(logprobs[0].device)
        # the attention shown is the first member's
        return combine_logprobs(logprobs, weights, self.combine), tuple(new_state), attentions[0]


# ---- test-time augmentation: the photo, its mirror image, a centre crop ---------------------
# each augmentation's views of the photo and their shares of every member's weight (tta_pixels
# makes the views): "flip", the photo and its mirror image; "flip-zoom", those and the centre
# crop of ZOOM of each side and its mirror image, a quarter each (the crop's side and its share
# chosen on the Flickr8k dev split: docs/variety-study.md, "Four views")
TTA_SHARES = {"flip": (0.5, 0.5), "flip-zoom": (0.25, 0.25, 0.25, 0.25)}
TTA = tuple(TTA_SHARES)
TTA_OFF = "none"  # --tta none: no augmentation, not even an ensemble folder's own
ZOOM = 0.85


def tta_pixels(pixels: torch.Tensor, tta: str, zoom: float = ZOOM) -> torch.Tensor:
    """Preprocessed pixels (B, 3, S, S) -> the views ``tta`` decodes (B, V, 3, S, S), view 0 the
    photo itself: "flip" adds its mirror image; "flip-zoom" also the centre crop of ``zoom`` of
    each side (the command's: ZOOM), scaled back to S x S (bilinear, antialiased), and the crop's
    mirror image. The crop is taken of the preprocessed pixels: the encoders' normalisation is
    per channel and affine, so it commutes with the crop's averaging."""
    if tta not in TTA_SHARES:
        raise ValueError(f"unknown test-time augmentation {tta!r} (known: {', '.join(TTA)})")
    views = [pixels, pixels.flip(-1)]
    if tta == "flip-zoom":
        S = pixels.shape[-1]
        side = int(round(S * zoom))
        o = (S - side) // 2
        crop = nn.functional.interpolate(pixels[..., o:o + side, o:o + side], size=(S, S), mode="bilinear",
                                         antialias=True, align_corners=False)  # (B, 3, S, S)
        views += [crop, crop.flip(-1)]
    return torch.stack(views, 1)  # (B, V, 3, S, S)


def with_tta_views(decoder: nn.Module, tta: str) -> EnsembleDecoder:
    """``decoder`` decoding the views of ``tta`` (:func:`tta_pixels`) at their shares
    (:func:`with_views`); feats then (B, V, L, D)."""
    if tta not in TTA_SHARES:
        raise ValueError(f"unknown test-time augmentation {tta!r} (known: {', '.join(TTA)})")
    return with_views(decoder, TTA_SHARES[tta])


def with_flip_views(decoder: nn.Module) -> EnsembleDecoder:
    """Test-time flip averaging: ``decoder`` (one model or an ensemble) decoding the photo
    (view 0) and its horizontal mirror image (view 1) as an ensemble of both, each of its members
    once per view at half its weight, combined as the ensemble combines (log-linear for one
    model). Captions describe the scene, which a mirror image keeps (only "left" and "right"
    swap, and captions rarely use them), so the two views' errors partly cancel, as different
    members' do. The decoder then takes feats (B, 2, L, D); the attention shown is view 0's."""
    return with_views(decoder, (0.5, 0.5))


def with_views(decoder: nn.Module, shares: Sequence[float]) -> EnsembleDecoder:
    """``decoder`` (one model or an ensemble) decoding len(``shares``) views of each image as an
    ensemble of them: each member once per view v, at ``shares[v]`` of its weight (the shares
    sum to 1), combined as the ensemble combines (log-linear for one model). The decoder then
    takes feats (B, len(shares), L, D); the attention shown is view 0's."""
    if isinstance(decoder, EnsembleDecoder):
        if decoder.views is not None:
            raise ValueError("this decoder already reads several views")
        members, weights, combine = list(decoder.members), decoder.weights, decoder.combine
    else:
        members, weights, combine = [decoder], [1.0], "loglinear"
    return EnsembleDecoder(members * len(shares), [w * share for share in shares for w in weights], combine,
                           views=[v for v in range(len(shares)) for _ in members])


# ---- members: which checkpoints can be decoded together ------------------------------------
def _encoder_identity(cfg: dict) -> tuple:
    enc = cfg.get("encoder", {})
    return enc.get("name"), enc.get("weights"), list(enc.get("grid", []))


def check_member_configs(members: Sequence[tuple[Path, dict]]) -> None:
    """Refuse, with one line naming the member folder, a member whose tokenizer or encoder
    differs from the first member's. Reads only the configs (before any weights load)."""
    (first_path, first), rest = members[0], members[1:]
    for path, cfg in rest:
        if cfg.get("vocab") != first.get("vocab"):
            raise CheckpointError(f"{path}: its vocabulary differs from {first_path}'s; "
                                  f"ensemble members must share one tokenizer")
        if _encoder_identity(cfg) != _encoder_identity(first):
            name, weights, grid = _encoder_identity(cfg)
            name0, weights0, grid0 = _encoder_identity(first)
            raise CheckpointError(f"{path}: uses encoder {name} (weights {weights}, grid {grid}), "
                                  f"{first_path} uses {name0} (weights {weights0}, grid {grid0}); "
                                  f"ensemble members must share one encoder")


def check_member_encoders(members: Sequence[tuple[Path, dict[str, torch.Tensor]]]) -> None:
    """Refuse a member whose fine-tuned encoder tensors (checkpoint tensors under ``encoder.``)
    differ from the first member's: one encoder pass must serve every member."""
    (first_path, first), rest = members[0], members[1:]
    for path, tuned in rest:
        same = tuned.keys() == first.keys() and all(torch.equal(tuned[k], first[k]) for k in tuned)
        if not same:
            raise CheckpointError(f"{path}: its fine-tuned encoder tensors differ from {first_path}'s; "
                                  f"ensemble members must share one encoder")


# ---- the ensemble folder --------------------------------------------------------------------
@dataclass
class EnsembleSpec:
    """An ensemble folder's ``ensemble.json``: members (each ``{"shipped": NAME}`` or
    ``{"path": PATH relative to the folder}``), their weights, and its decoding settings."""

    folder: Path
    members: list[dict]
    weights: list[float]
    combine: str = "loglinear"
    length_penalty: float = 0.0
    max_len: int | None = None
    tta: str | None = None  # test-time augmentation (TTA_SHARES: "flip", "flip-zoom")
    # the caption controls' rules the ensemble decodes with by default (controls.MODEL_DEFAULTS:
    # no_repeat_ngram, repetition_penalty, rare_word_bonus, min_words, max_words); a rule not named: the first member's
    rules: dict = field(default_factory=dict)
    # the reranker its captions are chosen by unless told otherwise (FolderRerank), or None
    rerank: FolderRerank | None = None

    def member_folders(self, shipped_root: Path) -> list[Path]:
        return [shipped_root / m["shipped"] if "shipped" in m else self.folder / m["path"] for m in self.members]


def _copy_matcher(source: Path, folder: Path, words: set[str] | None) -> None:
    """The matcher checkpoint ``source`` saved as ``folder/MATCHER_DIR`` (replacing what was
    there, the ensemble being overwritten): narrowed to ``words``, the members' word vocabulary
    (models.matcher.matcher_of_words: the same scores for every caption they can write, a
    smaller file), or copied as it is (None: tokens that are no words)."""
    from ..core.checkpoint import save_checkpoint
    from ..models.matcher import matcher_of_words

    target = folder / MATCHER_DIR
    if words is not None:
        save_checkpoint(target, *matcher_of_words(source, words))  # (read whole before the atomic write)
        return
    if target.exists() and target.resolve() == source.resolve():
        return
    tmp = folder / f".{MATCHER_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(source, tmp)
    if target.exists():  # (an ensemble written before: --overwrite replaces its matcher with the new one)
        shutil.rmtree(target)
    os.replace(tmp, target)


def is_ensemble_folder(folder: Path) -> bool:
    return (folder / ENSEMBLE_FILE).is_file()


def member_entry(folder: Path, out: Path, shipped_root: Path) -> dict:
    """How ``ensemble.json`` in ``out`` names the checkpoint ``folder``: a shipped model by
    name, any other folder by its path relative to ``out``."""
    if folder.parent.resolve() == shipped_root.resolve():
        return {"shipped": folder.name}
    return {"path": os.path.relpath(folder.resolve(), out.resolve())}


# why a Hugging Face model (--model hf:, captionkit.inference.hf_models) is no member: the members'
# next-word distributions are combined id by id, and its ids and its image side are its own
HF_MEMBER_REFUSAL = ("an ensemble combines its members' next-word log-probabilities over one tokenizer's words, "
                     "read from one encoder's image rows, and a Hugging Face model has a tokenizer and an image side "
                     "of its own; caption with it alone (--model hf:NAME)")


def read_ensemble(folder: Path) -> EnsembleSpec:
    """Read and check ``folder/ensemble.json``; a mistake is one CheckpointError naming the file
    and the field."""
    path = folder / ENSEMBLE_FILE
    doc = read_ensemble_doc(folder)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        found = doc.get("format") if isinstance(doc, dict) else None
        raise CheckpointError(f"{path}: not a captionkit ensemble (format {found!r})")
    if doc.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: written by a newer captionkit (version {doc['version']})")
    members = doc.get("members")
    if not isinstance(members, list) or not members:
        raise CheckpointError(f"{path}: 'members' must be a non-empty list")
    for i, m in enumerate(members):
        named = [m.get(k) for k in ("shipped", "path")] if isinstance(m, dict) else []
        if isinstance(m, dict) and ("hf" in m or any(isinstance(v, str) and v.startswith("hf:") for v in named)):
            raise CheckpointError(f"{path}: members[{i}] names a Hugging Face model, which cannot be a member: "
                                  f"{HF_MEMBER_REFUSAL}")
        ok = isinstance(m, dict) and len({"shipped", "path"} & set(m)) == 1 and \
            isinstance(m.get("shipped", m.get("path")), str) and "weight" in m
        if not ok:
            raise CheckpointError(f"{path}: members[{i}] must hold either 'shipped' (a shipped model's name) "
                                  f"or 'path' (relative to the folder), and 'weight'")
        if "shipped" in m and len(Path(m["shipped"]).parts) != 1:
            raise CheckpointError(f"{path}: members[{i}].shipped must be a shipped model's name, not a path")
    try:
        weights = normalised_weights([m["weight"] for m in members], len(members))
    except ValueError as e:
        raise CheckpointError(f"{path}: members' weights: {e}") from None
    combine = doc.get("combine", "loglinear")
    if combine not in COMBINE:
        raise CheckpointError(f"{path}: 'combine' must be one of {', '.join(COMBINE)}, not {combine!r}")
    decoding = doc.get("decoding", {})
    if not isinstance(decoding, dict):
        raise CheckpointError(f"{path}: 'decoding' must be a table of settings, not {decoding!r}")
    known = ("length_penalty", "max_len", "tta", *MODEL_DEFAULTS)
    unknown = [k for k in decoding if k not in known]
    if unknown:  # (a misspelt rule would otherwise be dropped without a word, and the captions change)
        raise CheckpointError(f"{path}: decoding.{unknown[0]} is not a setting an ensemble has "
                              f"(known: {', '.join(known)})")
    lp, max_len = decoding.get("length_penalty", 0.0), decoding.get("max_len")
    if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp) or lp < 0:
        raise CheckpointError(f"{path}: decoding.length_penalty must be a number >= 0, not {lp!r}")
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise CheckpointError(f"{path}: decoding.max_len must be a whole number >= 1, not {max_len!r}")
    tta = decoding.get("tta")
    if tta is not None and tta not in TTA:
        raise CheckpointError(f"{path}: decoding.tta must be one of {', '.join(TTA)} or absent, not {tta!r}")
    rules = {k: decoding[k] for k in MODEL_DEFAULTS if k in decoding}
    try:  # checked here, so a wrong rule is refused before any member loads
        model_controls(rules, str(path))
    except UserError as e:
        raise CheckpointError(str(e)) from None
    return EnsembleSpec(folder, members, weights, combine, float(lp), max_len, tta, rules, folder_rerank(path, doc))


def write_ensemble(out: Path, members: list[dict], weights: Sequence[float], length_penalty: float,
                   max_len: int | None = None, combine: str = "loglinear", tta: str | None = None,
                   rules: dict | None = None, rerank: FolderRerank | None = None,
                   matcher_words: set[str] | None = None) -> Path:
    """Write ``out/ensemble.json`` (members as :func:`member_entry` names them) and mark ``out``
    as a captionkit ensemble. The caller has checked ``out`` (outputs.check_folder_target: it is
    missing, empty, or an ensemble to overwrite) and the members; an existing ensemble keeps its
    other files (member checkpoints kept there). ``rules``: caption-control rules
    (controls.MODEL_DEFAULTS) the ensemble decodes with unless told otherwise. ``rerank``: its
    own reranker, whose matcher is kept in the folder (MATCHER_DIR), narrowed to ``matcher_words``
    (the members' word vocabulary; None: copied as it is)."""
    weights = normalised_weights(weights, len(members))
    decoding: dict = {"length_penalty": float(length_penalty)}
    if max_len is not None:
        decoding["max_len"] = int(max_len)
    if tta is not None:
        decoding["tta"] = tta
    decoding.update(rules or {})
    doc = {"format": FORMAT, "version": VERSION,
           "members": [{**m, "weight": round(w, 6)} for m, w in zip(members, weights)],
           "combine": combine, "decoding": decoding, **({"rerank": rerank.entry()} if rerank else {})}
    text = json.dumps(doc, indent=1) + "\n"
    if owner_kind(out) == KIND:  # --overwrite of an ensemble: its ensemble.json is replaced, atomically
        if rerank:
            _copy_matcher(rerank.matcher, out, matcher_words)
        atomic_write_text(out / ENSEMBLE_FILE, text)
    else:  # a new folder appears whole, or not at all
        with atomic_folder(out) as tmp:
            if rerank:
                _copy_matcher(rerank.matcher, tmp, matcher_words)
            (tmp / ENSEMBLE_FILE).write_text(text)
            write_marker(tmp, KIND)
    return out / ENSEMBLE_FILE
