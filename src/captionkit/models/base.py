"""The model contract every caption family implements, and the pieces the families share.

A family is one module under ``captionkit/models/`` holding a config dataclass and a
:class:`CaptionModel` subclass registered by name (``@register_family("sat", SATConfig)``, see
:mod:`captionkit.core.registry`). Shared code -- the trainer, self-critical training, decoding, the
captioner, the exporters -- uses only what is declared here, never a family's name or its
config fields beyond ``vocab_size`` and ``feat_dim`` (which every family has: the trainer sets
them). The contract, with feats (B, L, D) the cached encoder rows of B images:

    mem = model.prepare(feats)                       # per-image memory, computed once
    state = model.init_state(mem)                    # a tuple of batch-first tensors
    logprobs, state, attention = model.step(tokens, state, mem)   # (B, V), ..., (B, L)
    scores, attention = model(feats, inputs, image_index=None)    # teacher-forced, all positions
    loss, cross_entropy = model.training_loss(feats, inputs, targets, *, alpha_c=..., label_smoothing=...,
                                              image_index=None)

``mem`` has ``index_select(idx)`` (beam search repeats an image's memory per beam);
``forward``'s scores are logits or log-probabilities over the vocabulary (either: a
log-softmax of them gives the step's log-probabilities); ``image_index`` (B,) says which of the
U images of ``feats`` caption b belongs to, so the image side runs once per image. The
declared capabilities are class attributes and small methods with defaults below.

Why an abstract base class rather than a Protocol: the contract has defaults worth sharing
(``param_groups``, the decode options, how attention figures read the weights) that a
Protocol cannot carry without every family repeating them, and a family is an ``nn.Module``
anyway, so inheriting costs nothing. The abstract methods make a family that forgets one of
them fail when it is built, with the missing names, instead of when the trainer or the
decoder first calls it; and "is this a caption model" is an ``issubclass`` the tests ask of
every registered family, not a set of ``hasattr`` probes.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from abc import ABCMeta, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..data.vocab import Vocab
from ..kernels import packed_linear, unpack


class Packable(nn.Module):
    """A module whose float32 CPU products may use packed copies of its weights
    (:func:`kernels.packed_linear`) while ``packed`` is set: by :func:`pack_products`, for a
    model read to caption with. ``train()`` clears it and drops the copies."""

    packed = False

    def train(self, mode: bool = True):
        if mode:
            self.packed = False
            unpack(self.parameters())
        return super().train(mode)


class Linear(Packable, nn.Linear):
    """nn.Linear whose float32 CPU products in decoding can run gemm.c's packed kernel
    (:func:`kernels.packed_linear`: a beam step's few dozen rows, where MKL re-packs the weight
    at every call and ran at 55-90% of the packed kernel's speed at the default's shapes), once
    :func:`pack_products` has said that its weights are done changing; otherwise, and with a
    gradient, another dtype or device, under autocast or while traced, it is nn.Linear. The
    parameters, their names and checkpoints are nn.Linear's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = packed_linear(x, self.weight, self.bias) if self.packed else None
        return super().forward(x) if y is None else y


def pack_products(module: nn.Module) -> nn.Module:
    """Declare ``module``'s weights done changing (a checkpoint read for captioning): its
    :class:`Packable` parts (:class:`Linear` layers, and caption models, whose tied output
    layers call ``packed_linear`` themselves) may keep packed copies of their weights from now
    until ``module.train()``. Copies made before are dropped, so a declaration always packs the
    weights as they are now. Not for a model that is training: a packed copy is renewed when
    PyTorch counts an in-place change of its weight, and the fused Adam optimizer's steps are
    not counted (torch 2.14)."""
    unpack(module.parameters())
    for m in module.modules():
        if isinstance(m, Packable):
            m.packed = True
    return module


