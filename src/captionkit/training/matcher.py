"""Training the image-caption matcher (captionkit.models.matcher) of ``--rerank match``: the
``captionkit matcher`` command.

The matcher reads the encoder's cached rows (``captionkit features``; built here when missing),
mean-pooled once per photo, so an epoch over Flickr8k's 6,000 training photos takes seconds of
matmuls and most of its time in the GRU. Each epoch visits every training photo once with one
of its captions drawn at random (a batch never holds two captions of one photo, so every other
pair of the batch is a true negative for the InfoNCE loss), AdamW with a one-cycle schedule.
After each epoch the dev split's recall is measured (every dev caption against all dev photos),
and the epoch with the best caption-to-photo R@1 is kept. The bank of the checkpoint is
``bank_size`` training photos, drawn with the seed, embedded by that epoch's weights.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ..core.checkpoint import save_checkpoint
from ..core.errors import DatasetError
from ..core.outputs import check_folder_target
from ..data.datasets import load_dataset
from ..data.items import normalize
from ..encoders import create_encoder
from ..encoders.features import build_features
from ..models.matcher import KIND, SPECIAL, Matcher, MatcherConfig, pad_ids


def build_words(captions: list[list[str]], min_count: int) -> list[str]:
    """The matcher's vocabulary: <pad>, <unk>, then the words of at least ``min_count``
    occurrences in the captions, sorted (so the same captions give the same ids)."""
    counts = Counter(w for caps in captions for c in caps for w in normalize(c))
    return SPECIAL + sorted(w for w, n in counts.items() if n >= min_count and w not in SPECIAL)


@torch.no_grad()
def recall(m: Matcher, pooled: torch.Tensor, captions: list[list[str]]) -> dict[str, float]:
    """Retrieval among the given photos: every caption against every photo (caption -> photo
    R@1 and R@5) and every photo against every caption (photo -> caption R@1: is the best
    caption one of its own?). pooled (N, D); captions: each photo's."""
    was = m.training
    m.eval()
    images = m.pooled_image(pooled)  # (N, E)
    owner = torch.tensor([i for i, caps in enumerate(captions) for _ in caps])  # (C,)
    flat = [c for caps in captions for c in caps]
    texts = torch.cat([m.text(flat[i:i + 1000]) for i in range(0, len(flat), 1000)])  # (C, E)
    sim = texts @ images.t()  # (C, N)
    rank = (sim > sim[torch.arange(len(owner)), owner].unsqueeze(1)).sum(1)  # photos above the right one
    m.train(was)
    return {"t2i_r1": (rank < 1).float().mean().item(), "t2i_r5": (rank < 5).float().mean().item(),
            "i2t_r1": (owner[sim.argmax(0)] == torch.arange(len(images))).float().mean().item()}


def fit(cfg: MatcherConfig, train_pooled: torch.Tensor, train_caps: list[list[str]], dev_pooled: torch.Tensor,
        dev_caps: list[list[str]], *, epochs: int = 15, batch_size: int = 128, lr: float = 1e-3,
        weight_decay: float = 1e-4, seed: int = 0,
        log: Callable[[str], None] | None = None) -> tuple[Matcher, list[dict]]:
    """Train a matcher on pooled rows (N, D) and each photo's captions; -> the best epoch's
    matcher (by dev caption -> photo R@1, in eval mode, bank filled) and every epoch's figures."""
    if len(train_pooled) < 2 or len(dev_pooled) < 1:
        raise DatasetError(f"a matcher needs 2 or more training photos and 1 or more dev photos, "
                           f"got {len(train_pooled)} and {len(dev_pooled)}")
    if cfg.bank_size > len(train_pooled):
        raise DatasetError(f"a bank of {cfg.bank_size} photos needs as many training photos, got {len(train_pooled)}")
    torch.manual_seed(seed)
    draw = random.Random(seed)
    m = Matcher(cfg)
    batch_size = min(batch_size, len(train_pooled))
    per_epoch = len(train_pooled) // batch_size
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=weight_decay)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, lr, total_steps=epochs * per_epoch, pct_start=0.1)
    ids = [[m.word_ids(c) for c in caps] for caps in train_caps]  # each photo's captions as word ids
    history, best, best_state = [], -1.0, None
    for epoch in range(epochs):
        t0, total = time.perf_counter(), 0.0
        order = torch.randperm(len(train_pooled))
        m.train()
        for b in range(per_epoch):
            idx = order[b * batch_size:(b + 1) * batch_size].tolist()
            text = pad_ids([ids[i][draw.randrange(len(ids[i]))] for i in idx])  # (B, T): one caption a photo
            loss = m.contrastive_loss(m.pooled_image(train_pooled[idx]), m.text_ids(text))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item()
        figures = {"epoch": epoch + 1, "loss": total / per_epoch, **recall(m, dev_pooled, dev_caps),
                   "seconds": time.perf_counter() - t0}
        history.append(figures)
        if log:
            log(f"epoch {epoch + 1}: loss {figures['loss']:.3f}, dev caption->photo R@1 {figures['t2i_r1']:.3f} "
                f"R@5 {figures['t2i_r5']:.3f}, photo->caption R@1 {figures['i2t_r1']:.3f} "
                f"({figures['seconds']:.0f} s)")
        if figures["t2i_r1"] > best:
            best, best_state = figures["t2i_r1"], {k: v.clone() for k, v in m.state_dict().items()}
    m.load_state_dict(best_state)
    m.eval()
    pick = torch.randperm(len(train_pooled), generator=torch.Generator().manual_seed(seed))[:cfg.bank_size]
    with torch.no_grad():
        m.bank = m.pooled_image(train_pooled[pick.sort().values])  # (K, E)
    return m, history


