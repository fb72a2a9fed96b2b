"""A transformer captioner: image tokens -> [encoder layers] -> memory; a decoder of causal
self-attention, cross-attention to the memory and an MLP per layer, pre-norm (Vaswani et al.
2017, with the LayerNorm before each sublayer as in GPT-2).

The image side consumes the cached encoder rows (B, L, feat_dim), so the trainer's feature
cache works as for the LSTM:
- ``patches`` rows (8x8 pixel patches, 192 numbers each): the Linear feat_dim -> width below
  is ViT's learned patch embedding; with positions and ``encoder_layers`` of self-attention
  this is a vision transformer trained from scratch, together with the decoder.
- a pretrained CNN's or CLIP's grid: the same Linear projects it to the decoder width;
  ``encoder_layers`` may be 0 (the grid then goes straight to cross-attention).

The decoder step contract is the LSTM's (see :mod:`captionkit.inference.decoding`), so greedy decoding,
beam search and self-critical training work unchanged:

    mem = model.prepare(feats)          # image encoder + every layer's cross-attention K/V, once
    state = model.init_state(mem)       # the key/value cache of the self-attention
    logprobs, state, attention = model.step(tokens, state, mem)

The cache is preallocated at its full size (``max_positions``) with a position counter, and
a step writes its key/value with a scatter and attends under a mask of the filled slots:
shapes never change and there is no Python-side control flow in the step, so it exports
(ONNX) as one graph; it costs a full-length attention per step, which for captions of tens
of tokens is small next to the matmuls. One step per token; the teacher-forced
``forward`` computes all positions at once with a causal mask and gives the same numbers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.fields import check_fields, field_error, spec
from ..core.registry import register_exporter, register_family
from ..kernels import packed_linear
from .base import CaptionModel, DecoderExport, KVMemory, Linear, states_owned, token_cross_entropy


@dataclass
class TransformerConfig:
    """Sizes of the transformer captioner.

    vocab_size: tokens including the four special ones (set by the trainer).
    feat_dim: the cached image rows' size (set by the trainer from the encoder: 192 for
        ``patches``, 1280 for EfficientNet-Lite, 768 for CLIP ViT-B).
    grid: (H, W) of the image tokens, L = H * W learned image positions (set by the trainer).
    width: the model width (d_model) of the encoder and the decoder.
    heads: attention heads; width must be a multiple of it.
    encoder_layers: self-attention layers over the image tokens (0: the projected grid is the
        memory as it is; 2 for patches from scratch).
    decoder_layers: decoder layers.
    mlp_ratio: the MLP's hidden size as a multiple of width.
    dropout: on embeddings and on every residual branch.
    max_positions: the longest token sequence (<start> + tokens): learned positions and the
        KV cache's size. Decoding max_len + 1 and the longest training caption must fit.
    embed_dim: the word-embedding size; 0 means width. Otherwise a Linear embed_dim -> width
        follows the embedding (e.g. 300-d GloVe vectors into a 256-wide model).
    tie_embeddings: the output layer reuses the embedding matrix (Press & Wolf 2017), through
        the transpose of that Linear when embed_dim != width.
    attention_layer: whose cross-attention is returned for figures (averaged over heads);
        negative counts from the last layer.
    """

    vocab_size: int = spec(ge=5)  # the 4 special tokens and at least one more
    feat_dim: int = spec(1280, ge=1)
    grid: list[int] = spec(default_factory=lambda: [9, 9], length=2, ge=1)
    width: int = spec(256, ge=1)
    heads: int = spec(4, ge=1)
    encoder_layers: int = spec(0, ge=0)
    decoder_layers: int = spec(3, ge=1)
    mlp_ratio: int = spec(4, ge=1)
    dropout: float = spec(0.1, ge=0, lt=1)
    max_positions: int = spec(64, ge=1)
    embed_dim: int = spec(0, ge=0)
    tie_embeddings: bool = True
    attention_layer: int = -1

    def __post_init__(self):
        check_fields(self)
        if self.width % self.heads:
            raise field_error(self, "width", f"({self.width}) must be a multiple of heads ({self.heads})")
        if not -self.decoder_layers <= self.attention_layer < self.decoder_layers:
            raise field_error(self, "attention_layer", f"must name one of the {self.decoder_layers} decoder layers, "
                                                       f"got {self.attention_layer}")


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None):
    """Scaled dot-product attention that also returns its weights.
    q (B, h, T, d), k and v (B, h, S, d), mask broadcastable to (B, h, T, S), True = may attend
    -> out (B, h, T, d), weights (B, h, T, S). The softmax is taken in float32."""
    att = (q @ k.transpose(-2, -1)).float() * (1.0 / math.sqrt(q.shape[-1]))  # (B, h, T, S)
    if mask is not None:
        att = att.masked_fill(~mask, float("-inf"))
    weights = att.softmax(-1)
    return weights.to(v.dtype) @ v, weights


class SelfAttention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = Linear(cfg.width, 3 * cfg.width)
        self.proj = Linear(cfg.width, cfg.width)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        return x.view(B, T, self.heads, D // self.heads).transpose(1, 2)  # (B, h, T, d)

    def merge(self, y: torch.Tensor) -> torch.Tensor:
        B, h, T, d = y.shape
        return self.proj(y.transpose(1, 2).reshape(B, T, h * d))  # (B, T, D)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        q, k, v = (self.split(t) for t in self.qkv(x).chunk(3, dim=-1))  # (B, h, T, d) each
        return self.merge(attend(q, k, v, mask)[0])


class CrossAttention(nn.Module):
    """Queries from the words, keys and values from the image memory; K/V are computed once
    per image (``kv``) and reused at every step."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.heads = cfg.heads
        self.q = Linear(cfg.width, cfg.width)
        self.kv = Linear(cfg.width, 2 * cfg.width)
        self.proj = Linear(cfg.width, cfg.width)

    def keys_values(self, memory: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, L, D = memory.shape
        k, v = self.kv(memory).view(B, L, 2, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)  # (B, h, L, d) each
        return k, v

    def forward(self, x: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """x (B, T, D) -> (out (B, T, D), weights (B, h, T, L))."""
        B, T, D = x.shape
        q = self.q(x).view(B, T, self.heads, D // self.heads).transpose(1, 2)  # (B, h, T, d)
        y, w = attend(q, k, v, None)
        return self.proj(y.transpose(1, 2).reshape(B, T, D)), w  # (B, T, D)


class MLP(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.fc = Linear(cfg.width, cfg.mlp_ratio * cfg.width)
        self.proj = Linear(cfg.mlp_ratio * cfg.width, cfg.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.attn, self.mlp = SelfAttention(cfg), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.drop(self.attn(self.ln1(x), None))  # every image token sees every other
        return x + self.drop(self.mlp(self.ln2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.self_attn, self.cross, self.mlp = SelfAttention(cfg), CrossAttention(cfg), MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The self-attention queries, keys and values of positions x (B, T, D) -> (B, h, T, d) each."""
        return tuple(self.self_attn.split(t) for t in self.self_attn.qkv(self.ln1(x)).chunk(3, dim=-1))

    def forward(self, x, q, k_self, v_self, mask, k_img, v_img):
        """x (B, T, D) the new positions and q (B, h, T, d) their queries; k_self/v_self
        (B, h, S, d) the keys and values of every position they may attend to (the cache, or
        the whole caption under a causal mask); k_img/v_img (B, h, L, d)
        -> (x, cross-attention weights (B, h, T, L))."""
        x = x + self.drop(self.self_attn.merge(attend(q, k_self, v_self, mask)[0]))
        y, weights = self.cross(self.ln2(x), k_img, v_img)
        x = x + self.drop(y)
        return x + self.drop(self.mlp(self.ln3(x))), weights


@register_family("transformer", TransformerConfig)
class TransformerCaptioner(CaptionModel):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        D, V, E = cfg.width, cfg.vocab_size, cfg.embed_dim or cfg.width
        L = cfg.grid[0] * cfg.grid[1]
        # image side
        self.img_proj = Linear(cfg.feat_dim, D)  # ViT's patch embedding, or a CNN grid's projection
        self.img_pos = nn.Parameter(torch.zeros(L, D))
        # not named "encoder": checkpoints keep fine-tuned image-encoder tensors under "encoder."
        self.img_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.encoder_layers))
        self.ln_img = nn.LayerNorm(D)
        # word side
        self.embed = nn.Embedding(V, E)  # the trainer may load word vectors into it (GloVe)
        self.embed_proj = Linear(E, D, bias=False) if E != D else None
        self.pos = nn.Parameter(torch.zeros(cfg.max_positions, D))
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.decoder_layers))
        self.ln_f = nn.LayerNorm(D)
        self.head = None if cfg.tie_embeddings else Linear(D, V, bias=False)
        self.head_bias = nn.Parameter(torch.zeros(V))
        self.drop = nn.Dropout(cfg.dropout)
        self.attention_layer = cfg.attention_layer % cfg.decoder_layers
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's: N(0, 0.02) weights, zero biases, and the projections that add into the
        residual stream scaled by 1/sqrt(2 * layers), so the stream's variance does not grow
        with depth."""
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        nn.init.normal_(self.img_pos, std=0.02)
        nn.init.normal_(self.pos, std=0.02)
        n = 2 * (self.cfg.decoder_layers + self.cfg.encoder_layers)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") and ("attn" in name or "cross" in name or "mlp" in name):
                nn.init.normal_(p, std=0.02 / math.sqrt(n))

    # ---- declared capabilities ------------------------------------------------------------
    @classmethod
    def position_limit(cls, cfg: TransformerConfig) -> int:
        return cfg.max_positions

    def word_embedding(self) -> nn.Embedding:
        return self.embed

    # ---- shared pieces ---------------------------------------------------------------------
    def encode_image(self, feats: torch.Tensor) -> torch.Tensor:
        """Cached rows (B, L, feat_dim) -> image tokens (B, L, D)."""
        x = self.drop(self.img_proj(feats) + self.img_pos)  # (B, L, D)
        for layer in self.img_layers:
            x = layer(x)
        return self.ln_img(x)

    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens (B, T) at positions (B, T) -> (B, T, D)."""
        x = self.embed(tokens)  # (B, T, E)
        if self.embed_proj is not None:
            x = self.embed_proj(x)  # (B, T, D)
        return self.drop(x + self.pos[positions])

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Decoder output (B, T, D) -> (B, T, V)."""
        x = self.ln_f(x)
        if self.head is not None:
            return self.head(x) + self.head_bias
        if self.embed_proj is not None:  # back from width to the embedding size
            x = x @ self.embed_proj.weight  # (B, T, E)
        y = packed_linear(x, self.embed.weight, self.head_bias) if self.packed else None  # decoding, fp32 CPU
        return x @ self.embed.weight.t() + self.head_bias if y is None else y  # (B, T, V)

    # ---- the decoder step contract -------------------------------------------------------
    def prepare(self, feats: torch.Tensor) -> KVMemory:
        """(B, L, feat_dim) -> every decoder layer's cross-attention keys and values (B, h, L, d)
        of the encoded image tokens: the image encoder runs once per image."""
        mem = self.encode_image(feats)  # (B, L, D)
        kv = [layer.cross.keys_values(mem) for layer in self.layers]
        return KVMemory([k for k, _ in kv], [v for _, v in kv])

    def init_state(self, mem: KVMemory) -> tuple[torch.Tensor, ...]:
        """(position (B,), then per layer keys and values (B, h, max_positions, d)), all zero.
        The caches take the memory's dtype, the one the layers compute in (bf16/fp16 under
        autocast): a step then writes and reads them without casting the whole cache twice per
        layer; keys and values computed under autocast are in that dtype anyway, so a float32
        cache would hold exactly the same numbers."""
        B, h, _, d = mem.keys[0].shape
        device, dtype = mem.keys[0].device, mem.keys[0].dtype
        # distinct tensors, not one repeated: an exporter treats aliased inputs as one input
        caches = tuple(torch.zeros(B, h, self.cfg.max_positions, d, dtype=dtype, device=device)
                       for _ in range(2 * len(self.layers)))
        return (torch.zeros(B, dtype=torch.long, device=device),) + caches

    def step(self, tokens: torch.Tensor, state, mem: KVMemory):
        """tokens (B,) at the state's position -> (log-probs (B, V), new state, attention (B, L)):
        the cross-attention of layer ``attention_layer`` averaged over heads."""
        pos, caches = state[0], state[1:]
        P = self.cfg.max_positions
        x = self.embed_tokens(tokens.unsqueeze(1), pos.unsqueeze(1))  # (B, 1, D)
        slots = torch.arange(P, device=pos.device)
        mask = (slots.unsqueeze(0) <= pos.unsqueeze(1)).view(-1, 1, 1, P)  # (B, 1, 1, P): filled slots
        # Where the decoding loop owns its states (beam search, greedy: base.owned_states), the
        # new keys and values are written into the given caches in place; the out-of-place
        # scatter copied every layer's whole cache at every step, besides beam search's reorder.
        in_place = states_owned()
        new_caches, attention = [], None
        for i, layer in enumerate(self.layers):
            q, k_new, v_new = layer.qkv(x)  # (B, h, 1, d) each
            where = pos.view(-1, 1, 1, 1).expand_as(k_new)  # (B, h, 1, d): the slot to write
            # the caches are in the compute dtype (init_state): these casts are no-ops, kept
            # for a state made outside the autocast region it is decoded in
            k_cache, v_cache = caches[2 * i], caches[2 * i + 1]  # (B, h, P, d)
            k_new, v_new = k_new.to(k_cache.dtype), v_new.to(v_cache.dtype)
            if in_place:
                k_cache, v_cache = k_cache.scatter_(2, where, k_new), v_cache.scatter_(2, where, v_new)
            else:
                k_cache, v_cache = k_cache.scatter(2, where, k_new), v_cache.scatter(2, where, v_new)
            x, weights = layer(x, q, k_cache.to(q.dtype), v_cache.to(q.dtype), mask, mem.keys[i], mem.values[i])
            new_caches += [k_cache, v_cache]
            if i == self.attention_layer:
                attention = weights.mean(1)[:, 0]  # (B, h, 1, L) -> (B, L)
        logp = F.log_softmax(self.logits(x)[:, 0].float(), dim=-1)  # (B, V)
        return logp, (pos + 1, *new_caches), attention

    # ---- teacher-forced training ---------------------------------------------------------
    def forward(self, feats: torch.Tensor, inputs: torch.Tensor, image_index: torch.Tensor | None = None):
        """feats (B, L, feat_dim), inputs (B, T) = <start> w_1 .. w_{T-1}
        -> logits (B, T, V) and cross-attention (B, T, L) of layer ``attention_layer``.
        With image_index (B,), feats holds each image once (U, L, feat_dim) and caption b
        belongs to image image_index[b]: the encoder runs U times, not B."""
        B, T = inputs.shape
        mem = self.prepare(feats)
        if image_index is not None:
            mem = mem.index_select(image_index)  # (B, h, L, d) per layer
        positions = torch.arange(T, device=inputs.device).expand(B, T)  # (B, T)
        x = self.embed_tokens(inputs, positions)  # (B, T, D)
        causal = torch.ones(T, T, dtype=torch.bool, device=inputs.device).tril()  # (T, T): t sees <= t
        attention = None
        for i, layer in enumerate(self.layers):
            q, k, v = layer.qkv(x)  # (B, h, T, d) each
            x, weights = layer(x, q, k, v, causal, mem.keys[i], mem.values[i])
            if i == self.attention_layer:
                attention = weights.mean(1)  # (B, h, T, L) -> (B, T, L)
        return self.logits(x), attention

    def training_loss(self, feats: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, *,
                      alpha_c: float = 0.0, label_smoothing: float = 0.0,
                      image_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean token cross-entropy (with label smoothing if asked) -> (loss, plain cross-entropy);
        <pad> targets are ignored, so captions of different lengths may share a batch.
        ``alpha_c`` (the LSTM's doubly stochastic attention penalty) does not apply here.
        image_index: see ``forward``."""
        logits, _ = self(feats, inputs, image_index)
        return token_cross_entropy(logits, targets, label_smoothing=label_smoothing)


# ---- ONNX export (see captionkit.export.exporters) ------------------------------------------------------------
class _ONNXInit(nn.Module):
    """feats -> every decoder layer's cross-attention keys, then values, then the empty
    self-attention cache (position counter, per layer keys and values)."""

    def __init__(self, decoder: TransformerCaptioner):
        super().__init__()
        self.decoder = decoder

    def forward(self, feats):
        mem = self.decoder.prepare(feats)
        return (*mem.keys, *mem.values, *self.decoder.init_state(mem))


class _ONNXStep(nn.Module):
    """The decoder's own ``step`` on plain tensors: (tokens, pos, *cache, feats, *keys, *values).
    The step has no Python-side control flow (fixed-size cache, position counter), so this
    traces to one graph that is right for every position."""

    def __init__(self, decoder: TransformerCaptioner):
        super().__init__()
        self.decoder = decoder
        self.layers = decoder.cfg.decoder_layers

    def forward(self, tokens, *rest):
        n = self.layers
        state, mem = rest[:1 + 2 * n], rest[2 + 2 * n:]  # rest[1 + 2n] is feats, not read here
        logp, state, attention = self.decoder.step(tokens, tuple(state), KVMemory(list(mem[:n]), list(mem[n:])))
        return (logp, *state, attention)


@register_exporter("onnx", "transformer")
def onnx_export(decoder: TransformerCaptioner) -> DecoderExport:
    n = decoder.cfg.decoder_layers
    memory = [f"cross_k{i}" for i in range(n)] + [f"cross_v{i}" for i in range(n)]
    state = ["pos"] + [f"self_{kv}{i}" for i in range(n) for kv in ("k", "v")]
    return DecoderExport(_ONNXInit(decoder), _ONNXStep(decoder), memory=memory, state=state)
