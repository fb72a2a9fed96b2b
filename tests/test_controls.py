"""Caption controls (issue 32, item 2; docs/decoding-controls.md): n-gram blocking, the repetition
penalty, minimum and maximum words, sampling (temperature, top-k, top-p, seed), K captions per
image (sampling, the beam's n best, diverse beam search), in the one decoding core
(captionkit.inference.decoding) and everywhere it is reached: the Captioner and the Python API,
caption and evaluate, their JSON/JSONL/CSV outputs, the server, an ONNX export.

Equivalences are exact: neutral controls decode what decoding did before them (the reference
implementations of tests/test_beam_search.py and greedy as it was), sampling at temperature 0
is greedy, one caption is today's caption, diverse beam search of one group is beam search.
Behaviour is shown on crafted decoders whose next word is a table of the last one (a loop of
"a boat is riding a boat ..."), and on the random decoders of the beam search tests."""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from types import SimpleNamespace

import pytest
import torch
from test_beam_search import GRID, FEAT, ensemble, reference_beam_nbest, sat, transformer

from captionkit.cli.main import main
from captionkit.core.errors import UserError
from captionkit.data.vocab import Vocab
from captionkit.inference.captioner import Captioner
from captionkit.inference.controls import Controls, parse_fields
from captionkit.inference.decoding import (Caption, allowed_words, beam_nbest, decode, decode_lists, greedy,
                                           select_rows)
from captionkit.inference.shaping import Sampler
from captionkit.models.base import KVMemory

MODELS = {"sat": sat, "transformer": transformer, "ensemble": ensemble}


def feats(n: int, seed: int = 0) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(n, GRID[0] * GRID[1], FEAT) * 2


@torch.no_grad()
def reference_greedy(model, x: torch.Tensor, max_len: int) -> list[Caption]:
    """Greedy decoding as it was before the controls (the loop, one caption per image)."""
    B = x.shape[0]
    mem = model.prepare(x)
    state = model.init_state(mem)
    tokens = torch.full((B,), Vocab.start, dtype=torch.long)
    words, alphas, total = [], [], torch.zeros(B)
    alive = torch.ones(B, dtype=torch.bool)
    for t in range(max_len + 1):
        logp, state, alpha = model.step(tokens, state, mem)
        best, tokens = allowed_words(logp, t == max_len).max(1)
        total += torch.where(alive, best, torch.zeros_like(best))
        words.append(tokens)
        alphas.append(alpha)
        alive &= tokens != Vocab.end
        if not alive.any():
            break
    W, Al = torch.stack(words, 1), torch.stack(alphas, 1)
    out = []
    for b in range(B):
        ids = W[b].tolist()
        n = ids.index(Vocab.end)
        out.append(Caption(ids[:n], Al[b, :n].clone(), float(total[b])))
    return out


def same(got: list[Caption], want: list[Caption]) -> bool:
    return [(c.ids, c.logprob) for c in got] == [(c.ids, c.logprob) for c in want] and \
        all(torch.equal(g.attention, w.attention) for g, w in zip(got, want))


# ---- crafted decoders: the next word is a table of the last one --------------------------------
WORDS = ["<pad>", "<start>", "<end>", "<unk>", "a", "boat", "is", "riding", "in", "the", "water"]
W = {w: i for i, w in enumerate(WORDS)}


class TableDecoder(torch.nn.Module):
    """A step-contract decoder whose log-probabilities depend on the last word only: rows of
    ``table`` {last: {next: logit}} (others -5), the same for every image."""

    attention_view = "weights"

    def __init__(self, table: dict[str, dict[str, float]]):
        super().__init__()
        logits = torch.full((len(WORDS), len(WORDS)), -5.0)
        for last, nexts in table.items():
            for word, v in nexts.items():
                logits[W[last], W[word]] = v
        self.register_buffer("logp", logits.log_softmax(1))
        self.cfg = SimpleNamespace(vocab_size=len(WORDS), feat_dim=FEAT)

    def prepare(self, x):
        return KVMemory([x], [])

    def init_state(self, mem):
        return (mem.keys[0][:, 0, :1].clone(),)  # (B, 1): a state to carry

    def step(self, tokens, state, mem):
        x = mem.keys[0]
        return self.logp[tokens], state, x.new_zeros(x.shape[0], x.shape[1])


