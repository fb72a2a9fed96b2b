"""Beam search keeps finished hypotheses on the device (captionkit.inference.decoding.beam_nbest):
the same captions, n-best order, log-probabilities and attention as the host-side implementation it
replaced (copied below as the reference), and at most one host sync per decoding step."""

from __future__ import annotations

import pytest
import torch
from devicecheck import MetaAnswers, count_syncs, factory_sentinel, strict_devices

from captionkit.data.vocab import Vocab
from captionkit.inference.decoding import Caption, allowed_words, beam_nbest, select_rows
from captionkit.inference.ensemble import EnsembleDecoder
from captionkit.models import create_model

V, FEAT, GRID = 14, 10, [2, 3]


# ---- the reference: beam_nbest as it was before finished hypotheses moved to the device ----------
@torch.no_grad()
def reference_beam_nbest(model, feats: torch.Tensor, n_best: int, beam: int = 3, max_len: int = 20,
                         length_penalty: float = 0.0) -> list[list[Caption]]:
    B, K, device = feats.shape[0], beam, feats.device
    mem = model.prepare(feats)
    state = model.init_state(mem)
    rows = torch.arange(B, device=device).repeat_interleave(K)
    mem, state = mem.index_select(rows), select_rows(state, rows)
    tokens = torch.full((B * K,), Vocab.start, dtype=torch.long, device=device)
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0
    seqs = torch.zeros(B * K, 0, dtype=torch.long, device=device)
    hist = None
    finished: list[list[tuple[float, list[int], torch.Tensor, float]]] = [[] for _ in range(B)]
    done = [False] * B

    def norm(logprob: float, n_words: int) -> float:
        return logprob / (n_words + 1) ** length_penalty if length_penalty else logprob

    for t in range(max_len + 1):
        logp, state, alpha = model.step(tokens, state, mem)
        V = logp.shape[1]
        hist = alpha.unsqueeze(1) if hist is None else torch.cat([hist, alpha.unsqueeze(1)], 1)
        logp = allowed_words(logp, t == max_len)
        cand = (scores.view(B * K, 1) + logp).view(B, K * V)
        top_s, top_i = cand.topk(2 * K, dim=1)
        src, word = top_i // V, top_i % V
        is_end = word == Vocab.end
        for b, r in (is_end[:, :K]).nonzero().tolist():
            if done[b] or not torch.isfinite(top_s[b, r]):
                continue
            row = b * K + int(src[b, r])
            ids = seqs[row].tolist()
            lp = float(top_s[b, r])
            finished[b].append((norm(lp, len(ids)), ids, hist[row, :len(ids)].to("cpu", copy=True), lp))
        live_s = top_s.masked_fill(is_end, float("-inf"))
        pick = live_s.topk(K, dim=1).indices
        scores = live_s.gather(1, pick)
        parent = (torch.arange(B, device=device).unsqueeze(1) * K + src.gather(1, pick)).view(-1)
        tokens = word.gather(1, pick).view(-1)
        seqs = torch.cat([seqs[parent], tokens.unsqueeze(1)], 1)
        hist = hist[parent]
        state = select_rows(state, parent)
        for b in range(B):
            if done[b] or not finished[b]:
                continue
            nth_done = sorted((f[0] for f in finished[b]), reverse=True)[n_best - 1] \
                if len(finished[b]) >= n_best else float("-inf")
            if len(finished[b]) >= K or (length_penalty == 0.0 and nth_done >= float(scores[b, 0])):
                done[b] = True
        if all(done):
            break
    out = []
    for b in range(B):
        ranked = sorted(finished[b], key=lambda f: f[0], reverse=True)[:n_best]
        out.append([Caption(ids, att, lp) for _, ids, att, lp in ranked])
    return out


