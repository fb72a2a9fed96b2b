"""The transformer captioner against the decoder step contract: KV-cached steps equal the
teacher-forced forward, cached decoding equals uncached decoding, beam 1 equals greedy,
self-critical training runs on it, the step exports as one graph, and its cross-attention
makes a figure."""

import pytest
import torch
from helpers import assert_shared_image_matches_repeats
from torch import nn

from captionkit.data.vocab import Vocab
from captionkit.inference.decoding import allowed_words, beam_search, greedy
from captionkit.models import create_model, family_config
from captionkit.models.base import KVMemory
from captionkit.models.transformer import TransformerConfig
from captionkit.training.scst import SelfCritical

V, FEAT, GRID = 14, 10, [2, 3]


def tiny(spread: float = 0.1, **kw):
    """A random tiny model; weight matrices drawn wide so captions differ between images."""
    cfg = dict(vocab_size=V, feat_dim=FEAT, grid=GRID, width=16, heads=2, encoder_layers=1, decoder_layers=2,
               dropout=0.0, max_positions=16)
    cfg.update(kw)
    torch.manual_seed(0)
    m = create_model("transformer", cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() >= 2:
                p.normal_(0, spread)
    return m


def feats(B=5, seed=1):
    torch.manual_seed(seed)
    return torch.randn(B, GRID[0] * GRID[1], FEAT)


def test_config_checks():
    with pytest.raises(ValueError, match="width .* multiple of heads"):
        TransformerConfig(vocab_size=10, width=10, heads=4)
    with pytest.raises(ValueError, match="attention_layer"):
        TransformerConfig(vocab_size=10, decoder_layers=2, attention_layer=2)
    with pytest.raises(ValueError, match="unknown fields: widht"):
        family_config("transformer", {"vocab_size": 10, "widht": 3})
    assert TransformerConfig(vocab_size=10, grid=(3, 4)).grid == [3, 4]


@pytest.mark.parametrize("kw", [{}, {"embed_dim": 6, "tie_embeddings": True}, {"tie_embeddings": False},
                                {"encoder_layers": 0, "attention_layer": 0}])
def test_cached_steps_equal_the_teacher_forced_forward(kw):
    m = tiny(**kw)
    x = feats(3)
    torch.manual_seed(2)
    tokens = torch.randint(4, V, (3, 9))
    tokens[:, 0] = Vocab.start
    with torch.no_grad():
        logits, attention = m(x, tokens)  # (3, 9, V), (3, 9, L)
        mem = m.prepare(x)
        state = m.init_state(mem)
        for t in range(tokens.shape[1]):
            logp, state, alpha = m.step(tokens[:, t], state, mem)
            torch.testing.assert_close(logp, torch.log_softmax(logits[:, t], -1), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(alpha, attention[:, t], rtol=1e-5, atol=1e-6)
    assert int(state[0][0]) == tokens.shape[1]  # the position counter advanced once per token
    torch.testing.assert_close(attention.sum(-1), torch.ones(3, 9))  # weights over the image tokens


@torch.no_grad()
def _uncached_greedy(m, x, max_len):
    """Greedy decoding that recomputes the whole prefix with the teacher-forced forward at
    every step (no cache), under the same rules as captionkit.inference.decoding."""
    out = []
    for b in range(x.shape[0]):
        seq = [Vocab.start]
        for t in range(max_len + 1):
            logits, _ = m(x[b:b + 1], torch.tensor([seq]))
            word = int(allowed_words(torch.log_softmax(logits[:, -1], -1), t == max_len).argmax(1))
            if word == Vocab.end:
                break
            seq.append(word)
        out.append(seq[1:])
    return out


def test_kv_cached_decoding_gives_the_same_captions_as_uncached():
    m = tiny()
    x = feats(6)
    cached = [c.ids for c in greedy(m, x, max_len=10)]
    assert cached == _uncached_greedy(m, x, 10)
    assert len({tuple(c) for c in cached}) > 1  # the images get different captions: a real test


def test_a_wider_beam_finds_no_less_probable_caption_than_greedy():
    m = tiny()  # (beam 1 = greedy: tests/test_model_contract.py, for every family)
    x = feats(6)
    g = greedy(m, x, max_len=10)
    wide = beam_search(m, x, beam=4, max_len=10)
    assert all(w.logprob >= gc.logprob - 1e-4 for w, gc in zip(wide, g))


def test_training_loss_with_label_smoothing_reports_the_plain_cross_entropy():
    m = tiny(spread=0.02)
    x = feats(4)
    torch.manual_seed(3)
    ids = torch.randint(4, V, (4, 7))
    ids[:, 0], ids[:, -1] = Vocab.start, Vocab.end
    plain, ce = m.training_loss(x, ids[:, :-1], ids[:, 1:])
    smooth, ce_s = m.training_loss(x, ids[:, :-1], ids[:, 1:], label_smoothing=0.1)
    torch.testing.assert_close(plain, ce)
    torch.testing.assert_close(ce_s, ce)
    assert float(smooth.detach()) != pytest.approx(float(plain.detach()), abs=1e-4)
    m.train()
    opt = torch.optim.AdamW(m.parameters(), 1e-2)
    losses = []
    for _ in range(60):
        loss, ce = m.training_loss(x, ids[:, :-1], ids[:, 1:], label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(ce.detach()))
    assert losses[-1] < 0.3 * losses[0]


def test_shared_image_side_gives_the_same_loss_and_gradients_as_repeated_features():
    """batching = "image": each image encoded once and indexed per caption, captions of
    different lengths padded with <pad>, equals every caption with its own copy of the image
    and only its own length."""
    m = tiny(spread=0.05)
    x = feats(3)  # (U, L, F)
    image_index = torch.tensor([0, 0, 1, 2, 2, 2])
    torch.manual_seed(4)
    lengths = [7, 4, 6, 5, 7, 3]
    rows = []
    for n in lengths:
        ids = torch.randint(4, V, (n,))
        ids[0], ids[-1] = Vocab.start, Vocab.end
        rows.append(torch.cat([ids, torch.zeros(7 - n, dtype=torch.long)]))
    ids = torch.stack(rows)  # (6, 7), <pad> = 0 after each caption's <end>
    assert all(p.requires_grad for p in m.parameters())  # so every gradient is compared
    shared = assert_shared_image_matches_repeats(m, x, ids, image_index)
    # the padded batch's loss is the token-weighted mean of each caption's unpadded loss
    per = [m.training_loss(x[i:i + 1], ids[j:j + 1, :n - 1], ids[j:j + 1, 1:n])[0] * (n - 1)
           for j, (i, n) in enumerate(zip(image_index.tolist(), lengths))]
    torch.testing.assert_close(shared, sum(per) / sum(n - 1 for n in lengths))


def test_self_critical_training_runs_on_the_transformer():
    m = tiny(spread=0.1)
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(V - 4)])
    refs = {k: [[f"w{(k + j) % 8}", f"w{(k * 3 + j) % 8}", "w1"] for j in range(3)] for k in range(5)}
    sc = SelfCritical(refs, vocab, samples=3, max_len=6)
    x = feats(5)
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    for _ in range(3):
        torch.manual_seed(7)
        loss, stats = sc.loss(m, x, list(range(5)))
        assert torch.isfinite(loss) and stats.sample_reward >= 0 and stats.greedy_reward >= 0
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = m.state_dict()
    assert all(not torch.equal(before[k], after[k]) for k in ("layers.0.cross.q.weight", "embed.weight"))


