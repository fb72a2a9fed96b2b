"""ViT + GPT-2: an encoder-decoder captioner with cross-attention (family ``vit_gpt2``), built
through ``transformers``' ``VisionEncoderDecoderModel`` from any ViT-family image model and any
GPT-2 language model, each a Hugging Face hub name or a local folder:

    photo -> ViT -> tokens (B, prefix + H*W, D_vit) [-> Linear to GPT-2's width, if they differ]
    <start> w_1 .. w_T -> GPT-2 blocks: self-attention, cross-attention to the tokens, MLP -> w_1 .. w_T <end>

The ``VisionEncoderDecoderModel`` (``self.ved``) holds both sides, the new cross-attention
layers (GPT-2's ``crossattention`` and ``ln_cross_attn``, randomly initialised) and the
projection, so its exporter (registered at the bottom; :func:`captionkit.export.exporters.export_transformers`)
writes a plain transformers folder that ``VisionEncoderDecoderModel.from_pretrained`` loads.
Loading the two sides is :mod:`captionkit.core.hf`'s. Real weights are never replaced by random
ones: a model that is neither a folder, nor in the local Hugging Face cache, nor downloadable
is one line naming it (:class:`~captionkit.core.errors.WeightsUnavailable`), and a checkpoint short
of a tensor is refused (only GPT-2's cross-attention, which it cannot hold yet, and the ViT's
pooler, which captioning does not use, may be missing).

What trains, per side (``freeze_encoder_blocks``, ``freeze_decoder_blocks``): the embeddings
and the first N blocks stay frozen, the later blocks and the final norm train; 0 freezes
nothing, ``"all"`` the whole side. The cross-attention layers and the projection always train.
``param_groups()`` names encoder, decoder, cross_attention and projection, so each can have its
own learning rate (``train.lr_groups``). The module's ``state_dict()`` holds only the trained
tensors (:class:`~captionkit.models.base.TrainedTensorsMixin`): a checkpoint stores them and the
two sources; loading rebuilds the model from the sources and puts them on top.

How it meets the trainer's feature cache (a trade-off). The trainer caches what its [encoder]
computes before it builds the model, and ``captionkit caption`` runs that encoder before the
model's ``prepare``; the trainer's ``finetune_blocks`` trains an encoder's last blocks outside
the model. This family's feats are therefore the ViT's *input*: encoder ``vit_pixels``
(:mod:`captionkit.encoders.vit_pixels`) caches the photo resized to the ViT's size as rows of
patch pixels, and the family normalises them and runs the whole ViT, frozen blocks included,
in every step. Caching the frozen trunk instead (embeddings + the first N blocks) would save
that forward pass -- about 17.6 GFLOPs per image for ViT-B/16, once per image per step with
``train.batching = "image"``: by a FLOP count (not measured) roughly a fifth of a step of ViT-B
+ GPT-2 small on five captions per image -- but the cache would then depend on a [model] setting the trainer reads only after
building it, and the trained ViT blocks would live in the [encoder] (two copies of the ViT, or
a VisionEncoderDecoderModel without its encoder). One model that owns every weight and runs
exactly what ``from_pretrained`` would was preferred; a trainer hook that runs the frozen
trunk once over the cached pixels (as the trainer already does for blocks tuned before and
frozen now) would be the way to get the saving back.

Token ids: the ``lm`` tokenizer kind (:mod:`captionkit.data.tokenizers`) numbers GPT-2's tokens
from 4; <start> is embedded as GPT-2's BOS (``<|endoftext|>``) and <end> is its EOS (the same
token), mapped exactly as the prefix-LM family maps them.

Decoding follows :mod:`captionkit.inference.decoding`'s step contract. ``prepare`` runs the ViT once and
lets GPT-2 compute every layer's cross-attention keys and values from its tokens once: the
memory (``CrossMemory``). The state is GPT-2's own self-attention KV cache (per layer keys and
values (B, heads, t, head_dim), empty at first, one position longer per step). A step feeds
one token through an ``EncoderDecoderCache`` made of the two, so nothing of the image is
recomputed. The attention returned per step is GPT-2's cross-attention from the new position
(mean over layers and heads) over the patch tokens, the class token's share left out and the
rest renormalised: one weight per cell of the patch grid.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.errors import UserError
from ..core.fields import check_fields, spec
from ..core.hf import (
    DEFAULT_VIT,
    gpt2_config,
    is_cross_attention,
    kv_cache,
    load_gpt2,
    load_image_processor_dict,
    load_lm_tokenizer,
    load_vit,
    require_transformers,
    vit_geometry,
    with_cache,
)
from ..core.registry import register_exporter, register_family
from .base import CaptionModel, KVMemory, TrainedTensorsMixin, TransformersExport, pixel_rows_to_images
from .lm_tokens import N_SPECIAL, LMTokens

DEFAULT_LM = "gpt2"
ALL = "all"


def transformers_module():
    return require_transformers("the vit_gpt2 family", "vit_gpt2")


def _block_list(model: nn.Module, source: str, what: str) -> str:
    """The dotted name of the model's list of transformer blocks."""
    for name in ("layers", "encoder.layer", "encoder.layers", "transformer.h"):
        try:
            if isinstance(model.get_submodule(name), nn.ModuleList):
                return name
        except AttributeError:
            continue
    raise UserError(f"{what} {source!r} ({type(model).__name__}): no list of transformer blocks to freeze")