# argmax: a boat is riding a boat is riding ...; second choices lead to "the water" and an end
LOOP = TableDecoder({"<start>": {"a": 5}, "a": {"boat": 5, "the": 3}, "boat": {"is": 5, "<end>": 1},
                     "is": {"riding": 5, "in": 3}, "riding": {"a": 5, "the": 4}, "the": {"water": 5},
                     "water": {"<end>": 5}, "in": {"the": 5}}).eval()
# a loop beam search keeps too: its one cheap way out, "the water", loops on "in the water"
TRAP = TableDecoder({"<start>": {"a": 5}, "a": {"boat": 5, "the": 3}, "boat": {"is": 5, "<end>": 1},
                     "is": {"riding": 5, "in": 3}, "riding": {"a": 5, "the": 4}, "the": {"water": 5},
                     "water": {"<end>": 2, "in": 4}, "in": {"the": 5}}).eval()
# argmax: "a boat", then <end>; each word's second choice goes on
SHORT = TableDecoder({"<start>": {"a": 5}, "a": {"boat": 5}, "boat": {"<end>": 5, "is": 4},
                      "is": {"<end>": 5, "riding": 4}, "riding": {"<end>": 5, "in": 4},
                      "in": {"<end>": 5, "the": 4}, "the": {"<end>": 5, "water": 4},
                      "water": {"<end>": 5}}).eval()


def words(cap: Caption) -> list[str]:
    return [WORDS[i] for i in cap.ids]


def repeated_bigrams(ws: list[str]) -> list[tuple[str, str]]:
    grams = Counter(zip(ws, ws[1:]))
    return [g for g, n in grams.items() if n > 1]


# ---- equivalences (exact) ----------------------------------------------------------------------
NEUTRAL = [Controls(), Controls(no_repeat_ngram=0), Controls(repetition_penalty=1.0), Controls(rare_word_bonus=0.0),
           Controls(num_captions=1),
           Controls(beam_groups=1, diversity_strength=3.0), Controls(min_words=0, max_words=50),
           # the shaped code path (rules on, model log-probabilities kept apart), with a rule that never fires
           Controls(no_repeat_ngram=40, repetition_penalty=1.0)]


@pytest.mark.parametrize("family", sorted(MODELS))
def test_neutral_controls_decode_as_before(family):
    """Blocking of size 0, a penalty of 1, one caption, one group, a rule that never fires:
    greedy and beam search (n-best included) give exactly what they gave before the controls
    (captions, their order, log-probabilities, attention)."""
    model, x = MODELS[family](2), feats(3, 2)
    want_greedy = reference_greedy(model, x, 7)
    want_beam = reference_beam_nbest(model, x, 3, 3, 7, 0.0)
    want_lp = reference_beam_nbest(model, x, 1, 3, 7, 0.7)
    for c in NEUTRAL:
        assert same(greedy(model, x, 7, c), want_greedy), c
        assert same(decode(model, x, 1, 7, 0.0, c), want_greedy), c
        got = beam_nbest(model, x, 3, 3, 7, 0.0, c)
        assert all(same(g, w) for g, w in zip(got, want_beam)), c
        assert same(decode(model, x, 3, 7, 0.7, c), [w[0] for w in want_lp]), c


@pytest.mark.parametrize("family", sorted(MODELS))
def test_sampling_at_temperature_zero_is_greedy(family):
    """--sample --temperature 0 draws the most probable word: greedy's captions, log-probabilities
    and attention, whatever the seed, top-k and top-p; and with the step rules, greedy's with them."""
    model, x = MODELS[family](3), feats(5, 3)
    want = reference_greedy(model, x, 8)
    for c in (Controls(sample=True, temperature=0), Controls(sample=True, temperature=0, seed=7, top_k=3, top_p=0.5)):
        assert same([caps[0] for caps in decode_lists(model, x, 1, 8, 0.0, c)], want)
    rules = Controls(no_repeat_ngram=2, repetition_penalty=1.3)
    assert same(decode(model, x, 1, 8, 0.0, rules.with_options(sample=True, temperature=0)),
                greedy(model, x, 8, rules))