def pooled_rows(store, names: list[str], chunk: int = 256) -> torch.Tensor:
    """Each photo's rows averaged over the grid, (N, D) float32, read ``chunk`` photos at a time."""
    return torch.from_numpy(np.concatenate(
        [store.rows(names[i:i + chunk]).astype(np.float32).mean(1) for i in range(0, len(names), chunk)]))


def train_matcher(dataset: str, out: str | Path, *, images: str | None = None, encoder: str = "efficientnet_lite2",
                  train_split: str = "train", dev_split: str = "dev", epochs: int = 15, embed_dim: int = 512,
                  word_dim: int = 300, dropout: float = 0.2, min_count: int = 2, bank_size: int = 1000,
                  batch_size: int = 128, lr: float = 1e-3, seed: int = 0, overwrite: bool = False,
                  encoder_weights: str | None = None, log: Callable[[str], None] | None = None) -> Path:
    """The ``captionkit matcher`` command: train on ``dataset``'s training split, select on its
    dev split, write the checkpoint folder ``out`` (refused before any work if it holds
    something and ``overwrite`` is not given)."""
    target = check_folder_target(out, overwrite=overwrite, kinds=("checkpoint",))
    # the sizes checked before any work; the vocabulary, the rows' width and the encoder come later
    sizes = MatcherConfig(embed_dim=embed_dim, word_dim=word_dim, dropout=dropout, bank_size=bank_size)
    ds = load_dataset(dataset, images)
    train_items, dev_items = ds.split(train_split), ds.split(dev_split)
    for name, items in ((train_split, train_items), (dev_split, dev_items)):
        if not items:
            raise DatasetError(f"{dataset}: the {name} split is empty")
    enc = create_encoder(encoder, weights=encoder_weights)
    store = build_features(enc, [it.path for it in ds.all_items()], only=[it.path for it in train_items + dev_items])
    train_pooled = pooled_rows(store, [it.name for it in train_items])
    dev_pooled = pooled_rows(store, [it.name for it in dev_items])
    train_caps, dev_caps = [it.raw for it in train_items], [it.raw for it in dev_items]
    cfg = replace(sizes, words=build_words(train_caps, min_count), feat_dim=train_pooled.shape[1],
                  encoder=enc.cache_key(), bank_size=min(bank_size, len(train_items)))
    m, history = fit(cfg, train_pooled, train_caps, dev_pooled, dev_caps, epochs=epochs, batch_size=batch_size,
                     lr=lr, seed=seed, log=log)
    best = max(history, key=lambda h: h["t2i_r1"])
    config = {"kind": KIND, "matcher": asdict(cfg),
              "training": {"dataset": str(dataset), "train_split": train_split, "dev_split": dev_split,
                           "encoder": encoder, "epochs": epochs, "batch_size": batch_size, "lr": lr,
                           "min_count": min_count, "seed": seed, "best_epoch": best["epoch"], "history": history}}
    save_checkpoint(target, m.state_dict(), config)
    if log:
        log(f"{target}: epoch {best['epoch']} (dev caption->photo R@1 {best['t2i_r1']:.3f}), "
            f"{len(cfg.words):,} words, a bank of {cfg.bank_size} photos")
    return target
