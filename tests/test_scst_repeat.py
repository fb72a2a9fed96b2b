"""Self-critical training's repetition term (issue 32, item 3): a sampled caption that repeats a
content phrase ("a boat is riding a boat") is rewarded train.scst_repeat_penalty less."""

from __future__ import annotations

import pytest

from captionkit.core.errors import UserError
from captionkit.data.vocab import Vocab
from captionkit.scoring.metrics import CiderD
from captionkit.training.config import ConfigError, RunConfig
from captionkit.training.run import build_trainer
from captionkit.training.scst import SelfCritical
from captionkit.training.stages import prepare_data

WORDS = ["a", "boat", "is", "riding", "in", "the", "water", "dog", "runs"]
REFS = {0: [["a", "boat", "is", "riding", "in", "the", "water"], ["a", "boat", "in", "the", "water"]],
        1: [["a", "dog", "runs", "in", "the", "water"], ["a", "dog", "is", "in", "the", "water"]]}


def ids(vocab: Vocab, text: str) -> list[int]:
    return [vocab.words.index(w) for w in text.split()]


def test_a_caption_that_repeats_a_content_phrase_loses_the_penalty():
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + WORDS)
    captions = ["a boat is riding a boat in the water",  # repeats "a boat"
                "a boat is riding in the water",
                "a dog runs in the water in the water",  # repeats "the water" (and "in the")
                "a dog runs in a water in a dog"]  # repeats "a dog"; "in a" alone would not count
    keys, seqs = [0, 0, 1, 1], [ids(vocab, c) for c in captions]
    cider = CiderD(REFS)
    plain = [cider.score(k, c.split()) for k, c in zip(keys, captions)]
    assert SelfCritical(REFS, vocab, samples=2, baseline="mean").rewards(keys, seqs) == plain
    assert plain[0] > 0  # CIDEr-D pays the loop: what the term takes back
    got = SelfCritical(REFS, vocab, samples=2, baseline="mean", repeat_penalty=0.5).rewards(keys, seqs)
    assert got == pytest.approx([plain[0] - 0.5, plain[1], plain[2] - 0.5, plain[3] - 0.5])
    with pytest.raises(UserError, match="repeat penalty must be a number >= 0"):
        SelfCritical(REFS, vocab, repeat_penalty=-1.0)


def test_the_run_config_sets_the_penalty(tiny_config, tmp_path):
    def config(line: str) -> RunConfig:
        path = tmp_path / "scst.toml"
        path.write_text(tiny_config.read_text().replace(
            "[train]", f'[train]\nobjective = "scst"\nsamples = 2\nscst_baseline = "mean"\n{line}\n', 1))
        return RunConfig.load(path)

    cfg = config("scst_repeat_penalty = 0.25")
    assert build_trainer(cfg, tmp_path / "run", prepare_data(cfg)).scst.repeat_penalty == 0.25
    assert config("").train.scst_repeat_penalty == 0.0
    with pytest.raises(ConfigError, match="train.scst_repeat_penalty must be >= 0"):
        config("scst_repeat_penalty = -0.5")
    xe = tmp_path / "xe.toml"  # outside self-critical training it would be silently unused
    xe.write_text(tiny_config.read_text().replace("[train]", "[train]\nscst_repeat_penalty = 0.25\n", 1))
    with pytest.raises(ConfigError, match='train.scst_repeat_penalty is a self-critical reward: it needs '
                                          'train.objective = "scst"'):
        RunConfig.load(xe)
