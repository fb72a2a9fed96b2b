"""Greedy, sampling and batched beam search (diverse beam search included), written once
against the decoder step contract:

    mem = model.prepare(feats)                      # per-image memory, computed once
    state = model.init_state(mem)
    logprobs, state, attention = model.step(tokens, state, mem)

``state`` is a tuple of tensors whose first dimension is the batch; ``mem`` has
``index_select(idx)`` (the contract: :class:`captionkit.models.base.CaptionModel`). Both
functions return one :class:`Caption` per image, with the attention weights of every
generated word. :func:`select_rows` and :func:`allowed_words` are shared with self-critical
training's sampling (:mod:`captionkit.training.scst`).

The caption controls (:class:`captionkit.inference.controls.Controls`) act here, in the one
core every captioner goes through (a model, an ensemble, flip views, an ONNX export, the
server, the Python API): each step's log-probabilities are shaped by the rules
(:class:`captionkit.inference.shaping.StepRules`), greedy decoding and sampling are one walk
(:func:`walk`: the most probable word, or a drawn one), and beam search runs in groups for
diverse beam search. :func:`decode_lists` chooses among them. Without controls every path is
the code it was before, to the bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.vocab import Vocab
from ..models.base import owned_states
from .controls import DEFAULT, Controls
from .shaping import Sampler, StepRules, image_keys


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
def greedy(model, feats: torch.Tensor, max_len: int = 20, controls: Controls | None = None) -> list[Caption]:
    """Most probable word at every step, until <end> or ``max_len`` words (the step rules of
    ``controls`` applied)."""
    return [row[0] for row in walk(model, feats, max_len, controls or DEFAULT)]


@torch.no_grad()
def walk(model, feats: torch.Tensor, max_len: int, controls: Controls, keys: torch.Tensor | None = None,
         draws: range = range(1)) -> list[list[Caption]]:
    """One word at a time, per image and per draw in ``draws``: the most probable word
    (greedy; ``controls.sample`` False, or a temperature of 0) or one drawn by a
    :class:`~captionkit.inference.shaping.Sampler` keyed by ``keys`` (B,) (default: the
    features' own, :func:`~captionkit.inference.shaping.image_keys`). -> each image's
    captions, in the order of ``draws``. The one host sync of a step: is any row still open?
    ``max_len``: the model's longest caption (``controls.max_words`` may shorten it)."""
    B, device = feats.shape[0], feats.device
    S = len(draws)
    max_len = controls.max_len(max_len)
    mem = model.prepare(feats)
    state = model.init_state(mem)
    if S > 1:  # each image's rows side by side: b * S + s
        rows = torch.arange(B, device=device).repeat_interleave(S)  # (B*S,)
        mem, state = mem.index_select(rows), select_rows(state, rows)
    R = B * S
    tokens = torch.full((R,), Vocab.start, dtype=torch.long, device=device)
    shaped_walk = controls.shapes_steps or controls.sample
    rules, sampler = None, None  # made at the first step, which tells the vocabulary's size
    words, alphas = [], []
    total = torch.zeros(R, device=device)
    alive = torch.ones(R, dtype=torch.bool, device=device)
    for t in range(max_len + 1):
        with owned_states():  # each state is stepped once, then replaced
            logp, state, alpha = model.step(tokens, state, mem)
        allowed = allowed_words(logp, t == max_len)
        if not shaped_walk:
            best, tokens = allowed.max(1)  # greedy, as it always was
        else:
            if rules is None:
                rules = StepRules(controls, R, allowed.shape[1], device)
                if controls.sample and controls.temperature > 0:
                    keys = image_keys(feats) if keys is None else keys
                    first = torch.arange(draws.start, draws.start + S, device=device)  # (S,) the draws' numbers
                    sampler = Sampler(controls, keys.repeat_interleave(S), first.repeat(B), allowed.shape[1])
            shaped = rules.apply(allowed, t)
            tokens = sampler.choose(shaped, t) if sampler is not None else shaped.max(1).indices
            best = allowed.gather(1, tokens.unsqueeze(1)).squeeze(1)  # the model's log-probability of it
            rules.advance(tokens)
        total += torch.where(alive, best, torch.zeros_like(best))
        words.append(tokens)
        alphas.append(alpha)
        alive &= tokens != Vocab.end
        if not alive.any():
            break
    # one copy each to the CPU, where Captions live (not one per image)
    W = torch.stack(words, 1).cpu()  # (R, T)
    Al = torch.stack(alphas, 1).cpu()  # (R, T, L)
    total = total.cpu()
    out = []
    for b in range(B):
        row = []
        for r in range(b * S, b * S + S):
            ids = W[r].tolist()
            n = ids.index(Vocab.end)
            row.append(Caption(ids[:n], Al[r, :n].clone(), float(total[r])))
        out.append(row)
    return out


@torch.no_grad()
def beam_search(model, feats: torch.Tensor, beam: int = 3, max_len: int = 20,
                length_penalty: float = 0.0, controls: Controls | None = None) -> list[Caption]:
    """Batched beam search over all images at once.

    Hypotheses are ranked by logprob / (words + 1) ** length_penalty (0 = plain sum, as in
    the paper). With ``beam=1`` this returns exactly the greedy caption.
    """
    return [best[0] for best in beam_nbest(model, feats, 1, beam, max_len, length_penalty, controls)]


# Fewest rows a pruned beam search steps (see beam_nbest): float32 matmuls of fewer rows take
# another kernel (MKL's small-matrix path; measured on this project's AVX-512 CPU, a row's
# result differs from the same row's among more rows for 1-3, 5-7 and 9-11 rows, never from 12
# on), so a pruned batch keeps at least this many rows.
MIN_ROWS = 12
# A batch is pruned once at least this share of its images is done: pruning copies the kept
# rows' memory (beam search keeps one per beam: the default's is 1.2 MB a row in float32), about
# what a step costs, so dropping one photo of 16 cost more than stepping it to the end.
PRUNE_SHARE = 0.25


@torch.no_grad()
def beam_nbest(model, feats: torch.Tensor, n_best: int, beam: int = 3, max_len: int = 20,
               length_penalty: float = 0.0, controls: Controls | None = None, *,
               prune: bool = False) -> list[list[Caption]]:
    """Beam search keeping each image's ``n_best`` (<= ``beam``) best finished hypotheses,
    best first, ranked as :func:`beam_search` ranks them (whose caption is the first).

    Everything stays on the device until the end, and the one host sync of a step is how many
    images are still open. Each step records its chosen words, their beams' parents and its
    attention; a hypothesis that finishes is a log-probability, a length and the beam it ended
    on, kept in fixed-size buffers per image with masked tensor operations (:class:`_Finished`);
    its words and attention rows are traced back through the parents once, at the end.

    ``prune`` steps only what can change a result (the captioner decodes so): the first step
    runs once per image (its beams are copies of one another; only the first is live), and an
    image whose search is done leaves the batch (its rows of the state, the memory and the
    bookkeeping), so the model steps the open images' rows only -- in batches of 16 photos, a
    third of the rows stepped belonged to photos already done. Both keep at least
    ``MIN_ROWS`` rows (a batch of fewer is stepped whole). Exact where a row's numbers do not
    depend on the other rows of its batch: so for every shipped model (their widths are
    multiples of 16 floats, so each row of a matmul is equally aligned whichever rows surround
    it; tests/test_beam_pruning.py). Models of odd widths can round a row differently by its
    place in memory (MKL's small-width kernels; the last bit of a log-probability), as they
    do between batches of different photos. ``prune=False`` (the default) steps every row of
    the batch until its last image is done, as before.

    ``controls``: the step rules shape each step's log-probabilities (hypotheses are ranked by
    the shaped sums; a Caption's ``logprob`` stays the model's own), and ``beam_groups`` G > 1
    is diverse beam search (Vijayakumar et al. 2018): the beam split into G groups of
    beam / G, each a beam search of its own whose candidates lose ``diversity_strength`` per
    time the groups before it chose the word at this step (Hamming diversity). Each group is
    one "image" of :class:`_Finished`; an image's n best are then its groups' bests in turn
    (group 0's best, group 1's best, ..., then their second bests), distinct. An image leaves
    the batch once all its groups are done (a done group's beams still steer the later
    groups' diversity)."""
    c = controls or DEFAULT
    G, max_len = c.beam_groups, c.max_len(max_len)
    if not 1 <= n_best <= beam:
        raise ValueError(f"n_best must be between 1 and the beam size {beam}, got {n_best}")
    if beam % G:
        raise ValueError(f"the beam {beam} does not split into {G} groups of one size")
    B, K, device = feats.shape[0], beam, feats.device
    Kg = K // G  # each group's beams; the groups of all images are searched side by side
    # the fewest images a pruned batch keeps (None: this batch is never pruned)
    floor = -(-MIN_ROWS // K) if prune and B * K >= MIN_ROWS else None
    mem = model.prepare(feats)
    state = model.init_state(mem)
    rows = torch.arange(B, device=device).repeat_interleave(K)  # (B*K,): image b's group g beam j at b*K + g*Kg + j
    tokens = torch.full((B * K,), Vocab.start, dtype=torch.long, device=device)
    first = None  # the first step over one row per image, when that is as exact as over all
    if floor is not None and B >= MIN_ROWS and K > 1:
        # over the memory laid out as index_select lays out the beams' (a transformer's keys are
        # a permuted view until copied, and a matmul of a strided operand rounds otherwise)
        with owned_states():
            first = model.step(tokens[:B], state, mem.index_select(torch.arange(B, device=device)))  # (B, V), ..
    else:
        state = select_rows(state, rows)
    mem = mem.index_select(rows)
    scores = torch.full((B * G, Kg), float("-inf"), device=device)
    scores[:, 0] = 0.0  # only each group's first beam is live at the start
    diverse = G > 1 and c.diversity_strength > 0
    shaped = c.shapes_steps or diverse  # ranking scores differ from the model's log-probabilities
    model_scores = scores.clone() if shaped else None  # (n*G, Kg): the model's own sums, when they differ
    finished = _Finished(B * G, Kg, scores.dtype, device, shaped)
    steps = _Steps()
    rules = None
    kept = n_best if G == 1 else Kg  # each group's finished ranked (groups keep spares for duplicates)
    n = B  # the images in the batch (all of them until some are pruned)

    for t in range(max_len + 1):
        if first is not None:  # each image's rows are copies: the one row per image, repeated
            logp, state, alpha = first[0].index_select(0, rows), select_rows(first[1], rows), \
                first[2].index_select(0, rows)
            first = None
        else:
            with owned_states():  # the rows selected from the last step's: fresh tensors
                logp, state, alpha = model.step(tokens, state, mem)  # (n*K, V), ..., (n*K, L)
        V = logp.shape[1]
        allowed = allowed_words(logp, t == max_len)
        if rules is None:
            rules = StepRules(c, B * K, V, device)
        logp = rules.apply(allowed, t)
        top_s, top_i, live_s, pick = _select(scores, logp, n, G, Kg, V, c.diversity_strength if diverse else 0.0)
        src, word = top_i // V, top_i % V  # (n*G, 2Kg)
        is_end = word == Vocab.end
        new = is_end[:, :Kg] & torch.isfinite(top_s[:, :Kg])
        first_row = torch.arange(n * G, device=device).unsqueeze(1) * Kg  # (n*G, 1): each group's first beam's row
        if shaped:  # the model's sums of the same candidates
            model_top = model_scores.gather(1, src) + allowed.view(n * G, Kg * V).gather(1, top_i)  # (n*G, 2Kg)
            model_scores = model_top.gather(1, pick)
        # A candidate ending in <end> among the best Kg becomes a finished hypothesis.
        finished.add(t, new, top_s[:, :Kg], first_row + src[:, :Kg], model_top[:, :Kg] if shaped else None)
        scores = live_s.gather(1, pick)
        parent = (first_row + src.gather(1, pick)).view(-1)  # (n*K,)
        tokens = word.gather(1, pick).view(-1)
        finished.update_done(scores[:, 0], kept, length_penalty == 0.0)
        # the step's one host sync (as greedy's: is any image left? and pruned: how many?)
        if floor is None:
            going, keep = bool(finished.open.any()), None
        else:
            open_images = finished.open.view(n, G).any(1)  # (n,)
            n_open = int(open_images.sum())
            going, keep = n_open > 0, _kept_images(open_images, n_open, floor) if n_open else None
        if keep is not None:  # the done images leave: their rows go from what the next step reads
            groups = (keep.unsqueeze(1) * G + torch.arange(G, device=device)).view(-1)  # (n'*G,)
            beams = (keep.unsqueeze(1) * K + torch.arange(K, device=device)).view(-1)  # (n'*K,)
            finished.keep(groups)
            scores = scores.index_select(0, groups)
            model_scores = model_scores.index_select(0, groups) if shaped else None
            parent, tokens = parent.index_select(0, beams), tokens.index_select(0, beams)
            mem = mem.index_select(beams)
            n = keep.shape[0]
        steps.record(tokens, parent, alpha)
        if not going:
            break
        state = select_rows(state, parent)
        rules.advance(tokens, parent)
    lists = finished.ranked(kept, length_penalty, steps)
    if G == 1:
        return lists
    return [_in_turn(lists[b * G:(b + 1) * G], n_best) for b in range(B)]


def _kept_images(open_images: torch.Tensor, n_open: int, floor: int) -> torch.Tensor | None:
    """Which of a batch's images (open_images (n,): is its search still open) the next step
    keeps, in batch order (n',): the open ones, and the first done ones up to ``floor`` images.
    None when that is every image, or when fewer than PRUNE_SHARE of them would leave. No host
    read (``n_open`` is known)."""
    n = open_images.shape[0]
    if n - max(n_open, floor) < max(1.0, PRUNE_SHARE * n):
        return None
    order = torch.argsort((~open_images).to(torch.uint8), stable=True)  # (n,): the open first, in order
    return order[:max(n_open, floor)].sort().values


def _select(scores: torch.Tensor, logp: torch.Tensor, B: int, G: int, Kg: int, V: int, strength: float):
    """A step's choice among each group's candidates (its beams' scores (BG, Kg) plus the
    step's log-probabilities (B*K, V)): the best 2 Kg (scores and flat indices beam * V + word,
    (BG, 2Kg): enough to keep Kg live after ends), those scores with ends at -inf, and which Kg
    of them go on (BG, Kg). Group g's candidates first lose ``strength`` per beam of groups
    0..g-1 that goes on with their word (Hamming diversity), so the groups run in turn."""
    if G == 1:
        cand = (scores.view(B * Kg, 1) + logp).view(B, Kg * V)
        top_s, top_i = cand.topk(2 * Kg, dim=1)
        live_s = top_s.masked_fill(top_i % V == Vocab.end, float("-inf"))
        return top_s, top_i, live_s, live_s.topk(Kg, dim=1).indices
    per_group = logp.view(B, G, Kg, V)
    group_scores = scores.view(B, G, Kg)
    chosen = torch.zeros(B, V, dtype=logp.dtype, device=logp.device)  # (B, V): times chosen by earlier groups
    out = []
    for g in range(G):
        cand = group_scores[:, g].unsqueeze(2) + per_group[:, g]  # (B, Kg, V)
        if g:
            cand = cand - strength * chosen.unsqueeze(1)
        top_s, top_i = cand.view(B, Kg * V).topk(2 * Kg, dim=1)
        word = top_i % V
        live_s = top_s.masked_fill(word == Vocab.end, float("-inf"))
        pick = live_s.topk(Kg, dim=1).indices  # (B, Kg)
        going = torch.isfinite(live_s.gather(1, pick)).to(chosen.dtype)  # (B, Kg): live beams only
        chosen = chosen.scatter_add(1, word.gather(1, pick), going)
        out.append((top_s, top_i, live_s, pick))
    return tuple(torch.stack(parts, 1).view(B * G, -1) for parts in zip(*out))


def _in_turn(groups: list[list[Caption]], n: int) -> list[Caption]:
    """The groups' ranked captions taken in turn (each group's best, then each one's second
    best, ...), a caption that repeats an earlier one skipped, up to ``n``."""
    out, seen = [], set()
    for rank in range(max(map(len, groups), default=0)):
        for caps in groups:
            if rank < len(caps) and tuple(caps[rank].ids) not in seen:
                seen.add(tuple(caps[rank].ids))
                out.append(caps[rank])
    return out[:n]


class _Steps:
    """What each step of a beam search chose, on the device: the words (R',) its beams go on
    with, each one's parent row (R',) among the step's R beams, and the step's attention
    (R, L) of those beams (R' < R where images left the batch after the step)."""

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
        # (N,): each hypothesis's beam after word s (meaningful once it has begun; before, a row
        # that every step has: batches only shrink, and ``row`` is a row of the step it ended at)
        at = torch.zeros_like(row)
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
    candidates that are not added. Kept lean: a step's bookkeeping is a few small ops. With
    ``shaped`` ranking scores (caption controls), the model's own log-probabilities are kept
    beside them, for the Captions. Images that leave the batch (:meth:`keep`) leave their
    buffers' rows in full-size copies, where :meth:`ranked` reads every image's."""

    def __init__(self, B: int, K: int, dtype: torch.dtype, device: torch.device, shaped: bool = False):
        self.K, self.slots, self.rows = K, 2 * K, B * K
        self.logprob = torch.full((B, self.slots + 1), float("-inf"), dtype=dtype, device=device)
        self.model_logprob = self.logprob.clone() if shaped else None
        self.ended = torch.zeros(B, self.slots + 1, dtype=torch.long, device=device)
        self.count = torch.zeros(B, 1, dtype=torch.long, device=device)
        self.open = torch.ones(B, dtype=torch.bool, device=device)  # (B,) the images not done
        self.index: torch.Tensor | None = None  # (n,): which image each row is, once some have left
        self.full: list[torch.Tensor | None] = []  # all images' buffers, once some have left

    def _buffers(self) -> list[torch.Tensor | None]:
        return [self.logprob, self.model_logprob, self.ended, self.count]

    def _store(self) -> None:
        """The rows' buffers written to their images' rows of the full-size copies."""
        if self.index is not None:
            for full, now in zip(self.full, self._buffers()):
                if full is not None:
                    full.index_copy_(0, self.index, now)

    def keep(self, rows: torch.Tensor) -> None:
        """Only the rows ``rows`` (n',) stay (their images' searches go on); the others'
        results are final, and kept aside."""
        if self.index is None:  # the first images leave: every row is its image
            self.full = [None if t is None else t.clone() for t in self._buffers()]
            self.index = rows
        else:
            self._store()
            self.index = self.index.index_select(0, rows)
        self.logprob, self.model_logprob, self.ended, self.count = \
            [None if t is None else t.index_select(0, rows) for t in self._buffers()]
        self.open = self.open.index_select(0, rows)

    def add(self, t: int, new: torch.Tensor, logprob: torch.Tensor, rows: torch.Tensor,
            model_logprob: torch.Tensor | None = None) -> None:
        """At step ``t``, the candidates ``new`` (B, K) of open images finish, with their
        log-probabilities (B, K) (and the model's own, when shaped), after ``t`` words, on
        beams ``rows`` (B, K). Each image's go, in order, to its next free slots; the others to
        the spare slot."""
        new = new & self.open.unsqueeze(1)  # (B, K)
        upto = torch.cumsum(new, 1, dtype=torch.long)  # (B, K): how many of the image's new ones so far
        slot = torch.where(new, self.count - 1 + upto, self.slots)  # (B, K)
        self.logprob.scatter_(1, slot, logprob)
        if self.model_logprob is not None:
            self.model_logprob.scatter_(1, slot, model_logprob)
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
        self._store()
        if self.index is not None:  # every image's, as when none has left
            self.logprob, self.model_logprob, self.ended, self.count = self.full
            self.index = None
        B, S = self.ended.shape
        length = torch.div(self.ended, self.rows, rounding_mode="floor")  # (B, S): words
        ids, attention = steps.trace((self.ended % self.rows).view(-1), length.view(-1))  # (B*S, T), (.., L)
        T = ids.shape[1]
        whole = torch.cat([self.count.view(-1), length.view(-1), ids.view(-1)]).cpu()  # the integers, one copy
        count, length = whole[:B].tolist(), whole[B:B + B * S].view(B, S).tolist()
        ids = whole[B + B * S:].view(B, S, T)
        logprob, attention = self.logprob.cpu().tolist(), attention.view(B, S, T, -1).cpu()
        reported = logprob if self.model_logprob is None else self.model_logprob.cpu().tolist()

        def norm(lp: float, n_words: int) -> float:
            return lp / (n_words + 1) ** length_penalty if length_penalty else lp

        out = []
        for b, n in enumerate(count):
            ranked = sorted(range(n), key=lambda j: norm(logprob[b][j], length[b][j]), reverse=True)[:n_best]
            out.append([Caption(ids[b, j, :length[b][j]].tolist(), attention[b, j, :length[b][j]].clone(),
                                reported[b][j]) for j in ranked])
        return out


def decode(model, feats: torch.Tensor, beam: int = 1, max_len: int = 20, length_penalty: float = 0.0,
           controls: Controls | None = None, keys: torch.Tensor | None = None) -> list[Caption]:
    """One caption per image: greedy (beam 1, no length penalty), beam search, or sampling, as
    ``controls`` ask (the first of :func:`decode_lists`' captions)."""
    if controls is None or controls.num_captions == 1:
        return [caps[0] for caps in decode_lists(model, feats, beam, max_len, length_penalty, controls, keys)]
    return [caps[0] for caps in decode_lists(model, feats, beam, max_len, length_penalty,
                                              controls.with_options(num_captions=1), keys)]


SAMPLE_ROUNDS = 4  # --num-captions K draws K per image, then K more for an image short of K distinct, ...


def decode_lists(model, feats: torch.Tensor, beam: int = 1, max_len: int = 20, length_penalty: float = 0.0,
                 controls: Controls | None = None, keys: torch.Tensor | None = None, *,
                 prune: bool = False) -> list[list[Caption]]:
    """Each image's ``controls.num_captions`` captions (K; one without controls), distinct:

    - sampling (``controls.sample``): draws in order, K per round, until an image has K
      distinct or after SAMPLE_ROUNDS rounds (an image the model says little else of can have
      fewer); ``keys`` (B,): the images' keys for the noise (default: their features' hash);
    - else greedy (beam 1, no length penalty, K = 1, one group), or beam search: its K best,
      or diverse beam search's with ``beam_groups``.

    ``max_len``: the model's longest caption (``max_words`` may shorten it); ``prune``: beam
    search's (:func:`beam_nbest`)."""
    c = controls or DEFAULT
    if beam < 1:
        raise ValueError(f"beam size must be at least 1, got {beam}")
    max_len = c.max_len(max_len)
    if c.sample:
        return _sample_lists(model, feats, max_len, c, keys)
    if beam == 1 and length_penalty == 0.0 and c.num_captions == 1 and c.beam_groups == 1:
        return walk(model, feats, max_len, c)
    return beam_nbest(model, feats, c.num_captions, beam, max_len, length_penalty, c, prune=prune)


def _sample_lists(model, feats: torch.Tensor, max_len: int, c: Controls,
                  keys: torch.Tensor | None) -> list[list[Caption]]:
    K, B = c.num_captions, feats.shape[0]
    out: list[list[Caption]] = [[] for _ in range(B)]
    seen: list[set] = [set() for _ in range(B)]
    todo = list(range(B))
    for r in range(SAMPLE_ROUNDS if K > 1 else 1):
        x, k = feats, keys
        if len(todo) < B:  # the images still short of K: a copy of their indices per round, not per step
            idx = torch.tensor(todo, device=feats.device)
            x, k = feats.index_select(0, idx), None if keys is None else keys.index_select(0, idx)
        for b, caps in zip(todo, walk(model, x, max_len, c, k, draws=range(r * K, (r + 1) * K))):
            for cap in caps:
                if len(out[b]) < K and tuple(cap.ids) not in seen[b]:
                    seen[b].add(tuple(cap.ids))
                    out[b].append(cap)
        todo = [b for b in todo if len(out[b]) < K]
        if not todo:
            break
    return out
