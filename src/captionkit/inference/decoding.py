"""Greedy and batched beam search, written once against the decoder step contract:

    mem = model.prepare(feats)                      # per-image memory, computed once
    state = model.init_state(mem)
    logprobs, state, attention = model.step(tokens, state, mem)

``state`` is a tuple of tensors whose first dimension is the batch; ``mem`` has
``index_select(idx)`` (the contract: :class:`captionkit.models.base.CaptionModel`). Both
functions return one :class:`Caption` per image, with the attention weights of every
generated word. :func:`select_rows` and :func:`allowed_words` are shared with sampling
(:mod:`captionkit.training.scst`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.vocab import Vocab


@dataclass
class Caption:
    ids: list[int]  # word ids, without <start> and <end>
    attention: torch.Tensor  # (len(ids), L): the weights each word was generated with
    logprob: float  # sum of the words' log-probabilities, <end> included


def select_rows(state: tuple[torch.Tensor, ...], idx: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rows ``idx`` of every tensor of a decoding state (beams, samples, survivors)."""
    return tuple(s.index_select(0, idx) for s in state)


def allowed_words(logp: torch.Tensor, last_step: bool) -> torch.Tensor:
    """<pad>, <start> and <unk> are never generated (an unknown word is no word to show a
    reader); at the last step only <end> may follow."""
    if last_step:
        out = torch.full_like(logp, float("-inf"))
        out[:, Vocab.end] = logp[:, Vocab.end]
        return out
    logp = logp.clone()
    logp[:, [Vocab.pad, Vocab.start, Vocab.unk]] = float("-inf")
    return logp


@torch.no_grad()
def greedy(model, feats: torch.Tensor, max_len: int = 20) -> list[Caption]:
    """Most probable word at every step, until <end> or ``max_len`` words."""
    B, device = feats.shape[0], feats.device
    mem = model.prepare(feats)
    state = model.init_state(mem)
    tokens = torch.full((B,), Vocab.start, dtype=torch.long, device=device)
    words, alphas = [], []
    total = torch.zeros(B, device=device)
    alive = torch.ones(B, dtype=torch.bool, device=device)
    for t in range(max_len + 1):
        logp, state, alpha = model.step(tokens, state, mem)
        best, tokens = allowed_words(logp, t == max_len).max(1)
        total += torch.where(alive, best, torch.zeros_like(best))
        words.append(tokens)
        alphas.append(alpha)
        alive &= tokens != Vocab.end
        if not alive.any():
            break
    # one copy each to the CPU, where Captions live (not one per image)
    W = torch.stack(words, 1).cpu()  # (B, T)
    Al = torch.stack(alphas, 1).cpu()  # (B, T, L)
    total = total.cpu()
    out = []
    for b in range(B):
        ids = W[b].tolist()
        n = ids.index(Vocab.end)
        out.append(Caption(ids[:n], Al[b, :n].clone(), float(total[b])))
    return out


@torch.no_grad()
def beam_search(model, feats: torch.Tensor, beam: int = 3, max_len: int = 20,
                length_penalty: float = 0.0) -> list[Caption]:
    """Batched beam search over all images at once.

    Hypotheses are ranked by logprob / (words + 1) ** length_penalty (0 = plain sum, as in
    the paper). With ``beam=1`` this returns exactly the greedy caption.
    """
    return [best[0] for best in beam_nbest(model, feats, 1, beam, max_len, length_penalty)]