@pytest.mark.slow  # an ONNX export
def test_the_step_exports_as_one_graph():
    """No Python-side control flow in the step: torch.export traces it once, and the traced
    graph gives the eager step's numbers at later positions too."""
    m = tiny(encoder_layers=0, decoder_layers=1, attention_layer=0, max_positions=6)

    class Step(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = m

        def forward(self, tokens, pos, k, v, mem_k, mem_v):
            logp, state, attention = self.m.step(tokens, (pos, k, v), KVMemory([mem_k], [mem_v]))
            return (logp, attention, *state)

    x = feats(2)
    with torch.no_grad():
        mem = m.prepare(x)
        state = m.init_state(mem)
        exported = torch.export.export(Step(), (torch.tensor([1, 1]), *state, mem.keys[0], mem.values[0])).module()
        tokens = torch.tensor([Vocab.start, Vocab.start])
        for word in ([5, 6], [7, 7], [9, 4]):
            want = Step()(tokens, *state, mem.keys[0], mem.values[0])
            got = exported(tokens, *state, mem.keys[0], mem.values[0])
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            state, tokens = want[2:], torch.tensor(word)


def test_cross_attention_figure_for_a_tiny_model(tmp_path):
    from PIL import Image

    from captionkit.inference.captioner import Captioner
    from captionkit.inference.figures import save_attention_figure

    m = tiny()
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(V - 4)])
    cfg = {"family": "transformer", "model": {}, "encoder": {"grid": GRID}, "decoding": {"max_len": 6}}
    cap = Captioner(m, vocab, cfg)
    res = cap.result(cap.decode_features(feats(1), beam=2)[0])
    assert res.words and res.attention.shape == (len(res.words), GRID[0] * GRID[1])
    out = save_attention_figure(Image.new("RGB", (64, 48), (200, 100, 50)), res.words, res.attention, res.grid,
                                tmp_path / "fig.png")
    im = Image.open(out)
    assert im.format == "PNG" and im.width > 200


def test_label_smoothing_reaches_the_lstm_loss_too():
    from captionkit.models.sat import caption_loss
    torch.manual_seed(4)
    logits = torch.randn(2, 5, V)
    targets = torch.randint(4, V, (2, 5))
    alphas = torch.full((2, 5, 6), 1 / 6)
    plain, ce = caption_loss(logits, targets, alphas, alpha_c=0.0)
    smooth, ce_s = caption_loss(logits, targets, alphas, alpha_c=0.0, label_smoothing=0.2)
    torch.testing.assert_close(ce_s, ce)
    want = torch.nn.functional.cross_entropy(logits.reshape(-1, V), targets.reshape(-1), label_smoothing=0.2)
    torch.testing.assert_close(smooth, want)
