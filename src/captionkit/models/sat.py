"""Show, Attend and Tell (Xu et al. 2015): an LSTM decoder attending over a grid of annotation
vectors, with soft (deterministic, section 4.2) or hard (stochastic, section 4.1) attention.

Per word t, with a = (a_1..a_L) the annotation vectors and h_{t-1} the previous hidden state:
    e_ti  = w^T tanh(W_a a_i + U_a h_{t-1})          MLP attention
    alpha = softmax(e_t)                              over the L locations
    z_t   = beta_t * sum_i alpha_ti a_i,  beta_t = sigmoid(f_beta(h_{t-1}))   gated context
    h_t   = LSTM([E y_{t-1}; z_t], h_{t-1})
    p(y_t) ~ exp(L_o(E y_{t-1} + L_h h_t + L_z z_t))  deep output layer
h_0 and c_0 come from two MLPs of the mean annotation vector. Training adds the doubly
stochastic penalty lambda * sum_i (1 - sum_t alpha_ti)^2.

Hard attention replaces the expected context by the annotation vector of one location
s_t ~ Multinoulli(alpha_t) during training, and learns alpha by REINFORCE on the variational
lower bound (equation 12): the sentence log-likelihood is the reward, a moving average of it the
baseline, plus an entropy bonus on alpha; with probability 0.5 a caption is trained on the
expected context instead (``expected_prob``). Decoding uses the expected context (the soft
model's computation) or the most probable location (``decode_context``), and attention figures
show each word's most probable location.

Why the code looks the way it does: everything that does not depend on the recurrence is
computed once for the whole sequence, outside the time loop -- the attention projection
W_a a (the costliest part, (B, L, A)), the embedding's share of the LSTM gates, and the deep
output layer. The loop only runs what needs h_{t-1}: one fused matmul of h_{t-1} against
[U_a; f_beta; W_hh], the attention, and the context's share of the gates. Float32 training on
the CPU runs that loop as one autograd node with a hand-written backward (sat_recurrence.py):
the same math without some 40 graph nodes a word, and the weight gradients taken once for all
words instead of word by word.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.collectives import process_sum
from ..core.errors import UserError
from ..core.fields import check_fields, spec
from ..core.registry import register_exporter, register_family
from ..data.vocab import Vocab
from ..kernels import KERNEL_DEVICE, EnergyContext, half_copy, kernel_available
from .base import CaptionModel, DecoderExport, Linear, token_cross_entropy
from .sat_recurrence import SoftRecurrence


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
    attention: "soft" or "hard".
    The rest only matter for hard attention:
    reinforce_weight: lambda_r, weight of the REINFORCE term for the sampled locations.
    entropy_weight: lambda_e, weight of the entropy bonus H(alpha_t).
    baseline_decay: the moving-average baseline's decay (b <- decay * b + (1 - decay) * reward).
    expected_prob: probability that a training caption uses the expected context instead of
        sampled locations (the paper's 0.5).
    decode_context: how a hard-attention model attends when decoding: "expected" (the soft
        model's weighted mean) or "argmax" (the annotation vector of the most probable location).
    """

    vocab_size: int = spec(ge=5)  # the 4 special tokens and at least a word
    feat_dim: int = spec(1280, ge=1)
    embed_dim: int = spec(512, ge=1)
    hidden_dim: int = spec(512, ge=1)
    attn_dim: int = spec(512, ge=1)
    dropout: float = spec(0.5, ge=0, lt=1)
    gate: bool = True
    embed_dropout: float = spec(0.0, ge=0, lt=1)
    attention: str = spec("soft", choices=("soft", "hard"))
    reinforce_weight: float = spec(1.0, ge=0)
    entropy_weight: float = spec(0.01, ge=0)
    baseline_decay: float = spec(0.9, ge=0, le=1)
    expected_prob: float = spec(0.5, ge=0, le=1)
    decode_context: str = spec("expected", choices=("expected", "argmax"))

    def __post_init__(self):
        check_fields(self)


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
class SoftAttentionDecoder(CaptionModel):
    # trained on batches of one caption length (train.batching = "length"), as in the paper
    image_batching = False

    def __init__(self, cfg: SATConfig):
        super().__init__()
        self.cfg = cfg
        D, M, H, A, V = cfg.feat_dim, cfg.embed_dim, cfg.hidden_dim, cfg.attn_dim, cfg.vocab_size
        self.embed = nn.Embedding(V, M)
        self.init_h = nn.Sequential(Linear(D, H), nn.Tanh(), Linear(H, H))
        self.init_c = nn.Sequential(Linear(D, H), nn.Tanh(), Linear(H, H))
        self.att_feat = Linear(D, A)  # W_a
        # One matmul of h_{t-1} gives U_a h, f_beta(h) and W_hh h: [A | 1 | 4H] columns.
        self.h_proj = Linear(H, A + 1 + 4 * H)
        self.att_w = nn.Parameter(torch.empty(A).uniform_(-A ** -0.5, A ** -0.5))  # w (a bias would
        # shift every location's energy equally, which the softmax ignores)
        self.gates_emb = Linear(M, 4 * H)  # embedding's share of the LSTM gates (has the bias)
        self.gates_ctx = Linear(D, 4 * H, bias=False)  # context's share
        self.out_h = Linear(H, M)  # L_h
        self.out_z = Linear(D, M, bias=False)  # L_z
        self.out = Linear(M, V)  # L_o
        self.drop = nn.Dropout(cfg.dropout)
        self.embed_drop = nn.Dropout(cfg.embed_dropout)
        with torch.no_grad():  # LSTM forget-gate bias 1 (Jozefowicz et al. 2015)
            self.gates_emb.bias.zero_()
            self.gates_emb.bias[H:2 * H].fill_(1.0)
            self.h_proj.bias[A + 1:].zero_()
        if cfg.attention == "hard":
            # the REINFORCE baseline: the running mean log-likelihood per word, and how many
            # updates it has seen (saved with the weights, so a resumed run keeps it)
            self.register_buffer("baseline", torch.zeros(2))

    # ---- declared capabilities ------------------------------------------------------------
    @property
    def attention_view(self) -> str:
        # hard attention trains on one location per word: figures show each word's most likely one
        return "onehot-argmax" if self.cfg.attention == "hard" else "weights"

    def decode_options(self) -> dict[str, tuple]:
        return {"decode_context": ("expected", "argmax")} if self.cfg.attention == "hard" else {}

    def word_embedding(self) -> nn.Embedding:
        return self.embed

    # ---- the decoder step contract --------------------------------------------------------
    def prepare(self, feats: torch.Tensor) -> Memory:
        """(B, L, D) annotation vectors -> Memory."""
        mean = feats.mean(1, dtype=torch.float32)  # (B, D)
        kind = feats.device.type
        # (meta, the tests' stand-in GPU, has no autocast: asking would raise)
        if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):  # cast once here
            feats = feats.to(torch.get_autocast_dtype(kind))
        return Memory(feats, self.att_feat(feats), mean)  # proj: (B, L, A)

    def init_state(self, mem: Memory) -> tuple[torch.Tensor, torch.Tensor]:
        return self._init_from_mean(mem.mean)

    def _init_from_mean(self, mean: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tanh(self.init_h(mean)).float(), torch.tanh(self.init_c(mean)).float()  # (B, H)

    def _attend(self, h: torch.Tensor, mem: Memory, sampled: torch.Tensor | None = None):
        """One recurrence step's h_{t-1} work: attention weights, gated context, W_hh h, and
        the location drawn for each caption whose row of ``sampled`` (B,) is True (hard
        attention; the others get the expected context)."""
        A = self.cfg.attn_dim
        hp = self.h_proj(h)  # (B, A + 1 + 4H)
        q, beta_logit, gates_h = hp[:, :A], hp[:, A:A + 1], hp[:, A + 1:]
        e = mem.energy(q, self.att_w)  # (B, L) = w . tanh(W_a a_i + U_a h)
        alpha = torch.softmax(e, dim=1)  # (B, L), float32
        weights, loc = alpha, None
        if sampled is not None:
            loc = torch.multinomial(alpha.detach(), 1).squeeze(1)  # (B,) s_t ~ Multinoulli(alpha)
            onehot = F.one_hot(loc, alpha.shape[1]).to(alpha.dtype)  # (B, L)
            weights = torch.where(sampled.unsqueeze(1), onehot, alpha)
        elif self.cfg.attention == "hard" and self.cfg.decode_context == "argmax" and not self.training:
            weights = F.one_hot(alpha.argmax(1), alpha.shape[1]).to(alpha.dtype)  # (B, L)
        z = torch.bmm(weights.to(mem.feats.dtype).unsqueeze(1), mem.feats).squeeze(1)  # (B, D)
        if self.cfg.gate:
            z = torch.sigmoid(beta_logit) * z
        return alpha, z, gates_h, loc

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
        alpha, z, gates_h, _ = self._attend(h, mem)
        h, c = self._lstm(self.gates_emb(emb) + self.gates_ctx(z) + gates_h, c)
        return F.log_softmax(self._logits(emb, h, z), dim=-1), (h, c), alpha

    # ---- teacher-forced training ----------------------------------------------------------
    def forward(self, feats: torch.Tensor, inputs: torch.Tensor, image_index: torch.Tensor | None = None):
        """feats (B, L, D), inputs (B, T) = <start> w_1 .. w_{T-1}
        -> logits (B, T, V) and alphas (B, T, L), with the expected context at every step.
        With image_index (B,), feats holds each image once (U, L, D) and caption b belongs to
        image image_index[b] (self-critical training: several samples per image)."""
        logits, alphas, _ = self._unroll(feats, inputs, image_index=image_index)
        return logits, alphas

    def _unroll(self, feats: torch.Tensor, inputs: torch.Tensor, sampled: torch.Tensor | None = None,
                image_index: torch.Tensor | None = None):
        """The teacher-forced recurrence; captions with ``sampled`` (B,) True attend to a drawn
        location per step. -> logits (B, T, V), alphas (B, T, L), locations (B, T) or None."""
        if self._fusable(feats, sampled):
            return self._unroll_fused(feats, inputs, image_index)
        mem = self.prepare(feats)
        if image_index is not None:  # W_a a once per image, then one row per caption
            mem = mem.index_select(image_index)
        h, c = self.init_state(mem)
        emb = self.embed_drop(self.embed(inputs))  # (B, T, M)
        gates_emb = self.gates_emb(emb)  # (B, T, 4H), all steps at once
        hs, zs, alphas, locs = [], [], [], []
        for t in range(inputs.shape[1]):
            alpha, z, gates_h, loc = self._attend(h, mem, sampled)
            h, c = self._lstm(gates_emb[:, t] + self.gates_ctx(z) + gates_h, c)
            hs.append(h)
            zs.append(z)
            alphas.append(alpha)
            locs.append(loc)
        H_all = torch.stack(hs, 1)  # (B, T, H)
        Z_all = torch.stack(zs, 1)  # (B, T, D)
        return (self._logits(emb, H_all, Z_all), torch.stack(alphas, 1),
                torch.stack(locs, 1) if sampled is not None else None)

    def _fusable(self, feats: torch.Tensor, sampled: torch.Tensor | None) -> bool:
        """May the recurrence run as one autograd node (``sat_recurrence``)? It is written for
        float32 on the CPU with the C energy kernel, and for the expected context only."""
        cfg = self.cfg
        return (sampled is None and feats.device.type == KERNEL_DEVICE and feats.dtype == torch.float32
                and not torch.is_autocast_enabled(KERNEL_DEVICE) and kernel_available()
                and not (cfg.attention == "hard" and cfg.decode_context == "argmax" and not self.training))

    def _unroll_fused(self, feats: torch.Tensor, inputs: torch.Tensor, image_index: torch.Tensor | None):
        """``_unroll``'s expected-context recurrence, the same math in one autograd node."""
        proj = self.att_feat(feats)  # (U or B, L, A)
        mean = feats.mean(1)  # (U or B, D)
        if image_index is not None:  # W_a a once per image, then one row per caption
            feats, proj, mean = feats.index_select(0, image_index), proj.index_select(0, image_index), \
                mean.index_select(0, image_index)
        h, c = self._init_from_mean(mean)
        emb = self.embed_drop(self.embed(inputs))  # (B, T, M)
        feats = feats.contiguous()
        # features from the feature store are float16 values: the context then reads them so
        feats_half = None if feats.requires_grad else half_copy(feats)
        H_all, Z_all, alphas = SoftRecurrence.apply(
            proj.contiguous(), feats, self.gates_emb(emb), h, c, self.h_proj.weight, self.h_proj.bias,
            self.att_w, self.gates_ctx.weight, self.cfg.gate, feats_half)  # (B, T, H), (B, T, D), (B, T, L)
        return self._logits(emb, H_all, Z_all), alphas, None

    def training_loss(self, feats: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, *,
                      alpha_c: float = 0.0, label_smoothing: float = 0.0,
                      image_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The cross-entropy objective (soft, optionally label-smoothed) or the variational
        lower bound (hard) for one batch, per word, with the doubly stochastic penalty
        (weight ``alpha_c``). -> (loss, word cross-entropy). The model computes in the autocast
        dtype; the losses are taken in float32. No ``image_index``: see ``image_batching``."""
        cfg = self.cfg
        if image_index is not None:
            raise UserError("the sat family trains on batches of one caption length, not shared images")
        if cfg.attention == "soft":
            logits, alphas = self(feats, inputs)
            return caption_loss(logits.float(), targets, alphas, alpha_c, label_smoothing=label_smoothing)
        if label_smoothing:
            raise UserError("train.label_smoothing applies to the cross-entropy objective, "
                             "not hard attention's lower bound")
        B = inputs.shape[0]
        sampled = torch.rand(B, device=inputs.device) >= cfg.expected_prob  # (B,) captions trained on drawn locations
        logits, alphas, locs = self._unroll(feats, inputs, sampled)
        mask = (targets != Vocab.pad).float()  # (B, T)
        n_words = mask.sum()
        word_ll = -F.cross_entropy(logits.float().transpose(1, 2), targets, reduction="none")  # (B, T)
        sent_ll = (word_ll * mask).sum(1)  # (B,) log p(y | s, a): the reward
        lengths = mask.sum(1)
        reward = sent_ll.detach()
        # The baseline is per word, scaled by each caption's length: captions of different
        # lengths have very different log-likelihoods, and batches hold one length each.
        # Kept on the device and updated there (no host read per step); from the global
        # batch's sampled captions under DDP (process_sum), so that every process holds what
        # one process would; and only in training mode: the dev loss must not move it.
        old, updates = self.baseline.clone().unbind()  # (a copy: the buffer is written below)
        advantage = (reward - old * lengths) * sampled * (updates > 0)  # (B,), 0 for expected-context
        # captions, and on the first batch (no baseline yet: no REINFORCE step)
        log_p_loc = torch.log(alphas.gather(2, locs.unsqueeze(2)).squeeze(2).clamp_min(1e-12))  # (B, T)
        entropy = -(alphas * torch.log(alphas.clamp_min(1e-12))).sum(2)  # (B, T)
        lower_bound = (sent_ll.sum() + cfg.reinforce_weight * (advantage.unsqueeze(1) * log_p_loc * mask).sum()
                       + cfg.entropy_weight * (entropy * mask).sum())
        if self.training:
            with torch.no_grad():
                # (sum of the sampled captions' per-word rewards, how many were sampled)
                total, count = process_sum(torch.stack([(reward / lengths * sampled).sum(),
                                                        sampled.sum().to(reward.dtype)])).unbind()
                per_word = total / count.clamp_min(1)
                value = torch.where(updates == 0, per_word,
                                    cfg.baseline_decay * old + (1 - cfg.baseline_decay) * per_word)
                self.baseline.copy_(torch.stack([torch.where(count > 0, value, old), updates + 1]))
        ce = -sent_ll.sum() / n_words
        return -lower_bound / n_words + alpha_c * attention_penalty(alphas, targets), ce


def caption_loss(logits: torch.Tensor, targets: torch.Tensor, alphas: torch.Tensor,
                 alpha_c: float, pad: int = Vocab.pad, label_smoothing: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean word cross-entropy plus the doubly stochastic penalty
    alpha_c * mean_i (1 - sum_t alpha_ti)^2, averaged over locations and the batch.

    The paper adds lambda * sum_i (...)^2 to a sentence's summed log-likelihood; with the word
    loss averaged over words, the penalty is averaged over the L locations too, so that
    alpha_c = 1 stays a mild pull towards attending to every location over the sentence
    rather than a force flattening every word's attention (with L = 81 and 12 words the
    summed penalty would be ~60 against a word loss of ~2). With ``label_smoothing`` the
    total uses the smoothed cross-entropy; the returned cross-entropy is the plain one.
    Returns (total, cross-entropy)."""
    word_loss, ce = token_cross_entropy(logits, targets, ignore_index=pad, label_smoothing=label_smoothing)
    return word_loss + alpha_c * attention_penalty(alphas, targets, pad), ce


def attention_penalty(alphas: torch.Tensor, targets: torch.Tensor, pad: int = Vocab.pad) -> torch.Tensor:
    """mean_i (1 - sum_t alpha_ti)^2 over locations and captions, the words' steps only."""
    mask = (targets != pad).unsqueeze(2).to(alphas.dtype)  # (B, T, 1)
    attn_sum = (alphas * mask).sum(1)  # (B, L)
    return ((1.0 - attn_sum) ** 2).mean()


# ---- ONNX export (see captionkit.export.exporters) ------------------------------------------------------------
class _ONNXInit(nn.Module):
    def __init__(self, decoder: SoftAttentionDecoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, feats):
        mem = self.decoder.prepare(feats)
        h, c = self.decoder.init_state(mem)
        return mem.energy.proj, h, c


class _ONNXStep(nn.Module):
    """The decoder's own ``step`` on plain tensors (tokens, h, c, feats, proj)."""

    def __init__(self, decoder: SoftAttentionDecoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, tokens, h, c, feats, proj):
        logp, (h, c), alpha = self.decoder.step(tokens, (h, c), Memory(feats, proj, None))
        return logp, h, c, alpha


@register_exporter("onnx", "sat")
def onnx_export(decoder: SoftAttentionDecoder) -> DecoderExport:
    if decoder.cfg.attention == "hard" and decoder.cfg.decode_context == "argmax":
        raise UserError("hard attention with decode_context='argmax' cannot be exported yet")
    return DecoderExport(_ONNXInit(decoder), _ONNXStep(decoder), memory=["proj"], state=["h", "c"])
