"""How an epoch is cut and paced: the batches of captions (one length per batch, as in the
paper, or whole images with their captions), in a seeded order, and the learning-rate
schedule's multiplier. Functions of the seed and the saved training state only, so a resumed
run sees the same batches and continues on the same curve."""

from __future__ import annotations

import math
import random

from .config import TrainConfig


def lr_factor(tc: TrainConfig, step: int, progress: float) -> float:
    """The schedule's multiplier of the learning rate at optimizer step ``step`` (0-based) and
    ``progress`` = the fraction of the planned epochs done. A function of the saved training
    state only, so a resumed run continues on the same curve."""
    s = step + 1
    warm = min(1.0, s / tc.warmup_steps) if tc.warmup_steps else 1.0
    if tc.schedule == "cosine":
        return warm * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    if tc.schedule == "inverse_sqrt":
        return min(warm, math.sqrt(tc.warmup_steps / s))
    return warm


def image_batches(groups: list[list[int]], lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """Caption indices grouped by image (groups: each image's captions), whole images per
    batch, up to batch_size captions (at least one image). Images are ordered by their longest
    caption within seeded-random buckets, so a batch pads little; the batches are shuffled."""
    rng = random.Random(seed)
    order = [g for g in groups if g]
    rng.shuffle(order)
    order.sort(key=lambda g: max(lengths[i] for i in g))  # stable: random within a length
    batches, cur = [], []
    for g in order:
        if cur and len(cur) + len(g) > batch_size:
            batches.append(cur)
            cur = []
        cur = cur + g
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def length_batches(lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """Indices grouped so that every batch holds captions of one length, in a seeded order."""
    rng = random.Random(seed)
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(n, []).append(i)
    batches = []
    for n in sorted(by_len):
        idx = by_len[n]
        rng.shuffle(idx)
        batches += [idx[i:i + batch_size] for i in range(0, len(idx), batch_size)]
    rng.shuffle(batches)
    return batches
