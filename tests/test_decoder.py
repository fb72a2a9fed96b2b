import pytest
import torch

from captionkit.data.vocab import Vocab
from captionkit.inference.decoding import beam_search
from captionkit.kernels import EnergyContext, kernel_available
from captionkit.models import create_model, family_config
from captionkit.models.sat import SATConfig, caption_loss


def tiny(**kw):
    cfg = dict(vocab_size=12, feat_dim=10, embed_dim=8, hidden_dim=9, attn_dim=7, dropout=0.0)
    cfg.update(kw)
    torch.manual_seed(0)
    return create_model("sat", cfg).eval()


def test_config_checks():
    with pytest.raises(ValueError, match="dropout"):
        SATConfig(vocab_size=10, dropout=1.5)
    with pytest.raises(ValueError, match="unknown fields: widht"):
        family_config("sat", {"vocab_size": 10, "widht": 3})


@pytest.mark.skipif(not kernel_available(), reason="no C compiler: fused kernel unavailable")
def test_fused_attention_kernel_matches_pytorch():
    torch.manual_seed(1)
    B, L, A = 3, 5, 19
    proj0 = torch.randn(B, L, A, requires_grad=True)
    w = torch.randn(A, requires_grad=True)
    qs = [torch.randn(B, A, requires_grad=True) for _ in range(4)]
    weights = [torch.randn(B, L) for _ in qs]

    def run(fused):
        ctx = EnergyContext(proj0 * 1.0, use_kernel=fused)
        assert ctx.fused == fused
        out = sum((ctx(q, w) * g).sum() for q, g in zip(qs, weights))
        return [out.detach(), *torch.autograd.grad(out, [proj0, w, *qs])]

    for a, b in zip(run(True), run(False)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not kernel_available(), reason="no C compiler: fused kernel unavailable")
def test_training_tanh_is_float32_accurate():
    """Teacher-forced training's energy uses the kernel's rational tanh: with one attention unit
    (A = 1, w = 1, q = 0) the energy is that tanh itself, and its backward 1 - tanh^2. Checked
    against float64 over the whole range, both sides of the clamp at |x| = 8, and tiny x."""
    from captionkit.kernels import energy_backward, energy_forward
    pos = torch.cat([torch.linspace(0, 12, 120001), torch.logspace(-30, -1, 300), torch.tensor([7.9999, 8.0001, 1e4])])
    x = torch.cat([pos, -pos])
    proj, q, w = x.view(1, -1, 1).contiguous(), torch.zeros(1, 1), torch.ones(1)
    t = energy_forward(proj, q, w, rational=True)[0]
    exact = torch.tanh(x.double())
    assert (t.double() - exact).abs().max() < 4e-7  # 3.0e-7 measured on AVX2; glibc's tanhf 9.3e-8
    assert t.abs().max() <= 1 and torch.equal(t[:len(pos)], -t[len(pos):])  # bounded, odd
    small = x.abs() < 1e-3
    assert ((t[small].double() - exact[small]).abs() <= 1e-6 * exact[small].abs()).all()  # relative near 0
    gproj, gq, gw = torch.zeros_like(proj), torch.empty(1, 1), torch.zeros(1)
    energy_backward(torch.ones(1, x.numel()), proj, q, w, gproj, gq, gw, rational=True)
    assert (gproj.view(-1).double() - (1 - exact ** 2)).abs().max() < 1e-6
    # decoding's energy (glibc's tanhf) is another function (9.3e-8 measured)
    assert (energy_forward(proj, q, w)[0].double() - exact).abs().max() < 2.5e-7


@pytest.mark.skipif(not kernel_available(), reason="no C compiler: fused kernel unavailable")
def test_recurrence_kernels_refuse_tensors_they_cannot_read():
    """An internal contract, loud when broken: a column slice where a whole tensor is needed."""
    from captionkit.kernels import lstm_forward
    B, H = 2, 3
    gz = torch.zeros(B, 8 * H)[:, : 4 * H]  # rows 8H apart: not contiguous
    with pytest.raises(RuntimeError, match="recurrence kernel given"):
        lstm_forward(gz, torch.zeros(B, 4 * H), torch.zeros(B, 4 * H), torch.zeros(B, H), torch.empty(B, 4 * H),
                     torch.empty(B, H), torch.empty(B, H), torch.empty(B, H))
    with pytest.raises(RuntimeError, match="recurrence kernel given"):
        lstm_forward(torch.zeros(B, 4 * H), torch.zeros(B, 4 * H, dtype=torch.float64), torch.zeros(B, 4 * H),
                     torch.zeros(B, H), torch.empty(B, 4 * H), torch.empty(B, H), torch.empty(B, H), torch.empty(B, H))


