"""Self-critical training's mixed objective (issue 32, item 3): with train.scst_xe_weight W, the
loss is the self-critical loss plus W times the cross-entropy of the batch images' own reference
captions, all of them, which keeps probability on the words people use."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from ddpsteps import ThreadRanks, tiny_trainer
from helpers import TINY_CONFIG

from captionkit.data.items import mirror_words
from captionkit.data.vocab import Vocab
from captionkit.training.config import ConfigError, RunConfig
from captionkit.training.distributed import World
from captionkit.training.prefetch import HostBatch
from captionkit.training.trainer import Trainer

TRANSFORMER = """[model]
family = "transformer"
width = 16
heads = 2
encoder_layers = 1
decoder_layers = 1
dropout = 0.0
max_positions = 24
"""


def config_file(tmp_path, dataset, weight: float, family: str = "sat", objective: str = "scst", extra: str = ""):
    text = TINY_CONFIG.format(dataset=dataset)
    if family == "transformer":  # the tiny config's [model] table, swapped
        head, _, rest = text.partition("[model]")
        text = head + TRANSFORMER + "\n" + rest[rest.index("[train]"):]
    path = tmp_path / f"{family}{weight}{objective}{abs(hash(extra))}.toml"
    path.write_text(text.replace("[train]", f'[train]\nobjective = "{objective}"\nsamples = 2\n'
                                            f'scst_baseline = "mean"\nscst_xe_weight = {weight}\n{extra}', 1))
    return path


def reference_ids(trainer, rows: list[int], mirrored: bool = False) -> tuple[list[list[int]], list[int]]:
    """Every caption of the train images ``rows``, tokenised here from the dataset's words (not
    by the trainer's tables), and each caption's position in ``rows``."""
    cfg = trainer.cfg.data
    ids, image = [], []
    for p, row in enumerate(rows):
        for toks in trainer.data.train_items[row].words(cfg.words):
            toks = mirror_words(toks) if mirrored else toks
            ids.append(trainer.vocab.encode(toks[:cfg.max_words]))
            image.append(p)
    return ids, image


@pytest.mark.parametrize("family", ["sat", "transformer"])
def test_the_mixed_loss_is_the_self_critical_loss_plus_w_times_the_references_cross_entropy(
        family, flickr_dir, tmp_path):
    """The same batch, the same draws: the loss with W = 0.5 is the plain one (W = 0) plus 0.5 x
    the family's cross-entropy of the images' 5 captions each, computed here on its own; so are
    the gradients. The LSTM takes one image row per caption, the transformer indexes them."""
    plain = tiny_trainer(config_file(tmp_path, flickr_dir, 0.0, family), tmp_path / "plain")
    mixed = tiny_trainer(config_file(tmp_path, flickr_dir, 0.5, family), tmp_path / "mixed")
    mixed.model.load_state_dict(plain.model.state_dict())
    for t in (plain, mixed):
        t.model.eval()  # as fit() runs self-critical training: no dropout
    rows = [3, 0, 5]
    assert "ids" not in plain.host_tensors(rows)  # W = 0: nothing more is read or computed

    def loss_and_grads(trainer):
        torch.manual_seed(7)  # the same samples for both
        loss, figures = trainer.batch_loss(HostBatch(trainer.shard(rows), len(rows), trainer.host_tensors(rows)))
        params = [p for p in trainer.model.parameters() if p.requires_grad]
        return loss, figures, torch.autograd.grad(loss, params, allow_unused=True)

    p_loss, p_fig, p_grads = loss_and_grads(plain)
    m_loss, m_fig, m_grads = loss_and_grads(mixed)
    ids, image = reference_ids(plain, rows)
    assert len(ids) == 5 * len(rows)
    longest = max(map(len, ids))
    ids = torch.tensor([c + [Vocab.pad] * (longest - len(c)) for c in ids])  # (15, T+1)
    feats = plain.features(plain.data.train_feats.select(torch.tensor(rows)))[torch.tensor(image)]  # (15, L, D)
    xe, ce = plain.model.training_loss(feats, ids[:, :-1], ids[:, 1:], alpha_c=plain.cfg.train.alpha_c)
    params = [p for p in plain.model.parameters() if p.requires_grad]
    xe_grads = torch.autograd.grad(xe, params, allow_unused=True)
    assert float(xe.detach()) > 0.1
    torch.testing.assert_close(m_loss, p_loss + 0.5 * xe)
    torch.testing.assert_close(m_fig["reward"], p_fig["reward"])  # the same samples, the same rewards
    torch.testing.assert_close(m_fig["loss"], ce.detach())  # the cross-entropy is reported beside them
    assert "loss" not in p_fig
    moved = 0
    for a, b, g in zip(p_grads, m_grads, xe_grads):
        if g is not None:
            torch.testing.assert_close(b, a + 0.5 * g, rtol=1e-4, atol=1e-6)
            moved += int(g.abs().sum() > 0)
    assert moved > 3  # the term reaches the model's weights


def test_the_term_under_ddp_adds_up_to_the_one_process_term(flickr_dir, tmp_path):
    """Two ranks take Trainer.shard's parts of a batch of 5 images (unequal numbers of images and
    of reference words): weighted as train_step weights a self-critical shard, the average DDP
    takes of their gradients is the one-process gradient of the whole batch's term."""
    trainer = tiny_trainer(config_file(tmp_path, flickr_dir, 0.5, "transformer"), tmp_path / "run")
    trainer.model.eval()
    rows = [4, 1, 7, 2, 0]
    params = [p for p in trainer.model.parameters() if p.requires_grad]

    def term_grads(part: list[int], weight: float = 1.0):
        t = trainer.host_tensors(part)
        term, _ = trainer.reference_loss(trainer.features(t["feats"]), t["ids"], t["image_index"])
        return torch.autograd.grad(term * weight, params, allow_unused=True)

    whole = term_grads(rows)
    shards = [Trainer.shard(SimpleNamespace(world=World(r, 2), scst=True, cfg=trainer.cfg), rows) for r in range(2)]
    assert [len(s.part) for s in shards] == [3, 2]
    grads = ThreadRanks(2).run(lambda r: term_grads(shards[r].part, shards[r].loss_weight * 2))  # as train_step
    compared = 0
    for g, a, b in zip(whole, *grads):
        if g is not None:
            torch.testing.assert_close((a + b) / 2, g, rtol=1e-5, atol=1e-7)  # DDP averages
            compared += 1
    assert compared > 3


