"""Speed figures for the soft-attention pipeline, measured in one run on this machine.

    python benchmarks/speed.py [--quick] [--threads N]
    python benchmarks/speed.py --compare OTHER/src [--quick] [--threads N]   # another tree beside this one

Prints:
1. the machine's matmul peak (fp32, and bf16 where the CPU has it natively; 2048^3), for reference;
2. feature extraction images/s (JPEG decode + resize + EfficientNet-Lite2);
3. decoder training captions/s at the sgrvinod tutorial's sizes (196 locations x 1280 features
   of float16 values, as the feature store keeps them,
   attention/embedding/LSTM width 512, batch 32, vocabulary 2,633, 13 words), for captionkit
   (bf16 mixed precision where the CPU multiplies bf16 natively, and fp32) and for a
   tutorial-style decoder (recomputes the encoder's attention projection at every word), with
   the FLOP rate as a fraction of the fp32 peak;
4. captioning images/s with beam 3, encoder included, and the encoder/decoder split, for the
   default model (what ``captionkit caption`` uses with no --model) or each ``--model`` given,
   as ``captionkit caption`` runs it (batches of 16, two reader threads, ``--precision``).
Every figure is the median of several timed repeats. ``--captioning-only`` runs only 4.,
``--training-only`` only 1. and 3.

``--tutorial-checkout DIR`` times, beside them, the tutorial's own decoder: ``DecoderWithAttention``
from DIR/models.py, a checkout of github.com/sgrvinod/a-PyTorch-Tutorial-to-Image-Captioning kept
outside this repository, trained a batch at a time as its train.py does (captions padded to 52
tokens, scores and targets packed, cross-entropy plus the doubly stochastic term, gradients
clamped element-wise at 5, Adam, the top-5 accuracy it logs), at the same sizes and features.

``--compare OTHER/src`` measures 2.-4. for another checkout of captionkit too (e.g. ``git worktree
add --detach ../old HEAD~5``, then ``--compare ../old/src``): each measurement runs in a child
process per tree (benchmarks/device_path.py's ``run_in_tree``), alternating old, new, old, new
(``--rounds`` times), so both see the same machine; each figure is printed for both trees with
the speed-up (new / old; old / new for times). Captioning figures also say whether the two trees wrote the same captions.
Training's figures come with each tree's share of the matmul peaks (measured in the same child
process) and its multiple of the tutorial-style decoder, whose steps run between the tree's own
in the same child (the median over the rounds of each child's ratio; each child's is printed
too), e.g. ``--compare ../old/src --training-only --threads 2``. Training steps are always
interleaved that way, one step of each decoder a round, so that a ratio's two figures see the
same moment of a shared machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from device_path import run_in_tree  # noqa: E402
from timing import median_time, min_time, use_cpu_time  # noqa: E402
from tutorial_decoder import TutorialDecoder  # noqa: E402

from captionkit.cli.main import tune_allocator  # noqa: E402
from captionkit.core.precision import native_bf16  # noqa: E402
from captionkit.models.sat import SATConfig, SoftAttentionDecoder, caption_loss  # noqa: E402
from captionkit.training.config import TrainConfig  # noqa: E402
from captionkit.training.stages import make_optimizer  # noqa: E402

B, L, D, DIM, V, T = 32, 196, 1280, 512, 2633, 13
EMBED_DROPOUT = 0.0
# bf16 is measured only where the CPU multiplies it natively: elsewhere PyTorch emulates it
# (a 2048^3 matmul at well under 1 GFLOP/s), a figure of the emulation, not of captionkit
TRAIN_PRECISIONS = ("bf16", "fp32") if native_bf16() else ("fp32",)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
OWN = "tutorial's own fp32"  # --tutorial-checkout's figure


def use_recipe_sizes() -> None:
    """configs/sat_lite2_flickr8k.toml's sizes instead of the tutorial's: EfficientNet-Lite2's
    9 x 9 grid, 12 words (Flickr8k's typical training caption), embedding dropout 0.3."""
    global L, T, EMBED_DROPOUT
    L, T, EMBED_DROPOUT = 81, 12, 0.3


def matmul_peak(dtype: torch.dtype, repeats: int) -> float:
    """FLOP/s of the fastest of several 2048^3 matmuls (after one unmeasured): a peak is the
    machine at its best, and on a shared host a median's slow runs would lower it and flatter
    every fraction of it (the median swung 91-151 GFLOP/s in one session on 2 EPYC cores)."""
    n = 2048
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    a @ b
    return 2 * n ** 3 / min_time(lambda: a @ b, max(repeats, 7))


def matmul_peaks(repeats: int) -> dict[str, float]:
    """{precision: peak FLOP/s} for each of TRAIN_PRECISIONS."""
    return {p: matmul_peak(DTYPES[p], repeats) for p in TRAIN_PRECISIONS}


def peaks_text(peaks: dict[str, float]) -> str:
    return "matmul peak (2048^3): " + ", ".join(f"{p} {peaks[p] / 1e9:.0f} GFLOP/s" for p in reversed(TRAIN_PRECISIONS))


def train_step_flops() -> float:
    """Multiply-adds of one training step of the SAT decoder at these sizes, x2 for FLOPs,
    x3 for forward + backward (the attention projection's backward needs no input grad: x2)."""
    per_word = (DIM * (DIM + 1 + 4 * DIM)  # h_{t-1} projection: U_a, f_beta, W_hh
                + L * DIM + L * D  # energies, context
                + D * 4 * DIM + DIM * 4 * DIM  # context and embedding gates
                + DIM * DIM + D * DIM + DIM * V)  # deep output layer
    once = L * D * DIM + 2 * (D * DIM + DIM * DIM)  # attention projection, init MLPs
    return 2 * B * (3 * T * per_word + 2 * L * D * DIM + 3 * (once - L * D * DIM))


def tutorial_step_flops() -> float:
    """The tutorial-style decoder's FLOPs a training step at these sizes: its encoder projection
    (L x D x A) recomputed at every word, forward and weight gradient (the features take no
    gradient, so the projection, the context and init_h/init_c have no input gradient: x2, the
    rest x3). Equals torch.utils.flop_counter's count of its matmuls plus the context's
    element-wise weighted sum, which that leaves out (tests/test_speed_flops.py). This over
    train_step_flops() is the multiple of the tutorial-style decoder that equal GFLOP/s would
    give: 6.5x at the benchmark's sizes."""
    twice = L * D * DIM + L * D  # encoder_att (recomputed every word), the context
    thrice = (DIM * DIM + L * DIM + DIM * D  # decoder_att, full_att, f_beta
              + (DIM + D) * 4 * DIM + DIM * 4 * DIM + DIM * V)  # the LSTM cell's input and hidden, fc
    return 2 * B * (T * (2 * twice + 3 * thrice) + 2 * 2 * D * DIM)  # (+ init_h, init_c)


def tutorial_checkout(folder: Path):
    """The tutorial's models.py module from a checkout of its repository (``--tutorial-checkout``),
    or SystemExit in one line naming the folder."""
    models = folder / "models.py"
    spec = importlib.util.spec_from_file_location("tutorial_checkout_models", models) if models.is_file() else None
    if spec is None:
        raise SystemExit(f"--tutorial-checkout {folder}: no models.py there (a checkout of "
                         "sgrvinod/a-PyTorch-Tutorial-to-Image-Captioning)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not isinstance(getattr(module, "DecoderWithAttention", None), type):
        raise SystemExit(f"--tutorial-checkout {folder}: its models.py defines no DecoderWithAttention")
    return module


def tutorial_train_step(models, feats: torch.Tensor, ids: torch.Tensor):
    """One batch of the tutorial's own training loop (its train.py, per batch) for its
    DecoderWithAttention at these sizes: our code, its model's."""
    from torch.nn.utils.rnn import pack_padded_sequence
    models.device = torch.device("cpu")  # its forward's tensors: its own choice is CUDA on a GPU host
    decoder = models.DecoderWithAttention(attention_dim=DIM, embed_dim=DIM, decoder_dim=DIM, vocab_size=V,
                                          encoder_dim=D, dropout=0.5)
    opt = torch.optim.Adam([p for p in decoder.parameters() if p.requires_grad], lr=4e-4)
    caps = torch.zeros(B, max(52, T + 1), dtype=torch.long)  # its data files pad every caption to 52 tokens
    caps[:, :T + 1] = ids
    caplens = torch.full((B, 1), T + 1)  # <start>, the words, <end>: T words decoded

    def step():
        scores, caps_sorted, decode_lengths, alphas, _ = decoder(feats, caps, caplens)
        scores = pack_padded_sequence(scores, decode_lengths, batch_first=True).data
        targets = pack_padded_sequence(caps_sorted[:, 1:], decode_lengths, batch_first=True).data
        loss = torch.nn.functional.cross_entropy(scores, targets) + ((1.0 - alphas.sum(dim=1)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        for p in decoder.parameters():
            if p.grad is not None:
                p.grad.clamp_(-5.0, 5.0)
        opt.step()
        top5 = scores.topk(5, 1).indices.eq(targets.unsqueeze(1)).any(1).float().mean().item()  # what it logs
        return loss.item(), top5
    return step


def bench_training(repeats: int, tutorial: bool = True, checkout=None) -> dict:
    """name -> median seconds of a training step: captionkit in bf16 mixed precision (where the
    CPU has native bf16) and fp32, the tutorial-style decoder (``tutorial``) and the tutorial's
    own (``checkout``: its models module, :func:`tutorial_checkout`). Their steps are
    interleaved, one of each per round after two unmeasured, so that every figure sees the same
    machine: on a shared host the load moves within seconds, and the multiple of the tutorial-
    style decoder is a ratio of two of these figures."""
    torch.manual_seed(0)
    # float32 tensors of float16 values, as training reads them from the feature store (every
    # decoder here, old or new, gets the same ones)
    feats = torch.randn(B, L, D).abs().half().float()
    ids = torch.randint(4, V, (B, T + 1))
    steps = {}

    def captionkit_step(precision: str):
        model = SoftAttentionDecoder(SATConfig(vocab_size=V, feat_dim=D, embed_dim=DIM, hidden_dim=DIM, attn_dim=DIM,
                                             embed_dropout=EMBED_DROPOUT))
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
        return step

    for precision in TRAIN_PRECISIONS:
        steps[f"captionkit {precision}"] = captionkit_step(precision)
    if tutorial:
        base = TutorialDecoder(V, feat_dim=D, dim=DIM)
        base_opt = torch.optim.Adam(base.parameters(), 4e-4)
        lengths = torch.full((B,), T)

        def base_step():
            scores, alphas = base(feats, ids, lengths)
            loss = torch.nn.functional.cross_entropy(scores.reshape(-1, V), ids[:, 1:].reshape(-1))
            loss = loss + ((1.0 - alphas.sum(1)) ** 2).mean()
            base_opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(base.parameters(), 5.0)
            base_opt.step()
        steps["tutorial-style fp32"] = base_step
    if checkout is not None:
        steps[OWN] = tutorial_train_step(checkout, feats, ids)
    for step in steps.values():
        step()
        step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            times[name].append(median_time(step, 1, warmup=0))
    return {name: statistics.median(ts) for name, ts in times.items()}


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


def bench_captioning(n: int, beam: int = 3, model: str | None = None, precision: str = "auto") -> dict:
    from captionkit.data.images import load_rgb, to_tensor
    from captionkit.inference.captioner import Captioner

    cap = Captioner.load(model, device="cpu", precision=precision)
    paths = sample_photos(n)
    t = time.perf_counter()
    # as `captionkit caption` reads them: batches of 16, two reader threads (its --workers default)
    results = list(cap.caption_files(paths, beam=beam, batch_size=16, workers=2))
    total = time.perf_counter() - t
    assert all(not isinstance(r, Exception) for _, r in results)
    x = [to_tensor(load_rgb(p), cap.encoder.preprocess) for p in paths[:16]]
    t_enc = median_time(lambda: cap.encode_batch(x), 3, warmup=1)  # both passes with flip averaging
    feats = cap.encode_batch(x)
    t_dec = median_time(lambda: cap.decode_features(feats, beam=beam), 3, warmup=1)
    return {"images/s": n / total, "encoder ms/image": 1000 * t_enc / 16, "decoding ms/image": 1000 * t_dec / 16,
            "precision": cap.precision, "captions": [r.text for _, r in results]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer repeats and images")
    ap.add_argument("--captioning-only", action="store_true", help="only the captioning figures (4.)")
    ap.add_argument("--training-only", action="store_true", help="only the peak and the training figures (1., 3.)")
    ap.add_argument("--model", action="append", help="caption with this model (repeat: each in turn; "
                                                     "default: the default model)")
    ap.add_argument("--precision", default="auto", help="captioning's --precision (default auto, as the command's)")
    ap.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core)")
    ap.add_argument("--recipe-sizes", action="store_true",
                    help="training at configs/sat_lite2_flickr8k.toml's sizes (81 locations, 12 words)")
    ap.add_argument("--cpu-time", action="store_true",
                    help="time the peak and training by the process's CPU time, not the wall clock "
                         "(needs --threads 1: for a machine other work loads)")
    ap.add_argument("--images", type=int, help="JPEGs to caption and to extract (default 160, --quick 32)")
    ap.add_argument("--compare", type=Path, metavar="OTHER/src",
                    help="also measure the captionkit of another tree's src/ folder, alternating with this one")
    ap.add_argument("--rounds", type=int, default=3, help="with --compare: alternating passes per tree (default 3)")
    ap.add_argument("--tutorial-checkout", type=Path, metavar="DIR",
                    help="also time the tutorial's own decoder: a checkout of sgrvinod/a-PyTorch-Tutorial-to-"
                         "Image-Captioning (its models.py), kept outside this repository")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.tutorial_checkout and (args.compare or args.captioning_only):
        ap.error("--tutorial-checkout times this tree's training figures only: without --compare and --captioning-only")
    checkout = tutorial_checkout(args.tutorial_checkout) if args.tutorial_checkout else None
    if args.cpu_time and args.threads != 1:
        ap.error("--cpu-time needs --threads 1 (CPU time counts every thread's waiting too)")
    if args.cpu_time:
        use_cpu_time()
    if args.recipe_sizes:
        use_recipe_sizes()
    tune_allocator()  # as the captionkit command does
    if args.threads:
        torch.set_num_threads(args.threads)
    reps, n_img = (3, 32) if args.quick else (7, 160)
    n_img = args.images or n_img
    if args.child:  # one measurement for --compare, in the tree on PYTHONPATH: JSON on the last line
        return print(json.dumps(child(args.child, reps, n_img, args.precision)))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads" + (", CPU time" if args.cpu_time else ""))
    if args.compare:
        return compare(args, reps, n_img)
    if args.captioning_only:
        return report_captioning(n_img, args.model or [None], args.precision)
    peaks = matmul_peaks(reps)
    print(peaks_text(peaks) + ("" if "bf16" in peaks else "; bf16 not measured: no native bf16 on this CPU (AMX, AVX512-BF16)"))
    if not args.training_only:
        print(f"feature extraction (EfficientNet-Lite2, 260 px, {n_img} JPEGs): {bench_extraction(n_img):.1f} images/s")

    times = bench_training(reps, checkout=checkout)
    base = times["tutorial-style fp32"]
    ours, theirs = train_step_flops(), tutorial_step_flops()
    print(f"decoder training at {L} locations x {D} features, width {DIM}, batch {B}, {T} words, vocab {V} "
          f"({ours / 1e9:.1f} GFLOP a step; the tutorial-style decoder's {theirs / 1e9:.1f}, "
          f"{theirs / ours:.2f}x: its multiple at equal GFLOP/s):")
    for name, t in times.items():
        peak = peaks[name[-4:]]
        flops = theirs if name.startswith("tutorial") else ours
        print(f"  {name:22s} {B / t:7.1f} captions/s  {flops / t / 1e9:6.1f} GFLOP/s "
              f"= {flops / t / peak:5.1%} of the {name[-4:]} peak  ({base / t:5.2f}x tutorial-style)")
    if checkout is not None:
        print(f"  captionkit fp32 is {times[OWN] / times['captionkit fp32']:.2f}x the tutorial's "
              f"own decoder ({args.tutorial_checkout}), trained as its train.py does")
    if not args.training_only:
        report_captioning(n_img, args.model or [None], args.precision)


def report_captioning(n_img: int, models: list[str | None], precision: str = "auto") -> None:
    for model in models:
        c = bench_captioning(n_img, model=model, precision=precision)
        share = c["encoder ms/image"] / (c["encoder ms/image"] + c["decoding ms/image"])
        print(f"captioning with {model or 'the default model'}, beam 3, {c['precision']}, encoder included "
              f"({n_img} JPEGs, batch 16): {c['images/s']:.1f} images/s; encoder {c['encoder ms/image']:.1f} ms/image "
              f"({share:.0%}), beam decoding {c['decoding ms/image']:.1f} ms/image ({1 - share:.0%})", flush=True)


# ---- --compare: this tree against another, each measurement in a child process per tree ------
def child(what: str, reps: int, n_img: int, precision: str) -> dict:
    """One --compare measurement in this process (the tree on PYTHONPATH): name -> figure."""
    if what == "extraction":
        return {"feature extraction images/s": bench_extraction(n_img)}
    if what == "training":  # with the tutorial-style decoder's steps between its own, and the matmul peaks
        out = {f"decoder training {name} captions/s": B / t for name, t in bench_training(reps).items()}
        return {**out, **{f"peak {p}": peak for p, peak in matmul_peaks(reps).items()}}
    model = what.split(":", 1)[1] or None
    c = bench_captioning(n_img, model=model, precision=precision)
    name = model or "default model"
    return {f"captioning {name} images/s": c["images/s"], f"  encoder {name} ms/image": c["encoder ms/image"],
            f"  beam decoding {name} ms/image": c["decoding ms/image"], "captions " + name: c["captions"],
            "precision " + name: c["precision"]}


def report_training_shares(got: dict[str, dict[str, list]]) -> None:
    """Training's figures against the matmul peaks and the tutorial-style decoder, each
    measured in the same child as the tree's own steps: the multiple is the median over the
    rounds of each child's ratio."""
    flops, tut = train_step_flops(), "decoder training tutorial-style fp32 captions/s"
    # one peak per precision for both trees: the median of every child's (the same machine)
    peaks = {p: statistics.median(got["old"]["peak " + p] + got["new"]["peak " + p]) for p in TRAIN_PRECISIONS}
    tutorial = statistics.median(got["old"][tut] + got["new"][tut])
    theirs = tutorial_step_flops()
    t_rate = tutorial / B * theirs
    print(f"  {peaks_text(peaks)}; tutorial-style decoder, fp32: {tutorial:.1f} captions/s "
          f"(median of every child's) = {t_rate / 1e9:.1f} GFLOP/s, {t_rate / peaks['fp32']:.1%} of the fp32 peak; "
          f"its step does {theirs / flops:.2f}x our FLOPs (the multiple at equal GFLOP/s)", flush=True)
    for label in ("old", "new"):
        for p in reversed(TRAIN_PRECISIONS):
            rates = got[label][f"decoder training captionkit {p} captions/s"]
            rate = statistics.median(rates) / B * flops
            multiples = [r / t for r, t in zip(rates, got[label][tut])]  # each child's
            print(f"  {label} {p}: {rate / 1e9:.1f} GFLOP/s = {rate / peaks[p]:.1%} of the {p} peak, "
                  f"{statistics.median(multiples):.2f}x tutorial-style (in its own children: "
                  f"{', '.join(f'{m:.2f}x' for m in multiples)})", flush=True)


def compare(args: argparse.Namespace, reps: int, n_img: int) -> None:
    """Each section measured in a child per tree, alternating old, new; the medians and the speed-up."""
    trees = {"old": args.compare.resolve(), "new": ROOT / "src"}
    sections = ([] if args.captioning_only or args.training_only else ["extraction"]) + \
        ([] if args.captioning_only else ["training"]) + \
        ([] if args.training_only else [f"captioning:{m or ''}" for m in args.model or [None]])
    argv = ["--precision", args.precision, "--images", str(n_img)] + (["--quick"] if args.quick else []) + \
        (["--threads", str(args.threads)] if args.threads else []) + (["--cpu-time"] if args.cpu_time else []) + \
        (["--recipe-sizes"] if args.recipe_sizes else [])
    print(f"old: {trees['old']}\nnew: {trees['new']}\n{args.rounds} alternating rounds, precision {args.precision}, "
          f"{n_img} JPEGs; load average {os.getloadavg()[0]:.2f} (a shared machine's load shows in every figure)")
    print(f"{'figure':52} {'old':>9} {'new':>9} {'speed-up':>8}", flush=True)
    for section in sections:
        got: dict[str, dict[str, list]] = {"old": {}, "new": {}}
        for _ in range(args.rounds):
            for label, src in trees.items():
                for name, value in run_in_tree(src, __file__, ["--child", section, *argv]).items():
                    got[label].setdefault(name, []).append(value)
        if section == "training":
            report_training_shares(got)
        for name, values in got["new"].items():
            old = got["old"].get(name)
            if name.startswith(("precision", "peak", "decoder training tutorial")):
                continue
            if name.startswith("captions"):
                same = sum(a == b for a, b in zip(old[0], values[0]))
                print(f"  same captions, old and new: {same} of {len(values[0])} "
                      f"({got['new']['precision' + name[len('captions'):]][0]})", flush=True)
                continue
            a, b = statistics.median(old), statistics.median(values)
            speedup = a / b if name.endswith("ms/image") else b / a  # (times: less is faster)
            print(f"{name:52} {a:9.1f} {b:9.1f} {speedup:7.2f}x", flush=True)
        print(f"  (load average {os.getloadavg()[0]:.2f})", flush=True)


if __name__ == "__main__":
    main()
