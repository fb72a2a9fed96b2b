"""Scoring speed: captionkit's BLEU+ROUGE-L+CIDEr against pycocoevalcap's on the 1,000 Flickr8k
test images, side by side in one run (medians of repeated runs; pycocoevalcap's time includes
its Java PTB tokenizer start-up, as every coco-caption user pays it).

    python benchmarks/scoring.py [--captions C.json] [--repeats 5]

Default caption set: the sat-lite2-flickr8k LSTM's test captions (tests/data), else each image's first
reference scored against the other four.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLICKR8K = ROOT.parent / "shared" / "data" / "flickr8k"


def pycocoevalcap_three(cands, refs):
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer
    tok = PTBTokenizer()
    gts = tok.tokenize({k: [{"caption": r} for r in v] for k, v in refs.items()})
    res = tok.tokenize({k: [{"caption": cands[k]}] for k in refs})
    b, _ = Bleu(4).compute_score(gts, res, verbose=0)
    return {"Bleu_4": b[3], "ROUGE_L": Rouge().compute_score(gts, res)[0], "CIDEr": Cider().compute_score(gts, res)[0]}


def main() -> None:
    from captionkit.data.datasets import load_dataset
    from captionkit.scoring.evaluation import score_captions

    ap = argparse.ArgumentParser()
    ap.add_argument("--captions")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    items = load_dataset(FLICKR8K).split("test")
    lstm = ROOT / "tests" / "data" / "flickr8k_test_sat_lite2.json"
    if args.captions or lstm.is_file():
        cands = json.loads(Path(args.captions or lstm).read_text())
        refs = {it.name: it.raw for it in items}
        what = args.captions or "the sat-lite2-flickr8k captions"
    else:
        cands, refs = {it.name: it.raw[0] for it in items}, {it.name: it.raw[1:] for it in items}
        what = "first reference vs the other four"
    import os
    import subprocess
    import sys
    import tempfile
    tmp = tempfile.mkdtemp()
    cpath, rpath = os.path.join(tmp, "c.json"), os.path.join(tmp, "r.json")
    Path(cpath).write_text(json.dumps(cands))
    Path(rpath).write_text(json.dumps(refs))
    cli = [sys.executable, "-m", "captionkit.cli.main", "score", "--captions", cpath, "--refs", rpath,
           "--metrics", "bleu,rouge,cider", "--tokenizer", "python"]

    def run_cli():
        subprocess.run(cli, check=True, capture_output=True)
        return scores["captionkit, Python tokenizer"]

    runs = {
        "pycocoevalcap (Java tokenizer)": lambda: pycocoevalcap_three(cands, refs),
        "captionkit, Python tokenizer": lambda: score_captions(cands, refs, ("bleu", "rouge", "cider"),
                                                               tokenizer="python").scores,
        "captionkit, Java tokenizer": lambda: score_captions(cands, refs, ("bleu", "rouge", "cider"),
                                                             tokenizer="java").scores,
        "`captionkit score` command, whole process": run_cli,
    }
    print(f"{len(refs)} Flickr8k test images, {what}; BLEU-1..4 + ROUGE-L + CIDEr-D, "
          f"median of {args.repeats} runs")
    times, scores = {}, {}
    for name, fn in runs.items():
        ts = []
        for _ in range(args.repeats):
            t = time.perf_counter()
            scores[name] = fn()
            ts.append(time.perf_counter() - t)
        times[name] = statistics.median(ts)
    base = times["pycocoevalcap (Java tokenizer)"]
    for name, t in times.items():
        s = scores[name]
        print(f"  {name:42s} {t:6.3f} s  ({t / base:5.1%} of pycocoevalcap)  "
              f"BLEU-4 {100 * s['Bleu_4']:.4f} ROUGE-L {100 * s['ROUGE_L']:.4f} CIDEr {100 * s['CIDEr']:.4f}")


if __name__ == "__main__":
    main()