@torch.no_grad()
def beam_nbest(model, feats: torch.Tensor, n_best: int, beam: int = 3, max_len: int = 20,
               length_penalty: float = 0.0) -> list[list[Caption]]:
    """Beam search keeping each image's ``n_best`` (<= ``beam``) best finished hypotheses,
    best first, ranked as :func:`beam_search` ranks them (whose caption is the first).

    Everything stays on the device until the end, and the one host sync of a step is whether
    any image is still open. Each step records its chosen words, their beams' parents and its
    attention; a hypothesis that finishes is a log-probability, a length and the beam it ended
    on, kept in fixed-size buffers per image with masked tensor operations (:class:`_Finished`);
    its words and attention rows are traced back through the parents once, at the end."""
    if not 1 <= n_best <= beam:
        raise ValueError(f"n_best must be between 1 and the beam size {beam}, got {n_best}")
    B, K, device = feats.shape[0], beam, feats.device
    mem = model.prepare(feats)
    state = model.init_state(mem)
    rows = torch.arange(B, device=device).repeat_interleave(K)  # (B*K,)
    mem, state = mem.index_select(rows), select_rows(state, rows)
    tokens = torch.full((B * K,), Vocab.start, dtype=torch.long, device=device)
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0  # only the first beam is live at the start
    first_row = torch.arange(B, device=device).unsqueeze(1) * K  # (B, 1): each image's first beam's row
    finished = _Finished(B, K, scores.dtype, device)
    steps = _Steps()

    for t in range(max_len + 1):
        logp, state, alpha = model.step(tokens, state, mem)  # (B*K, V), ..., (B*K, L)
        V = logp.shape[1]
        logp = allowed_words(logp, t == max_len)
        cand = (scores.view(B * K, 1) + logp).view(B, K * V)
        top_s, top_i = cand.topk(2 * K, dim=1)  # (B, 2K): enough to keep K live after ends
        src, word = top_i // V, top_i % V  # (B, 2K)
        is_end = word == Vocab.end
        # A candidate ending in <end> among the best K becomes a finished hypothesis.
        finished.add(t, is_end[:, :K] & torch.isfinite(top_s[:, :K]), top_s[:, :K], first_row + src[:, :K])
        live_s = top_s.masked_fill(is_end, float("-inf"))
        pick = live_s.topk(K, dim=1).indices  # (B, K)
        scores = live_s.gather(1, pick)
        parent = (first_row + src.gather(1, pick)).view(-1)  # (B*K,)
        tokens = word.gather(1, pick).view(-1)
        steps.record(tokens, parent, alpha)
        state = select_rows(state, parent)
        finished.update_done(scores[:, 0], n_best, length_penalty == 0.0)
        if not finished.open.any():  # the step's one host sync (as greedy's: is any image left?)
            break
    return finished.ranked(n_best, length_penalty, steps)


