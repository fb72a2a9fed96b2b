"""Self-critical training's BLEU and METEOR terms (issue 32, item 3): each sampled caption's
reward gains train.scst_bleu_weight times its sentence BLEU-4 (scoring.metrics.SentenceBleu) and
train.scst_meteor_weight times its METEOR 1.5 (the jar: scoring.evaluation.sentence_meteor)."""

from __future__ import annotations

import math
import random

import pytest
from helpers import needs_java

from captionkit.core.errors import UserError
from captionkit.data.vocab import Vocab
from captionkit.scoring import evaluation as ev
from captionkit.scoring.metrics import CiderD, SentenceBleu, bleu_stats
from captionkit.training import config as config_module
from captionkit.training.config import ConfigError, RunConfig
from captionkit.training.run import build_trainer
from captionkit.training.scst import SelfCritical
from captionkit.training.stages import prepare_data

WORDS = ["a", "boat", "is", "riding", "in", "the", "water", "dog", "runs"]
REFS = {0: [["a", "boat", "is", "riding", "in", "the", "water"], ["a", "boat", "in", "the", "water"]],
        1: [["a", "dog", "runs", "in", "the", "water"], ["a", "dog", "is", "in", "the", "water"]]}


def test_unsmoothed_sentence_bleu_is_the_corpus_bleu_of_one_sentence():
    rng = random.Random(0)
    words = "a dog runs on the grass in park with ball red man".split()
    refs = {str(i): [" ".join(rng.choices(words, k=rng.randint(3, 12))) for _ in range(5)] for i in range(400)}
    cands = {}
    for k, rs in refs.items():  # a piece of a reference with words changed, so that most share 4-grams
        cand = rng.choice(rs).split()[rng.randint(0, 2):]
        for _ in range(rng.randint(0, 3)):
            cand[rng.randrange(len(cand))] = rng.choice(words)
        cands[k] = " ".join(cand + rng.choices(words, k=rng.randint(0, 3)))
    bleu = SentenceBleu({k: [r.split() for r in rs] for k, rs in refs.items()}, smooth=False)
    compared = 0
    for k in refs:
        stats = bleu_stats({k: cands[k]}, {k: refs[k]})
        if stats.correct.min() > 0:  # coco-caption's guards give a few 1e-6 where an order has no match
            assert bleu.score(k, cands[k].split()) == pytest.approx(stats.corpus()[3], abs=1e-9)
            compared += 1
        else:
            assert bleu.score(k, cands[k].split()) == 0.0
    assert compared >= 100


def test_smoothing_adds_one_to_the_higher_orders():
    bleu = SentenceBleu(REFS)
    # "a dog in the water" (5 words) against image 1: unigrams 5/5, bigrams 3/4 ("a dog", "in the",
    # "the water"), trigrams 1/3 ("in the water"), 4-grams 0/2; closest reference 6 words
    want = math.exp(1 - 6 / 5) * (1.0 * (4 / 5) * (2 / 4) * (1 / 3)) ** 0.25
    assert bleu.score(1, "a dog in the water".split()) == pytest.approx(want)
    assert SentenceBleu(REFS, smooth=False).score(1, "a dog in the water".split()) == 0.0
    assert bleu.score(0, "a boat is riding in the water".split()) == pytest.approx(1.0)  # a reference itself
    assert bleu.score(0, []) == 0.0
    # clipped: "water" is in a reference once, so the second one does not match
    assert bleu.score(1, ["water", "water"]) == pytest.approx(math.exp(1 - 6 / 2) * (0.5 * 1 / 2) ** 0.25)


def ids(vocab: Vocab, text: str) -> list[int]:
    return [vocab.words.index(w) for w in text.split()]


def test_the_reward_is_cider_d_plus_the_weighted_bleu():
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + WORDS)
    captions = ["a boat is riding in the water", "a boat in water", "a dog runs in the water", "dog water"]
    keys, seqs = [0, 0, 1, 1], [ids(vocab, c) for c in captions]
    cider, bleu = CiderD(REFS), SentenceBleu(REFS)
    plain = [cider.score(k, c.split()) for k, c in zip(keys, captions)]
    assert SelfCritical(REFS, vocab, samples=2, baseline="mean").rewards(keys, seqs) == plain
    got = SelfCritical(REFS, vocab, samples=2, baseline="mean", bleu_weight=0.5).rewards(keys, seqs)
    want = [p + 0.5 * bleu.score(k, c.split()) for p, k, c in zip(plain, keys, captions)]
    assert got == pytest.approx(want)
    assert got[1] - plain[1] < got[0] - plain[0]  # the term ranks the captions by their BLEU
    with pytest.raises(UserError, match="BLEU weight must be a finite number >= 0"):
        SelfCritical(REFS, vocab, bleu_weight=-1.0)


