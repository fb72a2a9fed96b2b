"""The SAT decoder's fused teacher-forced recurrence (models/sat_recurrence.py) against the
step-by-step code it replaced in float32 CPU training: the same loss and the same gradients
at float32 rounding, a graph that no longer grows with the caption length, and the parameter
names checkpoints hold unchanged."""

import pytest
import torch
import torch.nn.functional as F

from captionkit.kernels import energy_reference, kernel_available
from captionkit.models.sat import SATConfig, SoftAttentionDecoder, caption_loss

pytestmark = pytest.mark.skipif(not kernel_available(), reason="no C compiler: the fused path needs the kernel")


def reference_unroll(m: SoftAttentionDecoder, feats, inputs, image_index=None):
    """A copy of ``_unroll`` as it was before the fusion (soft attention, no sampled
    locations), with the attention energy in plain PyTorch: per word, h_proj(h), the energy,
    softmax, the gated context, the LSTM cell, each an autograd node of its own."""
    A = m.cfg.attn_dim
    mean = feats.mean(1, dtype=torch.float32)
    proj = m.att_feat(feats)
    if image_index is not None:
        feats, proj, mean = feats[image_index], proj[image_index], mean[image_index]
    h, c = torch.tanh(m.init_h(mean)), torch.tanh(m.init_c(mean))
    emb = m.embed_drop(m.embed(inputs))
    gates_emb = m.gates_emb(emb)
    hs, zs, alphas = [], [], []
    for t in range(inputs.shape[1]):
        hp = m.h_proj(h)
        q, beta_logit, gates_h = hp[:, :A], hp[:, A:A + 1], hp[:, A + 1:]
        alpha = torch.softmax(energy_reference(proj, q, m.att_w), dim=1)
        z = torch.bmm(alpha.unsqueeze(1), feats).squeeze(1)
        if m.cfg.gate:
            z = torch.sigmoid(beta_logit) * z
        i, f, g, o = (gates_emb[:, t] + m.gates_ctx(z) + gates_h).chunk(4, dim=1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        hs.append(h)
        zs.append(z)
        alphas.append(alpha)
    logits = m.out(m.drop(emb + m.out_h(torch.stack(hs, 1)) + m.out_z(torch.stack(zs, 1))))
    return logits, torch.stack(alphas, 1)


def tiny(gate: bool = True, attention: str = "soft") -> SoftAttentionDecoder:
    torch.manual_seed(0)
    cfg = SATConfig(vocab_size=37, feat_dim=24, embed_dim=16, hidden_dim=20, attn_dim=12, dropout=0.3,
                    embed_dropout=0.2, gate=gate, attention=attention)
    return SoftAttentionDecoder(cfg).train()  # dropout on: both paths must draw the same masks


def loss_and_grads(m, feats, ids, run, image_index=None, alpha_c=1.0):
    for p in m.parameters():
        p.grad = None
    feats.grad = None
    torch.manual_seed(1)
    logits, alphas = run(m, feats, ids[:, :-1], image_index)
    if alpha_c is None:  # no loss on the attention weights: they get no gradient of their own
        loss = F.cross_entropy(logits.transpose(1, 2), ids[:, 1:])
    else:
        loss, ce = caption_loss(logits, ids[:, 1:], alphas, alpha_c)
    loss.backward()
    return loss.detach(), logits.detach(), {n: p.grad.clone() for n, p in m.named_parameters()}, feats.grad


def fused(m, feats, inputs, image_index):
    logits, alphas, _ = m._unroll(feats, inputs, image_index=image_index)
    return logits, alphas


def graph_nodes(t: torch.Tensor) -> tuple[set, set[str]]:
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        names.add(type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return seen, names


def packed_products(monkeypatch, packed: bool) -> list:
    """Make the recurrence's per-word products run gemm.c's packed kernel (or PyTorch's
    matmul), whatever this CPU prefers; returns the list of RowProducts made, to check which ran."""
    from captionkit import kernels
    if packed and not kernels._load().gemm_supported():
        pytest.skip("gemm.c's kernel needs AVX2 and FMA")
    made = []

    class Spy(kernels.RowProducts):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            made.append(self)
    monkeypatch.setattr(kernels, "gemm_preferred", lambda: packed)
    monkeypatch.setattr(kernels, "RowProducts", Spy)
    return made


@pytest.mark.parametrize("packed", [True, False])  # the per-word products: gemm.c, or PyTorch
@pytest.mark.parametrize("gate", [True, False])
@pytest.mark.parametrize("feats_grad", [False, True])  # True: the encoder is being tuned
def test_fused_step_gives_todays_loss_and_gradients(monkeypatch, packed, gate, feats_grad):
    made = packed_products(monkeypatch, packed)
    m = tiny(gate)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(5, 7, 24, generator=g).abs().requires_grad_(feats_grad)  # (B, L, D)
    ids = torch.randint(4, 37, (5, 9), generator=g)
    ids[1, 6:] = 0  # padding: masked out of the loss and the attention penalty
    ids[3, 4:] = 0
    assert m._fusable(feats, None)
    new = loss_and_grads(m, feats, ids, fused)
    old = loss_and_grads(m, feats, ids, reference_unroll)
    torch.testing.assert_close(new[0], old[0])
    torch.testing.assert_close(new[1], old[1])
    assert new[2].keys() == old[2].keys()
    for name in old[2]:
        torch.testing.assert_close(new[2][name], old[2][name], msg=name)
    if feats_grad:
        torch.testing.assert_close(new[3], old[3])
    assert new[2]["h_proj.weight"].abs().sum() > 0 and new[2]["gates_ctx.weight"].abs().sum() > 0
    assert len(made) == 4 and all((r.packed is not None) == packed for r in made)  # h_proj, gates_ctx, both ways


def test_row_products_sizes_past_the_tiles_and_blocks(monkeypatch):
    """The benchmark's shapes in miniature but past every edge of gemm.c's tiling: rows not a
    multiple of its 4 (and more than its 64 a pass), inputs past one block of 128, outputs not a
    multiple of its 24 panels; the fused step's loss and gradients still equal the reference."""
    made = packed_products(monkeypatch, True)
    torch.manual_seed(0)
    m = SoftAttentionDecoder(SATConfig(vocab_size=41, feat_dim=150, embed_dim=16, hidden_dim=35, attn_dim=30,
                                       dropout=0.3, embed_dropout=0.2)).train()  # h_proj: 171 outputs, 35 inputs
    g = torch.Generator().manual_seed(6)
    feats = torch.randn(67, 5, 150, generator=g).abs()  # 67 captions
    ids = torch.randint(4, 41, (67, 5), generator=g)
    new = loss_and_grads(m, feats, ids, fused)
    old = loss_and_grads(m, feats, ids, reference_unroll)
    torch.testing.assert_close(new[0], old[0])
    for name in old[2]:
        torch.testing.assert_close(new[2][name], old[2][name], msg=name)
    assert [r.packed is not None for r in made] == [True] * 4


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("start", ["none", "bias", "addend"])
@pytest.mark.parametrize(("M", "K", "N"), [(1, 1, 1), (5, 20, 93), (32, 300, 48), (70, 129, 25)])
def test_row_products_packed_and_pytorch_agree(transposed, start, M, K, N):
    """RowProducts' two ways, gemm.c's packed kernel and PyTorch's W x^T, against float64, on
    row slices of wider matrices (as the recurrence passes them); the kernel's result does not
    depend on the thread count or on the other rows in the call (bit for bit)."""
    from captionkit import kernels
    if not kernels._load().gemm_supported():
        pytest.skip("gemm.c's kernel needs AVX2 and FMA")
    g = torch.Generator().manual_seed(M * K * N)
    w = torch.randn(K, N, generator=g) if transposed else torch.randn(N, K, generator=g)
    W = w.t() if transposed else w  # (N, K)
    x = torch.randn(M, K + 7, generator=g)[:, 3:3 + K]  # rows K + 7 floats apart
    bias = torch.randn(N, generator=g) if start == "bias" else None
    addend = torch.randn(M, N + 2, generator=g)[:, 1:1 + N] if start == "addend" else None
    want = x.double() @ W.double().t()
    want += 0 if start == "none" else bias.double() if start == "bias" else addend.double()
    outs = []
    for packed in (True, False):
        rp = kernels.RowProducts(w, transposed=transposed, packed=packed)
        assert (rp.packed is not None) == packed
        out = torch.full((M, N + 5), float("nan"))
        rp(x, out[:, :N], bias=bias, addend=addend)
        assert out[:, N:].isnan().all()  # nothing written past the slice
        torch.testing.assert_close(out[:, :N].double(), want, rtol=1e-5, atol=1e-5 * K ** 0.5)
        outs.append(out[:, :N])
    rp = kernels.RowProducts(w, transposed=transposed, packed=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one_thread = rp(x, torch.empty(M, N), bias=bias, addend=addend)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one_thread, outs[0])
    last = rp(x[-1:], torch.empty(1, N), bias=bias, addend=None if addend is None else addend[-1:])
    assert torch.equal(last, outs[0][-1:])


def test_row_products_same_in_either_vector_width(tmp_path):
    """gemm.c's AVX-512 tile (panels of 48) and its AVX2 tile (panels of 24) give the same
    outputs bit for bit: each output is the same sequence of FMAs either way. Runs where the
    CPU has AVX-512: the library as loaded against gemm.c compiled here without it."""
    import ctypes
    import shutil
    import subprocess

    from captionkit import kernels
    if not (kernels._load().gemm_supported() and kernels._load().gemm_panel() == 48):
        pytest.skip("the CPU has no AVX-512: only the AVX2 tile is built here")
    cc = shutil.which("cc") or shutil.which("gcc")
    so, obj = tmp_path / "gemm_avx2.so", tmp_path / "gemm_avx2.o"
    src = next(s for s in kernels._SOURCES if s.name == "gemm.c")
    # compiled as the loader does, with -ffast-math but linked without it (with it, loading the
    # library would set flush-to-zero for this whole test process)
    subprocess.run([cc, "-O3", "-ffast-math", "-march=native", "-mno-avx512f", "-fopenmp", "-fPIC", "-c",
                    str(src), "-o", str(obj)], check=True)
    subprocess.run([cc, "-shared", "-fopenmp", str(obj), "-o", str(so)], check=True)
    avx2 = kernels.declare_gemm(ctypes.CDLL(str(so)))
    assert avx2.gemm_panel() == 24
    g = torch.Generator().manual_seed(3)
    for M, K, N in [(32, 2561, 100), (13, 300, 49), (70, 129, 25), (1, 7, 3)]:
        w, x, bias = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g), torch.randn(N, generator=g)
        want = kernels.RowProducts(w, packed=True)(x, torch.empty(M, N), bias=bias)
        packed = torch.empty(-(-N // 24), K, 24)
        avx2.pack_panels(w.data_ptr(), K, 0, N, K, packed.data_ptr(), 1)
        out = torch.empty(M, N)
        avx2.gemm_packed(x.data_ptr(), K, M, K, packed.data_ptr(), N, bias.data_ptr(), None, 0, out.data_ptr(), N, 2)
        assert torch.equal(out, want), (M, K, N)


def test_row_products_refuse_what_they_cannot_take():
    from captionkit import kernels
    w = torch.randn(6, 4)
    rp = kernels.RowProducts(w, packed=False)
    with pytest.raises(RuntimeError, match=r"x \(3, 5\)"):
        rp(torch.randn(3, 5), torch.empty(3, 6))
    with pytest.raises(RuntimeError, match="strides"):
        rp(torch.randn(4, 3).t(), torch.empty(3, 6))  # columns of x not contiguous
    with pytest.raises(RuntimeError, match="float64"):
        kernels.RowProducts(w.double())
    if not kernels._load().gemm_supported():
        with pytest.raises(RuntimeError, match="AVX2"):
            kernels.RowProducts(w, packed=True)


def test_fused_step_without_a_loss_on_the_attention_weights():
    """Without the attention penalty the alphas get no gradient of their own (None in backward)."""
    m = tiny()
    g = torch.Generator().manual_seed(4)
    feats = torch.randn(4, 7, 24, generator=g).abs()
    ids = torch.randint(4, 37, (4, 6), generator=g)
    grads = []
    for run in (fused, reference_unroll):
        m.zero_grad(set_to_none=True)
        torch.manual_seed(1)
        logits, _ = run(m, feats, ids[:, :-1], None)
        F.cross_entropy(logits.transpose(1, 2), ids[:, 1:]).backward()
        grads.append({n: p.grad.clone() for n, p in m.named_parameters()})
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


@pytest.mark.parametrize("width", [24, 13])  # 13: a row of float16 not a whole number of vectors
@pytest.mark.parametrize(("gate", "alpha_c"), [(True, 1.0), (False, 1.0), (True, None)])
def test_fused_step_on_store_features_reads_them_as_float16(monkeypatch, width, gate, alpha_c):
    """Features from the feature store are float16 values: the recurrence's attention reads a
    float16 copy (half the bytes), a caption at a time (attend kernels), and gives the float32
    results; any value that float16 cannot hold exactly keeps the float32 path."""
    from captionkit import kernels
    calls = []
    for name in ("attend_forward", "attend_backward"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, _real=real, _name=name: (calls.append(_name), _real(*a)))
    torch.manual_seed(0)
    m = SoftAttentionDecoder(SATConfig(vocab_size=37, feat_dim=width, embed_dim=16, hidden_dim=20, attn_dim=12,
                                       dropout=0.3, embed_dropout=0.2, gate=gate)).train()
    g = torch.Generator().manual_seed(5)
    feats = (torch.randn(5, 7, width, generator=g) * 3).half().float()  # (B, L, D) as the store gives them
    ids = torch.randint(4, 37, (5, 9), generator=g)
    new = loss_and_grads(m, feats, ids, fused, alpha_c=alpha_c)
    old = loss_and_grads(m, feats, ids, reference_unroll, alpha_c=alpha_c)
    half = kernels._load().half_supported() == 1  # x86 with F16C; elsewhere the float32 path
    assert calls.count("attend_forward") == (8 if half else 0) and calls.count("attend_backward") == (8 if half else 0)
    torch.testing.assert_close(new[0], old[0])
    for name in old[2]:
        torch.testing.assert_close(new[2][name], old[2][name], msg=name)
    assert (new[2]["h_proj.weight"][12].abs().sum() > 0) == gate  # row A: beta's logit, trained with the gate only
    calls.clear()
    feats[2, 3, 1] += 1e-3  # no longer a float16 value
    loss_and_grads(m, feats, ids, fused, alpha_c=alpha_c)
    assert calls == []


def test_half_copy_only_where_every_value_converts_exactly():
    from captionkit import kernels
    if kernels._load().half_supported() != 1:
        pytest.skip("no float16 conversion in vectors on this CPU")
    x = torch.randn(3, 5, 19).half().float()
    x[0, 0, :4] = torch.tensor([0.0, 65504.0, 2.0 ** -24, float("inf")])  # largest, smallest subnormal
    h = kernels.half_copy(x)
    assert h is not None and h.dtype == torch.float16 and torch.equal(h.float(), x)
    for bad in (70000.0, 1e-40, 0.1, 2.0 ** -26):  # overflow, underflow, inexact, below float16's subnormals
        y = x.clone()
        y[2, 4, 18] = bad  # the scalar tail, past the last whole vector
        assert kernels.half_copy(y) is None, bad
        y = x.clone()
        y[1, 1, 3] = bad
        assert kernels.half_copy(y) is None, bad


def test_fused_step_with_shared_images():
    """Self-critical training: several captions per image through ``image_index``."""
    m = tiny()
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(3, 7, 24, generator=g).abs()  # (U, L, D)
    ids = torch.randint(4, 37, (6, 8), generator=g)
    index = torch.tensor([0, 0, 1, 1, 2, 2])
    new = loss_and_grads(m, feats, ids, fused, index)
    old = loss_and_grads(m, feats, ids, reference_unroll, index)
    torch.testing.assert_close(new[0], old[0])
    for name in old[2]:
        torch.testing.assert_close(new[2][name], old[2][name], msg=name)


def test_training_graph_does_not_grow_with_the_caption_length():
    """The recurrence is one autograd node: a 12-word caption's graph is the size of a 3-word
    one (step by step, every word added some 40 nodes)."""
    m = tiny()
    feats = torch.rand(2, 7, 24)
    sizes = {}
    for T in (3, 12):
        loss, _ = m.training_loss(feats, torch.randint(4, 37, (2, T)), torch.randint(4, 37, (2, T)), alpha_c=1.0)
        nodes, names = graph_nodes(loss)
        sizes[T] = len(nodes), "SoftRecurrenceBackward" in names
    assert sizes[12] == sizes[3]
    assert sizes[3][1]


def test_the_recurrence_steps_aside_where_it_does_not_apply():
    """bf16 autocast, hard attention's sampled locations and argmax decoding keep the
    step-by-step code (and give the same values as before)."""
    m = tiny()
    feats = torch.rand(2, 7, 24)
    assert m._fusable(feats, None)
    assert not m._fusable(feats, torch.ones(2, dtype=torch.bool))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert not m._fusable(feats, None)
    hard = SoftAttentionDecoder(SATConfig(vocab_size=37, feat_dim=24, embed_dim=16, hidden_dim=20, attn_dim=12,
                                          attention="hard", decode_context="argmax"))
    assert hard._fusable(feats, None)  # training: the expected context
    assert not hard.eval()._fusable(feats, None)


def test_parameter_names_are_unchanged():
    """Checkpoints of runs before the fusion load as they are: the same names and shapes."""
    m = SoftAttentionDecoder(SATConfig(vocab_size=37, feat_dim=24, embed_dim=16, hidden_dim=20, attn_dim=12))
    assert {k: tuple(v.shape) for k, v in m.state_dict().items()} == {
        "att_w": (12,), "embed.weight": (37, 16),
        "init_h.0.weight": (20, 24), "init_h.0.bias": (20,), "init_h.2.weight": (20, 20), "init_h.2.bias": (20,),
        "init_c.0.weight": (20, 24), "init_c.0.bias": (20,), "init_c.2.weight": (20, 20), "init_c.2.bias": (20,),
        "att_feat.weight": (12, 24), "att_feat.bias": (12,), "h_proj.weight": (93, 20), "h_proj.bias": (93,),
        "gates_emb.weight": (80, 16), "gates_emb.bias": (80,), "gates_ctx.weight": (80, 24),
        "out_h.weight": (16, 20), "out_h.bias": (16,), "out_z.weight": (16, 24), "out.weight": (37, 16),
        "out.bias": (37,)}


def test_step_by_step_decoding_agrees_with_the_fused_forward():
    """What training learns is what decoding runs: ``step`` word by word (the C kernel, no
    fusion) gives the fused teacher-forced forward's log-probabilities."""
    m = tiny().eval()
    feats = torch.rand(3, 7, 24)
    ids = torch.randint(4, 37, (3, 6))
    logits, alphas = m(feats, ids)
    mem = m.prepare(feats)
    state = m.init_state(mem)
    for t in range(ids.shape[1]):
        logp, state, alpha = m.step(ids[:, t], state, mem)
        torch.testing.assert_close(logp, F.log_softmax(logits[:, t], -1))
        torch.testing.assert_close(alpha, alphas[:, t])
