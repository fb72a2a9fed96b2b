"""A tiny caption family, the worked example of docs/architecture.md: everything a new family
needs is this file, written against captionkit.models.base and registered through
captionkit.core.registry; no other captionkit module changes. tests/test_model_contract.py
registers it (and unregisters it after), trains it through the real Trainer, decodes it with
the shared greedy and beam search, and captions photos with it through Captioner.

The model: a GRU over word embeddings and a dot-product attention context over the image rows
(Show, Attend and Tell's shape at its smallest). A package would register it with the
decorator form, ``@register_family("tiny", TinyConfig)`` above the class.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from captionkit.models.base import CaptionModel, KVMemory, token_cross_entropy


@dataclass
class TinyConfig:
    vocab_size: int  # set by the trainer from the tokenizer
    feat_dim: int = 8  # set by the trainer from the encoder
    width: int = 16

    def __post_init__(self):
        if min(self.vocab_size, self.feat_dim, self.width) < 1:
            raise ValueError("TinyConfig sizes must be positive")


class TinyCaptioner(CaptionModel):
    def __init__(self, cfg: TinyConfig):
        super().__init__()
        self.cfg = cfg
        self.keys = nn.Linear(cfg.feat_dim, cfg.width)
        self.values = nn.Linear(cfg.feat_dim, cfg.width)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.width)
        self.cell = nn.GRUCell(2 * cfg.width, cfg.width)
        self.out = nn.Linear(cfg.width, cfg.vocab_size)

    def word_embedding(self) -> nn.Embedding:
        return self.embed

    def prepare(self, feats: torch.Tensor) -> KVMemory:
        """(B, L, D) -> the attention's keys and values of the image rows (B, L, W), once."""
        return KVMemory([self.keys(feats)], [self.values(feats)])

    def init_state(self, mem: KVMemory) -> tuple[torch.Tensor]:
        return (torch.tanh(mem.values[0].mean(1)),)  # h_0 (B, W)

    def _next(self, tokens: torch.Tensor, h: torch.Tensor, mem: KVMemory):
        """One word: -> (logits (B, V), h (B, W), attention (B, L))."""
        keys, values = mem.keys[0], mem.values[0]
        attention = torch.softmax((keys @ h.unsqueeze(2)).squeeze(2) / math.sqrt(h.shape[1]), dim=1)  # (B, L)
        context = (attention.unsqueeze(1) @ values).squeeze(1)  # (B, W)
        h = self.cell(torch.cat([self.embed(tokens), context], 1), h)
        return self.out(h), h, attention

    def step(self, tokens: torch.Tensor, state: tuple[torch.Tensor], mem: KVMemory):
        logits, h, attention = self._next(tokens, state[0], mem)
        return F.log_softmax(logits.float(), dim=-1), (h,), attention

    def forward(self, feats: torch.Tensor, inputs: torch.Tensor, image_index: torch.Tensor | None = None):
        mem = self.prepare(feats)
        if image_index is not None:  # each image prepared once, then one row per caption
            mem = mem.index_select(image_index)
        (h,) = self.init_state(mem)
        logits, attention = [], []
        for t in range(inputs.shape[1]):
            out, h, a = self._next(inputs[:, t], h, mem)
            logits.append(out)
            attention.append(a)
        return torch.stack(logits, 1), torch.stack(attention, 1)  # (B, T, V), (B, T, L)

    def training_loss(self, feats: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, *,
                      alpha_c: float = 0.0, label_smoothing: float = 0.0,
                      image_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        logits, _ = self(feats, inputs, image_index)
        return token_cross_entropy(logits, targets, label_smoothing=label_smoothing)
