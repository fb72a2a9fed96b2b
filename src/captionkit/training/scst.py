"""Self-critical sequence training (Rennie et al. 2017), written against the decoder contract.

For each image, captions are *sampled* from the model and scored with CIDEr-D against the
image's references; the model's own greedy caption, scored the same way, is the baseline. The
loss is REINFORCE: -(r(sample) - r(greedy)) * log p(sample), so captions that beat what the
model would say anyway become more likely and worse ones less likely.

``baseline="mean"`` uses instead the mean reward of the image's *other* samples (Luo 2020, "A
better variant of self-critical sequence training"): each image's advantages then sum to zero,
and no greedy caption is decoded. It helps where the greedy caption's reward is inflated, e.g.
by a model that has learnt its training captions by heart (its greedy caption then beats almost
every sample, and nearly every advantage is negative).

``repeat_penalty`` P (issue 32): a caption that repeats a content phrase ("a boat is riding a
boat", scoring.diversity.repeated_phrase) is rewarded P less. CIDEr-D alone pays such loops (the
repeated words are n-grams the references hold), which is how self-critical training teaches
them; the term takes that pay back. 0: the plain reward.

``bleu_weight`` B (issue 32): each caption's reward gains B times its sentence BLEU-4 against
its image's references (scoring.metrics.SentenceBleu, smoothed). CIDEr-D weights an n-gram by
how rare it is among the references, so a reward of CIDEr-D alone pays little for getting the
common phrases of a caption in the order people write them, which is what BLEU-4's 4-gram
precision counts (Rennie et al. 2017 and Liu et al. 2017, "SPIDEr", train on such mixtures).

``meteor_weight`` M (issue 32): each caption's reward gains M times its METEOR 1.5 against its
image's references (the coco-caption jar, scoring.evaluation.sentence_meteor; needs Java).
METEOR aligns words through stems and synonyms and weighs recall well above precision (its
harmonic mean's alpha is 0.85 in METEOR 1.5's English parameters), so it pays a caption for
naming more of what the references name, where CIDEr-D's consensus pays the short common
caption. Rennie et al. 2017 also trained on METEOR alone; Liu et al. 2017 ("SPIDEr") mix
CIDEr-D with a second metric, as this does. One jar call per batch (a few hundred captions, ~0.3 s).

``matcher`` and ``match_weight`` W (issue 32): each caption's reward gains W times its
discriminability for its photo under an image-caption matcher (captionkit.models.matcher: how
much better the caption fits this photo than the matcher's bank of training photos). Luo et al.
2018 ("Discriminability objective for training descriptive captions") add such a retrieval term
to the CIDEr-D reward: a generic caption that fits many photos earns nothing from it, one that
names what this photo shows earns more. The matcher is frozen and runs where the features are.

What it uses of a model: the contract of :class:`captionkit.models.base.CaptionModel`, the
steps (``prepare``, ``init_state``, ``step``; to sample and to decode greedily) and the
teacher-forced ``forward(feats, inputs, image_index) -> (scores, attention)`` (to take the
log-probability of the samples in one pass, which is much cheaper than keeping the graph of
the sampling loop). The model runs without dropout
throughout, so the distribution the samples come from is the one whose gradient is taken.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.collectives import process_sum
from ..core.errors import UserError
from ..data.items import mirror_words
from ..data.vocab import Vocab
from ..inference.decoding import allowed_words, greedy, select_rows
from ..models.matcher import PAD, Matcher
from ..scoring.diversity import repeated_phrase
from ..scoring.evaluation import sentence_meteor
from ..scoring.metrics import CiderD, SentenceBleu


@torch.no_grad()
def sample(model, feats: torch.Tensor, n: int, max_len: int = 20,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """``n`` captions per image drawn from the model -> (B * n, T) word ids, each row ending
    in <end> and then <pad>; rows b*n .. b*n+n-1 belong to image b. Words that decoding never
    produces (<pad>, <start>, <unk>) are never drawn."""
    B, device = feats.shape[0], feats.device
    mem = model.prepare(feats)
    rows = torch.arange(B, device=device).repeat_interleave(n)  # (B*n,)
    mem, state = mem.index_select(rows), select_rows(model.init_state(mem), rows)
    tokens = torch.full((B * n,), Vocab.start, dtype=torch.long, device=device)
    alive = torch.ones(B * n, dtype=torch.bool, device=device)
    out = []
    for t in range(max_len + 1):
        logp, state, _ = model.step(tokens, state, mem)
        probs = allowed_words(logp.float(), t == max_len).exp()  # (B*n, V)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        tokens = torch.where(alive, tokens, torch.full_like(tokens, Vocab.pad))
        out.append(tokens)
        alive &= tokens != Vocab.end
        if not alive.any():
            break
    return torch.stack(out, 1)  # (B*n, T)


def sequence_logprobs(model, feats: torch.Tensor, seqs: torch.Tensor, n: int = 1) -> torch.Tensor:
    """log p of every word of ``seqs`` (B*n, T) given ``feats`` (B, L, D), n consecutive rows
    per image, teacher-forced, under the same renormalisation as sampling (<pad>, <start>,
    <unk> excluded) -> (B*n, T), 0 at pads. With n > 1 the model prepares each image once
    (``image_index``: the image side of a step is a large share of the cost)."""
    start = torch.full((seqs.shape[0], 1), Vocab.start, dtype=torch.long, device=seqs.device)
    inputs = torch.cat([start, seqs[:, :-1]], 1)  # (B*n, T): <start> w_1 .. w_{T-1}
    if n == 1:
        logits, _ = model(feats, inputs)  # (B, T, V)
    else:
        rows = torch.arange(feats.shape[0], device=feats.device).repeat_interleave(n)  # (B*n,)
        logits, _ = model(feats, inputs, image_index=rows)  # (B*n, T, V)
    logits = logits.float().clone()
    logits[..., [Vocab.pad, Vocab.start, Vocab.unk]] = float("-inf")
    logp = F.log_softmax(logits, dim=-1).gather(2, seqs.unsqueeze(2)).squeeze(2)  # (R, T)
    return logp.masked_fill(seqs == Vocab.pad, 0.0)


BASELINES = ("greedy", "mean")


@dataclass
class SelfCriticalStats:
    """0-dim tensors on the loss's device (read on the host when the trainer reads its figures)."""
    sample_reward: torch.Tensor  # mean reward of the sampled captions (CIDEr-D, and the terms set)
    greedy_reward: torch.Tensor | None  # mean CIDEr-D of the greedy captions (the greedy baseline)