class CaptionModel(Packable, metaclass=ABCMeta):
    """The contract of a caption family (see the module docstring)."""

    family: ClassVar[str]  # the registered name (set by register_family)
    cfg: Any  # the family's config dataclass; has vocab_size and feat_dim

    # ---- declared capabilities ---------------------------------------------------------------
    #: ``training_loss``/``forward`` take ``image_index``: the trainer's ``batching = "image"``
    #: (each image once per batch, indexed per caption) is allowed.
    image_batching: ClassVar[bool] = True
    #: how attention figures (and the ONNX runtimes) show a word's attention: "weights" as
    #: they are, or "onehot-argmax" (the one most probable location: hard attention); see
    #: ``view_attention``.
    attention_view: str = "weights"
    #: the names ``param_groups()`` can return: ``train.lr_groups`` is checked against them when
    #: the config is read, before a model is built
    GROUPS: ClassVar[tuple[str, ...]] = ("decoder",)
    # (Packable's ``packed``: products outside a Linear, a tied output layer, may use a packed
    # weight copy while it is set)

    @classmethod
    def position_limit(cls, cfg: Any) -> int | None:
        """``max_positions`` of a model of config ``cfg`` (the family's dataclass), known before
        the model is built (the run config's train.max_len is checked against it at load)."""
        return None

    @classmethod
    def check_trainable(cls, cfg: Any) -> None:
        """Refuse, with a one-line UserError, a config of this family that cannot be trained (the
        run config is checked with it before any data or model loads). Default: every config can."""

    @property
    def max_positions(self) -> int | None:
        """The longest token sequence (<start> + tokens) the model can take; None: no limit."""
        return self.position_limit(self.cfg)

    def decode_options(self) -> dict[str, tuple]:
        """Decoding variants to choose among on the dev split after training: option name ->
        the values to try (e.g. hard attention's ``decode_context``: expected or argmax). An
        option is a field of the family's config, so the chosen value is saved with it."""
        return {}

    def set_decode_options(self, **options) -> None:
        """Decode with these declared options from now on (the model's config is replaced by
        one with these values; the model's weights are untouched)."""
        declared = self.decode_options()
        for name, value in options.items():
            if value not in declared.get(name, ()):
                raise ValueError(f"{self.family}: {name} = {value!r} is not a decode option "
                                 f"(declared: {declared or 'none'})")
        if options:
            self.cfg = dataclasses.replace(self.cfg, **options)

    def word_embedding(self) -> nn.Embedding | None:
        """The word-embedding table the trainer may fill with pretrained vectors (GloVe);
        None when the family has none of its own (its tokens are a pretrained LM's)."""
        return None

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """The trained parameters by name of group (``train.lr_groups`` sets a learning rate
        per group). Default: one group, "decoder", of every parameter that requires grad."""
        return {"decoder": [p for p in self.parameters() if p.requires_grad]}

    @classmethod
    def tokenizer_source(cls, model_cfg: dict) -> str | None:
        """The pretrained tokenizer that ``data.tokenizer = "lm"`` means for a model of this
        config (a language model's source), or None when the family brings none."""
        return None

    # ---- the step contract -------------------------------------------------------------------
    @abstractmethod
    def prepare(self, feats: torch.Tensor) -> Any:
        """(B, L, D) -> the per-image memory (anything with ``index_select(idx)``)."""

    @abstractmethod
    def init_state(self, mem: Any) -> tuple[torch.Tensor, ...]:
        """The first recurrent state: a tuple of tensors whose first dimension is the batch."""

    @abstractmethod
    def step(self, tokens: torch.Tensor, state: tuple[torch.Tensor, ...], mem: Any):
        """tokens (B,) -> (log-probabilities (B, V), the next state, attention (B, L))."""

    # ---- teacher forcing -----------------------------------------------------------------------
    @abstractmethod
    def forward(self, feats: torch.Tensor, inputs: torch.Tensor, image_index: torch.Tensor | None = None):
        """inputs (B, T) = <start> w_1 .. w_{T-1} -> (scores (B, T, V), attention (B, T, L) or None)."""

    @abstractmethod
    def training_loss(self, feats: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, *,
                      alpha_c: float = 0.0, label_smoothing: float = 0.0,
                      image_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (the loss to minimise, the plain token cross-entropy to report). ``alpha_c``: the
        attention penalty's weight, for families that have one; <pad> targets are ignored."""


# ---- decoding loops that own their states ----------------------------------------------------
_OWNED = contextvars.ContextVar("captionkit_owned_states", default=False)


@contextlib.contextmanager
def owned_states():
    """Within the block, the decoding loop steps each state once and keeps no reference to a
    state it has stepped (beam search's reordered rows are fresh tensors): a family's ``step``
    may then write the next state into the tensors of the one it is given (the transformer's
    KV cache) instead of copying them. Outside it, ``step`` leaves its inputs as they were,
    so a caller may step one state with several words."""
    token = _OWNED.set(True)
    try:
        yield
    finally:
        _OWNED.reset(token)


def states_owned() -> bool:
    """Whether the running decoding loop owns its states (:func:`owned_states`)."""
    return _OWNED.get()


ATTENTION_VIEWS = ("weights", "onehot-argmax")


def view_attention(attention: torch.Tensor, view: str) -> torch.Tensor:
    """A caption's attention (T, L) as figures show it under a model's ``attention_view``."""
    if view == "onehot-argmax":
        return F.one_hot(attention.argmax(1), attention.shape[1]).float()
    return attention


def pixel_rows_to_images(feats: torch.Tensor, grid: tuple[int, int], patch: int) -> torch.Tensor:
    """Pixel-patch rows (B, H*W, 3*p*p) in [0, 1], each row one patch channel-major (the
    vit_pixels and hf_pixels encoders' output) -> the images they cut (B, 3, H*p, W*p)."""
    B = feats.shape[0]
    (H, W), p = grid, patch
    x = feats.float().reshape(B, H, W, 3, p, p)
    return x.permute(0, 3, 1, 4, 2, 5).reshape(B, 3, H * p, W * p)  # (B, 3, rows, p, cols, p) -> (B, 3, S, S)


class KVMemory:
    """An image's memory as per-layer attention keys and values (B, heads, L, head_dim), computed
    once per image and reused at every step: a transformer's cross-attention keys/values of the
    image tokens, or a language model's keys/values of a visual prefix."""

    def __init__(self, keys: list[torch.Tensor], values: list[torch.Tensor]):
        self.keys, self.values = keys, values

    def index_select(self, idx: torch.Tensor) -> "KVMemory":
        return KVMemory([k.index_select(0, idx) for k in self.keys], [v.index_select(0, idx) for v in self.values])


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = Vocab.pad,
                        label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean cross-entropy of logits (..., V) against targets (...), skipping ``ignore_index``
    -> (the loss, label-smoothed if asked; the plain cross-entropy, to report). Taken in
    float32 whatever the model computed in."""
    flat_logits, flat_targets = logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
    loss = F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index, label_smoothing=label_smoothing)
    if not label_smoothing:
        return loss, loss
    with torch.no_grad():
        return loss, F.cross_entropy(flat_logits, flat_targets, ignore_index=ignore_index)


class TrainedTensorsMixin:
    """For families built on large pretrained weights that stay mostly frozen: the module's
    ``state_dict()`` holds only the trained tensors, so a checkpoint stores them (and the
    config names the pretrained sources), and loading rebuilds the model from its sources and
    puts them on top. The family calls ``set_trained({parameter name: group})`` at the end of
    its ``__init__``; ``GROUPS`` orders the groups of ``param_groups()``. List this mixin
    before :class:`CaptionModel` among the bases."""

    GROUPS: ClassVar[tuple[str, ...]] = ()

    def set_trained(self, groups: dict[str, str]) -> None:
        unknown = sorted(set(groups.values()) - set(self.GROUPS))
        if unknown:
            raise ValueError(f"{type(self).__name__}: parameter group {unknown[0]!r} is not in GROUPS")
        self.groups = dict(groups)  # trained parameter name -> its group
        self.trained = set(groups)  # what training changes: saved in checkpoints

    def state_dict(self, *args, **kwargs):
        full = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        return type(full)((k, v) for k, v in full.items() if k[len(prefix):] in self.trained)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Load trained tensors on top of the pretrained sources; with ``strict`` they must be
        exactly the tensors this configuration trains."""
        if strict and set(state_dict) != self.trained:
            missing, extra = sorted(self.trained - set(state_dict)), sorted(set(state_dict) - self.trained)
            raise RuntimeError(f"{self.family} weights: missing {missing[:3]}, unexpected {extra[:3]}")
        return super().load_state_dict(state_dict, strict=False, assign=assign)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """The trained parameters by group, in ``GROUPS`` order; empty groups left out."""
        out: dict[str, list[nn.Parameter]] = {g: [] for g in self.GROUPS}
        for name, p in self.named_parameters():
            if name in self.groups:
                out[self.groups[name]].append(p)
        return {k: v for k, v in out.items() if v}


# ---- what exporters return (registered per family with registry.register_exporter) ---------------
@dataclass
class DecoderExport:
    """How a decoder is exported to ONNX (see :mod:`captionkit.export.exporters`).

    init: module ``feats -> (*memory, *state)`` (in the order of ``memory`` then ``state``).
    step: module ``(tokens, *state, feats, *memory) -> (logprobs, *state_next, attention)``.
    memory: names of the per-image tensors the step reads besides ``feats``.
    state: names of the recurrent tensors (the step returns ``<name>_next`` for each).
    """

    init: nn.Module
    step: nn.Module
    memory: list[str]
    state: list[str]


@dataclass
class TransformersExport:
    """What ``captionkit.export.exporters.export_transformers`` writes for a model.

    save: writes the plain transformers folder (weights, config, tokenizer, ...) into the
        folder it is given (a temporary one, renamed to the output when complete).
    model_changes, vocab_changes, weights: when the export is a captionkit model again, its
        checkpoint (written to ``captioner/`` inside the output, with the checkpoint's tuned
        encoder tensors): the changes to the ``model`` and ``vocab`` config tables that make it
        load from the exported folder, and the decoder tensors it keeps. None: no captioner.
    """

    save: Callable[[Path], None]
    model_changes: dict | None = None
    vocab_changes: dict | None = None
    weights: dict[str, torch.Tensor] | None = None
