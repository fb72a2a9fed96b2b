"""Show, Attend and Tell (Xu et al. 2015): an LSTM decoder with soft attention over a grid of
annotation vectors (sections 3.1.2 and 4.2 of the paper).

Per word t, with a = (a_1..a_L) the annotation vectors and h_{t-1} the previous hidden state:
    e_ti  = w^T tanh(W_a a_i + U_a h_{t-1})          MLP attention
    alpha = softmax(e_t)                              over the L locations
    z_t   = beta_t * sum_i alpha_ti a_i,  beta_t = sigmoid(f_beta(h_{t-1}))   gated context
    h_t   = LSTM([E y_{t-1}; z_t], h_{t-1})
    p(y_t) ~ exp(L_o(E y_{t-1} + L_h h_t + L_z z_t))  deep output layer
h_0 and c_0 come from two MLPs of the mean annotation vector. Training adds the doubly
stochastic penalty lambda * sum_i (1 - sum_t alpha_ti)^2.

Why the code looks the way it does: everything that does not depend on the recurrence is
computed once for the whole sequence, outside the time loop -- the attention projection
W_a a (the costliest part, (B, L, A)), the embedding's share of the LSTM gates, and the deep
output layer. The loop only runs what needs h_{t-1}: one fused matmul of h_{t-1} against
[U_a; f_beta; W_hh], the attention, and the context's share of the gates.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import EnergyContext
from . import register_family


@dataclass
class SATConfig:
    """Sizes of the soft-attention decoder.

    vocab_size: words including the four special tokens.
    feat_dim: D, the annotation vector size (1280 for EfficientNet-Lite).
    embed_dim: m, the word embedding size.
    hidden_dim: n, the LSTM size.
    attn_dim: the attention MLP's hidden size.
    dropout: dropout on the deep output layer's input.
    embed_dropout: dropout on the word embeddings (the LSTM's and the deep output's input).
    gate: use the gating scalar beta (paper section 4.2.1).
    """

    vocab_size: int
    feat_dim: int = 1280
    embed_dim: int = 512
    hidden_dim: int = 512
    attn_dim: int = 512
    dropout: float = 0.5
    gate: bool = True
    embed_dropout: float = 0.0

    def __post_init__(self):
        for k in ("vocab_size", "feat_dim", "embed_dim", "hidden_dim", "attn_dim"):
            if int(getattr(self, k)) < 1:
                raise ValueError(f"SATConfig.{k} must be positive, got {getattr(self, k)}")
        if self.vocab_size < 5:
            raise ValueError("SATConfig.vocab_size must include the 4 special tokens and a word")
        for k in ("dropout", "embed_dropout"):
            if not 0.0 <= getattr(self, k) < 1.0:
                raise ValueError(f"SATConfig.{k} must be in [0, 1), got {getattr(self, k)}")


class Memory:
    """What the decoder attends over, computed once per image: the annotation vectors and
    their attention projection W_a a (wrapped for the fused energy kernel)."""

    def __init__(self, feats: torch.Tensor, proj: torch.Tensor, mean: torch.Tensor):
        self.feats = feats  # (B, L, D)
        self.energy = EnergyContext(proj)  # proj: (B, L, A)
        self.mean = mean  # (B, D), float32

    def index_select(self, idx: torch.Tensor) -> "Memory":
        return Memory(self.feats.index_select(0, idx), self.energy.proj.index_select(0, idx),
                      self.mean.index_select(0, idx))


@register_family("sat", SATConfig)
class SoftAttentionDecoder(nn.Module):
    def __init__(self, cfg: SATConfig):
        super().__init__()
        self.cfg = cfg
        D, M, H, A, V = cfg.feat_dim, cfg.embed_dim, cfg.hidden_dim, cfg.attn_dim, cfg.vocab_size
        self.embed = nn.Embedding(V, M)
        self.init_h = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, H))
        self.init_c = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, H))
        self.att_feat = nn.Linear(D, A)  # W_a
        # One matmul of h_{t-1} gives U_a h, f_beta(h) and W_hh h: [A | 1 | 4H] columns.
        self.h_proj = nn.Linear(H, A + 1 + 4 * H)
        self.att_w = nn.Parameter(torch.empty(A).uniform_(-A ** -0.5, A ** -0.5))  # w (a bias would
        # shift every location's energy equally, which the softmax ignores)
        self.gates_emb = nn.Linear(M, 4 * H)  # embedding's share of the LSTM gates (has the bias)
        self.gates_ctx = nn.Linear(D, 4 * H, bias=False)  # context's share
        self.out_h = nn.Linear(H, M)  # L_h
        self.out_z = nn.Linear(D, M, bias=False)  # L_z
        self.out = nn.Linear(M, V)  # L_o
        self.drop = nn.Dropout(cfg.dropout)
        self.embed_drop = nn.Dropout(cfg.embed_dropout)
        with torch.no_grad():  # LSTM forget-gate bias 1 (Jozefowicz et al. 2015)
            self.gates_emb.bias.zero_()
            self.gates_emb.bias[H:2 * H].fill_(1.0)
            self.h_proj.bias[A + 1:].zero_()

    # ---- the decoder step contract --------------------------------------------------------
    def prepare(self, feats: torch.Tensor) -> Memory:
        """(B, L, D) annotation vectors -> Memory."""
        mean = feats.mean(1, dtype=torch.float32)  # (B, D)
        if torch.is_autocast_enabled("cpu"):  # cast once here, not at every use
            feats = feats.to(torch.get_autocast_dtype("cpu"))
        return Memory(feats, self.att_feat(feats), mean)  # proj: (B, L, A)

    def init_state(self, mem: Memory) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.init_h(mem.mean)).float(), torch.tanh(self.init_c(mem.mean)).float()  # (B, H)

    def _attend(self, h: torch.Tensor, mem: Memory):
        """One recurrence step's h_{t-1} work: attention weights, gated context, W_hh h."""
        A = self.cfg.attn_dim
        hp = self.h_proj(h)  # (B, A + 1 + 4H)
        q, beta_logit, gates_h = hp[:, :A], hp[:, A:A + 1], hp[:, A + 1:]
        e = mem.energy(q, self.att_w)  # (B, L) = w . tanh(W_a a_i + U_a h)
        alpha = torch.softmax(e, dim=1)  # (B, L), float32
        z = torch.bmm(alpha.to(mem.feats.dtype).unsqueeze(1), mem.feats).squeeze(1)  # (B, D)
        if self.cfg.gate:
            z = torch.sigmoid(beta_logit) * z
        return alpha, z, gates_h

    @staticmethod
    def _lstm(gates: torch.Tensor, c: torch.Tensor):
        i, f, g, o = gates.float().chunk(4, dim=1)  # (B, H) each; cell math in float32
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c), c

    def _logits(self, emb: torch.Tensor, h: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Deep output layer: L_o(E y_{t-1} + L_h h_t + L_z z_t)."""
        return self.out(self.drop(emb + self.out_h(h) + self.out_z(z)))

    def step(self, tokens: torch.Tensor, state, mem: Memory):
        """tokens (B,) previous words -> (log-probs (B, V), new state, alpha (B, L))."""
        h, c = state
        emb = self.embed_drop(self.embed(tokens))  # (B, M)
        alpha, z, gates_h = self._attend(h, mem)
        h, c = self._lstm(self.gates_emb(emb) + self.gates_ctx(z) + gates_h, c)
        return F.log_softmax(self._logits(emb, h, z), dim=-1), (h, c), alpha

    # ---- teacher-forced training ----------------------------------------------------------
    def forward(self, feats: torch.Tensor, inputs: torch.Tensor):
        """feats (B, L, D), inputs (B, T) = <start> w_1 .. w_{T-1}
        -> logits (B, T, V) and alphas (B, T, L)."""
        mem = self.prepare(feats)
        h, c = self.init_state(mem)
        emb = self.embed_drop(self.embed(inputs))  # (B, T, M)
        gates_emb = self.gates_emb(emb)  # (B, T, 4H), all steps at once
        hs, zs, alphas = [], [], []
        for t in range(inputs.shape[1]):
            alpha, z, gates_h = self._attend(h, mem)
            h, c = self._lstm(gates_emb[:, t] + self.gates_ctx(z) + gates_h, c)
            hs.append(h)
            zs.append(z)
            alphas.append(alpha)
        H_all = torch.stack(hs, 1)  # (B, T, H)
        Z_all = torch.stack(zs, 1)  # (B, T, D)
        return self._logits(emb, H_all, Z_all), torch.stack(alphas, 1)


def caption_loss(logits: torch.Tensor, targets: torch.Tensor, alphas: torch.Tensor,
                 alpha_c: float, pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean word cross-entropy plus the doubly stochastic penalty
    alpha_c * mean_i (1 - sum_t alpha_ti)^2, averaged over locations and the batch.

    The paper adds lambda * sum_i (...)^2 to a sentence's summed log-likelihood; with the word
    loss averaged over words, the penalty is averaged over the L locations too, so that
    alpha_c = 1 stays a mild pull towards attending to every location over the sentence
    rather than a force flattening every word's attention (with L = 81 and 12 words the
    summed penalty would be ~60 against a word loss of ~2). Returns (total, cross-entropy)."""
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=pad)
    mask = (targets != pad).unsqueeze(2).to(alphas.dtype)  # (B, T, 1)
    attn_sum = (alphas * mask).sum(1)  # (B, L)
    penalty = ((1.0 - attn_sum) ** 2).mean()
    return ce + alpha_c * penalty, ce
