"""Speed figures for the soft-attention pipeline, measured in one run on this machine.

    python benchmarks/speed.py [--quick]

Prints:
1. the machine's matmul peak (fp32 and bf16, 2048^3), for reference;
2. feature extraction images/s (JPEG decode + resize + EfficientNet-Lite2);
3. decoder training captions/s at the sgrvinod tutorial's sizes (196 locations x 1280 features,
   attention/embedding/LSTM width 512, batch 32, vocabulary 2,633, 13 words), for captionkit
   (bf16 mixed precision and fp32) and for a tutorial-style decoder (recomputes the encoder's
   attention projection at every word), with the FLOP rate as a fraction of the fp32 peak;
4. captioning images/s with beam 3, encoder included, and the encoder/decoder split, for the
   default model (what ``captionkit caption`` uses with no --model) or each ``--model`` given.
Every figure is the median of several timed repeats. ``--captioning-only`` runs only 4.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from timing import median_time  # noqa: E402
from tutorial_decoder import TutorialDecoder  # noqa: E402

from captionkit.cli.main import tune_allocator  # noqa: E402
from captionkit.models.sat import SATConfig, SoftAttentionDecoder, caption_loss  # noqa: E402
from captionkit.training.config import TrainConfig  # noqa: E402
from captionkit.training.stages import make_optimizer  # noqa: E402

B, L, D, DIM, V, T = 32, 196, 1280, 512, 2633, 13




def matmul_peak(dtype: torch.dtype, repeats: int) -> float:
    n = 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    return 2 * n ** 3 / median_time(lambda: a @ b, repeats)


def train_step_flops() -> float:
    """Multiply-adds of one training step of the SAT decoder at these sizes, x2 for FLOPs,
    x3 for forward + backward (the attention projection's backward needs no input grad: x2)."""
    per_word = (DIM * (DIM + 1 + 4 * DIM)  # h_{t-1} projection: U_a, f_beta, W_hh
                + L * DIM + L * D  # energies, context
                + D * 4 * DIM + DIM * 4 * DIM  # context and embedding gates
                + DIM * DIM + D * DIM + DIM * V)  # deep output layer
    once = L * D * DIM + 2 * (D * DIM + DIM * DIM)  # attention projection, init MLPs
    return 2 * B * (3 * T * per_word + 2 * L * D * DIM + 3 * (once - L * D * DIM))


def bench_training(repeats: int) -> dict:
    torch.manual_seed(0)
    feats = torch.randn(B, L, D).abs()
    ids = torch.randint(4, V, (B, T + 1))
    out = {}
    for precision in ("bf16", "fp32"):
        model = SoftAttentionDecoder(SATConfig(vocab_size=V, feat_dim=D, embed_dim=DIM, hidden_dim=DIM, attn_dim=DIM))
        opt = make_optimizer([{"params": list(model.parameters()), "lr": 4e-4}], TrainConfig(precision=precision))
        x = feats.to(torch.bfloat16) if precision == "bf16" else feats

        def step():
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits, alphas = model(x, ids[:, :-1])
            loss, _ = caption_loss(logits.float(), ids[:, 1:], alphas, 1.0)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            opt.step()

        out[f"captionkit {precision}"] = median_time(step, repeats)
    base = TutorialDecoder(V, feat_dim=D, dim=DIM)
    opt = torch.optim.Adam(base.parameters(), 4e-4)
    lengths = torch.full((B,), T)

    def base_step():
        scores, alphas = base(feats, ids, lengths)
        loss = torch.nn.functional.cross_entropy(scores.reshape(-1, V), ids[:, 1:].reshape(-1))
        loss = loss + ((1.0 - alphas.sum(1)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(base.parameters(), 5.0)
        opt.step()

    out["tutorial-style fp32"] = median_time(base_step, max(3, repeats // 3), warmup=1)
    return out


def sample_photos(n: int) -> list[Path]:
    test = ROOT.parent / "shared" / "data" / "flickr8k"
    if (test / "Flickr_8k.testImages.txt").is_file():
        names = (test / "Flickr_8k.testImages.txt").read_text().split()[:n]
        return [test / "Flicker8k_Dataset" / x for x in names]
    photos = sorted((ROOT / "samples").glob("*.jpg"))
    return [photos[i % len(photos)] for i in range(n)]


def bench_extraction(n: int) -> float:
    from captionkit.encoders import create_encoder
    from captionkit.encoders.features import build_features

    enc = create_encoder("efficientnet_lite2")
    paths = sample_photos(n)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.perf_counter()
        build_features(enc, paths, root=Path(tmp), progress=False)
        return n / (time.perf_counter() - t)


def bench_captioning(n: int, beam: int = 3, model: str | None = None) -> dict:
    from captionkit.data.images import load_rgb, to_tensor
    from captionkit.inference.captioner import Captioner

    cap = Captioner.load(model, device="cpu")
    paths = sample_photos(n)
    t = time.perf_counter()
    results = list(cap.caption_files(paths, beam=beam, batch_size=16))
    total = time.perf_counter() - t
    assert all(not isinstance(r, Exception) for _, r in results)
    x = [to_tensor(load_rgb(p), cap.encoder.preprocess) for p in paths[:16]]
    t_enc = median_time(lambda: cap.encode_batch(x), 3, warmup=1)  # both passes with flip averaging
    feats = cap.encode_batch(x)
    t_dec = median_time(lambda: cap.decode_features(feats, beam=beam), 3, warmup=1)
    return {"images/s": n / total, "encoder ms/image": 1000 * t_enc / 16, "decoding ms/image": 1000 * t_dec / 16}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats and images")
    ap.add_argument("--captioning-only", action="store_true", help="only the captioning figures (4.)")
    ap.add_argument("--model", action="append", help="caption with this model (repeat: each in turn; "
                                                     "default: the default model)")
    args = ap.parse_args()
    tune_allocator()  # as the captionkit command does
    reps, n_img = (3, 32) if args.quick else (7, 160)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    if args.captioning_only:
        return report_captioning(n_img, args.model or [None])
    peak32, peak16 = matmul_peak(torch.float32, reps), matmul_peak(torch.bfloat16, reps)
    print(f"matmul peak (2048^3): fp32 {peak32 / 1e9:.0f} GFLOP/s, bf16 {peak16 / 1e9:.0f} GFLOP/s")

    print(f"feature extraction (EfficientNet-Lite2, 260 px, {n_img} JPEGs): {bench_extraction(n_img):.1f} images/s")

    times = bench_training(reps)
    flops = train_step_flops()
    base = times["tutorial-style fp32"]
    print(f"decoder training at {L} locations x {D} features, width {DIM}, batch {B}, {T} words, vocab {V}:")
    for name, t in times.items():
        print(f"  {name:22s} {B / t:7.1f} captions/s  {flops / t / 1e9:6.1f} GFLOP/s "
              f"= {flops / t / peak32:5.1%} of fp32 peak  ({base / t:4.1f}x tutorial-style)")

    report_captioning(n_img, args.model or [None])


def report_captioning(n_img: int, models: list[str | None]) -> None:
    for model in models:
        c = bench_captioning(n_img, model=model)
        share = c["encoder ms/image"] / (c["encoder ms/image"] + c["decoding ms/image"])
        print(f"captioning with {model or 'the default model'}, beam 3, encoder included ({n_img} JPEGs, "
              f"batch 16): {c['images/s']:.1f} images/s; encoder {c['encoder ms/image']:.1f} ms/image "
              f"({share:.0%}), beam decoding {c['decoding ms/image']:.1f} ms/image ({1 - share:.0%})", flush=True)


if __name__ == "__main__":
    main()
