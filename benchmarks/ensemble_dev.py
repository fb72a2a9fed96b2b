"""Ensembles and consensus (MBR) reranking of the two shipped Lite2 models on the Flickr8k dev
split (1,000 images): scores with the coco-caption scorers and captioning speed.

    OMP_NUM_THREADS=1 nice python benchmarks/ensemble_dev.py [--dataset ../shared/data/flickr8k]
        [--beam 3] [--nbest 5] [--no-meteor] [--out DIR] [--speed-images 160] [--repeats 3]

Rows (beam 3 unless said):
- each model alone, at its own dev-tuned length penalty;
- their ensemble (captionkit.inference.ensemble), weights 0.5/0.5, log-linear at length penalty 1.0, 1.5
  and 2.0, and the linear (probability-mean) combination at 1.0;
- MBR (captionkit.inference.rerank) over the union of both models' ``nbest``-best lists (beam ``nbest``,
  each model at its own length penalty): uniform weights, probability weights, and uniform with
  document frequencies from pools of 16 images (what ``caption``/``evaluate --rerank mbr`` do
  with their default batch size) instead of all 1,000;
- MBR over the log-linear ensemble's own ``nbest``-best list (length penalty 1.5).

Speed: images/s decoding cached encoder rows (the encoder excluded: it runs once per image
whatever decodes after it), batches of 16, one thread, the median of ``repeats`` runs over the
first ``speed-images`` dev images with the systems interleaved (so a change in the machine's
load falls on all alike); MBR rows include their n-best decoding and the reranking.
Scores x100. The test split is never touched: selection happens on dev (issue 21's rules).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

MODELS = ("transformer-lite2-flickr8k", "sat-lite2-flickr8k")
BATCH = 16


def feature_store(cache_key: str, names: list[str]):
    """The cached feature set (captionkit features) that holds every image of ``names``."""
    from captionkit.encoders.features import FeatureStore, default_cache_root

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


def beam(cap, store, lp: float, width: int):
    """A system: names -> {image: caption}, beam search with ``cap``."""
    def run(names):
        out = {}
        for chunk, feats in batches(store, names):
            out.update({n: cap.text(c) for n, c in zip(chunk, cap.decode_features(feats, beam=width, length_penalty=lp))})
        return out
    return run


class NBest:
    """names -> {image: [(caption, logprob), ...]} best first (beam n). The scoring pass keeps
    the last lists (``memo``), so the MBR rows sharing them decode once; speed runs do not."""

    def __init__(self, cap, store, n: int, lp: float | None = None):
        self.cap, self.store, self.n, self.lp = cap, store, n, lp
        self.memo, self.last = True, (None, None)

    def __call__(self, names: list[str]) -> dict:
        if self.memo and self.last[0] == names:
            return self.last[1]
        out = {}
        for chunk, feats in batches(self.store, names):
            lists = self.cap.nbest_features(feats, self.n, self.n, self.lp)
            out.update({k: [(self.cap.text(c), c.logprob) for c in caps] for k, caps in zip(chunk, lists)})
        self.last = (list(names), out)
        return out


def mbr(sources: list, weighted: bool = False, pool: int | None = None):
    """A system: MBR over the union of the ``sources``' n-best lists; ``weighted``: each list's
    probabilities renormalised over the list, the lists weighted equally; ``pool``: rerank that
    many images at a time (document frequencies from them only; default all)."""
    from captionkit.inference.rerank import mbr_choice, sequence_weights

    def run(names):
        lists = [src(names) for src in sources]
        cands = {k: [t for lst in lists for t, _ in lst[k]] for k in names}
        weights = None
        if weighted:
            weights = {k: [w / len(lists) for lst in lists for w in sequence_weights([lp for _, lp in lst[k]])]
                       for k in names}
        out, size = {}, pool or len(names)
        for i in range(0, len(names), size):
            part = names[i:i + size]
            choice = mbr_choice({k: cands[k] for k in part}, {k: weights[k] for k in part} if weights else None)
            out.update({k: cands[k][choice[k]] for k in part})
        return out
    return run


def speeds(systems: dict, names: list[str], repeats: int) -> dict[str, float]:
    """images/s of each system on ``names``: the median of ``repeats`` runs, the systems
    interleaved so that a change in the machine's load falls on all of them alike."""
    times: dict[str, list[float]] = {k: [] for k in systems}
    for _ in range(repeats):
        for label, run in systems.items():
            t0 = time.perf_counter()
            run(names)
            times[label].append(time.perf_counter() - t0)
    return {k: len(names) / statistics.median(v) for k, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", default=str(ROOT.parent / "shared" / "data" / "flickr8k"))
    ap.add_argument("--beam", type=int, default=3)
    ap.add_argument("--nbest", type=int, default=5, help="n-best size (and beam) of the MBR rows")
    ap.add_argument("--no-meteor", action="store_true", help="skip METEOR (the Java jar)")
    ap.add_argument("--out", help="write every row's captions here as ROW.json (a new folder)")
    ap.add_argument("--speed-images", type=int, default=160, help="images each speed run decodes (0: no speed)")
    ap.add_argument("--repeats", type=int, default=3, help="speed runs per system")
    ap.add_argument("--limit", type=int, help="only the first N dev images (a quick check of the script)")
    args = ap.parse_args()
    import torch

    from captionkit.core.outputs import atomic_write_text, check_folder_target
    from captionkit.data.datasets import load_dataset
    from captionkit.inference.captioner import Captioner
    from captionkit.scoring.evaluation import score_captions

    out_dir = check_folder_target(args.out, overwrite=False) if args.out else None
    torch.set_num_threads(1)
    items = load_dataset(args.dataset).split("dev")[:args.limit]
    names = [it.name for it in items]
    refs = {it.name: it.raw for it in items}
    t_model, t_sat = (Captioner.load(m, with_encoder=False, device="cpu") for m in MODELS)
    store = feature_store(t_model.config["encoder"]["cache_key"], names)
    metrics = ("bleu", "cider") if args.no_meteor else ("bleu", "meteor", "cider")
    n, k = args.nbest, args.beam
    loglinear = Captioner.load_ensemble(MODELS, [0.5, 0.5], with_encoder=False, device="cpu")
    linear = Captioner.load_ensemble(MODELS, [0.5, 0.5], combine="linear", with_encoder=False,
                                    device="cpu")
    both = [NBest(t_model, store, n), NBest(t_sat, store, n)]
    ens_nbest = NBest(loglinear, store, n, 1.5)
    systems = {f"{MODELS[0]} alone, lp {t_model.length_penalty:g}": beam(t_model, store, t_model.length_penalty, k),
               f"{MODELS[1]} alone, lp {t_sat.length_penalty:g}": beam(t_sat, store, t_sat.length_penalty, k),
               **{f"ensemble 0.5/0.5 log-linear, lp {lp:g}": beam(loglinear, store, lp, k) for lp in (1.0, 1.5, 2.0)},
               "ensemble 0.5/0.5 linear, lp 1": beam(linear, store, 1.0, k),
               f"MBR, both models' {n}-best (uniform)": mbr(both),
               f"MBR, both models' {n}-best (prob.-weighted)": mbr(both, weighted=True),
               f"MBR, both models' {n}-best (uniform, pools of {BATCH})": mbr(both, pool=BATCH),
               f"MBR, log-linear ensemble's {n}-best (lp 1.5)": mbr([ens_nbest])}

    print(f"Flickr8k dev, {len(names)} images; beam {k} (MBR rows: beam {n}, {n}-best); scores x100, "
          f"coco-caption scorers", flush=True)
    scores = {}
    for i, (label, run) in enumerate(systems.items()):
        caps = run(names)
        scores[label] = score_captions(caps, refs, metrics=metrics, quiet=True).scores
        if out_dir:
            slug = "".join(ch if ch.isalnum() or ch in ".-" else "_" for ch in label).strip("_")
            atomic_write_text(out_dir / f"{i:02d}_{slug}.json", json.dumps(caps, indent=1))
        print(f"  scored {label}", file=sys.stderr, flush=True)
    for src in (*both, ens_nbest):
        src.memo = False
    speed = speeds(systems, names[:args.speed_images], args.repeats) if args.speed_images else {}
    print(f"speed: images/s decoding cached Lite2 rows (encoder excluded), batches of {BATCH}, one thread, "
          f"median of {args.repeats} interleaved runs over {args.speed_images} images; MBR rows include "
          f"their n-best decoding and the reranking")
    print("| system | BLEU-4 | " + ("" if args.no_meteor else "METEOR | ") + "CIDEr-D | images/s |")
    print("|---|---:|" + ("" if args.no_meteor else "---:|") + "---:|---:|")
    for label, s in scores.items():
        print(f"| {label} | {100 * s['Bleu_4']:.2f} | " + ("" if args.no_meteor else f"{100 * s['METEOR']:.2f} | ")
              + f"{100 * s['CIDEr']:.2f} | " + (f"{speed[label]:.1f} |" if label in speed else "- |"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
