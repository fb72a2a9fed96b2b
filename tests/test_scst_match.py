"""Self-critical training's discriminability term (issue 32, item 3): with train.scst_matcher and
train.scst_match_weight W, each caption's reward gains W times the matcher's discriminability of
the caption for its photo (Luo et al. 2018). W = 0 is the plain reward; the term is what the
matcher says of the same captions; a run trains differently with it; mistakes are one line."""

from __future__ import annotations

import math

import pytest
import torch
from meta_models import features, tiny_model

from captionkit.core.checkpoint import CheckpointError, read_weights
from captionkit.data.vocab import SPECIALS, Vocab
from captionkit.models.matcher import Matcher, MatcherConfig
from captionkit.training.config import ConfigError, RunConfig
from captionkit.training.matcher import train_matcher
from captionkit.training.run import build_trainer, train
from captionkit.training.scst import SelfCritical, sample
from captionkit.training.stages import prepare_data

WORDS = ["a", "dog", "cat", "runs", "sits", "on", "the", "grass", "mat"]
VOCAB = Vocab(list(SPECIALS) + WORDS[:8])  # 12 words: meta_models' tiny sat
REFS = {0: [["a", "dog", "runs", "on", "the", "grass"]], 1: [["a", "cat", "sits", "on", "the", "grass"]]}


def random_matcher(feat_dim: int, seed: int = 0) -> Matcher:
    torch.manual_seed(seed)
    m = Matcher(MatcherConfig(words=["<pad>", "<unk>"] + WORDS, feat_dim=feat_dim, embed_dim=8, word_dim=4,
                              dropout=0.0, bank_size=6))
    m.bank.copy_(torch.nn.functional.normalize(torch.randn(6, 8), dim=-1))
    return m.eval()


@pytest.fixture
def sat(request):
    return tiny_model("sat", request.getfixturevalue).eval()


def scst_loss(sat, feats, baseline: str, matcher=None, weight: float = 0.0):
    torch.manual_seed(3)  # the same samples for every call
    sc = SelfCritical(REFS, VOCAB, samples=3, max_len=6, baseline=baseline, matcher=matcher, match_weight=weight)
    return sc.loss(sat, feats, [0, 1])


@pytest.mark.parametrize("baseline", ["greedy", "mean"])
def test_weight_zero_is_the_plain_reward_and_a_weight_adds_the_matcher_s_discriminability(sat, baseline):
    feats = features(sat, 2, torch.device("cpu"))  # (2, L, D)
    m = random_matcher(sat.cfg.feat_dim)
    plain_loss, plain = scst_loss(sat, feats, baseline)
    zero_loss, zero = scst_loss(sat, feats, baseline, m, 0.0)
    assert torch.equal(plain_loss, zero_loss) and torch.equal(plain.sample_reward, zero.sample_reward)

    torch.manual_seed(3)
    seqs = [[w for w in row if w not in (Vocab.end, Vocab.pad)] for row in sample(sat, feats, 3, 6).tolist()]
    texts = [" ".join(VOCAB.decode(s)) for s in seqs]
    disc = m.discriminability(m.image(feats).repeat_interleave(3, 0), m.text(texts))  # (6,)
    sc = SelfCritical(REFS, VOCAB, samples=3, matcher=m, match_weight=1.0)
    assert torch.allclose(sc.discriminability(feats, seqs, 3), disc)
    _, with_term = scst_loss(sat, feats, baseline, m, 0.5)
    assert with_term.sample_reward.item() == pytest.approx(plain.sample_reward.item() + 0.5 * disc.mean().item(),
                                                           abs=1e-6)
    if baseline == "greedy":  # the baseline's captions gain their own term
        assert with_term.greedy_reward.item() != pytest.approx(plain.greedy_reward.item(), abs=1e-6)
    with pytest.raises(Exception, match="match weight must be a finite number >= 0"):
        SelfCritical(REFS, VOCAB, matcher=m, match_weight=-1.0)


def test_the_unpacked_text_tower_equals_the_packed_one():
    """Matcher.text_on_device (no packing: no host read) gives text_ids' embeddings, for captions
    of every length in one batch, padding included."""
    m = random_matcher(5, seed=2)
    captions = ["a", "a dog", "a dog runs on the grass", "the cat sits on the mat", "grass", "zebra zebra"]
    ids = m.ids(captions)  # (6, T), 0-padded
    assert torch.allclose(m.text_on_device(ids), m.text_ids(ids), atol=1e-6)
    assert torch.allclose(m.text_on_device(ids[2:3]), m.text_ids(ids)[2:3], atol=1e-6)


