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
    best first, ranked as :func:`beam_search` ranks them (whose caption is the first)."""
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
    seqs = torch.zeros(B * K, 0, dtype=torch.long, device=device)
    hist: torch.Tensor | None = None  # (B*K, t, L)
    finished: list[list[tuple[float, list[int], torch.Tensor, float]]] = [[] for _ in range(B)]
    done = [False] * B

    def norm(logprob: float, n_words: int) -> float:
        return logprob / (n_words + 1) ** length_penalty if length_penalty else logprob

    for t in range(max_len + 1):
        logp, state, alpha = model.step(tokens, state, mem)  # (B*K, V), ..., (B*K, L)
        V = logp.shape[1]
        hist = alpha.unsqueeze(1) if hist is None else torch.cat([hist, alpha.unsqueeze(1)], 1)
        logp = allowed_words(logp, t == max_len)
        cand = (scores.view(B * K, 1) + logp).view(B, K * V)
        top_s, top_i = cand.topk(2 * K, dim=1)  # (B, 2K): enough to keep K live after ends
        src, word = top_i // V, top_i % V  # (B, 2K)
        is_end = word == Vocab.end
        # A candidate ending in <end> among the best K becomes a finished hypothesis.
        for b, r in (is_end[:, :K]).nonzero().tolist():
            if done[b] or not torch.isfinite(top_s[b, r]):
                continue
            row = b * K + int(src[b, r])
            ids = seqs[row].tolist()
            lp = float(top_s[b, r])
            finished[b].append((norm(lp, len(ids)), ids, hist[row, :len(ids)].to("cpu", copy=True), lp))
        live_s = top_s.masked_fill(is_end, float("-inf"))
        pick = live_s.topk(K, dim=1).indices  # (B, K)
        scores = live_s.gather(1, pick)
        parent = (torch.arange(B, device=device).unsqueeze(1) * K + src.gather(1, pick)).view(-1)  # (B*K,)
        tokens = word.gather(1, pick).view(-1)
        seqs = torch.cat([seqs[parent], tokens.unsqueeze(1)], 1)
        hist = hist[parent]
        state = select_rows(state, parent)
        for b in range(B):
            if done[b] or not finished[b]:
                continue
            # Without length normalisation a live beam can only lose probability: once the
            # n_best-th finished hypothesis beats the best live one, none can enter the n best.
            nth_done = sorted((f[0] for f in finished[b]), reverse=True)[n_best - 1] \
                if len(finished[b]) >= n_best else float("-inf")
            if len(finished[b]) >= K or (length_penalty == 0.0 and nth_done >= float(scores[b, 0])):
                done[b] = True
        if all(done):
            break
    out = []
    for b in range(B):
        ranked = sorted(finished[b], key=lambda f: f[0], reverse=True)[:n_best]  # stable: ties keep order
        out.append([Caption(ids, att, lp) for _, ids, att, lp in ranked])
    return out


def decode(model, feats: torch.Tensor, beam: int = 1, max_len: int = 20,
           length_penalty: float = 0.0) -> list[Caption]:
    if beam < 1:
        raise ValueError(f"beam size must be at least 1, got {beam}")
    if beam == 1 and length_penalty == 0.0:
        return greedy(model, feats, max_len)
    return beam_search(model, feats, beam, max_len, length_penalty)