# ---- the model ----------------------------------------------------------------------------------
@dataclass
class ViTGPT2Config:
    """The ViT + GPT-2 captioner.

    vocab_size: the ``lm`` tokenizer's size, GPT-2's tokens + 4 (set by the trainer; train with
        data.tokenizer = "lm").
    feat_dim, grid: the rows of encoder ``vit_pixels``: 3 x p x p pixels per patch on the ViT's
        (S/p) x (S/p) patch grid (set by the trainer; 768 and [14, 14] for 224 px, 16 px patches).
    vit: the image model: a transformers vision transformer of square patches with a list of
        blocks (ViT; DeiT, BEiT, DINOv2 are accepted but untested), a hub name or a local folder
        holding its config.json, weights and preprocessor_config.json (its normalisation). [encoder] weights
        should name the same model (a different input geometry is refused).
    lm: the language model: GPT-2 architecture (gpt2, distilgpt2, gpt2-medium, ... or a folder
        with its tokenizer). An absolute folder path is safest: a relative one is taken from the
        working directory.
    freeze_encoder_blocks: the ViT's embeddings (patches, class token, positions) and its first N
        blocks stay frozen; its later blocks and final layer norm train. 0: nothing frozen;
        "all": the whole ViT frozen.
    freeze_decoder_blocks: the same for GPT-2: its token and position embeddings (tied to its
        output layer) and its first N blocks' self-attention and MLP stay frozen; the later
        blocks and the final norm train. 0: nothing frozen; "all": all of GPT-2's own weights.
        The cross-attention layers (new) always train.
    Parameter groups for train.lr_groups: encoder (the ViT's trained tensors), decoder (GPT-2's),
    cross_attention (every block's crossattention and ln_cross_attn) and projection (the Linear
    from the ViT's width to GPT-2's; only when the widths differ), e.g.
    lr_groups = {encoder = 1e-5, decoder = 5e-5, cross_attention = 5e-4}.
    """

    vocab_size: int = spec(ge=1)
    feat_dim: int = spec(768, ge=1)
    grid: list[int] = spec(default_factory=lambda: [14, 14], length=2, ge=1)
    vit: str = spec(DEFAULT_VIT, min_len=1)
    lm: str = spec(DEFAULT_LM, min_len=1)
    freeze_encoder_blocks: int | str = spec(ALL, ge=0, choices=(ALL,), describe=f'a number of blocks >= 0 or "{ALL}"')
    freeze_decoder_blocks: int | str = spec(0, ge=0, choices=(ALL,), describe=f'a number of blocks >= 0 or "{ALL}"')

    def __post_init__(self):
        check_fields(self)