def test_one_caption_is_todays_caption_and_one_group_is_beam_search():
    model, x = ensemble(4), feats(4, 4)
    want = reference_beam_nbest(model, x, 3, 3, 8, 0.0)
    assert same(decode(model, x, 3, 8, 0.0, Controls(num_captions=1)), [w[0] for w in want])
    for c in (Controls(num_captions=3), Controls(num_captions=3, beam_groups=1, diversity_strength=2.0)):
        assert all(same(g, w) for g, w in zip(decode_lists(model, x, 3, 8, 0.0, c), want))
    # K = 2 of a beam of 3: the first two of its n best
    assert all(same(g, w[:2]) for g, w in zip(decode_lists(model, x, 3, 8, 0.0, Controls(num_captions=2)), want))


# ---- each control changes the output -------------------------------------------------------------
def test_ngram_blocking_removes_the_repeated_bigram():
    x = feats(2)
    plain = greedy(LOOP, x, 12)[0]
    assert words(plain)[:8] == ["a", "boat", "is", "riding"] * 2 and repeated_bigrams(words(plain))
    blocked = greedy(LOOP, x, 12, Controls(no_repeat_ngram=2))[0]
    assert words(blocked) == ["a", "boat", "is", "riding", "a", "the", "water"]
    # beam search finds the way out of the first loop, not of the second; blocking does
    plain = beam_nbest(TRAP, x, 3, 3, 12, 0.0)[0]
    assert words(plain[0]) == ["a", "boat", "is", "riding", "the", "water", "in", "the", "water", "in", "the", "water"]
    blocked = beam_nbest(TRAP, x, 3, 3, 12, 0.0, Controls(no_repeat_ngram=2))
    assert words(blocked[0][0]) == ["a", "boat", "is", "riding", "the", "water"]
    assert all(not repeated_bigrams(words(c)) for caps in blocked for c in caps)  # every beam's own n-grams
    # n = 1: no word twice; n = 3: "a boat is riding a boat" may stay, "riding a boat is" may not
    once = greedy(LOOP, x, 12, Controls(no_repeat_ngram=1))[0]
    assert len(set(words(once))) == len(words(once))
    three = words(greedy(LOOP, x, 12, Controls(no_repeat_ngram=3))[0])
    assert not [g for g, n in Counter(zip(three, three[1:], three[2:])).items() if n > 1]
    # its log-probability is the model's own sum over the words it has
    cap = greedy(LOOP, x, 12, Controls(no_repeat_ngram=2))[0]
    ids = [Vocab.start, *cap.ids, Vocab.end]
    assert cap.logprob == pytest.approx(sum(float(LOOP.logp[a, b]) for a, b in zip(ids, ids[1:])), abs=1e-5)


def test_repetition_penalty_repeats_less():
    x = feats(1)
    for beam in (1, 3):
        penalised = words(decode(TRAP, x, beam, 12, 0.0, Controls(repetition_penalty=5.0))[0])
        plain = words(decode(TRAP, x, beam, 12)[0])
        assert len(penalised) - len(set(penalised)) < len(plain) - len(set(plain)), (beam, penalised)
    assert words(greedy(LOOP, x, 12, Controls(repetition_penalty=5.0))[0]) == \
        ["a", "boat", "is", "riding", "the", "water"]
    # a gentle penalty leaves the loop as it is ("a" after "riding" is much the more probable)
    assert words(greedy(LOOP, x, 12, Controls(repetition_penalty=1.1))[0]) == words(greedy(LOOP, x, 12)[0])