@pytest.mark.skipif(not kernel_available(), reason="no C compiler: fused kernel unavailable")
def test_loading_the_kernel_keeps_subnormal_floats():
    """The kernel is built with -ffast-math; linked with it, loading the library would switch the
    whole process to flush-to-zero, so that numpy and torch silently turn 1e-40 into 0."""
    import subprocess
    import sys
    code = ("import numpy as np, torch; from captionkit.kernels import _load; assert _load() is not None; "
            "print(float(np.float32(1e-39) * np.float32(0.5)), float(torch.tensor([1e-39]) * 0.5))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert [float(v) for v in out] == pytest.approx([5e-40, 5e-40], rel=1e-3, abs=0)  # not 0.0


def test_step_and_teacher_forced_forward_agree():
    m = tiny()
    feats = torch.randn(2, 6, 10)
    tokens = torch.tensor([[1, 5, 7, 4], [1, 6, 6, 9]])
    logits, alphas = m(feats, tokens)
    mem = m.prepare(feats)
    state = m.init_state(mem)
    for t in range(tokens.shape[1]):
        logp, state, alpha = m.step(tokens[:, t], state, mem)
        torch.testing.assert_close(logp, torch.log_softmax(logits[:, t], -1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(alpha, alphas[:, t], rtol=1e-5, atol=1e-6)
    assert torch.allclose(alphas.sum(-1), torch.ones(2, 4))


def test_training_steps_lower_the_loss():
    m = tiny(dropout=0.1).train()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    feats = torch.randn(4, 6, 10)
    ids = torch.randint(4, 12, (4, 7))
    ids[:, 0], ids[:, -1] = Vocab.start, Vocab.end
    losses = []
    for _ in range(40):
        logits, alphas = m(feats, ids[:, :-1])
        loss, ce = caption_loss(logits, ids[:, 1:], alphas, alpha_c=1.0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(ce.detach()))
    assert losses[-1] < 0.3 * losses[0]


def test_doubly_stochastic_penalty():
    logits = torch.zeros(1, 2, 5)
    targets = torch.tensor([[4, 2]])
    alphas = torch.tensor([[[0.5, 0.5, 0.0], [0.5, 0.5, 0.0]]])  # location sums 1, 1, 0
    total, ce = caption_loss(logits, targets, alphas, alpha_c=2.0)
    assert float(total - ce) == pytest.approx(2.0 * (0 + 0 + 1) / 3)  # mean over locations


@torch.no_grad()
def _exhaustive_best(m, feats, max_len):
    """The most probable caption of each image by trying every word sequence."""
    best = []
    for b in range(feats.shape[0]):
        mem = m.prepare(feats[b:b + 1])
        frontier = [([], 0.0, m.init_state(mem), Vocab.start)]
        top = (float("-inf"), None)
        for t in range(max_len + 1):
            nxt = []
            for ids, lp, state, tok in frontier:
                logp, st, _ = m.step(torch.tensor([tok]), state, mem)
                end_lp = lp + float(logp[0, Vocab.end])
                if end_lp > top[0]:
                    top = (end_lp, ids)
                if t < max_len:
                    nxt += [(ids + [w], lp + float(logp[0, w]), st, w) for w in range(4, logp.shape[1])]
            frontier = nxt
        best.append(top)
    return best


def test_wide_beam_finds_the_exhaustive_optimum():
    m = tiny(vocab_size=7)  # three words besides the specials
    torch.manual_seed(4)
    feats = torch.randn(4, 6, 10)
    exact = _exhaustive_best(m, feats, max_len=3)
    for (lp, ids), cap in zip(exact, beam_search(m, feats, beam=27, max_len=3)):
        assert cap.ids == ids
        assert cap.logprob == pytest.approx(lp, abs=1e-4)


def test_length_penalty_prefers_longer_captions():
    m = tiny()
    torch.manual_seed(5)
    feats = torch.randn(8, 6, 10)
    plain = beam_search(m, feats, beam=3, max_len=10)
    normed = beam_search(m, feats, beam=3, max_len=10, length_penalty=1.0)
    assert sum(len(c.ids) for c in normed) >= sum(len(c.ids) for c in plain)