class CrossMemory(KVMemory):
    """Per image: the ViT's tokens in GPT-2's width (B, L, D) and each GPT-2 layer's
    cross-attention keys and values of them (B, heads, L, head_dim)."""

    def __init__(self, hidden: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor]):
        super().__init__(keys, values)
        self.hidden = hidden

    def index_select(self, idx: torch.Tensor) -> "CrossMemory":
        return CrossMemory(self.hidden.index_select(0, idx), [k.index_select(0, idx) for k in self.keys],
                           [v.index_select(0, idx) for v in self.values])

    def cache(self):
        """A DynamicCache holding these keys and values as they are (core.hf.kv_cache: not
        copied at every step, which for ViT-B's 197 tokens is as large as the step's own work)."""
        return kv_cache(zip(self.keys, self.values))


def _side_part(name: str, blocks: str, embeddings: tuple[str, ...]) -> int | str:
    """Where a parameter sits in one side: "embeddings", a block number, or "head" (after the
    blocks: the final norm, an untied output layer)."""
    if name.startswith(embeddings):
        return "embeddings"
    m = re.match(re.escape(blocks) + r"\.(\d+)\.", name)
    return int(m.group(1)) if m else "head"


def _trains(part: int | str, freeze: int | str) -> bool:
    """Does a part of a side train when its embeddings and first ``freeze`` blocks are frozen?"""
    if freeze == ALL:
        return False
    if part == "embeddings":
        return freeze == 0
    return part == "head" or part >= freeze