def test_the_run_config_sets_the_weight(tiny_config, tmp_path):
    def config(lines: str) -> RunConfig:
        path = tmp_path / "scst.toml"
        path.write_text(tiny_config.read_text().replace("[train]", f"[train]\n{lines}\n", 1))
        return RunConfig.load(path)

    scst = 'objective = "scst"\nsamples = 2\nscst_baseline = "mean"\n'
    cfg = config(scst + "scst_bleu_weight = 0.75")
    assert build_trainer(cfg, tmp_path / "run", prepare_data(cfg)).scst.bleu_weight == 0.75
    assert config(scst).train.scst_bleu_weight == 0.0
    with pytest.raises(ConfigError, match="train.scst_bleu_weight must be >= 0"):
        config(scst + "scst_bleu_weight = -0.5")
    with pytest.raises(ConfigError, match='train.scst_bleu_weight is a self-critical reward: it needs '
                                          'train.objective = "scst"'):
        config("scst_bleu_weight = 1.0")


@needs_java
@pytest.mark.slow  # the METEOR jar
def test_the_reward_is_cider_d_plus_the_weighted_meteor_of_the_jar():
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + WORDS)
    captions = ["a boat is riding in the water", "a boat in water", "a dog runs in the water", "dog water", ""]
    keys, seqs = [0, 0, 1, 1, 1], [ids(vocab, c) for c in captions]
    plain = SelfCritical(REFS, vocab, samples=2, baseline="mean").rewards(keys, seqs)
    got = SelfCritical(REFS, vocab, samples=2, baseline="mean", meteor_weight=2.0).rewards(keys, seqs)
    # each caption's METEOR is the jar's segment score of it against its own image's references
    refs = {k: [" ".join(r) for r in rs] for k, rs in REFS.items()}
    _, per, _ = ev.meteor_jar({str(i): c for i, c in enumerate(captions)},
                              {str(i): refs[k] for i, k in enumerate(keys)})
    assert got == pytest.approx([p + 2.0 * m for p, m in zip(plain, per)])
    assert per[0] > per[1] > 0 and per[2] > per[3] > 0 and per[4] == 0.0  # an empty sample scores 0
    assert list(ev.sentence_meteor(captions, [refs[k] for k in keys])) == list(per)
    with pytest.raises(UserError, match="METEOR weight must be a finite number >= 0"):
        SelfCritical(REFS, vocab, meteor_weight=float("nan"))


def test_the_meteor_weight_is_checked_at_load_java_included(tiny_config, tmp_path, monkeypatch):
    def config(lines: str) -> RunConfig:
        path = tmp_path / "scst.toml"
        path.write_text(tiny_config.read_text().replace("[train]", f"[train]\n{lines}\n", 1))
        return RunConfig.load(path)

    scst = 'objective = "scst"\nsamples = 2\nscst_baseline = "mean"\n'
    monkeypatch.setattr(config_module, "java_available", lambda: True)
    cfg = config(scst + "scst_meteor_weight = 1.5")
    assert build_trainer(cfg, tmp_path / "run", prepare_data(cfg)).scst.meteor_weight == 1.5
    assert config(scst).train.scst_meteor_weight == 0.0
    with pytest.raises(ConfigError, match="train.scst_meteor_weight must be >= 0"):
        config(scst + "scst_meteor_weight = -1")
    with pytest.raises(ConfigError, match="train.scst_meteor_weight is a self-critical reward"):
        config("scst_meteor_weight = 1.0")
    monkeypatch.setattr(config_module, "java_available", lambda: False)
    with pytest.raises(ConfigError, match=r"train.scst_meteor_weight .*needs Java for the METEOR 1.5 jar"):
        config(scst + "scst_meteor_weight = 1.5")
    assert config(scst).train.scst_meteor_weight == 0.0  # no term, no Java needed
