"""BLEU-1..4, ROUGE-L and CIDEr-D in Python, computing what the coco-caption scorers
(``pycocoevalcap``) compute (equal to 1e-6), with n-grams counted once as integer ids in numpy
arrays, and BLEU kept as per-image sufficient statistics so that bootstrap resampling over
images costs a matrix product instead of a rescoring.

All functions take already tokenised text: {image: "space separated tokens"} for the
candidates and {image: ["tokens", ...]} for the references (see :mod:`captionkit.scoring.ptb_tokenize`).
Scores are unscaled (BLEU and ROUGE-L in 0..1, CIDEr-D in 0..10), as pycocoevalcap returns them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

_TINY, _SMALL = 1e-15, 1e-9  # coco-caption's guards against division by zero


@dataclass
class Corpus:
    """Every candidate and reference as words, and all their 1..n-grams counted once, in flat
    arrays shared by BLEU and CIDEr-D. Sentences 0..N-1 are the candidates (one per image, in
    ``keys`` order), N.. the references; n-grams get integer ids, so counting, clipping and
    tf-idf are numpy operations instead of dictionary loops."""

    keys: list[str]
    n: int
    cand_len: np.ndarray  # (N,) words per candidate
    ref_img: np.ndarray  # (M,) image of each reference
    ref_len: np.ndarray  # (M,) words per reference
    sent: np.ndarray  # (E,) sentence of each (sentence, n-gram) entry
    order: np.ndarray  # (E,) n-gram order - 1
    gram: np.ndarray  # (E,) n-gram id
    count: np.ndarray  # (E,) occurrences of the n-gram in the sentence
    n_grams: int

    @classmethod
    def build(cls, cands: dict[str, str], refs: dict[str, list[str]], n: int = 4) -> "Corpus":
        keys = list(refs)
        sentences = [cands[k].split() for k in keys]
        ref_img = [i for i, k in enumerate(keys) for _ in refs[k]]
        sentences += [r.split() for k in keys for r in refs[k]]
        lens = np.array([len(s) for s in sentences], dtype=np.int64)
        vocab: dict[str, int] = {}
        stream = np.array([vocab.setdefault(w, len(vocab)) for s in sentences for w in s], dtype=np.int64)
        sent_of = np.repeat(np.arange(len(sentences)), lens)  # sentence of every token
        sent, order, gram, count = [], [], [], []
        offset = 0
        for k in range(1, n + 1):
            m = len(stream) - k + 1
            if m <= 0:
                break
            start = np.arange(m)
            ok = sent_of[start] == sent_of[start + k - 1]  # the window stays inside a sentence
            windows = np.stack([stream[j:j + m][ok] for j in range(k)], axis=1)  # (E_k, k)
            if len(windows) == 0:
                continue
            V = max(len(vocab), 1)
            if V ** k < 2 ** 62:  # one int64 code per n-gram: a 1-d sort instead of a row sort
                code = windows @ (V ** np.arange(k, dtype=np.int64))
                _, gid = np.unique(code, return_inverse=True)
            else:
                _, gid = np.unique(windows, axis=0, return_inverse=True)
            gid = gid.reshape(-1) + offset
            offset = int(gid.max()) + 1
            pairs, c = np.unique(sent_of[start[ok]] * (offset + 1) + gid, return_counts=True)
            sent.append(pairs // (offset + 1))
            gram.append(pairs % (offset + 1))
            order.append(np.full(len(pairs), k - 1))
            count.append(c)

        def cat(xs: list[np.ndarray]) -> np.ndarray:
            return np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)

        N = len(keys)
        return cls(keys, n, lens[:N], np.array(ref_img, dtype=np.int64), lens[N:],
                   cat(sent), cat(order), cat(gram), cat(count).astype(np.float64), offset)

    def image_of(self, sent: np.ndarray) -> np.ndarray:
        N = len(self.keys)
        return np.where(sent < N, sent, self.ref_img[np.maximum(sent - N, 0)])


def _corpus(cands, refs) -> Corpus:
    return cands if isinstance(cands, Corpus) else Corpus.build(cands, refs)


def _lookup(keys_sorted: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    """values of ``query`` keys in a sorted key array, 0 where absent."""
    if len(keys_sorted) == 0:
        return np.zeros(len(query))
    pos = np.clip(np.searchsorted(keys_sorted, query), 0, len(keys_sorted) - 1)
    return np.where(keys_sorted[pos] == query, values[pos], 0.0)


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


def bleu_stats(cands: dict[str, str] | Corpus, refs: dict[str, list[str]] | None = None) -> BleuStats:
    c = _corpus(cands, refs)
    N, n, G = len(c.keys), c.n, np.int64(c.n_grams + 1)
    tl = c.cand_len.astype(np.float64)
    # closest reference length, ties to the shorter (coco-caption's "closest")
    reflen = np.zeros(N)
    best = np.full(N, np.inf)
    for r in np.argsort(c.ref_len, kind="stable"):
        i = c.ref_img[r]
        d = abs(c.ref_len[r] - tl[i])
        if d < best[i]:
            best[i], reflen[i] = d, c.ref_len[r]
    guess = np.maximum(0, tl[:, None] - np.arange(n)[None, :])  # (N, n)
    is_ref = c.sent >= N
    img = c.image_of(c.sent)
    key = img * G + c.gram
    # per (image, n-gram): the most times any one reference has it
    rkeys, rinv = np.unique(key[is_ref], return_inverse=True)
    maxref = np.zeros(len(rkeys))
    np.maximum.at(maxref, rinv.reshape(-1), c.count[is_ref])
    hyp = ~is_ref
    clipped = np.minimum(c.count[hyp], _lookup(rkeys, maxref, key[hyp]))
    correct = np.bincount(c.sent[hyp] * n + c.order[hyp], weights=clipped, minlength=N * n).reshape(N, n)
    return BleuStats(tl, reflen, correct, guess)


class SentenceBleu:
    """BLEU-n of single candidates against fixed references, for rewards during self-critical
    training (issue 32: a reward that pays the precision of longer n-grams, which CIDEr-D's
    tf-idf weighting pays little for common phrases).

    A sentence's BLEU is corpus BLEU's formula on its own counts: clipped n-gram matches (each
    n-gram counted at most as often as one reference has it) over the candidate's n-grams, the
    geometric mean over n = 1..n, times the brevity penalty against the reference closest in
    length (ties to the shorter, coco-caption's "closest"). A short caption often has no
    matching 4-gram, which would make its BLEU-4 0 whatever else it gets right, so orders 2..n
    add one to their matches and totals (Lin and Och 2004, "ORANGE", their smoothing for
    sentence-level BLEU); ``smooth=False`` gives ``bleu_stats`` of the one sentence instead.
    Sentences are sequences of tokens (words or ids)."""

    def __init__(self, refs: dict, n: int = 4, smooth: bool = True):
        self.n, self.smooth = n, smooth
        self.refs = {}
        for k, rs in refs.items():  # per image: reference lengths, the most any one has of each n-gram
            most: dict[tuple, int] = {}
            for r in rs:
                for g, c in _ngram_counts(list(r), n).items():
                    most[g] = max(most.get(g, 0), c)
            self.refs[k] = (sorted(len(r) for r in rs), most)

    def score(self, key, words) -> float:
        """BLEU-n (0..1) of one candidate for the image ``key``."""
        words = list(words)
        lengths, most = self.refs[key]
        correct, guess = [0] * self.n, [max(0, len(words) - i) for i in range(self.n)]
        for g, c in _ngram_counts(words, self.n).items():
            correct[len(g) - 1] += min(c, most.get(g, 0))
        log_p = 0.0
        for i in range(self.n):
            add = 1 if self.smooth and i > 0 else 0
            num, den = correct[i] + add, guess[i] + add
            if num == 0 or den == 0:
                return 0.0
            log_p += math.log(num / den)
        reflen = min(lengths, key=lambda x: abs(x - len(words)))  # sorted: ties to the shorter
        bp = 1.0 if len(words) >= reflen else math.exp(1 - reflen / len(words))
        return bp * math.exp(log_p / self.n)


def _ngram_counts(words: list, n: int) -> dict[tuple, int]:
    out: dict[tuple, int] = {}
    for k in range(1, n + 1):
        for i in range(len(words) - k + 1):
            g = tuple(words[i:i + k])
            out[g] = out.get(g, 0) + 1
    return out


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
def cider_d_scores(cands: dict[str, str] | Corpus, refs: dict[str, list[str]] | None = None,
                   sigma: float = 6.0) -> np.ndarray:
    """(N,) per-image CIDEr-D (x10, as coco-caption; the corpus score is their mean).

    Document frequencies come from the references; as in coco-caption, the Gaussian length
    penalty compares bigram counts."""
    c = _corpus(cands, refs)
    pairs = cider_d_pairs(c, sigma=sigma)
    return np.bincount(c.ref_img, weights=pairs, minlength=len(c.keys)) / np.bincount(c.ref_img, minlength=len(c.keys))


def cider_d_pairs(cands: dict[str, str] | Corpus, refs: dict[str, list[str]] | None = None,
                  sigma: float = 6.0) -> np.ndarray:
    """(M,) the CIDEr-D (x10) of each reference's pair: its image's candidate against that one
    reference, in the order of the references (image by image); an image's CIDEr-D is the mean
    of its pairs'. Document frequencies still come from all references."""
    c = _corpus(cands, refs)
    N, n, G = len(c.keys), c.n, np.int64(c.n_grams + 1)
    S = N + len(c.ref_img)
    is_ref = c.sent >= N
    img = c.image_of(c.sent)
    w, norm = tf_idf(c)
    bigrams = np.bincount(c.sent[c.order == 1], weights=c.count[c.order == 1], minlength=S)
    # shared n-grams of every (reference, candidate of its image) pair: sum min(w_h, w_r) * w_r
    hyp = ~is_ref
    hkeys = img[hyp] * G + c.gram[hyp]
    hsort = np.argsort(hkeys)
    wh = _lookup(hkeys[hsort], w[hyp][hsort], img[is_ref] * G + c.gram[is_ref])
    wr = w[is_ref]
    ref_rows = c.sent[is_ref] - N
    M = len(c.ref_img)
    dot = np.bincount(ref_rows * n + c.order[is_ref], weights=np.minimum(wh, wr) * wr,
                      minlength=M * n).reshape(M, n)
    nh, nr = norm[c.ref_img], norm[N:]  # (M, n)
    denom = nh * nr
    val = np.where(denom != 0, dot / np.where(denom != 0, denom, 1.0), dot)
    delta = bigrams[c.ref_img] - bigrams[N:]
    val *= np.exp(-(delta ** 2) / (2 * sigma ** 2))[:, None]
    return val.mean(1) * 10.0


def tf_idf(c: Corpus) -> tuple[np.ndarray, np.ndarray]:
    """CIDEr's tf-idf weight of every (sentence, n-gram) entry of ``c`` (E,), and the norm of each
    sentence's vector of each order (S, n). Document frequencies come from the references: the
    number of images whose references hold the n-gram; the idf is log(images / df)."""
    N, n, G = len(c.keys), c.n, np.int64(c.n_grams + 1)
    S = N + len(c.ref_img)
    is_ref = c.sent >= N
    img = c.image_of(c.sent)
    df = np.bincount(c.gram[is_ref][np.unique(img[is_ref] * G + c.gram[is_ref], return_index=True)[1]],
                     minlength=int(G))
    log_n = math.log(float(N))
    w = c.count * (log_n - np.log(np.maximum(1.0, df[c.gram])))  # (E,)
    norm = np.sqrt(np.bincount(c.sent * n + c.order, weights=w * w, minlength=S * n)).reshape(S, n)
    return w, norm


class CiderD:
    """CIDEr-D of single candidates against fixed references and document frequencies, for
    rewards during self-critical training: the n-gram statistics of the training references
    are computed once, and a candidate is scored alone (``cider_d_scores`` instead takes the
    document frequencies from the evaluated set itself). With the evaluated set's references
    it gives ``cider_d_scores``' numbers. Sentences are sequences of tokens (words or ids)."""

    def __init__(self, refs: dict, n: int = 4, sigma: float = 6.0):
        self.n, self.sigma = n, sigma
        grams = {k: [self._count(r) for r in rs] for k, rs in refs.items()}
        self.df: dict[tuple, int] = {}
        for rs in grams.values():  # the number of images whose references hold the n-gram
            for g in {g for c in rs for g in c}:
                self.df[g] = self.df.get(g, 0) + 1
        self.log_n = math.log(float(max(len(refs), 1)))
        self.refs = {k: [self._vector(c) for c in rs] for k, rs in grams.items()}

    def _count(self, words) -> dict[tuple, int]:
        return _ngram_counts(list(words), self.n)

    def _vector(self, counts: dict[tuple, int]):
        """tf-idf per n-gram, the norm of each order's vector, and the bigram count."""
        vec: dict[tuple, float] = {}
        norm = [0.0] * self.n
        bigrams = 0
        for g, tf in counts.items():
            w = tf * (self.log_n - math.log(max(1.0, self.df.get(g, 0.0))))
            vec[g] = w
            norm[len(g) - 1] += w * w
            if len(g) == 2:
                bigrams += tf
        return vec, [math.sqrt(x) for x in norm], bigrams

    def score(self, key, words) -> float:
        """CIDEr-D (x10) of one candidate for the image ``key``."""
        hv, hn, hb = self._vector(self._count(words))
        refs = self.refs[key]
        total = 0.0
        for rv, rn, rb in refs:
            val = [0.0] * self.n
            for g, w in hv.items():
                r = rv.get(g)
                if r is not None:
                    val[len(g) - 1] += min(w, r) * r
            penalty = math.exp(-((hb - rb) ** 2) / (2 * self.sigma ** 2))
            total += sum((v / (hn[i] * rn[i]) if hn[i] * rn[i] != 0 else v) for i, v in enumerate(val)) * penalty
        return total / self.n / len(refs) * 10.0
