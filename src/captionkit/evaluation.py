"""Scoring captions with the coco-caption scorers (the ``pycocoevalcap`` package).

One function, :func:`coco_scores`, used by ``captionkit evaluate``, ``captionkit score`` and
the trainer's validation, so training-time and reported scores are computed the same way.
Scores are returned unscaled (0..1, CIDEr 0..10); :func:`format_scores` prints them x100.
"""

from __future__ import annotations

import shutil
import sys
from typing import Iterable

METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr")


def have_java() -> bool:
    return shutil.which("java") is not None


def ptb_tokenize(captions: dict[str, list[dict]]) -> dict[str, list[str]]:
    """coco-caption's tokenisation: Stanford PTBTokenizer (the jar pycocoevalcap ships), lower
    case, then its punctuation list removed. Same as pycocoevalcap's PTBTokenizer, but quiet and
    without writing a temporary file into site-packages."""
    import subprocess
    from pathlib import Path

    from pycocoevalcap.tokenizer import ptbtokenizer as ptb

    keys = [k for k, v in captions.items() for _ in v]
    text = "\n".join(c["caption"].replace("\n", " ") for v in captions.values() for c in v)
    jar = Path(ptb.__file__).with_name(ptb.STANFORD_CORENLP_3_4_1_JAR)
    cmd = ["java", "-cp", str(jar), "edu.stanford.nlp.process.PTBTokenizer", "-preserveLines", "-lowerCase"]
    out = subprocess.run(cmd, input=(text + "\n").encode(), capture_output=True, check=True).stdout.decode()
    lines = out.split("\n")
    if len(lines) < len(keys):
        raise RuntimeError(f"PTBTokenizer returned {len(lines)} lines for {len(keys)} captions")
    result: dict[str, list[str]] = {}
    for k, line in zip(keys, lines):
        result.setdefault(k, []).append(" ".join(w for w in line.rstrip().split(" ") if w not in ptb.PUNCTUATIONS))
    return result


def _simple_tokenize(texts: dict[str, list[str]]) -> dict[str, list[str]]:
    from .data import normalize
    return {k: [" ".join(normalize(t)) for t in v] for k, v in texts.items()}


def coco_scores(captions: dict[str, str], refs: dict[str, list[str]],
                metrics: Iterable[str] = ("bleu", "meteor", "rouge", "cider"),
                quiet: bool = False) -> dict[str, float]:
    """Corpus scores of ``captions`` ({image: caption}) against ``refs`` ({image: [refs]}).

    Tokenisation is coco-caption's PTB tokenizer (Java). Without Java, captions are
    tokenised by lower-casing and dropping punctuation, and METEOR is left out with a message.
    """
    missing = sorted(set(refs) ^ set(captions))
    if missing:
        raise ValueError(f"captions and references cover different images, e.g. {missing[:3]}")
    metrics = set(metrics)
    gts = {k: [{"caption": r} for r in refs[k]] for k in refs}
    res = {k: [{"caption": captions[k]}] for k in refs}
    if have_java():
        gts, res = ptb_tokenize(gts), ptb_tokenize(res)
    else:
        gts = _simple_tokenize({k: [c["caption"] for c in v] for k, v in gts.items()})
        res = _simple_tokenize({k: [c["caption"] for c in v] for k, v in res.items()})
        if "meteor" in metrics and not quiet:
            print("METEOR skipped: the METEOR 1.5 scorer needs Java (apt-get install default-jre)",
                  file=sys.stderr)
        metrics.discard("meteor")
    out: dict[str, float] = {}
    if "bleu" in metrics:
        from pycocoevalcap.bleu.bleu import Bleu
        score, _ = Bleu(4).compute_score(gts, res, verbose=0)
        out.update({f"Bleu_{i + 1}": float(s) for i, s in enumerate(score)})
    if "meteor" in metrics:
        from pycocoevalcap.meteor.meteor import Meteor
        meteor = Meteor()  # a Java subprocess, stopped when the object is collected
        out["METEOR"] = float(meteor.compute_score(gts, res)[0])
        del meteor
    if "rouge" in metrics:
        from pycocoevalcap.rouge.rouge import Rouge
        out["ROUGE_L"] = float(Rouge().compute_score(gts, res)[0])
    if "cider" in metrics:
        from pycocoevalcap.cider.cider import Cider
        out["CIDEr"] = float(Cider().compute_score(gts, res)[0])
    return {k: out[k] for k in METRICS if k in out}


def format_scores(scores: dict[str, float]) -> str:
    return "  ".join(f"{k} {100 * v:.2f}" for k, v in scores.items())