def test_mirrored_images_are_trained_on_their_mirrored_captions(sided, tmp_path):
    """train.flip = 1: every image of the epoch is seen mirrored, and the captions of the mixed
    term are the mirrored ones ("left" and "right" swapped), as cross-entropy training reads them."""
    trainer = tiny_trainer(config_file(tmp_path, sided, 0.5, extra="flip = 1.0"), tmp_path / "run")
    batch = trainer.epoch_batches(0)[0]
    assert bool(trainer.epoch_mirrored[batch].all())
    got = [[w for w in row if w != Vocab.pad] for row in trainer.host_tensors(batch)["ids"].tolist()]
    want, image = reference_ids(trainer, batch, mirrored=True)
    assert got == want and any(want != plain for want, plain in zip(want, reference_ids(trainer, batch)[0]))
    assert trainer.host_tensors(batch)["image_index"].tolist() == image


def test_the_weight_is_checked_at_load(flickr_dir, tmp_path):
    assert RunConfig.load(config_file(tmp_path, flickr_dir, 0.25)).train.scst_xe_weight == 0.25
    with pytest.raises(ConfigError, match="train.scst_xe_weight must be >= 0"):
        RunConfig.load(config_file(tmp_path, flickr_dir, -1.0))
    with pytest.raises(ConfigError, match='train.scst_xe_weight mixes cross-entropy .* needs train.objective = "scst"'):
        RunConfig.load(config_file(tmp_path, flickr_dir, 0.5, objective="xe"))
