"""BLEU-1..4, ROUGE-L and CIDEr-D in Python, computing exactly what the coco-caption scorers
(``pycocoevalcap``) compute, from per-image sufficient statistics so that bootstrap resampling
over images costs a matrix product instead of a rescoring.

All functions take already tokenised text: {image: "space separated tokens"} for the
candidates and {image: ["tokens", ...]} for the references (see :mod:`captionkit.tokenize`).
Scores are unscaled (BLEU and ROUGE-L in 0..1, CIDEr-D in 0..10), as pycocoevalcap returns them.
"""

from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass

import numpy as np

_TINY, _SMALL = 1e-15, 1e-9  # coco-caption's guards against division by zero


def _ngrams(words: list[str], n: int) -> list[Counter]:
    """Counts of the 1..n-grams of ``words``, one Counter per order (unigrams keyed by the
    word itself, longer n-grams by tuples)."""
    return [Counter(words)] + [Counter(zip(*(words[j:] for j in range(k)))) for k in range(2, n + 1)]


@dataclass
class Corpus:
    """Candidates and references split into words and counted once, shared by the metrics."""

    keys: list[str]
    cand_words: list[list[str]]
    cand_ngrams: list[list[Counter]]
    ref_words: list[list[list[str]]]
    ref_ngrams: list[list[list[Counter]]]

    @classmethod
    def build(cls, cands: dict[str, str], refs: dict[str, list[str]], n: int = 4) -> "Corpus":
        keys = list(refs)
        cw = [cands[k].split() for k in keys]
        rw = [[r.split() for r in refs[k]] for k in keys]
        return cls(keys, cw, [_ngrams(w, n) for w in cw], rw, [[_ngrams(w, n) for w in ws] for ws in rw])


def _corpus(cands, refs) -> Corpus:
    return cands if isinstance(cands, Corpus) else Corpus.build(cands, refs)


# ---- BLEU --------------------------------------------------------------------------------
@dataclass
class BleuStats:
    """Per-image counts: (N,) hypothesis and closest reference lengths, (N, n) clipped matches
    and n-gram totals. Corpus BLEU is a function of their sums."""

    testlen: np.ndarray
    reflen: np.ndarray
    correct: np.ndarray
    guess: np.ndarray

    def corpus(self, weights: np.ndarray | None = None, brevity_penalty: bool = True) -> list:
        """BLEU-1..n of the corpus, or (R, n) for bootstrap ``weights`` (R, N): row r counts
        image i weights[r, i] times."""
        return bleu_from_sums(*(weights @ x if weights is not None else x.sum(0)
                                for x in (self.testlen, self.reflen, self.correct, self.guess)),
                              brevity_penalty=brevity_penalty)


def bleu_from_sums(testlen, reflen, correct, guess, brevity_penalty: bool = True):
    """Corpus BLEU-1..n from summed statistics; works on arrays with a leading batch axis."""
    correct, guess = np.asarray(correct, dtype=np.float64), np.asarray(guess, dtype=np.float64)
    prec = (correct + _TINY) / (guess + _SMALL)  # (..., n)
    n = prec.shape[-1]
    scores = np.cumprod(prec, axis=-1) ** (1.0 / np.arange(1, n + 1))
    if brevity_penalty:
        ratio = (np.asarray(testlen, dtype=np.float64) + _TINY) / (np.asarray(reflen, dtype=np.float64) + _SMALL)
        bp = np.where(ratio < 1, np.exp(1 - 1 / np.minimum(ratio, 1)), 1.0)
        scores = scores * np.expand_dims(bp, -1)
    return scores.tolist()


def bleu_stats(cands: dict[str, str] | Corpus, refs: dict[str, list[str]] | None = None, n: int = 4) -> BleuStats:
    c = _corpus(cands, refs)
    N = len(c.keys)
    testlen, reflen = np.zeros(N), np.zeros(N)
    correct, guess = np.zeros((N, n)), np.zeros((N, n))
    for i in range(N):
        tl = len(c.cand_words[i])
        testlen[i] = tl
        reflen[i] = min((abs(len(w) - tl), len(w)) for w in c.ref_words[i])[1]  # "closest", ties to shorter
        guess[i] = [max(0, tl - k + 1) for k in range(1, n + 1)]
        for k in range(n):
            maxref: dict[tuple, int] = {}
            for rc in c.ref_ngrams[i]:
                for g, cnt in rc[k].items():
                    if cnt > maxref.get(g, 0):
                        maxref[g] = cnt
            correct[i, k] = sum(min(maxref.get(g, 0), cnt) for g, cnt in c.cand_ngrams[i][k].items())
    return BleuStats(testlen, reflen, correct, guess)


