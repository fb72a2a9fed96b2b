"""Per-step costs of decoding that the CPU does not show but a GPU pays for: an ensemble's weights
made into a tensor (a host->device copy) at every step, the transformer's KV cache cast twice per
layer per step under autocast, the LM families' KV cache copied into a new DynamicCache at every
step. Each is counted, and the outputs are the same as before."""

from __future__ import annotations

import contextlib

import pytest
import torch
from devicecheck import MetaAnswers, _to_target, factory_sentinel, hot_path, strict_devices
from torch.overrides import TorchFunctionMode

from captionkit.data.vocab import Vocab
from captionkit.inference.decoding import beam_search, greedy
from captionkit.inference.ensemble import EnsembleDecoder
from captionkit.models import create_model

V, FEAT, GRID = 14, 10, [2, 3]


def transformer(seed: int, max_positions: int = 16):
    torch.manual_seed(seed)
    return create_model("transformer", {"vocab_size": V, "feat_dim": FEAT, "grid": GRID, "width": 8, "heads": 2,
                                        "decoder_layers": 2, "dropout": 0.0,
                                        "max_positions": max_positions}).eval()


def feats(n: int = 3) -> torch.Tensor:
    torch.manual_seed(7)
    return torch.randn(n, GRID[0] * GRID[1], FEAT)


# ---- the ensemble's weights -----------------------------------------------------------------------
def test_an_ensembles_weights_become_a_tensor_once_per_device():
    """No step makes a tensor of host numbers (on a GPU, a host->device copy per step): the
    weights are filled in on the device once, at the first step there, and kept."""
    ens = EnsembleDecoder([transformer(0), transformer(1)], [0.25, 0.75]).to("meta")
    x = torch.randn(2, GRID[0] * GRID[1], FEAT, device="meta")
    with strict_devices(MetaAnswers(fill=Vocab.end)):
        with hot_path(EnsembleDecoder, "step", lambda: factory_sentinel("meta", strict_data=True)):
            greedy(ens, x, max_len=3)
            first = ens.weight_tensor(torch.device("meta"))
            beam_search(ens, x, beam=2, max_len=3)
    assert list(ens._weight_tensors) == [torch.device("meta")]
    assert ens.weight_tensor(torch.device("meta")) is first


@pytest.mark.parametrize("combine", ["loglinear", "linear"])
def test_an_ensemble_decodes_as_before(combine):
    """The tensor of weights gives the numbers the per-step one gave (float32 from the same
    Python floats): greedy and beam captions of an ensemble equal those decoded with weights
    built at every step."""
    from captionkit.inference import ensemble as module

    ens = EnsembleDecoder([transformer(0), transformer(1)], [0.3, 0.7], combine)
    x = feats()
    new = [(c.ids, c.logprob, c.attention) for c in beam_search(ens, x, beam=3, max_len=8)]
    old_step = module.combine_logprobs

    def per_step(logprobs, weights, how):  # the old call: the Python weights, every step
        return old_step(logprobs, ens.weights, how)

    try:
        module.combine_logprobs = per_step
        old = [(c.ids, c.logprob, c.attention) for c in beam_search(ens, x, beam=3, max_len=8)]
    finally:
        module.combine_logprobs = old_step
    assert [(i, lp) for i, lp, _ in new] == [(i, lp) for i, lp, _ in old]
    assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(new, old))


# ---- the transformer's KV cache under autocast ------------------------------------------------------
class CacheCasts(TorchFunctionMode):
    """Counts dtype conversions of whole KV caches (B, h, max_positions, d)."""

    def __init__(self, positions: int):
        super().__init__()
        self.positions, self.count = positions, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "to" and args and isinstance(args[0], torch.Tensor):
            t = args[0]
            _, dtype, _ = _to_target(args, kwargs)
            if t.dim() == 4 and t.shape[2] == self.positions and dtype is not None and dtype != t.dtype:
                self.count += 1
        return func(*args, **kwargs)


def test_the_transformer_cache_is_kept_in_the_compute_dtype():
    model = transformer(0, max_positions=12)
    x = feats()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        mem = model.prepare(x)
        state = model.init_state(mem)
        assert {t.dtype for t in state[1:]} == {torch.bfloat16}
        tokens = torch.full((3,), Vocab.start, dtype=torch.long)
        with CacheCasts(12) as casts:
            for _ in range(4):
                _, state, _ = model.step(tokens, state, mem)
        assert casts.count == 0  # it was 2 per layer per step: 16 here
    with torch.no_grad():  # float32 decoding keeps a float32 cache
        assert {t.dtype for t in model.init_state(model.prepare(x))[1:]} == {torch.float32}