def test_min_and_max_words():
    x = feats(3)
    assert words(greedy(SHORT, x, 10)[0]) == ["a", "boat"]
    for beam in (1, 2):
        longer = decode(SHORT, x, beam, 10, 0.0, Controls(min_words=4))
        assert [words(c) for c in longer] == [["a", "boat", "is", "riding"]] * 3
    shorter = greedy(LOOP, x, 12, Controls(max_words=3))
    assert [words(c) for c in shorter] == [["a", "boat", "is"]] * 3
    assert all(len(c.ids) <= 3 for caps in beam_nbest(TRAP, x, 3, 3, 12, 0.0, Controls(max_words=3)) for c in caps)
    # max_words never goes beyond the model's own longest caption; min_words beyond it is refused
    assert len(greedy(LOOP, x, 5, Controls(max_words=50))[0].ids) == 5
    with pytest.raises(UserError, match="--min-words 7 is more than this model's longest caption, 5 words"):
        decode(LOOP, x, 1, 5, 0.0, Controls(min_words=7))


def test_every_word_blocked_ends_the_caption():
    """A row whose every word is blocked gets <end> back rather than a word of -inf."""
    x = feats(1)
    cap = greedy(LOOP, x, 30, Controls(no_repeat_ngram=1, min_words=8))[0]  # 8 distinct words are not there
    assert words(cap) == ["a", "boat", "is", "riding", "the", "water", "in"] and cap.logprob > float("-inf")


@pytest.mark.parametrize("family", ["sat", "ensemble"])
def test_a_seed_draws_the_same_captions_whatever_the_batch(family):
    """Sampling is reproducible: the same seed gives an image the same captions alone, in a batch
    of 3 or of 8, first or last; another seed gives other captions."""
    model, x = MODELS[family](5), feats(8, 5)
    c = Controls(sample=True, seed=11, num_captions=3)
    whole = decode_lists(model, x, 1, 9, 0.0, c)
    alone = decode_lists(model, x[5:6], 1, 9, 0.0, c)[0]
    three = decode_lists(model, x[[5, 0, 7]], 1, 9, 0.0, c)
    for got in (alone, three[0]):
        assert [g.ids for g in got] == [w.ids for w in whole[5]]
    assert [[c.ids for c in caps] for caps in three[1:]] == [[c.ids for c in whole[i]] for i in (0, 7)]
    other = decode_lists(model, x, 1, 9, 0.0, c.with_options(seed=12))
    assert [[c.ids for c in caps] for caps in other] != [[c.ids for c in caps] for caps in whole]
    # K captions: distinct (an image the model says little else of may have fewer after SAMPLE_ROUNDS
    # rounds of draws), and the first is the one caption of num_captions 1
    assert all(len({tuple(c.ids) for c in caps}) == len(caps) for caps in whole)
    assert sum(len(caps) == 3 for caps in whole) >= 7
    one = decode(model, x, 1, 9, 0.0, c.with_options(num_captions=1))
    assert [o.ids for o in one] == [caps[0].ids for caps in whole]


def test_sampler_draws_from_the_shaped_distribution():
    """The Gumbel-max draws follow softmax(logp / T), within the top-k and the nucleus."""
    R = 20000
    logp = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().expand(R, 4)
    keys, draws = torch.arange(R) % 97, torch.arange(R) // 97

    def freq(**options) -> list[float]:
        s = Sampler(Controls(sample=True, seed=3, **options), keys, draws, 4)
        n = torch.bincount(s.choose(logp, 0), minlength=4).float() / R
        return n.tolist()

    assert freq() == pytest.approx([0.5, 0.3, 0.15, 0.05], abs=0.015)
    hot = torch.tensor([0.5, 0.3, 0.15, 0.05]) ** 0.5
    assert freq(temperature=2.0) == pytest.approx((hot / hot.sum()).tolist(), abs=0.015)
    assert freq(top_k=2) == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0], abs=0.015)
    assert freq(top_p=0.7) == pytest.approx([0.5 / 0.8, 0.3 / 0.8, 0, 0], abs=0.015)  # 0.5 < 0.7: the 2nd too
    assert freq(top_p=0.5) == [1.0, 0, 0, 0]
    # the noise of a step is the same however its rows are batched; it differs between steps
    s = Sampler(Controls(sample=True, seed=3), keys[:5], draws[:5], 4)
    assert torch.equal(s.noise(2)[3], Sampler(Controls(sample=True, seed=3), keys[3:4], draws[3:4], 4).noise(2)[0])
    assert not torch.equal(s.noise(2), s.noise(3))


