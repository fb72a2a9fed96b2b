"""Flip-augmented training (train.flip, issue 32 item 3): a share of the training images is seen
mirrored each epoch, its features from the mirror-image cache, "left" and "right" swapped in its
captions and self-critical rewards."""

from __future__ import annotations

import pytest
import torch
from helpers import TINY_CONFIG

from captionkit.core.checkpoint import read_config
from captionkit.data.items import mirror_words
from captionkit.data.vocab import Vocab
from captionkit.encoders import create_encoder
from captionkit.encoders.features import build_features
from captionkit.scoring.metrics import CiderD
from captionkit.training.config import ConfigError, RunConfig
from captionkit.training.run import build_trainer, train
from captionkit.training.scst import SelfCritical, SelfCriticalStats
from captionkit.training.stages import prepare_data


def config_file(tmp_path, dataset, flip: float, epochs: int = 3):
    path = tmp_path / f"flip{flip}.toml"
    path.write_text(TINY_CONFIG.format(dataset=dataset).replace("[train]", f"[train]\nflip = {flip}", 1)
                    .replace("epochs = 3", f"epochs = {epochs}"))
    return path


def config(tmp_path, dataset, flip: float) -> RunConfig:
    return RunConfig.load(config_file(tmp_path, dataset, flip))


def test_mirror_words_swaps_the_sides_only():
    assert mirror_words(["a", "dog", "on", "the", "left", "of", "Right", "lefty"]) == \
        ["a", "dog", "on", "the", "right", "of", "Left", "lefty"]
    assert mirror_words(mirror_words(["left", "right", "leftover"])) == ["left", "right", "leftover"]


def test_a_mirrored_image_has_its_mirror_features_and_swapped_caption(sided, tmp_path):
    cfg = config(tmp_path, sided, 0.5)
    trainer = build_trainer(cfg, tmp_path / "run", prepare_data(cfg))
    names = [it.name for it in trainer.data.train_items]
    # the mirror image's features, computed here from the encoder on the mirrored pixels
    torch.manual_seed(cfg.train.seed)  # prepare_data's random encoder
    enc = create_encoder("efficientnet_lite0", weights="random")
    paths = [it.path for it in trainer.data.train_items]
    plain = torch.from_numpy(build_features(enc, paths).rows(names)).float()
    mirror = torch.from_numpy(build_features(enc, paths, flip=True).rows(names)).float()
    assert not torch.equal(plain, mirror)

    draws = []
    for epoch in range(3):
        trainer.epoch_batches(epoch)
        draws.append(trainer.epoch_mirrored.clone())
        trainer.epoch_batches(epoch)
        assert torch.equal(trainer.epoch_mirrored, draws[-1])  # seeded by the epoch: resumable
    assert any(not torch.equal(draws[0], d) for d in draws[1:])  # a new draw each epoch
    assert 0 < torch.stack(draws).float().mean() < 1

    left, right = trainer.vocab.words.index("left"), trainer.vocab.words.index("right")
    seen_mirrored = seen_plain = 0
    for epoch in range(3):
        batches = trainer.epoch_batches(epoch)
        for batch in batches:
            host = trainer.host_tensors(batch)
            for j, i in enumerate(batch):
                row, ids = trainer.examples[i]
                flipped = bool(trainer.epoch_mirrored[row])
                want = mirror if flipped else plain
                torch.testing.assert_close(host["feats"][j].float(), want[row])
                got = host["ids"][j][:len(ids)].tolist()
                if flipped:
                    assert got == [{left: right, right: left}.get(w, w) for w in ids]
                else:
                    assert got == ids
                sided_caption = left in ids or right in ids
                seen_mirrored += flipped and sided_caption
                seen_plain += not flipped and sided_caption
    assert seen_mirrored and seen_plain

    off = build_trainer(config(tmp_path, sided, 0.0), tmp_path / "off", prepare_data(config(tmp_path, sided, 0.0)))
    assert off.data.train_feats_mirrored is None and not off.mirrored_ids
    for batch in off.epoch_batches(0)[:3]:
        assert torch.equal(off.host_tensors(batch)["feats"].float(), plain[[off.examples[i][0] for i in batch]])
    # the same model and batch: the loss the two trainers train on differs where images are mirrored
    off.model.load_state_dict(trainer.model.state_dict())
    batch = next(b for b in trainer.epoch_batches(0) if trainer.epoch_mirrored[[trainer.examples[i][0] for i in b]].any())
    trainer.model.eval(), off.model.eval()
    with torch.no_grad():
        assert trainer.batch_loss(batch)[0] != off.batch_loss(batch)[0]


def test_self_critical_rewards_swap_a_mirrored_samples_sides_back():
    words = ["a", "dog", "on", "the", "left", "right", "grass"]
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + words)
    refs = {0: [["a", "dog", "on", "the", "left"], ["a", "dog", "on", "the", "grass"]],
            1: [["a", "dog", "on", "the", "grass"]]}
    sc = SelfCritical(refs, vocab, samples=2, baseline="mean")
    say = [[vocab.words.index(w) for w in "a dog on the right".split()],
           [vocab.words.index(w) for w in "a dog on the left".split()]]
    cider = CiderD(refs)
    # the mirror image's "right" is the photo's "left"
    assert sc.rewards([0, 0], say, [True, False]) == [cider.score(0, "a dog on the left".split())] * 2
    assert sc.rewards([0, 0], say) == [cider.score(0, "a dog on the right".split()),
                                       cider.score(0, "a dog on the left".split())]


def test_a_run_with_flip_trains_and_records_it(sided, tmp_path):
    train(config_file(tmp_path, sided, 1.0, epochs=1), out=tmp_path / "run", progress=False)
    assert read_config(tmp_path / "run" / "best")["train"]["train"]["flip"] == 1.0
    with pytest.raises(ConfigError, match=r"train.flip must be in \[0, 1\], got 1.5"):
        config(tmp_path, sided, 1.5)


def test_self_critical_training_gets_the_mirror_features_and_flags(sided, tmp_path):
    path = config_file(tmp_path, sided, 0.5)
    path.write_text(path.read_text().replace("[train]", '[train]\nobjective = "scst"\nsamples = 2\nscst_baseline = "mean"', 1))
    cfg = RunConfig.load(path)
    trainer = build_trainer(cfg, tmp_path / "run", prepare_data(cfg))
    seen = []
    stats = SelfCriticalStats(torch.zeros(()), None)
    trainer.scst.loss = lambda model, feats, keys, mirrored=None: (seen.append((feats, keys, mirrored)),
                                                                    (torch.zeros(()), stats))[1]
    batch = trainer.epoch_batches(1)[0]
    trainer.batch_loss(batch)
    feats, keys, mirrored = seen[0]
    assert keys == batch and mirrored == trainer.epoch_mirrored[batch].tolist() and any(mirrored)
    rows = torch.tensor(batch)
    flip = trainer.epoch_mirrored[rows]
    torch.testing.assert_close(feats[flip], trainer.data.train_feats_mirrored.select(rows[flip]).float())
    torch.testing.assert_close(feats[~flip], trainer.data.train_feats.select(rows[~flip]).float())
