"""Ensembles and consensus (MBR) reranking of the two shipped Lite2 models on the Flickr8k dev
split (1,000 images): scores with the coco-caption scorers and captioning speed.

    OMP_NUM_THREADS=1 nice python benchmarks/ensemble_dev.py [--dataset ../shared/data/flickr8k]
        [--beam 3] [--nbest 5] [--no-meteor] [--out DIR]

Rows (beam 3 unless said):
- each model alone, at its own dev-tuned length penalty;
- their ensemble (captionkit.ensemble), weights 0.5/0.5, log-linear, length penalty 1.0/1.5/2.0,
  and the linear (probability-mean) combination at length penalty 1.0;
- MBR (captionkit.rerank) over the union of both models' beam-``nbest`` n-best lists (each at its
  own length penalty): uniform weights, probability weights, and uniform with document
  frequencies from batches of 16 images (what ``caption``/``evaluate --rerank mbr`` do) instead
  of all 1,000;
- MBR over the ensemble's own beam-``nbest`` n-best list (length penalty 1.0).

Speed is images/s of decoding from cached encoder rows (the encoder excluded: it runs once per
image whatever the decoders are), one batch of 16 images at a time, on this machine as loaded
when it ran; MBR rows include their n-best decoding and the reranking. Scores are x100.
The test split is never touched: selection happens on dev (issue 21's rules).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODELS = ("transformer-lite2-flickr8k", "sat-lite2-flickr8k")
BATCH = 16


def feature_store(cache_key: str, names: list[str]):
    """The cached feature set (captionkit features) that holds every image of ``names``."""
    from captionkit.features import FeatureStore, default_cache_root

    for folder in sorted((default_cache_root() / cache_key).glob("*/")):
        if (folder / "meta.json").is_file():
            store = FeatureStore(folder)
            if all(n in store for n in names):
                return store
    raise SystemExit(f"no cached {cache_key} features hold the dev images under {default_cache_root()}: "
                     f"run `captionkit features --dataset ...` first")


def batches(store, names: list[str]):
    import torch
    for i in range(0, len(names), BATCH):
        yield names[i:i + BATCH], torch.from_numpy(store.rows(names[i:i + BATCH]).astype("float32"))


def decode_all(cap, store, names, beam: int, lp: float):
    """{image: caption} and seconds spent decoding."""
    out, secs = {}, 0.0
    for chunk, feats in batches(store, names):
        t0 = time.perf_counter()
        caps = cap.decode_features(feats, beam=beam, length_penalty=lp)
        secs += time.perf_counter() - t0
        out.update({n: cap.text(c) for n, c in zip(chunk, caps)})
    return out, secs


def nbest_all(cap, store, names, n: int, lp: float | None = None):
    """{image: [(caption, logprob), ...]} best first, and seconds spent decoding."""
    out, secs = {}, 0.0
    for chunk, feats in batches(store, names):
        t0 = time.perf_counter()
        lists = cap.nbest_features(feats, n, n, lp)
        secs += time.perf_counter() - t0
        out.update({k: [(cap.text(c), c.logprob) for c in caps] for k, caps in zip(chunk, lists)})
    return out, secs


def mbr(lists: list[dict], names: list[str], weighted: bool = False, pool: int | None = None):
    """MBR over the union of n-best lists -> ({image: caption}, seconds). ``pool``: rerank that
    many images at a time (document frequencies from them only)."""
    from captionkit.rerank import mbr_choice, sequence_weights

    t0 = time.perf_counter()
    cands = {k: [t for lst in lists for t, _ in lst[k]] for k in names}
    weights = None
    if weighted:  # each list's probabilities renormalised over the list, the lists weighted equally
        weights = {k: [w / len(lists) for lst in lists for w in sequence_weights([lp for _, lp in lst[k]])]
                   for k in names}
    pool = pool or len(names)
    out = {}
    for i in range(0, len(names), pool):
        part = names[i:i + pool]
        choice = mbr_choice({k: cands[k] for k in part}, {k: weights[k] for k in part} if weights else None)
        out.update({k: cands[k][choice[k]] for k in part})
    return out, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default=str(ROOT.parent / "shared" / "data" / "flickr8k"))
    ap.add_argument("--beam", type=int, default=3)
    ap.add_argument("--nbest", type=int, default=5, help="n-best size (and beam) of the MBR rows")
    ap.add_argument("--no-meteor", action="store_true", help="skip METEOR (the Java jar)")
    ap.add_argument("--out", help="write every row's captions here as ROW.json (a new folder)")
    args = ap.parse_args()
    import torch

    from captionkit.captioner import Captioner
    from captionkit.data import load_dataset
    from captionkit.evaluation import score_captions
    from captionkit.outputs import atomic_write_text, check_folder_target, write_marker

    out_dir = check_folder_target(args.out, overwrite=False) if args.out else None
    torch.set_num_threads(1)
    items = load_dataset(args.dataset).split("dev")
    names = [it.name for it in items]
    refs = {it.name: it.raw for it in items}
    t_model, t_sat = (Captioner.load(m, with_encoder=False) for m in MODELS)
    store = feature_store(t_model.config["encoder"]["cache_key"], names)
    metrics = ("bleu", "cider") if args.no_meteor else ("bleu", "meteor", "cider")
    rows: list[tuple[str, dict, float]] = []

    def report(label: str, caps: dict, secs: float) -> None:
        rep = score_captions(caps, refs, metrics=metrics, quiet=True)
        s = rep.scores
        line = (f"{label:58s} {100 * s['Bleu_4']:6.2f} " + (f"{100 * s['METEOR']:6.2f} " if "METEOR" in s else "")
                + f"{100 * s['CIDEr']:6.2f} {len(caps) / secs:8.1f}")
        print(line, flush=True)
        rows.append((label, s, len(caps) / secs))
        if out_dir:
            slug = "".join(ch if ch.isalnum() or ch in ".-" else "_" for ch in label).strip("_")
            atomic_write_text(out_dir / f"{len(rows):02d}_{slug}.json", json.dumps(caps, indent=1))

    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
        write_marker(out_dir, "benchmark")
    print(f"Flickr8k dev, {len(names)} images, beam {args.beam}; scores x100 (coco-caption scorers); "
          f"speed: images/s decoding cached Lite2 rows, encoder excluded, batches of {BATCH}, 1 thread")
    print(f"{'system':58s} {'BLEU-4':>6s} " + ("" if args.no_meteor else f"{'METEOR':>6s} ") + f"{'CIDEr':>6s} {'img/s':>8s}")
    for name, cap in zip(MODELS, (t_model, t_sat)):
        lp = cap.length_penalty
        report(f"{name} alone, lp {lp:g}", *decode_all(cap, store, names, args.beam, lp))
    for combine, lps in (("loglinear", (1.0, 1.5, 2.0)), ("linear", (1.0,))):
        ens = Captioner.load_ensemble(MODELS, [0.5, 0.5], combine=combine, with_encoder=False)
        for lp in lps:
            report(f"ensemble 0.5/0.5 {combine}, lp {lp:g}", *decode_all(ens, store, names, args.beam, lp))
    n = args.nbest
    lists, secs = zip(*(nbest_all(cap, store, names, n) for cap in (t_model, t_sat)))
    dec = sum(secs)
    for label, kw in ((f"MBR over both models' {n}-best (uniform)", {}),
                      (f"MBR over both models' {n}-best (probability-weighted)", {"weighted": True}),
                      (f"MBR over both models' {n}-best (uniform, pools of {BATCH})", {"pool": BATCH})):
        caps, rerank_secs = mbr(list(lists), names, **kw)
        report(label, caps, dec + rerank_secs)
        print(f"  (decoding {dec:.1f} s, reranking {rerank_secs:.1f} s)")
    ens = Captioner.load_ensemble(MODELS, [0.5, 0.5], with_encoder=False)
    ens_lists, secs = nbest_all(ens, store, names, n, 1.0)
    caps, rerank_secs = mbr([ens_lists], names)
    report(f"MBR over the ensemble's {n}-best (lp 1, uniform)", caps, secs + rerank_secs)
    print(f"  (decoding {secs:.1f} s, reranking {rerank_secs:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
