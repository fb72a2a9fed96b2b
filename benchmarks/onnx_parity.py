"""ONNX parity and int8: the exported graphs against PyTorch on Flickr8k test images.

    python benchmarks/onnx_parity.py --n 1000 --dataset ../shared/data/flickr8k [--beam 3]

Exports the shipped model (float32 and int8 decoder graphs; --onnx DIR reuses an export),
captions the first N test images with PyTorch, onnxruntime float32 and onnxruntime int8 (the
same search code, captionkit.inference.decoding), and prints: the share of captions identical to
PyTorch's, each system's test scores (BLEU-4, ROUGE-L, CIDEr-D; PTB tokenizer in Python),
the graph sizes, and images/s (encoder included, batches of 16). --json writes everything.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from captionkit.data.datasets import load_dataset  # noqa: E402
from captionkit.export.exporters import export_onnx  # noqa: E402
from captionkit.export.onnx_runtime import load_onnx_captioner, read_manifest  # noqa: E402
from captionkit.inference.captioner import Captioner  # noqa: E402
from captionkit.inference.shipped import FAST_MODEL  # noqa: E402
from captionkit.scoring.evaluation import score_captions  # noqa: E402


def caption_all(cap, paths, beam):
    t0 = time.perf_counter()
    out = {p.name: r.text for p, r in cap.caption_files(paths, beam=beam, batch_size=16)}
    return out, len(paths) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1000, help="test images (the split's first N)")
    ap.add_argument("--dataset", default="../shared/data/flickr8k")
    ap.add_argument("--split", default="test")
    ap.add_argument("--beam", type=int, default=3)
    ap.add_argument("--onnx", help="an existing export with int8 graphs (default: export to a temp folder)")
    ap.add_argument("--threads", type=int, default=None, help="torch and onnxruntime threads")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    items = load_dataset(args.dataset).split(args.split)[:args.n]
    refs = {it.name: it.raw for it in items}
    paths = [it.path for it in items]
    ref_cap = Captioner.load(FAST_MODEL, device="cpu")  # ONNX export takes one model (the default is an ensemble)
    folder = Path(args.onnx) if args.onnx else Path(tempfile.mkdtemp(prefix="captionkit-onnx-"))
    if not args.onnx:
        export_onnx(ref_cap, folder, int8=True, model_name="sat-lite2-flickr8k")
    manifest = read_manifest(folder)
    systems = {"pytorch": ref_cap,
               "onnx float32": load_onnx_captioner(folder, "float32", args.threads),
               "onnx int8": load_onnx_captioner(folder, "int8", args.threads)}
    results = {}
    for name, cap in systems.items():
        caps, speed = caption_all(cap, paths, args.beam)
        rep = score_captions(caps, refs, metrics=["bleu", "rouge", "cider"], tokenizer="python", quiet=True)
        results[name] = {"captions": caps, "images_per_s": speed,
                         "scores": {k: round(100 * v, 2) for k, v in rep.scores.items()}}
    ref = results["pytorch"]["captions"]
    print(f"{len(paths)} {args.split} images, beam {args.beam}, export in {folder}")
    print(f"{'system':14s} {'identical':>10s} {'BLEU-4':>7s} {'ROUGE-L':>8s} {'CIDEr':>6s} {'img/s':>7s} {'graphs MB':>9s}")
    for name, r in results.items():
        same = sum(r["captions"][k] == ref[k] for k in ref)
        r["identical"], r["identical_share"] = same, same / len(ref)
        size = None
        if name != "pytorch":
            variant = name.split()[1]
            size = sum((folder / f).stat().st_size for f in manifest["graphs"][variant].values()) / 1e6
        r["graphs_mb"] = size
        s = r["scores"]
        print(f"{name:14s} {100 * r['identical_share']:9.1f}% {s['Bleu_4']:7.2f} {s['ROUGE_L']:8.2f} {s['CIDEr']:6.2f} "
              f"{r['images_per_s']:7.1f} {'' if size is None else f'{size:9.1f}'}")
    f32 = results["onnx float32"]["identical_share"]
    print(f"float32 parity {'PASS' if f32 >= 0.99 else 'FAIL'} (>= 99% identical captions required)")
    if args.json:
        Path(args.json).write_text(json.dumps({"n": len(paths), "beam": args.beam, "results": results}, indent=1))


if __name__ == "__main__":
    main()