class _Steps:
    """What each step of a beam search chose, on the device: the words (B*K,) its beams go on
    with, each one's parent row (B*K,) among the step's beams, and the step's attention
    (B*K, L) of those beams."""

    def __init__(self):
        self.words: list[torch.Tensor] = []
        self.parents: list[torch.Tensor] = []
        self.attention: list[torch.Tensor] = []

    def record(self, words: torch.Tensor, parents: torch.Tensor, attention: torch.Tensor) -> None:
        self.words.append(words)
        self.parents.append(parents)
        self.attention.append(attention)

    def trace(self, row: torch.Tensor, length: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hypotheses that ended on beam ``row`` (N,) after ``length`` (N,) words -> their words
        (N, T) and attention (N, T, L), valid up to each one's length: followed back from the
        last word, through each step's parents."""
        T, N = len(self.words), row.shape[0]
        words = torch.zeros(N, T, dtype=torch.long, device=row.device)
        attention = self.attention[0].new_zeros(N, T, self.attention[0].shape[-1])
        at = row  # (N,): each hypothesis's beam after word s (meaningful once it has begun)
        for s in range(T - 2, -1, -1):  # a hypothesis that ended at the last step has T - 1 words
            at = torch.where(length == s + 1, row, at)  # those of s + 1 words begin here
            words[:, s] = self.words[s][at]
            at = self.parents[s][at]
            attention[:, s] = self.attention[s][at]
        return words, attention


class _Finished:
    """Each image's finished hypotheses, on the decoding device, in the order they finished:
    log-probability, and where it ended (``step * B*K + beam row``: the step is its number of
    words), in buffers of ``2 * beam`` slots per image (an image still open holds fewer than
    ``beam``, and a step adds at most ``beam``), plus one spare slot that takes the writes of
    candidates that are not added. Kept lean: a step's bookkeeping is a few small ops."""

    def __init__(self, B: int, K: int, dtype: torch.dtype, device: torch.device):
        self.K, self.slots, self.rows = K, 2 * K, B * K
        self.logprob = torch.full((B, self.slots + 1), float("-inf"), dtype=dtype, device=device)
        self.ended = torch.zeros(B, self.slots + 1, dtype=torch.long, device=device)
        self.count = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.open = torch.ones(B, dtype=torch.bool, device=device)  # (B,) the images not done

    def add(self, t: int, new: torch.Tensor, logprob: torch.Tensor, rows: torch.Tensor) -> None:
        """At step ``t``, the candidates ``new`` (B, K) of open images finish, with their
        log-probabilities (B, K), after ``t`` words, on beams ``rows`` (B, K). Each image's go,
        in order, to its next free slots; the others to the spare slot."""
        new = new & self.open.unsqueeze(1)  # (B, K)
        upto = torch.cumsum(new, 1, dtype=torch.long)  # (B, K): how many of the image's new ones so far
        slot = torch.where(new, self.count - 1 + upto, self.slots)  # (B, K)
        self.logprob.scatter_(1, slot, logprob)
        self.ended.scatter_(1, slot, rows + t * self.rows)
        self.count += upto[:, -1:]

    def update_done(self, best_live: torch.Tensor, n_best: int, plain: bool) -> None:
        """Images with ``beam`` finished hypotheses are done. Without length normalisation
        (``plain``) a live beam can only lose probability: once an image's n_best-th finished
        hypothesis is at least its best live one (``best_live`` (B,)), none can enter its n
        best, and it is done too. (An image with none finished stays open.)"""
        count = self.count.squeeze(1)
        full = count >= self.K
        if plain:
            nth = self.logprob[:, :self.slots].topk(n_best, dim=1).values[:, -1]  # (B,): -inf with fewer
            full = full | (nth >= best_live)
        self.open &= ~full | (count == 0)

    def ranked(self, n_best: int, length_penalty: float, steps: _Steps) -> list[list[Caption]]:
        """Each image's ``n_best`` best, by logprob / (words + 1) ** length_penalty (ties keep
        the order they finished in), copied to the CPU once."""
        B, S = self.ended.shape
        length = torch.div(self.ended, self.rows, rounding_mode="floor")  # (B, S): words
        ids, attention = steps.trace((self.ended % self.rows).view(-1), length.view(-1))  # (B*S, T), (.., L)
        T = ids.shape[1]
        whole = torch.cat([self.count.view(-1), length.view(-1), ids.view(-1)]).cpu()  # the integers, one copy
        count, length = whole[:B].tolist(), whole[B:B + B * S].view(B, S).tolist()
        ids = whole[B + B * S:].view(B, S, T)
        logprob, attention = self.logprob.cpu().tolist(), attention.view(B, S, T, -1).cpu()

        def norm(lp: float, n_words: int) -> float:
            return lp / (n_words + 1) ** length_penalty if length_penalty else lp

        out = []
        for b, n in enumerate(count):
            ranked = sorted(range(n), key=lambda j: norm(logprob[b][j], length[b][j]), reverse=True)[:n_best]
            out.append([Caption(ids[b, j, :length[b][j]].tolist(), attention[b, j, :length[b][j]].clone(),
                                logprob[b][j]) for j in ranked])
        return out


def decode(model, feats: torch.Tensor, beam: int = 1, max_len: int = 20,
           length_penalty: float = 0.0) -> list[Caption]:
    if beam < 1:
        raise ValueError(f"beam size must be at least 1, got {beam}")
    if beam == 1 and length_penalty == 0.0:
        return greedy(model, feats, max_len)
    return beam_search(model, feats, beam, max_len, length_penalty)
