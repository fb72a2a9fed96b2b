"""Beam search that steps only what can change a result (captionkit.inference.decoding.beam_nbest,
``prune=True``, what the captioner decodes with): the first step once per image, and no rows of
images whose search is done. The captions, their order, log-probabilities and attention are
exactly those of the search that steps every row to the end (``prune=False``), with and without
the caption controls; and the transformer writes its KV cache in place only inside a decoding
loop that owns its states.

The models' widths are multiples of 16 floats, as every shipped model's: each row of a matmul is
then laid out alike whichever rows surround it (MKL's kernels for odd small widths round a row by
its place in memory, as docs/speed.md says)."""

from __future__ import annotations

import pytest
import torch
from test_beam_search import _peaked

from captionkit.data.vocab import Vocab
from captionkit.inference import decoding
from captionkit.inference.controls import Controls
from captionkit.inference.decoding import Caption, beam_nbest, greedy
from captionkit.inference.ensemble import EnsembleDecoder, with_flip_views
from captionkit.models import create_model
from captionkit.models.base import owned_states

V, FEAT, GRID = 30, 16, [2, 3]


def sat(seed: int):
    torch.manual_seed(seed)
    return _peaked(create_model("sat", {"vocab_size": V, "feat_dim": FEAT, "embed_dim": 16, "hidden_dim": 16,
                                        "attn_dim": 16, "dropout": 0.0}), 2.5)


def transformer(seed: int):
    torch.manual_seed(seed)
    model = _peaked(create_model("transformer", {"vocab_size": V, "feat_dim": FEAT, "grid": GRID, "width": 16,
                                                 "heads": 2, "decoder_layers": 2, "dropout": 0.0,
                                                 "max_positions": 16}), 3.0)
    with torch.no_grad():  # scaled, it would hardly ever end a caption before max_len
        model.head_bias[Vocab.end] += 2.0
    return model


def ensemble(seed: int):
    return EnsembleDecoder([sat(seed), transformer(seed + 1)], [0.4, 0.6])


def flip(seed: int):  # the default's shape: 2 members x 2 views, each model's views one batch
    return with_flip_views(ensemble(seed))


MODELS = {"sat": sat, "transformer": transformer, "ensemble": ensemble, "flip": flip}


