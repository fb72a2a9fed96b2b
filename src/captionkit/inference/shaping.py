"""What shapes a decoding step's choice beyond the model's log-probabilities (the caption
controls of :mod:`captionkit.inference.controls`), on the decoding device, without host reads:

- :class:`StepRules`: n-gram blocking, the repetition penalty, the rare-word bonus and the
  minimum length, applied
  to a step's log-probabilities (R, V) from each row's words so far, which it keeps (and
  reorders with beam search's parents).
- :class:`Sampler`: a word drawn per row from the shaped distribution at a temperature,
  within the top-k and the nucleus (top-p), by the Gumbel-max trick with noise that is a hash
  of (seed, image key, draw, step, word): no random generator state, so an image's draws do
  not depend on the batch it is decoded in, nor on its place there.
- :func:`image_keys`: an image's key for that noise, a hash of its pixels (or features).

The hashes are integer arithmetic on int64 tensors that never overflows (32-bit values times
multipliers below 2**31), so they are exact on every device.
"""

from __future__ import annotations

import math

import torch

from ..data.vocab import SPECIALS, Vocab
from .controls import RARE_FROM, Controls

MASK32 = 0xFFFFFFFF
_NEG_INF = float("-inf")


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply, after Wellons' lowbias32, with multipliers
    below 2**31 so that int64 products cannot overflow) of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x2545F491) & MASK32
    return x ^ (x >> 16)


def image_keys(values: torch.Tensor) -> torch.Tensor:
    """(B, ...) pixels (or features) -> (B,) int64 keys in [0, 2**32): a hash of each image's
    values rounded to 1/256, summed exactly in int64 (so in any order) with a weight per
    position. Pixels are the same whatever the batch an image is read in; features may differ
    in their last bits between batch sizes (then so may a key)."""
    q = (values.detach().float().flatten(1) * 256).round().clamp(-2 ** 15, 2 ** 15).long()  # (B, N)
    weights = mix32(torch.arange(q.shape[1], device=q.device, dtype=torch.long)) & 0xFFFFFF  # (N,) < 2**24
    s = (q * weights).sum(1)  # (B,): terms below 2**39 in size, so no overflow for N < 2**24 values
    # the sum's low and high 32 bits, mixed (& of a negative int64 takes its two's complement bits)
    return mix32((s & MASK32) ^ mix32((s >> 32) & MASK32))


def rare_word_bonus(bonus: float, vocab_size: int, device: torch.device) -> torch.Tensor:
    """(V,) float32 what each id of a frequency-ordered vocabulary gains with the rare-word bonus
    ``bonus``: bonus * ln(rank / RARE_FROM) above rank RARE_FROM, else 0 (the specials: 0)."""
    rank = torch.arange(vocab_size, dtype=torch.float64) - (len(SPECIALS) - 1)  # id 4 -> rank 1
    gain = bonus * (rank.clamp(min=1).log() - math.log(RARE_FROM)).clamp(min=0)
    gain[:len(SPECIALS)] = 0
    return gain.float().to(device)