@register_family("vit_gpt2", ViTGPT2Config)
class ViTGPT2Captioner(TrainedTensorsMixin, LMTokens, CaptionModel):
    GROUPS = ("encoder", "decoder", "cross_attention", "projection")
    default_lm = DEFAULT_LM

    def __init__(self, cfg: ViTGPT2Config):
        super().__init__()
        self.cfg = cfg
        tf = transformers_module()
        gpt2_config(cfg.lm)  # a LLaMA named here fails in one line, before its tokenizer is read
        tok = load_lm_tokenizer(cfg.lm)
        if cfg.vocab_size != len(tok) + N_SPECIAL:
            raise UserError(f"ViTGPT2Config.vocab_size is {cfg.vocab_size}, but the tokenizer of {cfg.lm!r} has "
                             f"{len(tok)} tokens + {N_SPECIAL} specials (train with data.tokenizer = \"lm\" and "
                             f"[model] lm naming the same model)")
        vit, lm = load_vit(cfg.vit), load_gpt2(cfg.lm)
        self.bind_tokenizer(tok, lm, cfg.lm)
        size, self.patch, _ = vit_geometry(vit.config, cfg.vit)
        side = size // self.patch
        if cfg.feat_dim != 3 * self.patch ** 2 or cfg.grid != [side, side]:
            raise UserError(f"the image rows are {cfg.grid[0]}x{cfg.grid[1]} x {cfg.feat_dim}, but {cfg.vit!r} takes "
                             f"{side}x{side} patches of 3x{self.patch}x{self.patch} pixels: train on [encoder] "
                             f"name = \"vit_pixels\" with weights = {cfg.vit!r}")
        processor = load_image_processor_dict(cfg.vit)
        normalize = processor.get("do_normalize", True)
        mean = processor.get("image_mean", [0.0] * 3) if normalize else [0.0] * 3
        std = processor.get("image_std", [1.0] * 3) if normalize else [1.0] * 3
        self.register_buffer("pixel_mean", torch.tensor(mean, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(std, dtype=torch.float32).view(1, 3, 1, 1), persistent=False)

        # the two sides, the cross-attention inside GPT-2's blocks, and the projection when the
        # widths differ: one model, exactly as from_encoder_decoder_pretrained would build it
        self.ved = tf.VisionEncoderDecoderModel(encoder=vit, decoder=lm)
        self.ved.config.decoder_start_token_id = self.bos_id  # for transformers' own generate()
        self.ved.config.pad_token_id = self.ved.config.eos_token_id = self.eos_id

        vit_blocks, lm_blocks = _block_list(vit, cfg.vit, "vision model"), _block_list(lm, cfg.lm, "language model")
        sides = (("encoder", cfg.freeze_encoder_blocks, cfg.vit, len(vit.get_submodule(vit_blocks))),
                 ("decoder", cfg.freeze_decoder_blocks, cfg.lm, len(lm.get_submodule(lm_blocks))))
        for what, freeze, source, n in sides:
            if freeze != ALL and freeze > n:
                raise UserError(f"ViTGPT2Config.freeze_{what}_blocks is {freeze}, but {source!r} has {n} blocks "
                                 f"(\"all\" freezes all of it)")
        groups: dict[str, str] = {}  # trained parameter name -> its group
        for name, p in self.named_parameters():
            if name.startswith("ved.enc_to_dec_proj."):
                group = "projection"
            elif name.startswith("ved.encoder."):
                sub = name[len("ved.encoder."):]
                trains = not sub.startswith("pooler.") and _trains(
                    _side_part(sub, vit_blocks, ("embeddings.",)), cfg.freeze_encoder_blocks)
                group = "encoder" if trains else None
            elif is_cross_attention(name):
                group = "cross_attention"
            else:
                sub = name[len("ved.decoder."):]
                part = _side_part(sub, lm_blocks, ("transformer.wte.", "transformer.wpe."))
                group = "decoder" if _trains(part, cfg.freeze_decoder_blocks) else None
            p.requires_grad_(group is not None)
            if group:
                groups[name] = group
        # what training changes: saved in checkpoints, everything else comes from the sources
        self.set_trained(groups)

    @property
    def gpt2(self) -> nn.Module:
        return self.ved.decoder

    # ---- the image side --------------------------------------------------------------------
    def pixels(self, feats: torch.Tensor) -> torch.Tensor:
        """vit_pixels rows (B, H*W, 3*p*p) in [0, 1] -> the ViT's normalised input (B, 3, S, S)."""
        return (pixel_rows_to_images(feats, self.cfg.grid, self.patch) - self.pixel_mean) / self.pixel_std

    def encode(self, feats: torch.Tensor) -> torch.Tensor:
        """vit_pixels rows -> the ViT's tokens in GPT-2's width (B, prefix + H*W, D): what the
        VisionEncoderDecoderModel's forward hands its decoder as encoder_hidden_states."""
        hidden = self.ved.encoder(pixel_values=self.pixels(feats)).last_hidden_state  # (B, L, D_vit)
        if hasattr(self.ved, "enc_to_dec_proj"):  # the model has it exactly when its forward uses it
            hidden = self.ved.enc_to_dec_proj(hidden)
        return hidden

    # ---- the decoder step contract ---------------------------------------------------------
    def prepare(self, feats: torch.Tensor) -> CrossMemory:
        """(B, H*W, 3*p*p) -> the ViT's tokens and GPT-2's cross-attention keys/values of them.
        GPT-2 computes a layer's cross-attention keys and values the first time it meets the
        tokens and keeps them in the cross-attention half of its cache, so one <start> step
        through its blocks fills them (its self-attention half is dropped: decoding feeds
        <start> again as its first step)."""
        from transformers import DynamicCache, EncoderDecoderCache
        hidden = self.encode(feats)  # (B, L, D)
        cache = EncoderDecoderCache(DynamicCache(), DynamicCache())
        start = torch.full((hidden.shape[0], 1), self.bos_id, dtype=torch.long, device=hidden.device)
        self.gpt2.transformer(input_ids=start, encoder_hidden_states=hidden, **with_cache(cache))
        cross = cache.cross_attention_cache.layers
        return CrossMemory(hidden, [layer.keys for layer in cross], [layer.values for layer in cross])

    def init_state(self, mem: CrossMemory) -> tuple[torch.Tensor, ...]:
        """GPT-2's empty self-attention cache: (keys_0, values_0, keys_1, ...) (B, heads, 0, head_dim)."""
        c = self.gpt2.config
        empty = mem.hidden.new_zeros(mem.hidden.shape[0], c.n_head, 0, c.n_embd // c.n_head)
        return (empty,) * (2 * c.n_layer)

    @staticmethod
    def _cache(state, mem: CrossMemory):
        """GPT-2's cache: the self-attention keys/values of the state, the memory's cross-attention
        ones (non-empty, so GPT-2 uses them instead of recomputing them from the tokens); both
        as they are, not copied."""
        from transformers import EncoderDecoderCache
        return EncoderDecoderCache(kv_cache(zip(state[0::2], state[1::2])), mem.cache())

    def step(self, tokens: torch.Tensor, state, mem: CrossMemory):
        """tokens (B,) -> (log-probs (B, V), the cache one position longer, attention (B, H*W))."""
        cache = self._cache(state, mem)
        out = self.gpt2(input_ids=self.lm_ids(tokens).unsqueeze(1), encoder_hidden_states=mem.hidden,
                        **with_cache(cache), output_attentions=True)
        logp = self.to_vocab(out.logits[:, -1])  # (B, V)
        # per layer (B, heads, 1, L): the new position over the ViT's tokens
        att = torch.stack([a[:, :, -1] for a in out.cross_attentions]).float().mean((0, 2))  # (B, L)
        cells = att[:, -self.cfg.grid[0] * self.cfg.grid[1]:]  # the patch tokens follow the class token(s)
        attention = cells / cells.sum(1, keepdim=True).clamp_min(1e-12)
        layers = cache.self_attention_cache.layers
        return logp, tuple(t for layer in layers for t in (layer.keys, layer.values)), attention

    # ---- teacher-forced training (forward and training_loss: LMTokens) ---------------------
    def lm_logits(self, feats: torch.Tensor, inputs: torch.Tensor, image_index: torch.Tensor | None = None):
        """feats (B, H*W, 3*p*p), inputs (B, T) = <start> w_1 .. w_{T-1} -> GPT-2 logits (B, T, V_lm).
        As in decoding, the memory is prepared first (gradients flow back through it to the
        cross-attention and the ViT). With image_index (B,), feats holds each image once
        (U, H*W, 3*p*p) and caption b belongs to image image_index[b]: the ViT and the
        cross-attention keys/values then run once per image, not once per caption."""
        mem = self.prepare(feats)  # (B or U, ...)
        if image_index is not None:
            mem = mem.index_select(image_index)  # (B, ...)
        cache = self._cache(self.init_state(mem), mem)
        return self.gpt2(input_ids=self.lm_ids(inputs), encoder_hidden_states=mem.hidden, **with_cache(cache)).logits


@register_exporter("transformers", "vit_gpt2")
def transformers_export(model: ViTGPT2Captioner, checkpoint: str, out: Path) -> TransformersExport:
    """The VisionEncoderDecoderModel (``save_pretrained``), GPT-2's tokenizer and the ViT's image
    processor settings, which ``VisionEncoderDecoderModel.from_pretrained`` and transformers'
    own ``generate`` use."""
    def save(folder: Path) -> None:
        model.ved.save_pretrained(folder)
        load_lm_tokenizer(model.cfg.lm).save_pretrained(folder)
        (folder / "preprocessor_config.json").write_text(json.dumps(load_image_processor_dict(model.cfg.vit),
                                                                    indent=1))

    return TransformersExport(save)