# ---- ROUGE-L ------------------------------------------------------------------------------
def _lcs(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence, bit-parallel over ``b`` (Hyyro 2004):
    one big-integer step per word of ``a`` instead of a row of the dynamic programme."""
    if not a or not b:
        return 0
    masks: dict[str, int] = {}
    for j, w in enumerate(b):
        masks[w] = masks.get(w, 0) | (1 << j)
    full = (1 << len(b)) - 1
    v = full
    for w in a:
        u = v & masks.get(w, 0)
        v = ((v + u) | (v - u)) & full
    return len(b) - bin(v).count("1")


def rouge_l_scores(cands: dict[str, str], refs: dict[str, list[str]], beta: float = 1.2) -> np.ndarray:
    """(N,) per-image ROUGE-L F-measures (the corpus score is their mean)."""
    out = np.zeros(len(refs))
    for i, k in enumerate(refs):
        c = cands[k].split(" ")  # coco-caption splits on single spaces
        prec, rec = [], []
        for r in refs[k]:
            rt = r.split(" ")
            lcs = _lcs(rt, c)
            prec.append(lcs / len(c))
            rec.append(lcs / len(rt))
        p, r = max(prec), max(rec)
        out[i] = (1 + beta ** 2) * p * r / (r + beta ** 2 * p) if p != 0 and r != 0 else 0.0
    return out


# ---- CIDEr-D ------------------------------------------------------------------------------
def cider_d_scores(cands: dict[str, str] | Corpus, refs: dict[str, list[str]] | None = None, n: int = 4,
                   sigma: float = 6.0, df_refs: dict[str, list[str]] | None = None) -> np.ndarray:
    """(N,) per-image CIDEr-D (x10, as coco-caption; the corpus score is their mean).

    Document frequencies come from ``df_refs`` (default: the references themselves, as
    coco-caption). As in coco-caption, the Gaussian length penalty compares bigram counts.
    Every sentence's tf-idf vector is computed once (coco-caption recomputes the references')."""
    c = _corpus(cands, refs)
    df_counts = c.ref_ngrams if df_refs is None else \
        [[_ngrams(r.split(), n) for r in rs] for rs in df_refs.values()]
    df: Counter = Counter()
    for sentences in df_counts:
        df.update({g for grams in sentences for order in grams for g in order})
    log_n = math.log(float(len(df_counts)))
    # an n-gram no reference has gets df 0, clipped to 1: weight log_n
    idf = {g: log_n - math.log(max(1.0, d)) for g, d in df.items()}

    def vec(grams: list[Counter]):
        vs, norms = [], []
        for counts in grams:
            v = {g: float(tf) * idf.get(g, log_n) for g, tf in counts.items()}
            w = list(v.values())
            vs.append(v)
            norms.append(math.sqrt(sum(map(operator.mul, w, w))))
        return vs, norms, sum(grams[1].values())  # "length": the number of bigrams

    two_sigma2 = 2 * sigma ** 2
    out = np.zeros(len(c.keys))
    for i in range(len(c.keys)):
        vh, nh, lh = vec(c.cand_ngrams[i])
        total = [0.0] * n
        for grams in c.ref_ngrams[i]:
            vr, nr, lr = vec(grams)
            penalty = math.e ** (-((lh - lr) ** 2) / two_sigma2)
            for k in range(n):
                vhk, vrk = vh[k], vr[k]
                # only shared n-grams contribute: min(w, 0) * 0 is 0
                val = sum(min(vhk[g], vrk[g]) * vrk[g] for g in vhk.keys() & vrk.keys())
                if nh[k] != 0 and nr[k] != 0:
                    val /= nh[k] * nr[k]
                total[k] += val * penalty
        out[i] = float(np.mean(total)) / len(c.ref_ngrams[i]) * 10.0
    return out