class StepRules:
    """The per-step rules of ``controls`` over ``rows`` hypotheses of words (module docstring)."""

    def __init__(self, controls: Controls, rows: int, vocab_size: int, device: torch.device):
        self.n = controls.no_repeat_ngram
        self.penalty = controls.repetition_penalty
        self.min_words = controls.min_words
        self.active = controls.shapes_steps
        self.V = vocab_size
        # each row's words so far (R, t), for n-gram blocking; which words it holds (R, V), for the penalty
        self.history = torch.zeros(rows, 0, dtype=torch.long, device=device) if self.n else None
        self.seen = torch.zeros(rows, vocab_size, dtype=torch.bool, device=device) if self.penalty != 1.0 else None
        self.bonus = rare_word_bonus(controls.rare_word_bonus, vocab_size, device) \
            if controls.rare_word_bonus > 0 else None  # (V,)

    def apply(self, logp: torch.Tensor, t: int) -> torch.Tensor:
        """A step's log-probabilities (R, V) after ``t`` words -> the shaped ones (a new tensor;
        ``logp`` itself when no rule is active). A row whose every word is blocked gets its
        <end> back (a caption ends rather than being made of nothing)."""
        if not self.active:
            return logp
        out = logp
        if self.seen is not None:  # CTRL's penalty on log-probabilities (<= 0): times P; 0 divided by P
            p = self.penalty
            out = torch.where(self.seen, torch.where(out < 0, out * p, out / p), out)
        if self.bonus is not None:  # after the penalty, which scales the model's own log-probabilities
            out = out + self.bonus
        if self.n and t >= self.n:
            out = out.masked_fill(self._blocked(t), _NEG_INF)
        if t < self.min_words:
            out = out.clone() if out is logp else out
            out[:, Vocab.end] = _NEG_INF
        stuck = torch.isneginf(out).all(1)  # (R,)
        out = out.clone() if out is logp else out
        out[:, Vocab.end] = torch.where(stuck, logp[:, Vocab.end], out[:, Vocab.end])
        return out

    def _blocked(self, t: int) -> torch.Tensor:
        """(R, V) the words that would complete an n-gram each row already holds."""
        n, h = self.n, self.history  # (R, t)
        grams = h.unfold(1, n, 1)  # (R, t - n + 1, n): every n-gram so far
        prefix = h[:, t - n + 1:]  # (R, n - 1): the words a new n-gram would begin with
        match = (grams[:, :, :-1] == prefix.unsqueeze(1)).all(2)  # (R, t - n + 1)
        # the n-grams' last words where they match, else a spare column V (dropped): every write
        # is True, so repeated indices cannot race
        words = torch.where(match, grams[:, :, -1], torch.full_like(grams[:, :, -1], self.V))
        blocked = torch.zeros(h.shape[0], self.V + 1, dtype=torch.bool, device=h.device)
        return blocked.scatter_(1, words, True)[:, :self.V]

    def advance(self, words: torch.Tensor, parent: torch.Tensor | None = None) -> None:
        """The rows go on from rows ``parent`` (R,) of the step (None: each from itself) with
        ``words`` (R,)."""
        if not self.active:
            return
        if self.history is not None:
            h = self.history if parent is None else self.history.index_select(0, parent)
            self.history = torch.cat([h, words.unsqueeze(1)], 1)
        if self.seen is not None:
            s = self.seen if parent is None else self.seen.index_select(0, parent)
            self.seen = s.scatter(1, words.unsqueeze(1), True)


class Sampler:
    """Draws one word per row from ``softmax(shaped / temperature)`` within the top-k words
    and the nucleus of mass top-p, by the Gumbel-max trick: argmax(scores + G), G a Gumbel
    noise per (seed, row's image key, row's draw, step, word). Temperature 0: the most probable
    word (no noise). ``keys`` (R,) and ``draws`` (R,) int64 on the decoding device."""

    def __init__(self, controls: Controls, keys: torch.Tensor, draws: torch.Tensor, vocab_size: int):
        self.temperature, self.top_k, self.top_p = controls.temperature, controls.top_k, controls.top_p
        seed = torch.full_like(keys, controls.seed)
        self.base = mix32(mix32(mix32(seed) ^ keys) ^ mix32(draws))  # (R,)
        self.words = mix32(torch.arange(vocab_size, device=keys.device, dtype=torch.long) + 0x9E3779B1 & MASK32)

    def noise(self, t: int) -> torch.Tensor:
        """(R, V) float32 Gumbel noise of step ``t``."""
        row = mix32(self.base ^ (((t + 1) * 0x61C88647) & MASK32))  # (R,)
        bits = mix32(row.unsqueeze(1) ^ self.words.unsqueeze(0))  # (R, V)
        u = ((bits >> 8).float() + 0.5) * (1.0 / 2 ** 24)  # (R, V) uniform in (0, 1), exact
        return -torch.log(-torch.log(u))

    def filtered(self, shaped: torch.Tensor) -> torch.Tensor:
        """(R, V) shaped log-probabilities -> scores at the temperature, -inf outside the top-k
        and the nucleus."""
        s = shaped.float() / self.temperature
        if self.top_k and self.top_k < s.shape[1]:
            kth = s.topk(self.top_k, dim=1).values[:, -1:]  # (R, 1)
            s = s.masked_fill(s < kth, _NEG_INF)
        if self.top_p < 1.0:
            ordered, order = s.sort(dim=1, descending=True)  # (R, V)
            probs = ordered.softmax(1)
            before = probs.cumsum(1) - probs  # (R, V): the mass of the more probable words
            drop = before >= self.top_p  # the most probable word is always kept (0 before it)
            s = s.masked_fill(drop.scatter(1, order, drop), _NEG_INF)
        return s

    def choose(self, shaped: torch.Tensor, t: int) -> torch.Tensor:
        """(R, V) -> (R,) the words drawn at step ``t``."""
        if self.temperature == 0:
            return shaped.max(1).indices
        return (self.filtered(shaped) + self.noise(t)).max(1).indices
