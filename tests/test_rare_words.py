"""The rare-word bonus (issue 32, item 3; docs/decoding-controls.md): ``--rare-word-bonus B``
adds B * ln(rank / 30) to the log-probability of every word rarer than the 30 most frequent of
a word vocabulary (whose ids are in frequency order), in the one decoding core. A bonus of 0
decodes as before (tests/test_controls.py's neutral controls); a bonus flips a choice between a
frequent word and a rarer one exactly where the gain passes the model's margin; reported
log-probabilities stay the model's own; tokenizers whose ids are not frequency ranks are refused
in one line; the option reaches the command line, an ensemble folder's rules and the server."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch
from helpers import write_picky_decoder

from captionkit.cli.main import main
from captionkit.core.errors import UserError
from captionkit.data.tokenizers import build_tokenizer
from captionkit.data.vocab import SPECIALS, Vocab
from captionkit.inference.captioner import Captioner
from captionkit.inference.controls import RARE_FROM, Controls, parse_fields
from captionkit.inference.decoding import beam_nbest, decode_lists, greedy
from captionkit.inference.shaping import rare_word_bonus
from captionkit.models.base import KVMemory

V = 140  # ids 4..139: ranks 1..136
COMMON, RARE = 4, 133  # ranks 1 and 130: the bonus gives RARE B * ln(130 / 30) = 1.466 B


def test_the_bonus_is_b_times_the_log_rank_beyond_the_30th():
    gain = rare_word_bonus(2.0, V, torch.device("cpu"))
    assert gain.shape == (V,) and gain.dtype == torch.float32
    assert torch.all(gain[:len(SPECIALS)] == 0)  # <pad> <start> <end> <unk>
    ranks = torch.arange(V) - 3
    assert torch.all(gain[(ranks <= RARE_FROM) & (ranks >= 1)] == 0)  # the 30 most frequent words
    assert float(gain[3 + RARE_FROM]) == 0 and float(gain[3 + RARE_FROM + 1]) > 0
    assert float(gain[3 + 90]) == pytest.approx(2.0 * math.log(3.0))  # rank 90: three times rarer than the 30th
    assert torch.all(gain[3 + RARE_FROM + 1:].diff() > 0)  # rarer, more


class TwoWayDecoder(torch.nn.Module):
    """After <start>: COMMON by a margin of ``margin`` (log-probabilities) over RARE, every other
    word far behind; then <end>. Each image the same."""

    attention_view = "weights"

    def __init__(self, margin: float):
        super().__init__()
        logits = torch.full((V, V), -20.0)
        logits[Vocab.start, COMMON], logits[Vocab.start, RARE] = 5.0, 5.0 - margin
        logits[COMMON, Vocab.end] = logits[RARE, Vocab.end] = 5.0
        self.register_buffer("logp", logits.log_softmax(1))
        self.cfg = SimpleNamespace(vocab_size=V, feat_dim=4)

    def prepare(self, x):
        return KVMemory([x], [])

    def init_state(self, mem):
        return (mem.keys[0][:, 0, :1].clone(),)

    def step(self, tokens, state, mem):
        x = mem.keys[0]
        return self.logp[tokens], state, x.new_zeros(x.shape[0], x.shape[1])


def first_words(caps) -> list[int]:
    return [c.ids[0] for c in caps]


@pytest.mark.parametrize("margin", [0.5, 1.0, 2.0])
def test_the_bonus_flips_a_choice_where_its_gain_passes_the_margin(margin):
    model, x = TwoWayDecoder(margin).eval(), torch.randn(3, 5, 4)
    gain = math.log(130 / 30)
    for bonus in (0.0, 0.3, 0.8, 1.2, 2.0):
        c = Controls(rare_word_bonus=bonus)
        want = RARE if bonus * gain > margin else COMMON
        assert first_words(greedy(model, x, 4, c)) == [want] * 3, (margin, bonus)
        assert first_words([caps[0] for caps in beam_nbest(model, x, 2, 2, 4, 0.0, c)]) == [want] * 3
        drawn = decode_lists(model, x, 1, 4, 0.0, c.with_options(sample=True, temperature=0))
        assert first_words([caps[0] for caps in drawn]) == [want] * 3  # temperature 0: greedy, with the bonus
        # what is reported is the model's own log-probability of the caption it chose
        cap = greedy(model, x, 4, c)[0]
        ids = [Vocab.start, *cap.ids, Vocab.end]
        assert cap.logprob == pytest.approx(sum(float(model.logp[a, b]) for a, b in zip(ids, ids[1:])), abs=1e-5)


def test_a_bonus_of_zero_and_words_of_the_first_30_ranks_change_nothing():
    model, x = TwoWayDecoder(1.0).eval(), torch.randn(2, 5, 4)
    plain = greedy(model, x, 4)
    assert [(c.ids, c.logprob) for c in greedy(model, x, 4, Controls(rare_word_bonus=0.0))] == \
        [(c.ids, c.logprob) for c in plain]
    assert not Controls(rare_word_bonus=0.0).shapes_steps and Controls(rare_word_bonus=0.1).shapes_steps


def test_values_and_tokenizers_that_do_not_fit_are_one_line():
    with pytest.raises(UserError, match="--rare-word-bonus must be a finite number >= 0, not -1"):
        Controls(rare_word_bonus=-1).check()
    for kind in ("char", "bpe", "lm"):
        with pytest.raises(UserError, match=f"this model's tokens are '{kind}' tokens"):
            Controls(rare_word_bonus=0.5).fit_tokens(kind)
        Controls(rare_word_bonus=0.0).fit_tokens(kind)  # none asked: nothing to refuse
    Controls(rare_word_bonus=0.5).fit_tokens("word")
    assert parse_fields({"rare_word_bonus": "0.5"}) == {"rare_word_bonus": 0.5}


# ---- through the Captioner, the command line and an ensemble's rules ---------------------------------
RARE_WORDS = [f"rare{i}" for i in range(40)]  # ranks 9..48 after the picky words


@pytest.fixture(scope="module")
def wide_models(tmp_path_factory):
    """Two picky checkpoints (captions that follow the pixels) of a 52-word vocabulary: the
    picky words, then 40 rarer ones."""
    root = tmp_path_factory.mktemp("wide")
    return [write_picky_decoder(root / f"m{seed}", seed, tuple(RARE_WORDS)) for seed in (0, 1)]


def rare_share(texts: list[str]) -> float:
    words = [w for t in texts for w in t.split()]
    return sum(w.startswith("rare") and int(w[4:]) + 9 > RARE_FROM for w in words) / max(len(words), 1)


def test_the_option_changes_captions_toward_rarer_words(wide_models, picky_data, tmp_path, capsys):
    photos = sorted((picky_data / "Flicker8k_Dataset").iterdir())
    cap = Captioner.load(str(wide_models[0]), device="cpu", precision="fp32")
    plain = [r.text for r in cap(photos)]
    favoured = [r.text for r in cap(photos, rare_word_bonus=3.0)]
    assert favoured != plain and rare_share(favoured) > rare_share(plain)
    # the command line: the same captions as the API
    out = []
    for i, extra in enumerate(([], ["--rare-word-bonus", "3"])):
        assert main(["caption", str(photos[0].parent), "--model", str(wide_models[0]), "--device", "cpu",
                     "--precision", "fp32", "--workers", "0", "--json", str(tmp_path / f"{i}.json"), *extra]) == 0
        out.append(json.loads((tmp_path / f"{i}.json").read_text()))
    capsys.readouterr()
    assert [out[0][p.name] for p in photos] == plain and [out[1][p.name] for p in photos] == favoured
    # a model whose tokens are characters refuses it, in one line, and decodes as before without it
    char = Captioner(cap.decoder, build_tokenizer("char", [["a", "b"]]), cap.config, encoder=cap.encoder)
    with pytest.raises(UserError, match="this model's tokens are 'char' tokens"):
        char(photos[0], rare_word_bonus=1.0)
    # and a config that sets it for such a model is refused when it loads, naming the config
    ruled = {**cap.config, "decoding": {**cap.config["decoding"], "rare_word_bonus": 0.5}}
    with pytest.raises(UserError, match="^the model's config: decoding: --rare-word-bonus .* 'char' tokens"):
        Captioner(cap.decoder, char.vocab, ruled, encoder=cap.encoder)
    assert Captioner(cap.decoder, cap.vocab, ruled, encoder=cap.encoder).controls.rare_word_bonus == 0.5


def test_an_ensemble_folder_may_set_it_and_a_flag_overrides_it(wide_models, picky_data, tmp_path, capsys):
    photos = sorted((picky_data / "Flicker8k_Dataset").iterdir())
    members = [str(m) for m in wide_models]
    ruled = Captioner.load_ensemble(members, rules={"rare_word_bonus": 3.0}, device="cpu", precision="fp32")
    plain = Captioner.load_ensemble(members, device="cpu", precision="fp32")
    assert [r.text for r in ruled(photos)] == [r.text for r in plain(photos, rare_word_bonus=3.0)] != \
        [r.text for r in plain(photos)]
    assert [r.text for r in ruled(photos, rare_word_bonus=0.0)] == [r.text for r in plain(photos)]
    folder = tmp_path / "ens"
    assert main(["ensemble", "--model", members[0], "--model", members[1], "--rare-word-bonus", "3",
                 "--out", str(folder)]) == 0
    capsys.readouterr()
    assert [r.text for r in Captioner.load(str(folder), device="cpu", precision="fp32")(photos)] == \
        [r.text for r in ruled(photos)]