def test_nucleus_of_one_word_and_top_k_of_one_are_greedy():
    model, x = transformer(6), feats(4, 6)
    want = reference_greedy(model, x, 8)
    for c in (Controls(sample=True, seed=5, top_k=1), Controls(sample=True, seed=5, top_p=1e-6)):
        assert [cap.ids for cap in decode(model, x, 1, 8, 0.0, c)] == [w.ids for w in want]


def test_diverse_beam_search_gives_distinct_captions():
    """beam 6 in 3 groups: each image's captions are distinct, the first is group 0's (a plain
    beam search of width 2), and on some image the list differs from the beam's 3 best."""
    model, x = ensemble(7), feats(6, 7)
    c = Controls(num_captions=3, beam_groups=3, diversity_strength=2.0)
    lists = decode_lists(model, x, 6, 9, 0.0, c)
    assert all(len({tuple(cap.ids) for cap in caps}) == len(caps) for caps in lists)
    assert sum(len(caps) == 3 for caps in lists) >= 4
    assert same([caps[0] for caps in lists], [w[0] for w in reference_beam_nbest(model, x, 1, 2, 9, 0.0)])
    plain = beam_nbest(model, x, 3, 6, 9, 0.0)
    assert [[cap.ids for cap in caps] for caps in lists] != [[cap.ids for cap in caps] for caps in plain]
    # a strength of 0: the groups are alike, and the duplicates are dropped
    alike = decode_lists(model, x, 6, 9, 0.0, c.with_options(diversity_strength=0.0))
    assert [[cap.ids for cap in caps] for caps in alike] == \
        [[w.ids for w in ref] for ref in reference_beam_nbest(model, x, 2, 2, 9, 0.0)]


# ---- the values a user gives ---------------------------------------------------------------------
@pytest.mark.parametrize("controls, beam, message", [
    (Controls(sample=True, top_p=1.5), None, "--top-p must be more than 0 and at most 1, not 1.5"),
    (Controls(top_p=0.9), None, "--top-p is a sampling option: give --sample too"),
    (Controls(num_captions=4), 3, "--num-captions 4 takes the best of the beam: it needs --beam 4 or more, not 3"),
    (Controls(beam_groups=4), 6, "--beam 6 is not a multiple of 4"),
    (Controls(sample=True), 3, "--sample draws each word; --beam 3 is beam search's"),
    (Controls(sample=True, temperature=0, num_captions=2), None, "needs a temperature above 0"),
    (Controls(min_words=5, max_words=3), None, "--min-words 5 is more than --max-words 3"),
    (Controls(repetition_penalty=0.0), None, "--repetition-penalty must be a finite number > 0"),
    (Controls(sample=True, seed=2 ** 32), None, "--seed must be below 2\\*\\*32"),
])
def test_a_value_that_does_not_fit_is_one_line(controls, beam, message):
    with pytest.raises(UserError, match=message):
        controls.check(beam)