def test_a_compute_dtype_cache_gives_the_float32_caches_numbers():
    """Keys and values computed under autocast are bf16 already: a float32 cache held exactly
    these numbers, so every step's log-probabilities and attention are unchanged."""
    model = transformer(2, max_positions=12)
    x = feats()
    tokens = [torch.full((3,), Vocab.start, dtype=torch.long)] + [torch.randint(4, V, (3,)) for _ in range(6)]
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        mem = model.prepare(x)
        new = model.init_state(mem)
        old = (new[0],) + tuple(t.float() for t in new[1:])  # what init_state made before
        for tok in tokens:
            a, new, att_a = model.step(tok, new, mem)
            b, old, att_b = model.step(tok, old, mem)
            assert torch.equal(a, b) and torch.equal(att_a, att_b)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        captions = greedy(model, x, max_len=8)
    assert all(c.attention.dtype == torch.float32 for c in captions)


# ---- the LM families' DynamicCache ------------------------------------------------------------------
def _old_cache(state):
    """How the LM families built their cache before: from (keys, values) pairs, which copies
    each onto an empty tensor."""
    from transformers import DynamicCache
    return DynamicCache(list(zip(state[0::2], state[1::2]))) if state else DynamicCache()


@contextlib.contextmanager
def counting_cache_updates():
    """Counts DynamicLayer.update calls: each concatenates keys/values onto a layer's cache."""
    from transformers.cache_utils import DynamicLayer

    calls = []
    update = DynamicLayer.update

    def counted(self, *a, **k):
        calls.append(1)
        return update(self, *a, **k)

    DynamicLayer.update = counted
    try:
        yield calls
    finally:
        DynamicLayer.update = update


def steps_and_updates(model, x, tokens):
    """Each step's (log-probs, attention, state), and the cache updates the steps made."""
    with torch.no_grad():
        mem = model.prepare(x)
        state = model.init_state(mem)
        out = []
        with counting_cache_updates() as calls:
            for tok in tokens:
                logp, state, att = model.step(tok, state, mem)
                out.append((logp, att, state))
    return out, len(calls)


def assert_same_steps(new, old) -> None:
    for (la, aa, sa), (lb, ab, sb) in zip(new, old):
        assert torch.equal(la, lb) and torch.equal(aa, ab) and all(torch.equal(p, q) for p, q in zip(sa, sb))


def test_the_prefix_lm_step_appends_to_its_cache_without_copying_it(tiny_lm, monkeypatch):
    pytest.importorskip("peft")
    from captionkit.data.tokenizers import LMTokenizer
    from captionkit.models.prefix_lm import PrefixLMCaptioner

    torch.manual_seed(0)
    model = create_model("prefix_lm", {"vocab_size": len(LMTokenizer.build(tiny_lm)), "feat_dim": 24,
                                       "grid": [7, 7], "lm": tiny_lm, "pool": [2, 2], "lora_dropout": 0.0}).eval()
    x = torch.randn(2, 49, 24)
    tokens = [torch.full((2,), Vocab.start, dtype=torch.long), torch.tensor([5, 9]), torch.tensor([7, 6])]
    layers = model.core.config.num_hidden_layers
    new, new_updates = steps_and_updates(model, x, tokens)
    monkeypatch.setattr(PrefixLMCaptioner, "_cache", staticmethod(_old_cache))
    old, old_updates = steps_and_updates(model, x, tokens)
    assert new_updates == layers * len(tokens)  # the new position only: one concatenation per layer
    assert old_updates == 2 * layers * len(tokens)  # before, the whole cache was copied first
    assert_same_steps(new, old)


def test_the_vit_gpt2_step_appends_to_its_cache_without_copying_it(tiny_vit, tiny_gpt2, monkeypatch):
    from transformers import EncoderDecoderCache

    from captionkit.data.tokenizers import LMTokenizer
    from captionkit.models.vit_gpt2 import ViTGPT2Captioner

    torch.manual_seed(0)
    model = create_model("vit_gpt2", {"vocab_size": len(LMTokenizer.build(tiny_gpt2)), "feat_dim": 192,
                                      "grid": [4, 4], "vit": tiny_vit, "lm": tiny_gpt2}).eval()
    x = torch.rand(2, 16, 192)
    tokens = [torch.full((2,), Vocab.start, dtype=torch.long), torch.tensor([5, 9]), torch.tensor([7, 6])]
    layers = model.gpt2.config.n_layer
    new, new_updates = steps_and_updates(model, x, tokens)
    monkeypatch.setattr(ViTGPT2Captioner, "_cache",
                        staticmethod(lambda state, mem: EncoderDecoderCache(_old_cache(state), mem.cache())))
    old, old_updates = steps_and_updates(model, x, tokens)
    assert new_updates == layers * len(tokens)
    assert old_updates == 2 * layers * len(tokens)
    assert_same_steps(new, old)
