"""What each training objective costs, measured in one run on this machine.

    python benchmarks/objectives.py [--repeats N]

At the shipped model's sizes (EfficientNet-Lite2 9x9x1280 grid, width 512, vocabulary 2,541,
the trainer's default precision, "auto": bf16 mixed precision where the CPU multiplies bf16
natively, float32 elsewhere) it times one optimizer step of:
- soft attention, cross-entropy (batch 32 captions of 13 words);
- hard attention, the lower bound with sampled locations (same batch);
- soft attention with the encoder's last 3 blocks and head fine-tuned (same batch; the
  decoder's input comes from the cached 9x9x208 output of block 18);
- self-critical training (the shipped model on the sample photos, batch 16 images x 5 sampled
  captions + greedy baselines, CIDEr-D rewards against 5 references of 12 words);
and prints medians, throughput, the ratio to the soft step, and what an epoch of Flickr8k
(30,000 training captions / 6,000 images) costs at that rate.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import torch
from timing import median_time

from captionkit.core.precision import resolve_precision
from captionkit.data.images import load_rgb, to_tensor
from captionkit.data.vocab import Vocab
from captionkit.encoders import create_encoder
from captionkit.inference.captioner import Captioner
from captionkit.inference.shipped import FAST_MODEL
from captionkit.models import create_model
from captionkit.training.config import TrainConfig
from captionkit.training.scst import SelfCritical
from captionkit.training.stages import make_optimizer

ROOT = Path(__file__).resolve().parents[1]
B, T, V, GRID, D = 32, 13, 2541, (9, 9), 1280
SIZES = dict(vocab_size=V, feat_dim=D, embed_dim=512, hidden_dim=512, attn_dim=512, dropout=0.5, embed_dropout=0.3)




def optimizer_step(params, loss, opt):
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 5.0)
    opt.step()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.manual_seed(0)
    tc = TrainConfig()
    bf16 = resolve_precision(tc.precision) == "bf16"  # what the trainer would use here
    print(f"precision {tc.precision}: {'bf16 mixed precision' if bf16 else 'float32'}")
    feats = torch.randn(B, GRID[0] * GRID[1], D).abs().to(torch.bfloat16 if bf16 else torch.float32)
    ids = torch.randint(4, V, (B, T + 1))
    ids[:, 0], ids[:, -1] = Vocab.start, Vocab.end
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)
    times: dict[str, tuple[float, int, str]] = {}

    for attention in ("soft", "hard"):
        model = create_model("sat", dict(SIZES, attention=attention)).train()
        opt = make_optimizer([{"params": list(model.parameters()), "lr": 1e-4}], tc)

        def step():
            with autocast:
                loss, _ = model.training_loss(feats, ids[:, :-1], ids[:, 1:], alpha_c=1.0)
            optimizer_step(list(model.parameters()), loss, opt)

        times[f"{attention} attention, cross-entropy"] = (median_time(step, args.repeats), B, "captions")

    encoder = create_encoder("efficientnet_lite2", weights="random")  # the speed does not depend on the weights
    trunk, tail = encoder.split(3)
    cached = torch.randn(B, GRID[0] * GRID[1], trunk.dim).abs()  # block 18's output, as cached
    for p in tail.parameters():
        p.requires_grad_(True)
    model = create_model("sat", SIZES).train()
    params = list(model.parameters()) + list(tail.parameters())
    opt = make_optimizer([{"params": list(model.parameters()), "lr": 1e-4},
                          {"params": list(tail.parameters()), "lr": 1e-4}], tc)

    def ft_step():
        with autocast:
            loss, _ = model.training_loss(tail(cached, GRID), ids[:, :-1], ids[:, 1:], alpha_c=1.0)
        optimizer_step(params, loss, opt)

    times["soft + last 3 encoder blocks tuned"] = (median_time(ft_step, args.repeats), B, "captions")

    # Sampling cost depends on how long the captions are, so this one uses the shipped model
    # on the sample photos (an untrained model would babble to the length limit).
    cap = Captioner.load(FAST_MODEL, device="cpu")  # one decoder to sample from (the default is an ensemble)
    photos = sorted((ROOT / "samples").glob("*.jpg"))
    n_img = 16
    x = torch.stack([to_tensor(load_rgb(photos[i % len(photos)]), cap.encoder.preprocess) for i in range(n_img)])
    with torch.inference_mode():
        img_feats = cap.encoder(x.contiguous(memory_format=torch.channels_last)).clone()  # (16, 81, 1280)
    rng = random.Random(0)
    words = cap.vocab.words[4:300]
    refs = {k: [[rng.choice(words) for _ in range(12)] for _ in range(5)] for k in range(6000)}
    sc = SelfCritical(refs, cap.vocab, samples=5, max_len=20)
    model = cap.decoder.float().eval()  # self-critical training samples without dropout
    for p in model.parameters():
        p.requires_grad_(True)
    opt = make_optimizer([{"params": list(model.parameters()), "lr": 5e-5}], tc)

    def scst_step():
        with autocast:
            loss, _ = sc.loss(model, img_feats, list(range(n_img)))
        optimizer_step(list(model.parameters()), loss, opt)

    times["self-critical (5 samples/image)"] = (median_time(scst_step, args.repeats), n_img, "images")

    base = times["soft attention, cross-entropy"][0] / B
    print(f"{'objective':38s} {'s/step':>8s} {'throughput':>18s} {'x soft':>7s} {'Flickr8k epoch':>15s}")
    for name, (t, n, unit) in times.items():
        per_epoch = (30000 if unit == "captions" else 6000) * t / n
        print(f"{name:38s} {t:8.3f} {n / t:10.1f} {unit + '/s':>7s} {t / n / base:7.2f} {per_epoch / 60:11.1f} min")


if __name__ == "__main__":
    main()