def test_cli_refuses_before_loading_anything(picky_data, no_expensive_work, capsys):
    photos = str(picky_data / "Flicker8k_Dataset")
    for argv, message in ((["--sample", "--top-p", "1.5"], "--top-p must be more than 0 and at most 1"),
                          (["--num-captions", "4"], "--num-captions 4 takes the best of the beam"),
                          (["--num-captions", "5", "--beam", "4"], "needs --beam 5 or more, not 4"),
                          (["--seed", "3"], "--seed is a --sample option: give --sample too"),
                          (["--diversity-strength", "1"], "--diversity-strength is a --beam-groups option"),
                          (["--sample", "--num-captions", "2", "--rerank", "mbr"], "does not go with --rerank")):
        assert main(["caption", photos, *argv]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    assert main(["evaluate", "--dataset", str(picky_data), "--sample", "--beam", "2"]) == 2
    assert "--beam 2 is beam search's" in capsys.readouterr().err


def test_server_fields_parse_or_refuse():
    assert parse_fields({"sample": "true", "top_p": "0.9", "seed": "4", "num_captions": "", "max_words": "7"}) == \
        {"sample": True, "top_p": 0.9, "seed": 4, "max_words": 7}
    for fields, message in (({"top_k": "2.5"}, "'top_k' must be an integer"), ({"sample": "maybe"}, "true or false"),
                            ({"temperature": "hot"}, "'temperature' must be a number")):
        with pytest.raises(UserError, match=message):
            parse_fields(fields)


# ---- through the Captioner, the API, the command line, the server, ONNX --------------------------
@pytest.fixture(scope="module")
def cap(picky_models) -> Captioner:
    return Captioner.load(str(picky_models[0]), device="cpu")


@pytest.fixture(scope="module")
def photos(picky_data) -> list:
    return sorted((picky_data / "Flicker8k_Dataset").iterdir())


def test_api_controls(cap, photos):
    """cap(images, **controls): one caption as before; K captions as a list with their
    log-probabilities; a seed's draws whatever the batch size; a bad value is one UserError."""
    before = [r.text for r in cap(photos)]
    assert [r.text for r in cap(photos, num_captions=1, no_repeat_ngram=0, repetition_penalty=1.0)] == before
    assert all(r.captions is None for r in cap(photos))
    several = cap(photos, num_captions=3)
    assert [r.text for r in several] == before
    assert all(r.captions[0] == r.text and len(set(r.captions)) == len(r.captions) == 3 for r in several)
    assert all(r.logprobs[0] == r.logprob and r.logprobs == sorted(r.logprobs, reverse=True) for r in several)
    drawn = [r.captions for r in cap(photos, sample=True, seed=9, num_captions=2, batch_size=12)]
    assert drawn == [r.captions for r in cap(photos, sample=True, seed=9, num_captions=2, batch_size=5)]
    assert drawn == [cap(p, sample=True, seed=9, num_captions=2).captions for p in photos[::-1]][::-1]
    assert drawn != [r.captions for r in cap(photos, sample=True, seed=10, num_captions=2)]
    blocked = [r.text for r in cap(photos, no_repeat_ngram=2)]
    assert blocked != before and not any(repeated_bigrams(t.split()) for t in blocked)
    assert any(repeated_bigrams(t.split()) for t in before)  # (the picky decoder loops, as shipped ones did)
    with pytest.raises(UserError, match="--top-p must be more than 0"):
        cap("/no/such/photo.png", sample=True, top_p=1.5)
    with pytest.raises(TypeError, match="unknown caption control 'top_q'"):
        cap(photos[0], top_q=0.5)


def read_outputs(folder, name: str = "o") -> dict[str, bytes]:
    return {p.name.replace(name, "o", 1): p.read_bytes() for p in folder.iterdir()
            if p.name.startswith(name + ".") and not p.name.endswith(".meta.json")}


def test_one_caption_writes_todays_files_byte_for_byte(picky_models, photos, tmp_path, capsys):
    a = str(picky_models[0])
    for name, extra in (("plain", []), ("one", ["--num-captions", "1", "--beam-groups", "1"])):
        assert main(["caption", str(photos[0].parent), "--model", a, "--device", "cpu", "--workers", "0",
                     "--json", str(tmp_path / f"{name}.json"), "--jsonl", str(tmp_path / f"{name}.jsonl"),
                     "--csv", str(tmp_path / f"{name}.csv"), *extra]) == 0
    capsys.readouterr()
    assert read_outputs(tmp_path, "plain") == read_outputs(tmp_path, "one")
    plain_meta = (tmp_path / "plain.jsonl.meta.json").read_text()
    assert plain_meta == (tmp_path / "one.jsonl.meta.json").read_text().replace("one.jsonl", "plain.jsonl")
    for args in ([], ["--num-captions", "1"]):  # and stdout: one line per image
        assert main(["caption", str(photos[0]), "--model", a, "--device", "cpu", "--workers", "0", *args]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and out[0] == out[1]


def test_several_captions_are_written_as_lists(picky_models, photos, tmp_path, capsys):
    a, folder = str(picky_models[0]), str(photos[0].parent)
    opts = ["--model", a, "--device", "cpu", "--workers", "0", "--num-captions", "3"]
    outs = ["--json", str(tmp_path / "o.json"), "--jsonl", str(tmp_path / "o.jsonl"), "--csv", str(tmp_path / "o.csv")]
    assert main(["caption", folder, *opts, *outs]) == 0
    capsys.readouterr()
    lists = json.loads((tmp_path / "o.json").read_text())
    want = {p.name: r.captions for p, r in zip(photos, Captioner.load(a, device="cpu")(photos, num_captions=3))}
    assert lists == want
    lines = [json.loads(line) for line in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert {rec["image"]: rec["captions"] for rec in lines} == want and all(set(r) == {"image", "captions"}
                                                                           for r in lines)
    rows = list(csv.reader(io.StringIO((tmp_path / "o.csv").read_text())))
    assert rows[0] == ["image", "caption_1", "caption_2", "caption_3", "error"]
    assert {r[0]: r[1:4] for r in rows[1:]} == want and all(r[4] == "" for r in rows[1:])
    # resumed: nothing left to do; another K is refused with one line
    assert main(["caption", folder, *opts, "--jsonl", str(tmp_path / "o.jsonl"), "--csv", str(tmp_path / "o.csv")]) == 0
    assert "0/0 images" in capsys.readouterr().err
    assert main(["caption", folder, *opts[:-1], "2", "--jsonl", str(tmp_path / "o.jsonl")]) == 2
    assert "was written with --num-captions 3, this run has --num-captions 2" in capsys.readouterr().err
    # stdout: a line per caption
    assert main(["caption", str(photos[0]), *opts]) == 0
    assert capsys.readouterr().out.splitlines() == [f"{photos[0].name}\t{c}" for c in want[photos[0].name]]
    # sampled, with a seed: the same files again
    drawn = ["--sample", "--seed", "5", "--num-captions", "2", "--top-k", "5", "--temperature", "1.5"]
    for name in ("s1", "s2"):
        assert main(["caption", folder, *opts[:-2], *drawn, "--json", str(tmp_path / f"{name}.json"),
                     "--batch-size", "4" if name == "s1" else "16"]) == 0
    assert (tmp_path / "s1.json").read_bytes() == (tmp_path / "s2.json").read_bytes()


def test_evaluate_scores_the_first_and_keeps_the_lists(picky_models, picky_data, tmp_path, capsys):
    a = str(picky_models[0])
    base = ["evaluate", "--model", a, "--dataset", str(picky_data), "--device", "cpu", "--workers", "0",
            "--tokenizer", "python", "--meteor", "none", "--metrics", "bleu,cider"]
    assert main([*base, "--out", str(tmp_path / "plain.json")]) == 0
    assert main([*base, "--out", str(tmp_path / "k.json"), "--num-captions", "2", "--no-repeat-ngram", "2"]) == 0
    printed = capsys.readouterr().out
    assert "beam 3, length penalty 0, no repeat ngram 2, num captions 2" in printed
    plain, k = (json.loads((tmp_path / f).read_text()) for f in ("plain.json", "k.json"))
    assert "caption_lists" not in plain and "controls" not in plain
    assert k["controls"] == {"num_captions": 2, "no_repeat_ngram": 2}
    # the rules decoded with, given or the model's own, in every file
    assert plain["rules"] == {"no_repeat_ngram": 0, "repetition_penalty": 1.0, "rare_word_bonus": 0.0,
                              "min_words": 0, "max_words": None}
    assert k["rules"] == {**plain["rules"], "no_repeat_ngram": 2}
    assert {n: c[0] for n, c in k["caption_lists"].items()} == k["captions"] != plain["captions"]


def test_server_takes_controls_as_form_fields(cap, photos):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from captionkit.serve import ServeConfig, create_app

    app = create_app({"m": cap}, ServeConfig(controls={"no_repeat_ngram": 2}))
    image = photos[0].read_bytes()
    client = TestClient(app).__enter__()

    def post(**fields):
        return client.post("/v1/caption", files={"image": ("p.png", image, "image/png")},
                           data={k: str(v) for k, v in fields.items()})

    plain = post(no_repeat_ngram=0).json()
    assert plain["caption"] == cap(photos[0]).text and "captions" not in plain
    assert post().json()["caption"] == cap(photos[0], no_repeat_ngram=2).text  # the server's default
    three = post(num_captions=3, beam=4).json()
    assert three["captions"] == cap(photos[0], num_captions=3, beam=4, no_repeat_ngram=2).captions
    assert three["caption"] == three["captions"][0] and three["beam"] == 4
    drawn = post(sample="true", seed=3, num_captions=2).json()
    assert drawn["captions"] == post(sample="true", seed=3, num_captions=2).json()["captions"]
    assert drawn["captions"] == cap(photos[0], sample=True, seed=3, num_captions=2, no_repeat_ngram=2).captions
    for fields, message in (({"top_p": "1.5", "sample": "1"}, "--top-p must be more than 0"),
                            ({"num_captions": "11", "sample": "1"}, "'num_captions' must be at most 10"),
                            ({"top_k": "x"}, "'top_k' must be an integer")):
        r = post(**fields)
        assert r.status_code == 400 and message in r.json()["error"], r.json()
    client.__exit__(None, None, None)


def test_onnx_export_takes_the_controls(picky_models, photos, tmp_path):
    """An ONNX export decodes through the same core: the same captions as PyTorch in float32."""
    pytest.importorskip("onnxruntime")
    from captionkit.export.exporters import export_onnx
    from captionkit.export.onnx_runtime import load_onnx_captioner

    cap = Captioner.load(str(picky_models[0]), device="cpu", precision="fp32")
    export_onnx(cap, tmp_path / "onnx", model_name="picky", log=lambda s: None)
    ort = load_onnx_captioner(tmp_path / "onnx")
    for options in ({"no_repeat_ngram": 2, "min_words": 3}, {"num_captions": 3, "beam_groups": 3, "beam": 3},
                    {"sample": True, "seed": 2, "num_captions": 2}):
        assert [r.captions or r.text for r in ort(photos, **options)] == \
            [r.captions or r.text for r in cap(photos, **options)]


def test_ngram_history_follows_the_beams():
    """StepRules' history is reordered with the beams' parents: a beam search whose beams swap
    places still blocks each one's own n-grams (the LOOP decoder, beam 3, blocking 2)."""
    x = feats(2)
    lists = beam_nbest(LOOP, x, 3, 3, 12, 0.0, Controls(no_repeat_ngram=2))
    for caps in lists:
        assert all(not repeated_bigrams(words(c)) for c in caps)
    assert select_rows  # (the decoder contract's helper the rules share)


def test_nbest_features_checks_its_controls_as_every_path_does(picky_models):
    """The n best beams are beam search's: sampling controls, or a rule out of range, are one line
    there too (as in decode_lists and caption_files), before anything is decoded."""
    cap = Captioner.load(picky_models[0])
    feats = torch.zeros(1, 4, 4)  # (never reached: refused first)
    with pytest.raises(UserError, match="--sample draws each word; --beam 3 is beam search's"):
        cap.nbest_features(feats, 2, beam=3, controls=cap.controls_for(sample=True))
    with pytest.raises(UserError, match="--no-repeat-ngram must be a whole number >= 0"):
        cap.nbest_features(feats, 2, beam=3, controls=Controls(no_repeat_ngram=-1))