def leave_one_out_mean(rewards: torch.Tensor, n: int) -> torch.Tensor:
    """rewards (B*n,), n consecutive samples per image -> each sample's baseline: the mean
    reward of its image's other n - 1 samples (B*n,)."""
    per_image = rewards.view(-1, n)  # (B, n)
    return ((per_image.sum(1, keepdim=True) - per_image) / (n - 1)).reshape(-1)


def _reward_weight(value: float, what: str) -> float:
    """A reward term's weight as a float, or a UserError naming the term."""
    if not 0 <= value < float("inf"):
        raise UserError(f"the self-critical {what} weight must be a finite number >= 0, not {value!r}")
    return float(value)


class SelfCritical:
    """The self-critical objective for one set of training images.

    refs: for each image key, its reference captions as lists of words (document frequencies
    for CIDEr-D come from these). vocab turns word ids back into words. baseline: "greedy"
    (the greedy caption's reward) or "mean" (the other samples' mean reward; samples >= 2).
    repeat_penalty: what a caption that repeats a content phrase loses of its reward (0: nothing).
    matcher, match_weight: the discriminability term (module docstring; no matcher: none).
    bleu_weight: what each caption's reward gains per unit of its sentence BLEU-4 (0: nothing).
    meteor_weight: what each caption's reward gains per unit of its METEOR 1.5 (0: nothing)."""

    def __init__(self, refs: dict, vocab: Vocab, samples: int = 5, max_len: int = 20,
                 baseline: str = "greedy", repeat_penalty: float = 0.0, matcher: Matcher | None = None,
                 match_weight: float = 0.0, bleu_weight: float = 0.0, meteor_weight: float = 0.0):
        if baseline not in BASELINES:
            raise UserError(f"self-critical baseline must be one of {', '.join(BASELINES)}, not {baseline!r}")
        if baseline == "mean" and samples < 2:
            raise UserError("the mean baseline needs at least 2 samples per image")
        if not repeat_penalty >= 0:
            raise UserError(f"the self-critical repeat penalty must be a number >= 0, not {repeat_penalty!r}")
        self.cider = CiderD(refs)
        self.vocab, self.samples, self.max_len, self.baseline = vocab, samples, max_len, baseline
        self.repeat_penalty = float(repeat_penalty)
        self.bleu_weight = _reward_weight(bleu_weight, "BLEU")
        self.bleu = SentenceBleu(refs) if bleu_weight else None
        self.meteor_weight = _reward_weight(meteor_weight, "METEOR")
        self.meteor_refs = {k: [" ".join(r) for r in rs] for k, rs in refs.items()} if meteor_weight else None
        self.matcher, self.match_weight = matcher, _reward_weight(match_weight, "match")
        if matcher is not None:
            matcher.eval().requires_grad_(False)
            matcher.check_bank()

    def discriminability(self, feats: torch.Tensor, seqs: list[list[int]], n: int) -> torch.Tensor:
        """The matcher's discriminability of each word-id sequence (without <start>/<end>) for
        its image: feats (B, L, D), ``n`` consecutive sequences per image -> (B*n,) on the
        features' device (where the matcher must be). The word ids become the matcher's on the
        host, where they are already: nothing is read back from the device."""
        m = self.matcher
        words = [m.word_ids(" ".join(self.vocab.decode(s))) for s in seqs]
        longest = max(map(len, words))
        ids = torch.tensor([w + [PAD] * (longest - len(w)) for w in words], device=feats.device)  # (B*n, T)
        with torch.no_grad():
            images = m.image(feats).repeat_interleave(n, 0)  # (B*n, E)
            texts = m.text_on_device(ids)  # (B*n, E)
            return m.discriminability(images, texts, checked=True)  # (B*n,)

    def rewards(self, keys: list, seqs: list[list[int]], mirrored: list[bool] | None = None) -> list[float]:
        """CIDEr-D of each word-id sequence (without <start>/<end>) for its image key, plus
        ``bleu_weight`` times its sentence BLEU-4 and ``meteor_weight`` times its METEOR, less
        ``repeat_penalty`` where it repeats a content phrase; scored on the CPU. ``mirrored``:
        per sequence, whether it describes its image mirrored (train.flip): its "left" and
        "right" are swapped back before it meets the references."""
        out, captions = [], []
        for j, (k, s) in enumerate(zip(keys, seqs)):
            words = self.vocab.decode(s)
            if mirrored is not None and mirrored[j]:
                words = mirror_words(words)
            if self.meteor_refs is not None:
                captions.append(" ".join(words))
            r = self.cider.score(k, words)
            if self.bleu is not None:
                r += self.bleu_weight * self.bleu.score(k, words)
            if self.repeat_penalty and repeated_phrase(words) is not None:
                r -= self.repeat_penalty
            out.append(r)
        if self.meteor_refs is not None:  # the batch's captions in one call of the jar
            meteor = sentence_meteor(captions, [self.meteor_refs[k] for k in keys])
            out = [r + self.meteor_weight * float(m) for r, m in zip(out, meteor)]
        return out

    def loss(self, model, feats: torch.Tensor, keys: list, mirrored: list[bool] | None = None
             ) -> tuple[torch.Tensor, SelfCriticalStats]:
        """feats (B, L, D) of the images ``keys`` -> (REINFORCE loss, mean rewards). ``mirrored``
        (B,): which feats are of the image's mirror image (their rewards: see :meth:`rewards`).

        The loss is a sum over the sampled words divided by the number of sampled words of the
        *global* batch (:func:`~captionkit.core.collectives.process_sum`: this process's count
        with one process), so that under DDP the processes' losses add up to the one-process
        loss of the whole batch (the trainer weights each by 1, a stand-in shard by 0)."""
        n = self.samples
        seqs = sample(model, feats, n, self.max_len)  # (B*n, T)
        # host reads that cannot go: CIDEr-D is scored on the CPU, so the samples (and the
        # greedy captions) come to the host; sampling and greedy decoding also read once per
        # word, to stop when every caption has ended
        ids = [[w for w in row if w not in (Vocab.end, Vocab.pad)] for row in seqs.tolist()]
        each = None if mirrored is None else [m for m in mirrored for _ in range(n)]
        rewards = torch.tensor(self.rewards([k for k in keys for _ in range(n)], ids, each), device=feats.device)  # (B*n,)
        if self.match_weight:
            rewards = rewards + self.match_weight * self.discriminability(feats, ids, n)
        greedy_rewards = None
        if self.baseline == "greedy":
            base = greedy(model, feats, self.max_len)
            greedy_rewards = torch.tensor(self.rewards(keys, [c.ids for c in base], mirrored), device=feats.device)  # (B,)
            if self.match_weight:
                greedy_rewards = greedy_rewards + self.match_weight * self.discriminability(
                    feats, [c.ids for c in base], 1)
            advantage = rewards - greedy_rewards.repeat_interleave(n)  # (B*n,)
        else:
            advantage = rewards - leave_one_out_mean(rewards, n)  # (B*n,)
        logp = sequence_logprobs(model, feats, seqs, n)  # (B*n, T)
        words = process_sum((seqs != Vocab.pad).sum())
        loss = -(advantage.unsqueeze(1) * logp).sum() / words
        return loss, SelfCriticalStats(rewards.mean(), None if greedy_rewards is None else greedy_rewards.mean())
