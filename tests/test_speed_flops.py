"""benchmarks/speed.py's FLOP count of the tutorial-style decoder, against torch's own count:
the multiple of it that equal GFLOP/s would give (docs/speed.md) rests on it."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from helpers import benchmark_module


@pytest.mark.parametrize("sizes", [(2, 3, 8, 4, 11, 2), (3, 5, 7, 6, 13, 4)])
def test_the_tutorial_decoders_flop_count_is_torchs(sizes, monkeypatch):
    speed = benchmark_module("speed")
    B, L, D, DIM, V, T = sizes
    for name, value in zip(("B", "L", "D", "DIM", "V", "T"), sizes):
        monkeypatch.setattr(speed, name, value)
    tutorial = speed.TutorialDecoder(V, feat_dim=D, dim=DIM)  # the decoder speed.py times
    feats, ids = torch.randn(B, L, D), torch.randint(0, V, (B, T + 1))
    with FlopCounterMode(display=False) as counter:
        scores, alphas = tutorial(feats, ids, torch.full((B,), T))
        (scores.sum() + alphas.sum()).backward()
    # torch counts matmuls only: the context's weighted sum over L x D, forward and the
    # gradient of alpha, is the difference
    assert speed.tutorial_step_flops() == counter.get_total_flops() + 2 * B * T * 2 * L * D