def features(model, batch: int, seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    x = torch.randn(batch, GRID[0] * GRID[1], FEAT) * 2
    return torch.stack([x, x.flip(1) * 0.9], 1) if getattr(model, "views", None) else x


def assert_identical(got: list[list[Caption]], want: list[list[Caption]]) -> None:
    assert [[c.ids for c in g] for g in got] == [[c.ids for c in w] for w in want]
    assert [[c.logprob for c in g] for g in got] == [[c.logprob for c in w] for w in want]  # exactly
    for g_list, w_list in zip(got, want):
        for g, w in zip(g_list, w_list):
            assert torch.equal(g.attention, w.attention)


class Rows:
    """Counts the rows each ``model.step`` call steps."""

    def __init__(self, model):
        self.counts: list[int] = []
        self.step = model.step
        model.step = self

    def __call__(self, tokens, state, mem):
        self.counts.append(tokens.shape[0])
        return self.step(tokens, state, mem)


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("batch", [5, 16])
def test_the_pruned_search_gives_exactly_the_unpruned_results(family, batch):
    """Beams 2-5, n-best 1 to the beam, with and without length normalisation: the same
    captions, order, log-probabilities and attention (16 photos: the first step runs once per
    image, and photos leave; 5: a batch of fewer than MIN_ROWS rows stays whole for beam 2)."""
    model = MODELS[family](batch)
    x = features(model, batch, 100 + batch)
    for beam in (2, 3, 5):
        for n_best in sorted({1, beam}):
            for lp in (0.0, 1.5):
                want = beam_nbest(model, x, n_best, beam, 12, lp)
                assert_identical(beam_nbest(model, x, n_best, beam, 12, lp, prune=True), want)


CONTROLS = {
    "blocking": Controls(no_repeat_ngram=2),
    "penalty": Controls(repetition_penalty=1.7),
    "min and max words": Controls(min_words=4, max_words=7),
    "n-best": Controls(num_captions=3, no_repeat_ngram=3),
    "diverse beam": Controls(num_captions=2, beam_groups=3, diversity_strength=0.8),
}


@pytest.mark.parametrize("name", sorted(CONTROLS))
@pytest.mark.parametrize("family", ["ensemble", "flip"])
def test_the_pruned_search_under_caption_controls(name, family):
    """Each control of inference/controls.py acts in the pruned search as in the unpruned one
    (its rules' rows leave with their images; a diverse search's image leaves when all its
    groups are done)."""
    model = MODELS[family](3)
    x = features(model, 16, 7)
    c = CONTROLS[name]
    for beam, lp in ((3, 0.0), (6, 1.5)):
        if beam % c.beam_groups:
            continue
        want = decoding.decode_lists(model, x, beam, 12, lp, c)
        got = decoding.decode_lists(model, x, beam, 12, lp, c, prune=True)
        assert_identical(got, want)


def test_pruning_steps_fewer_rows_and_beam_one_is_greedy():
    """The pruned search steps the first step once per image and fewer rows as photos finish
    (never fewer than MIN_ROWS); with beam 1 it is still the greedy caption."""
    model = ensemble(11)
    x = features(model, 16, 3)
    rows = Rows(model)
    beam_nbest(model, x, 1, 3, 12, 0.0)
    unpruned, rows.counts = rows.counts, []
    beam_nbest(model, x, 1, 3, 12, 0.0, prune=True)
    pruned = rows.counts
    assert set(unpruned) == {48} and len(pruned) == len(unpruned)
    assert pruned[0] == 16 and min(pruned[1:]) >= decoding.MIN_ROWS
    assert sum(pruned) < 0.8 * sum(unpruned)
    greedy_caps = greedy(model, x, 12)
    assert_identical([caps[:1] for caps in beam_nbest(model, x, 1, 1, 12, 0.0, prune=True)],
                     [[c] for c in greedy_caps])


def test_the_captioner_decodes_pruned():
    """The captioner (``captionkit caption``, the Python API, the server) decodes with pruning:
    fewer rows than the search that steps every row, and the same captions."""
    from captionkit.data.vocab import SPECIALS
    from captionkit.inference.captioner import Captioner

    vocab = Vocab(list(SPECIALS) + [f"w{i}" for i in range(V - 4)])
    model = ensemble(5)
    cap = Captioner(model, vocab, {"encoder": {"grid": GRID}, "decoding": {"length_penalty": 0.0, "max_len": 12}})
    cap.place("cpu", "fp32")
    x = features(model, 16, 9)
    want = beam_nbest(model, x, 1, 3, cap.max_len, cap.length_penalty_or(None))
    rows = Rows(model)
    got = cap.decode_lists(x, beam=3)
    assert rows.counts[0] == 16 and sum(rows.counts) < 48 * len(rows.counts)
    assert_identical(got, want)


# ---- the transformer's KV cache ------------------------------------------------------------------
def test_the_kv_cache_is_written_in_place_only_where_the_loop_owns_its_states():
    """Inside owned_states (the decoding loops) a step writes its keys and values into the caches
    it is given; outside, a state stepped twice with different words gives each step's own
    answer (the caller may keep it), and both ways compute the same numbers."""
    model = transformer(3).eval()
    x = features(model, 4, 1)
    with torch.no_grad():
        mem = model.prepare(x)
        state = model.init_state(mem)
        start = torch.full((4,), Vocab.start, dtype=torch.long)
        first = model.step(start, state, mem)[1]
        assert all(torch.count_nonzero(c) == 0 for c in state[1:])  # the given state is untouched
        a = model.step(torch.full((4,), 5), first, mem)
        b = model.step(torch.full((4,), 6), first, mem)
        again = model.step(torch.full((4,), 5), first, mem)
        assert torch.equal(a[0], again[0]) and not torch.equal(a[0], b[0])
        with owned_states():
            fresh = tuple(t.clone() for t in first)
            owned = model.step(torch.full((4,), 5), fresh, mem)
        assert all(n is o for n, o in zip(owned[1][1:], fresh[1:]))  # the same tensors, written
        assert torch.equal(owned[0], a[0]) and all(torch.equal(n, o) for n, o in zip(owned[1], a[1]))