# ---- random models whose captions differ by image, length and beam ------------------------------
def _peaked(model, scale: float):
    """Weights scaled up: random decoders at their usual scale give near-uniform word
    distributions (one caption whatever the image, ends at random); scaled, their captions
    follow the features, finish at different steps and differ between beams."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model.eval()


def sat(seed: int):
    torch.manual_seed(seed)
    return _peaked(create_model("sat", {"vocab_size": V, "feat_dim": FEAT, "embed_dim": 8, "hidden_dim": 9,
                                        "attn_dim": 7, "dropout": 0.0}), 3.0)


def transformer(seed: int):
    torch.manual_seed(seed)
    model = _peaked(create_model("transformer", {"vocab_size": V, "feat_dim": FEAT, "grid": GRID, "width": 8,
                                                 "heads": 2, "decoder_layers": 2, "dropout": 0.0,
                                                 "max_positions": 16}), 6.0)
    with torch.no_grad():  # scaled, it would hardly ever end a caption before max_len
        model.head_bias[Vocab.end] += 2.0
    return model


def ensemble(seed: int):
    return EnsembleDecoder([sat(seed), transformer(seed + 1)], [0.3, 0.7])


MODELS = {"sat": sat, "transformer": transformer, "ensemble": ensemble}


def assert_identical(got: list[list[Caption]], want: list[list[Caption]]) -> None:
    assert len(got) == len(want)
    for g_list, w_list in zip(got, want):
        assert [c.ids for c in g_list] == [c.ids for c in w_list]
        assert [c.logprob for c in g_list] == [c.logprob for c in w_list]  # exactly, not approximately
        for g, w in zip(g_list, w_list):
            assert g.attention.dtype == w.attention.dtype and g.attention.device.type == "cpu"
            assert torch.equal(g.attention, w.attention)


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_beam_search_on_the_device_equals_the_host_side_one(family, batch):
    """Every beam width 1..5, n_best from 1 to the beam, with and without length normalisation,
    two lengths: the captions, their order, log-probabilities and attention are exactly the
    reference's."""
    model = MODELS[family](batch)
    torch.manual_seed(100 + batch)
    feats = torch.randn(batch, GRID[0] * GRID[1], FEAT) * 2
    for beam in range(1, 6):
        for n_best in sorted({1, (beam + 1) // 2, beam}):
            for lp in (0.0, 0.7, 1.5):
                for max_len in (3, 9):
                    want = reference_beam_nbest(model, feats, n_best, beam, max_len, lp)
                    assert_identical(beam_nbest(model, feats, n_best, beam, max_len, lp), want)


def test_the_comparison_sees_early_stops_and_several_lengths():
    """The random models above are not degenerate: images finish at different lengths, n-best
    lists hold different captions, and length normalisation changes some of them."""
    model = ensemble(8)
    torch.manual_seed(108)
    feats = torch.randn(8, GRID[0] * GRID[1], FEAT) * 2
    plain = beam_nbest(model, feats, 3, 3, 9, 0.0)
    normed = beam_nbest(model, feats, 3, 3, 9, 1.5)
    assert len({len(lst[0].ids) for lst in plain}) > 2
    assert any(len({tuple(c.ids) for c in lst}) == 3 for lst in plain)
    assert [lst[0].ids for lst in plain] != [lst[0].ids for lst in normed]


@pytest.mark.parametrize("beam", [1, 3, 5])
def test_beam_search_syncs_the_host_at_most_once_per_step(beam):
    """On the stand-in GPU (meta), the hypotheses that finish are no host reads: one sync per
    step (is every image done?) and the copies at the end. Every candidate is an <end> (as at
    a real run's last step), so the old per-hypothesis reads would all happen."""
    model = transformer(0).to("meta")
    feats = torch.randn(4, GRID[0] * GRID[1], FEAT, device="meta")
    steps = []
    step = model.step

    def counted(*a):
        steps.append(1)
        return step(*a)

    model.step = counted
    answers = MetaAnswers(fill=Vocab.end, truth=True, nonzero="all")  # an image always open: max_len + 1 steps
    with strict_devices(answers), count_syncs(answers=answers) as syncs:
        with factory_sentinel(torch.device("meta")):
            beam_nbest(model, feats, 1, beam, max_len=6, length_penalty=0.0)
    assert len(steps) == 7
    end_copies = 3  # the finished buffers, copied to the host once: integers, log-probs, attention
    assert syncs.total <= len(steps) + end_copies, syncs.report()
