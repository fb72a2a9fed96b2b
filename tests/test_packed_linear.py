"""Decoding's products in gemm.c's packed kernel (kernels.packed_linear, models.base.Linear):
when the kernel takes a product and when PyTorch keeps it, the values against PyTorch's, a row
independent of the rows beside it, the weight packed again after it changes, only models read
for captioning packed (never one that trains), and a decoder's captions and log-probabilities
with the kernel against plain PyTorch."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from captionkit import kernels
from captionkit.inference.decoding import beam_nbest, greedy
from captionkit.models import create_model
from captionkit.models.base import Linear, pack_products

pytestmark = pytest.mark.skipif(not kernels.gemm_preferred(), reason="gemm.c's packed kernel is not used here")


def test_packed_only_for_float32_cpu_inference():
    g = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(37, 19, generator=g), torch.randn(37, generator=g), torch.randn(2, 5, 19, generator=g)
    with torch.no_grad():
        y = kernels.packed_linear(x, w, b)
        assert y is not None and y.shape == (2, 5, 37)
        torch.testing.assert_close(y, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        assert kernels.packed_linear(x.double(), w.double()) is None
        assert kernels.packed_linear(x[..., :3], w) is None  # not this weight's width: PyTorch raises
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert kernels.packed_linear(x, w, b) is None
        with kernels.plain_pytorch():
            assert kernels.packed_linear(x, w, b) is None
    assert kernels.packed_linear(x, w, b) is None  # gradient mode: autograd needs PyTorch's product
    with torch.inference_mode():
        assert kernels.packed_linear(x, w, b) is not None  # a weight made outside: packed
        made_here = torch.randn(37, 19)  # an inference tensor: in-place changes go uncounted
        assert kernels.packed_linear(x, made_here) is None
        lin = pack_products(Linear(19, 4))  # so a module built under inference_mode is nn.Linear, and works
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


def test_a_row_does_not_depend_on_its_neighbours():
    """Beam search drops finished photos' rows from the batch (prune): a row's products must be
    the same bit for bit in a batch of 96 rows, of 5, or alone."""
    g = torch.Generator().manual_seed(1)
    w, b, x = torch.randn(300, 257, generator=g), torch.randn(300, generator=g), torch.randn(96, 257, generator=g)
    with torch.no_grad():
        full = kernels.packed_linear(x, w, b)
        assert torch.equal(kernels.packed_linear(x[40:45], w, b), full[40:45])
        assert torch.equal(kernels.packed_linear(x[95:], w, b), full[95:])
        assert torch.equal(kernels.packed_linear(x[::2], w, b), full[::2])  # rows not adjacent in memory


def test_the_weight_is_packed_again_when_it_changes():
    lin = pack_products(Linear(16, 24))
    x = torch.randn(3, 16)
    with torch.no_grad():
        lin(x)  # packed now
        lin.weight.mul_(2)  # in place, as an optimizer step
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.load_state_dict({"weight": torch.eye(24, 16), "bias": torch.ones(24)})  # in place too
        torch.testing.assert_close(lin(x), F.linear(x, torch.eye(24, 16), torch.ones(24)), rtol=0, atol=1e-6)


def test_linear_is_nn_linear_for_checkpoints_and_gradients():
    plain = nn.Linear(7, 5)
    ours = Linear(7, 5)
    ours.load_state_dict(plain.state_dict())  # same names, same shapes
    assert isinstance(ours, nn.Linear) and ours.state_dict().keys() == plain.state_dict().keys()
    x = torch.randn(4, 7, requires_grad=True)
    ours(x).sum().backward()  # with a gradient: nn.Linear's product, gradients as ever
    g_ours = x.grad.clone()
    x.grad = None
    plain(x).sum().backward()
    assert torch.equal(g_ours, x.grad)


@pytest.mark.parametrize("family", ["sat", "transformer"])
def test_decoding_with_the_kernel_against_plain_pytorch(family):
    """A decoder's beam search and greedy decoding with its products in the packed kernel give
    the captions of plain PyTorch (a random model whose top words are far apart) and
    log-probabilities within float32 rounding."""
    torch.manual_seed(0)
    V = 40
    cfg = ({"vocab_size": V, "feat_dim": 64, "embed_dim": 32, "hidden_dim": 48, "attn_dim": 24,
            "dropout": 0.0} if family == "sat" else
           {"vocab_size": V, "feat_dim": 64, "width": 32, "heads": 2, "encoder_layers": 1,
            "decoder_layers": 2, "dropout": 0.0, "max_positions": 12, "grid": [3, 3]})
    model = pack_products(create_model(family, cfg).eval())
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3)  # sharper distributions: no near ties between the best words
    feats = torch.randn(6, 9, 64)
    runs = []
    for plain in (False, True):
        with torch.no_grad(), (kernels.plain_pytorch() if plain else torch.no_grad()):
            runs.append((beam_nbest(model, feats, 3, beam=3, max_len=10), greedy(model, feats, max_len=10)))
    (packed_beams, packed_greedy), (plain_beams, plain_greedy) = runs
    head = model.out.weight if family == "sat" else model.embed.weight  # the tied output layer
    assert head in kernels._packed_weights  # the first run's products were the kernel's
    for a, b in zip(packed_beams, plain_beams):
        assert [c.ids for c in a] == [c.ids for c in b]
        torch.testing.assert_close(torch.tensor([c.logprob for c in a]), torch.tensor([c.logprob for c in b]),
                                   rtol=1e-5, atol=1e-5)
    assert [c.ids for c in packed_greedy] == [c.ids for c in plain_greedy]
    assert sum(len(c.ids) for c in plain_greedy) > 6  # the captions are words, not only <end>


def test_only_models_read_for_captioning_are_packed():
    """A model that trains changes its weights where PyTorch does not count it (fused Adam), so
    a packed copy could go stale: nothing is packed until pack_products, and train() ends it."""
    torch.manual_seed(0)
    model = create_model("sat", {"vocab_size": 20, "feat_dim": 16, "embed_dim": 8, "hidden_dim": 12,
                                 "attn_dim": 6, "dropout": 0.0})
    opt = torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
    feats = torch.randn(2, 4, 16)
    greedy(model.eval(), feats, max_len=6)
    assert model.out.weight not in kernels._packed_weights  # not declared done changing: PyTorch's
    pack_products(model)
    greedy(model, feats, max_len=6)
    assert model.out.weight in kernels._packed_weights
    version = model.out.weight._version
    model.train()
    assert not model.packed and not model.out.packed
    loss = sum(p.sum() for p in model.parameters())
    loss.backward()
    opt.step()  # the weights move; PyTorch's version counter does not (fused Adam)
    assert model.out.weight._version == version
    assert model.out.weight not in kernels._packed_weights  # train() dropped the copies
    with torch.no_grad():
        after = model.eval().out(torch.ones(1, 8))
        torch.testing.assert_close(after, F.linear(torch.ones(1, 8), model.out.weight, model.out.bias))


def test_a_declaration_packs_the_weights_as_they_are_now():
    """pack_products drops copies made before it: a weight moved by fused Adam (not counted by
    PyTorch) while the model was packed is packed afresh when the model is declared again."""
    lin = pack_products(Linear(16, 24))
    x = torch.ones(2, 16)
    opt = torch.optim.Adam(lin.parameters(), lr=0.5, fused=True)
    with torch.no_grad():
        lin(x)  # packed
    lin.weight.grad, lin.bias.grad = torch.ones(24, 16), torch.ones(24)
    opt.step()  # moved without a train(): the version counter does not see it
    pack_products(lin)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_the_shipped_default_is_read_packed():
    from captionkit.inference.captioner import Captioner
    cap = Captioner.load(with_encoder=False, precision="fp32")
    linears = [m for m in cap.decoder.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed for m in linears)
