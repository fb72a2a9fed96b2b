"""benchmarks/speed.py's FLOP count of the tutorial-style decoder, against torch's own count:
the multiple of it that equal GFLOP/s would give (docs/speed.md) rests on it."""

import re

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


# ---- --tutorial-checkout: the tutorial's own decoder, from a checkout outside the repository ----

# A stand-in for the tutorial's models.py with its decoder's interface (not its code): it
# records what the training step hands it
STAND_IN = '''
import torch
from torch import nn

calls = []
device = torch.device("meta")  # the tutorial's module chooses CUDA where there is one: not the CPU


class DecoderWithAttention(nn.Module):
    def __init__(self, attention_dim, embed_dim, decoder_dim, vocab_size, decoder_layers=1, encoder_dim=2048,
                 dropout=0.5):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.fc = nn.Linear(embed_dim + encoder_dim, vocab_size)

    def forward(self, encoder_out, encoded_captions, caption_lengths):
        calls.append((tuple(encoded_captions.shape), caption_lengths.squeeze(1).tolist()))
        lengths, order = caption_lengths.squeeze(1).sort(descending=True)
        decode_lengths = (lengths - 1).tolist()
        caps, T, L = encoded_captions[order], max(decode_lengths), encoder_out.shape[1]
        context = encoder_out[order].mean(1, keepdim=True).expand(-1, T, -1)
        scores = self.fc(torch.cat([self.embedding(caps[:, :T]), context], 2))
        return scores, caps, decode_lengths, torch.full((len(caps), T, L), 1.0 / L).to(device), order
'''


def test_the_tutorials_own_decoder_trains_as_its_train_py_does(tmp_path, monkeypatch):
    speed = benchmark_module("speed")
    sizes = dict(B=3, L=4, D=6, DIM=5, V=11, T=2)
    for name, value in sizes.items():
        monkeypatch.setattr(speed, name, value)
    (tmp_path / "models.py").write_text(STAND_IN)
    models = speed.tutorial_checkout(tmp_path)
    feats, ids = torch.randn(3, 4, 6), torch.randint(4, 11, (3, 3))
    step = speed.tutorial_train_step(models, feats, ids)
    losses = [step()[0] for _ in range(30)]
    assert losses[-1] < losses[0]  # it trains: Adam on its own parameters
    # its data files' captions: padded to 52 tokens, lengths of <start> + words + <end>
    assert models.calls[0] == ((3, 52), [3, 3, 3])
    times = speed.bench_training(1, tutorial=False, checkout=models)
    assert set(times) == {"captionkit fp32", speed.OWN} | ({"captionkit bf16"} if "bf16" in speed.TRAIN_PRECISIONS else set())
    assert all(t > 0 for t in times.values())


def test_a_folder_that_is_not_the_tutorials_checkout_is_named(tmp_path):
    speed = benchmark_module("speed")
    with pytest.raises(SystemExit, match=re.escape(f"--tutorial-checkout {tmp_path}: no models.py there")):
        speed.tutorial_checkout(tmp_path)
    (tmp_path / "models.py").write_text("class Encoder: pass\n")
    with pytest.raises(SystemExit, match="its models.py defines no DecoderWithAttention"):
        speed.tutorial_checkout(tmp_path)
