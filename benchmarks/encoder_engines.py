"""The EfficientNet-Lite2 encoder in each engine this CPU offers, on the same photos: time per
image and how far its features are from captionkit's own (PyTorch eager, channels_last).

    python benchmarks/encoder_engines.py [--threads 2] [--images 32] [--compile]

Engines: ``eager`` (Encoder.encode, what captioning runs), ``bf16`` (the same under bf16 autocast,
what --precision auto picks on a CPU with native bf16), ``onnxruntime`` (the encoder exported to
ONNX, float32, CPUExecutionProvider), and with ``--compile`` ``torch.compile`` (inductor; its
first call compiles for a minute or more, not counted). Each engine runs in a process of its
own (an engine's worker threads left spinning would slow the next one's). Each figure is the
median of ``--repeats`` passes over the photos, in batches of 16 (the caption command's); "max
|diff|" is the largest difference from eager's features (0: bit for bit the same).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from speed import sample_photos  # noqa: E402

from captionkit.cli.main import tune_allocator  # noqa: E402


ENGINES = ("eager", "bf16 autocast", "onnxruntime", "torch.compile")


def engine(name: str, enc, tmp: Path):
    """The encoder as ``name`` runs it: pixels (B, 3, S, S) -> features (B, L, D) float32."""
    if name == "eager":
        return enc.encode
    if name == "bf16 autocast":
        def bf16(x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return enc.encode(x).float()
        return bf16
    if name == "onnxruntime":
        import onnxruntime as ort

        path = tmp / "encoder.onnx"
        torch.onnx.export(enc, (torch.zeros(2, 3, 260, 260),), str(path), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "b"}, "y": {0: "b"}}, dynamo=False)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = torch.get_num_threads(), 1
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        return lambda x: torch.from_numpy(session.run(None, {"x": x.contiguous().numpy()})[0])
    compiled = torch.compile(enc)

    def run(x):
        with torch.inference_mode():
            return compiled(x.contiguous(memory_format=torch.channels_last))
    return run


def measure(args: argparse.Namespace) -> None:
    """One engine, in this process: its features to args.out, ms/image as JSON on stdout."""
    from captionkit.data.images import load_rgb, to_tensor
    from captionkit.encoders import create_encoder

    enc = create_encoder("efficientnet_lite2")
    pixels = torch.stack([to_tensor(load_rgb(p), enc.preprocess) for p in sample_photos(args.images)])
    batches = pixels.split(16)
    with tempfile.TemporaryDirectory() as tmp:
        fn = engine(args.engine, enc, Path(tmp))
        torch.save(torch.cat([fn(b) for b in batches]), args.out)  # (also the warm-up, and compile's)
        times = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            for b in batches:
                fn(b)
            times.append(time.perf_counter() - t)
    print(json.dumps(1000 * statistics.median(times) / args.images))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also torch.compile (compiling takes minutes)")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    tune_allocator()
    torch.set_num_threads(args.threads)
    if args.engine:
        return measure(args)
    print(f"torch {torch.__version__}, {args.threads} threads, {args.images} photos in batches of 16")
    names = [n for n in ENGINES if n != "torch.compile" or args.compile]
    with tempfile.TemporaryDirectory() as tmp:
        want = None
        for name in names:
            out = Path(tmp) / f"{len(list(Path(tmp).iterdir()))}.pt"
            run = subprocess.run([sys.executable, __file__, "--engine", name, "--out", str(out), "--threads",
                                  str(args.threads), "--images", str(args.images), "--repeats", str(args.repeats)],
                                 capture_output=True, text=True)
            if run.returncode:
                print(f"{name:15s} failed: {run.stderr.strip().splitlines()[-1]}")
                continue
            got = torch.load(out)
            want = got if want is None else want  # eager's, the first
            print(f"{name:15s} {json.loads(run.stdout.strip().splitlines()[-1]):7.1f} ms/image   "
                  f"max |diff| {(got - want).abs().max().item():.2e}", flush=True)


if __name__ == "__main__":
    main()
