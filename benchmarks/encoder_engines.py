"""The EfficientNet-Lite2 encoder in each engine this CPU offers, on the same photos: time per
image and how far its features are from captionkit's own (PyTorch eager, channels_last).

    python benchmarks/encoder_engines.py [--threads 2] [--images 32] [--compile]

Engines: ``eager`` (Encoder.encode, what captioning runs), ``bf16`` (the same under bf16 autocast,
what --precision auto picks on a CPU with native bf16), ``onnxruntime`` (the encoder exported to
ONNX, float32, CPUExecutionProvider), and with ``--compile`` ``torch.compile`` (inductor; its
first call compiles for a minute or more, not counted). Each figure is the median of
``--repeats`` passes over the photos, in batches of 16 (the caption command's); "max |diff|" is
the largest difference from eager's features (0: bit for bit the same).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from speed import sample_photos  # noqa: E402

from captionkit.cli.main import tune_allocator  # noqa: E402


def engines(enc, compile_too: bool, tmp: Path) -> dict:
    out = {"eager": enc.encode}

    def bf16(x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return enc.encode(x).float()

    out["bf16 autocast"] = bf16
    try:
        import onnxruntime as ort
    except ImportError:
        print("onnxruntime is not installed: skipped")
    else:
        path = tmp / "encoder.onnx"
        torch.onnx.export(enc, (torch.zeros(2, 3, 260, 260),), str(path), input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "b"}, "y": {0: "b"}}, dynamo=False)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads, opts.inter_op_num_threads = torch.get_num_threads(), 1
        session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
        out["onnxruntime"] = lambda x: torch.from_numpy(session.run(None, {"x": x.contiguous().numpy()})[0])
    if compile_too:
        compiled = torch.compile(enc)

        def run(x):
            with torch.inference_mode():
                return compiled(x.contiguous(memory_format=torch.channels_last))

        out["torch.compile"] = run
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", action="store_true", help="also torch.compile (compiling takes minutes)")
    args = ap.parse_args()
    tune_allocator()
    torch.set_num_threads(args.threads)
    from captionkit.data.images import load_rgb, to_tensor
    from captionkit.encoders import create_encoder

    enc = create_encoder("efficientnet_lite2")
    pixels = torch.stack([to_tensor(load_rgb(p), enc.preprocess) for p in sample_photos(args.images)])
    batches = pixels.split(16)
    want = torch.cat([enc.encode(b) for b in batches])
    print(f"torch {torch.__version__}, {args.threads} threads, {args.images} photos in batches of 16")
    with tempfile.TemporaryDirectory() as tmp:
        found = engines(enc, args.compile, Path(tmp))
        for name, fn in found.items():
            got = torch.cat([fn(b) for b in batches])  # (also the warm-up, and compile's first call)
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                for b in batches:
                    fn(b)
                times.append(time.perf_counter() - t)
            print(f"{name:15s} {1000 * statistics.median(times) / args.images:7.1f} ms/image   "
                  f"max |diff| {(got - want).abs().max().item():.2e}", flush=True)


if __name__ == "__main__":
    main()
