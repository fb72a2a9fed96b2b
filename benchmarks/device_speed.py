"""Captioning and feature extraction speed of the shipped default model on one device.

    python benchmarks/device_speed.py                       # --device auto: a GPU when there is one
    python benchmarks/device_speed.py --device cpu --images 48
    python benchmarks/device_speed.py --device cuda --images 2000 --batch-size 64 --workers 8

Prints the device (the GPU's or the CPU's name), the precision the captioner resolved, and:
1. captions/s: ``Captioner.caption_files`` end to end (JPEG decoding, the encoder, beam search),
   as ``captionkit caption`` runs it, after one warm-up batch;
2. images/s: ``build_features`` of the same images with the default model's encoder into an
   empty temporary cache (float32 on every device, as ``captionkit features``), after one
   warm-up batch of the encoder.
The images are the repository's samples/ photos, repeated to ``--images`` (or a folder's).
Each figure is one timed pass; run it twice and take the second on a machine that is busy.
"""

from __future__ import annotations

import argparse
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

from captionkit.cli.argtypes import device_name  # noqa: E402
from captionkit.cli.main import tune_allocator  # noqa: E402
from captionkit.core.devices import resolve_device  # noqa: E402
from captionkit.core.precision import PRECISIONS  # noqa: E402
from captionkit.data.images import find_images  # noqa: E402
from captionkit.encoders import create_encoder  # noqa: E402
from captionkit.encoders.features import build_features  # noqa: E402
from captionkit.inference.captioner import Captioner  # noqa: E402


def device_label(device: torch.device) -> str:
    """What a reader needs to compare figures: the GPU's name, or the CPU's model and threads."""
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    if device.type == "cpu":
        model = platform.processor() or platform.machine()
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
        return f"cpu ({model}, {torch.get_num_threads()} torch threads)"
    return str(device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def photos(folder: str | None, n: int) -> list[Path]:
    found = find_images([folder]) if folder else sorted((ROOT / "samples").glob("*.jpg"))
    if not found:
        sys.exit(f"no photos in {folder or ROOT / 'samples'}")
    return [found[i % len(found)] for i in range(n)]


def captions_per_second(cap: Captioner, paths: list[Path], beam: int, batch_size: int, workers: int) -> float:
    list(cap.caption_files(paths[:batch_size], beam=beam, batch_size=batch_size, workers=workers))  # warm-up
    synchronize(cap.device)
    t = time.perf_counter()
    results = list(cap.caption_files(paths, beam=beam, batch_size=batch_size, workers=workers))
    synchronize(cap.device)
    elapsed = time.perf_counter() - t
    bad = [str(r) for _, r in results if isinstance(r, Exception)]
    if bad:
        sys.exit(f"unreadable photos: {bad[0]}")
    return len(paths) / elapsed


def images_per_second(encoder_name: str, device: torch.device, paths: list[Path], batch_size: int,
                      workers: int) -> float:
    enc = create_encoder(encoder_name).to(device)
    side = enc.preprocess.size
    enc.encode(torch.zeros(batch_size, 3, side, side))  # warm-up (kernel selection, allocator)
    with tempfile.TemporaryDirectory() as tmp:
        synchronize(device)
        t = time.perf_counter()
        build_features(enc, paths, root=Path(tmp), batch_size=batch_size, progress=False, workers=workers)
        synchronize(device)
        return len(paths) / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", type=device_name, default="auto")
    ap.add_argument("--precision", choices=PRECISIONS, default="auto")
    ap.add_argument("--images", type=int, default=48, help="photos to caption and encode")
    ap.add_argument("--folder", help="photos to use instead of samples/")
    ap.add_argument("--beam", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--workers", type=int, default=2, help="as captionkit caption --workers")
    args = ap.parse_args()
    tune_allocator()  # as the captionkit command does
    try:
        device = resolve_device(args.device)
    except ValueError as e:
        sys.exit(f"device_speed.py: {e}")
    paths = photos(args.folder, args.images)
    cap = Captioner.load(device=device, precision=args.precision)
    print(f"device: {device_label(device)}; torch {torch.__version__}")
    print(f"model: {cap.config['encoder']['name']} + {cap.config['family']} (the shipped default); "
          f"precision {cap.precision}; beam {args.beam}; batch {args.batch_size}; workers {args.workers}; "
          f"{len(paths)} photos")
    cps = captions_per_second(cap, paths, args.beam, args.batch_size, args.workers)
    print(f"captioning: {cps:.2f} captions/s (decoding, encoder and beam search)")
    ips = images_per_second(cap.config["encoder"]["name"], device, paths, args.batch_size, args.workers)
    print(f"feature extraction: {ips:.2f} images/s (float32)")


if __name__ == "__main__":
    main()