def test_the_term_prefers_the_caption_the_matcher_ties_to_the_photo():
    """Two photos, a matcher whose text side is trained into agreement with them: a caption's
    reward under the term is higher for the photo it matches than for the other."""
    m = random_matcher(4, seed=1)
    feats = torch.eye(4)[:2].unsqueeze(1).expand(2, 3, 4).clone()  # (2, 3, 4): two distinct photos
    dog, cat = [VOCAB.words.index(w) for w in "a dog runs".split()], [VOCAB.words.index(w) for w in "a cat sits".split()]
    opt = torch.optim.Adam(m.parameters(), lr=0.05)
    m.requires_grad_(True).train()
    for _ in range(60):  # photo 0 <-> "a dog runs", photo 1 <-> "a cat sits"
        loss = m.contrastive_loss(m.image(feats), m.text(["a dog runs", "a cat sits"]))
        opt.zero_grad()
        loss.backward()
        opt.step()
    sc = SelfCritical(REFS, VOCAB, samples=1, matcher=m, match_weight=1.0)  # (frozen, eval mode)
    d = sc.discriminability(feats, [dog, cat], 1)
    swapped = sc.discriminability(feats, [cat, dog], 1)
    assert (d > swapped).all() and not m.training and not any(p.requires_grad for p in m.parameters())


# ---- the run config and a run ------------------------------------------------------------------
def scst_config(tiny_config, tmp_path, lines: str, init=None):
    """The tiny config as a self-critical run with ``lines`` added to [train] (a path);
    ``init``: starting from that checkpoint (its model: the [model] table goes)."""
    text = tiny_config.read_text()
    if init is not None:
        head, _, rest = text.partition("[model]")
        text = head + rest[rest.index("[train]"):]
        lines = f'init = "{init}"\n{lines}'
    path = tmp_path / f"scst{abs(hash(lines))}.toml"
    path.write_text(text.replace("[train]", f'[train]\nobjective = "scst"\nsamples = 2\nscst_baseline = "mean"\n'
                                            f'{lines}\n', 1))
    return path


def test_the_run_config_checks_the_term(tiny_config, tiny_matcher, tmp_path):
    cfg = RunConfig.load(scst_config(tiny_config, tmp_path, f'scst_matcher = "{tiny_matcher}"\nscst_match_weight = 0.2'))
    trainer = build_trainer(cfg, tmp_path / "run", prepare_data(cfg))
    assert trainer.scst.match_weight == 0.2 and isinstance(trainer.scst.matcher, Matcher)
    assert RunConfig.load(scst_config(tiny_config, tmp_path, "")).train.scst_match_weight == 0.0
    with pytest.raises(ConfigError, match="train.scst_match_weight needs train.scst_matcher"):
        RunConfig.load(scst_config(tiny_config, tmp_path, "scst_match_weight = 0.2"))
    with pytest.raises(ConfigError, match="train.scst_match_weight must be >= 0"):
        RunConfig.load(scst_config(tiny_config, tmp_path, f'scst_matcher = "{tiny_matcher}"\nscst_match_weight = -1'))
    with pytest.raises(ConfigError, match="train.scst_matcher reads the encoder's cached rows"):
        RunConfig.load(scst_config(tiny_config, tmp_path, f'scst_matcher = "{tiny_matcher}"\nfinetune_blocks = 1'))
    path = tmp_path / "xe.toml"
    path.write_text(tiny_config.read_text().replace("[train]", f'[train]\nscst_matcher = "{tiny_matcher}"', 1))
    with pytest.raises(ConfigError, match='needs train.objective = "scst"'):
        RunConfig.load(path)


def test_a_folder_that_is_not_a_matcher_is_one_line_before_any_work(tiny_config, tiny_run, tmp_path,
                                                                     no_expensive_work):
    config = scst_config(tiny_config, tmp_path, f'scst_matcher = "{tiny_run / "best"}"\nscst_match_weight = 0.2')
    with pytest.raises(CheckpointError, match="not a matcher checkpoint"):
        train(config, out=tmp_path / "run", progress=False)


def test_a_matcher_of_another_encoder_is_refused_naming_it(tiny_config, picky_data, tmp_path, tmp_path_factory):
    other = tmp_path_factory.mktemp("other_matcher") / "m"
    train_matcher(str(picky_data), other, encoder="patches", epochs=1, embed_dim=8, word_dim=4, min_count=1,
                  bank_size=2, batch_size=4)
    cfg = RunConfig.load(scst_config(tiny_config, tmp_path, f'scst_matcher = "{other}"\nscst_match_weight = 0.2'))
    with pytest.raises(ConfigError, match=f"train.scst_matcher: {other} is a matcher of patches"):
        build_trainer(cfg, tmp_path / "run", prepare_data(cfg))


@pytest.mark.slow  # three short self-critical runs
def test_the_term_changes_what_a_run_learns_and_weight_zero_does_not(tiny_config, tiny_run, tiny_matcher, tmp_path):
    def run(name: str, lines: str) -> dict:
        train(scst_config(tiny_config, tmp_path, lines, init=tiny_run / "best"), out=tmp_path / name, max_steps=2, progress=False)
        return read_weights(tmp_path / name / "last")

    plain = run("plain", "")
    zero = run("zero", f'scst_matcher = "{tiny_matcher}"\nscst_match_weight = 0.0')
    term = run("term", f'scst_matcher = "{tiny_matcher}"\nscst_match_weight = 5.0')
    assert all(torch.equal(plain[k], zero[k]) for k in plain)
    assert any(not torch.equal(plain[k], term[k]) for k in plain)
    assert all(math.isfinite(v.float().abs().max().item()) for v in term.values())
