"""Candidates for the shipped default on the Flickr8k dev split (issue 21): ensembles of any
checkpoints, member weights, length penalty, test-time flip averaging and MBR reranking, scored
with the coco-caption scorers from cached encoder rows (the test split is never touched).

    OMP_NUM_THREADS=1 nice python benchmarks/default_dev.py --dataset ../shared/data/flickr8k \\
        --system 'A+B lp=1.5' --system 'A+B lp=1.5 flip' --system 'A+B w=0.6,0.4 lp=1.5 mbr=5' \\
        [--beam 3] [--meteor] [--jsonl results.jsonl]

A system is ``MODEL[+MODEL...]`` (checkpoint folders, ensemble folders or shipped names) followed
by options: ``w=W1,W2,..`` (member weights, default equal), ``lp=X`` (length penalty, default the
model's own), ``flip`` (test-time flip averaging: each member also decodes the mirror image's
features, captionkit.inference.ensemble.with_flip_views), ``mbr=N`` (consensus over the N best beams,
reranked batch by batch as ``caption --rerank mbr`` does).

The photos' features come from the cache ``captionkit features`` writes; the mirror images'
are encoded once into their own cache (features.build_features(flip=True)) the first time a
``flip`` system runs. Speed: images/s of the whole dev pass from cached rows (decoding only, the
encoder excluded), batches of 16, one thread, on whatever else the machine is running.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ensemble_dev import BATCH, feature_store  # noqa: E402  (one way to find the cached rows)


def parse_system(text: str) -> dict:
    models, *opts = text.split()
    spec = {"models": models.split("+"), "weights": None, "lp": None, "flip": False, "mbr": None}
    for o in opts:
        key, _, val = o.partition("=")
        if key == "w":
            spec["weights"] = [float(x) for x in val.split(",")]
        elif key == "lp":
            spec["lp"] = float(val)
        elif key == "flip" and not val:
            spec["flip"] = True
        elif key == "mbr":
            spec["mbr"] = int(val)
        else:
            raise SystemExit(f"system {text!r}: unknown option {o!r}")
    return spec


def load(spec: dict):
    from captionkit.inference.captioner import Captioner
    if len(spec["models"]) == 1 and spec["weights"] is None:
        return Captioner.load(spec["models"][0], with_encoder=False, tta="flip" if spec["flip"] else None,
                               device="cpu")
    return Captioner.load_ensemble(spec["models"], spec["weights"], length_penalty=spec["lp"],
                                   with_encoder=False, tta="flip" if spec["flip"] else None, device="cpu")


def run(cap, spec: dict, stores: list, names: list[str], beam: int) -> tuple[dict[str, str], float]:
    import numpy as np
    import torch
    out, t0 = {}, time.perf_counter()
    for i in range(0, len(names), BATCH):
        chunk = names[i:i + BATCH]
        rows = [s.rows(chunk).astype("float32") for s in stores]
        feats = torch.from_numpy(np.stack(rows, 1) if len(rows) > 1 else rows[0])  # (B, [V,] L, D)
        if spec["mbr"]:
            caps = cap.mbr(cap.nbest_features(feats, spec["mbr"], beam, spec["lp"]))
        else:
            caps = cap.decode_features(feats, beam, spec["lp"])
        out.update({n: cap.text(c) for n, c in zip(chunk, caps)})
    return out, len(names) / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dataset", default=str(ROOT.parent / "shared/data/flickr8k"))
    ap.add_argument("--system", action="append", required=True)
    ap.add_argument("--beam", type=int, default=3)
    ap.add_argument("--meteor", action="store_true", help="also METEOR (the jar; slower)")
    ap.add_argument("--jsonl", help="append each row (settings, scores, speed, captions) to this file")
    args = ap.parse_args()
    specs = [parse_system(s) for s in args.system]

    import torch

    from captionkit.data.datasets import load_dataset
    from captionkit.encoders import create_encoder
    from captionkit.encoders.features import build_features
    from captionkit.scoring.evaluation import score_captions

    torch.set_num_threads(1)
    items = load_dataset(args.dataset).split("dev")
    names = [it.name for it in items]
    refs = {it.name: list(it.raw) for it in items}
    first = load(specs[0]) if specs else None
    cache_key = create_encoder(first.config["encoder"]["name"]).cache_key()
    plain = feature_store(cache_key, names)
    flipped = None
    metrics = ("bleu", "meteor", "cider") if args.meteor else ("bleu", "cider")
    for text, spec in zip(args.system, specs):
        cap = first if spec is specs[0] else load(spec)
        if spec["flip"] and flipped is None:
            flipped = build_features(create_encoder(cap.config["encoder"]["name"]), [it.path for it in items],
                                     flip=True)
        caps, speed = run(cap, spec, [plain, flipped] if spec["flip"] else [plain], names, args.beam)
        rep = score_captions(caps, refs, metrics=metrics, quiet=True)
        scores = {k: round(100 * v, 2) for k, v in rep.scores.items() if k in ("Bleu_4", "METEOR", "CIDEr")}
        print(f"{text}\t{json.dumps(scores)}\t{speed:.1f} images/s", flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(json.dumps({"system": text, "beam": args.beam, "scores": scores,
                                    "images_per_s": round(speed, 1), "captions": caps}) + "\n")


if __name__ == "__main__":
    main()
