"""How varied a set of captions is, beside how accurate (docs/scoring.md, "Diversity").

n-gram scores cannot tell a better captioner from a blander one: a model that gives hundreds of
photos the same safe caption can score well. These figures say what a reader of the captions
sees. Every one is computed on the tokens the scorers see (coco-caption's PTB tokenisation,
lower case, punctuation dropped), so a word count here is the one BLEU and CIDEr-D counted.

On a set {image: [caption, ...]} (one caption per image, or several: an n-best list, samples):

- vocabulary: distinct words over all captions.
- distinct captions: distinct token sequences over all captions.
- novel captions: captions with words that are no training caption (when the training split is
  known), as Shetty et al. 2017 and Deshpande et al. 2019 count them.
- Div-1, Div-2: distinct unigrams (bigrams) over all captions divided by the number of words
  (Shetty et al. 2017); for sets with several captions per image also the same ratio over each
  image's captions, averaged over images (Deshpande et al. 2019).
- mean length in words.
- repeated content phrase: captions in which a content phrase occurs twice (see
  :func:`repeated_phrase`), the loops of "a boat is riding a boat in the water".
- mBLEU-4 (Shetty et al. 2017), several captions per image only: the BLEU-4 of each image's i-th
  caption against its other captions, as coco-caption's corpus BLEU-4 over the images, averaged
  over i. Lower is more diverse.
- Self-CIDEr (Wang and Chan, CVPR 2019), several captions per image only: from the matrix K of
  CIDEr similarities between an image's m captions, with eigenvalues l_1 >= ... >= l_m,
  -log_m(sqrt(l_1) / sum_j sqrt(l_j)), averaged over images: 0 when the captions say the same
  thing, 1 when they share nothing. Higher is more diverse.

:func:`diversity_rows` gives the set's row and the human row (the same figures for the
references). numpy only, like the rest of the scoring wing.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields

import numpy as np

from . import metrics as M
from .ptb_tokenize import tokenize_sets

# Words that are not content: articles and determiners, pronouns, prepositions, conjunctions,
# auxiliaries and a few adverbs, and the PTB tokenizer's clitics. A two-word phrase needs a word
# outside this list to be a content phrase: "a boat" is one, "in a" is not.
STOP_WORDS = frozenset("""
a an the this that these those some any each every another other such no
i me my mine we us our ours you your yours he him his she her hers it its they them their theirs
one ones myself yourself himself herself itself ourselves themselves
what which who whom whose where when why how there here
of in on at by for with without from to into onto upon over under above below up down out off
through across along around about against between among behind beside near next toward towards
past via during before after while than as like
and or but nor so yet if then because though although
is are was were be been being am do does did doing have has had having
will would can could shall should may might must
not very too also just all both few more most much many own same only
's ' n't 're 'm 've 'll 'd
""".split())

PER_IMAGE_FIELDS = ("div_1_per_image", "div_2_per_image", "mbleu_4", "self_cider")


@dataclass
class Diversity:
    """The figures of one set of captions (see the module's doc). Shares are 0..1; the fields
    that need several captions per image (PER_IMAGE_FIELDS) are None on a set with one each,
    novel_captions is None when no training captions were given."""

    images: int
    captions: int
    captions_per_image: int  # the most any image has
    vocabulary: int
    distinct_captions: int
    novel_captions: int | None
    div_1: float
    div_2: float
    mean_length: float
    repeated_phrase: int  # captions with a repeated content phrase
    div_1_per_image: float | None = None
    div_2_per_image: float | None = None
    mbleu_4: float | None = None
    self_cider: float | None = None

    def as_dict(self) -> dict:
        return {f.name: _rounded(getattr(self, f.name)) for f in fields(self)}


def _rounded(v):
    return round(v, 6) if isinstance(v, float) else v


def as_sets(captions: dict) -> dict[str, list[str]]:
    """{image: caption or [caption, ...]} -> {image: [caption, ...]}."""
    return {k: [v] if isinstance(v, str) else list(v) for k, v in captions.items()}


def is_content_word(token: str) -> bool:
    """A token with a letter or digit that is not in STOP_WORDS."""
    return token not in STOP_WORDS and any(ch.isalnum() for ch in token)


def repeated_phrase(words: list[str]) -> tuple[str, str] | None:
    """The first content phrase that occurs twice in a caption, else None.

    A content phrase is two adjacent words of which at least one is a content word
    (:func:`is_content_word`); it repeats when the same two words stand at two positions of
    the caption. "a boat is riding a boat in the water" repeats ("a", "boat"); "a dog runs in a
    park in a city" repeats only "in a", two stop words, and does not count."""
    seen: set[tuple[str, str]] = set()
    for pair in zip(words, words[1:]):
        if not (is_content_word(pair[0]) or is_content_word(pair[1])):
            continue
        if pair in seen:
            return pair
        seen.add(pair)
    return None


def _ngrams(words: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i:i + n]) for i in range(len(words) - n + 1)]


def _div(captions: list[list[str]], n: int) -> float:
    """Distinct n-grams of these captions (within a caption, never across two) over their words."""
    words = sum(len(c) for c in captions)
    return len({g for c in captions for g in _ngrams(c, n)}) / words if words else 0.0


def mbleu_4(sets: dict[str, list[str]]) -> float | None:
    """mBLEU-4 of tokenised sets (see the module's doc); None without an image of two captions."""
    multi = {k: v for k, v in sets.items() if len(v) >= 2}
    if not multi:
        return None
    scores = []
    for i in range(max(len(v) for v in multi.values())):
        keys = [k for k, v in multi.items() if len(v) > i]  # images with an i-th caption
        corpus = M.Corpus.build({k: multi[k][i] for k in keys}, {k: multi[k][:i] + multi[k][i + 1:] for k in keys})
        scores.append(M.bleu_stats(corpus).corpus()[3])
    return float(np.mean(scores))


def self_cider_per_image(sets: dict[str, list[str]]) -> dict[str, float]:
    """Self-CIDEr of every image of tokenised sets that has two captions or more.

    The kernel is CIDEr (Vedantam et al. 2015), as in Wang and Chan: the mean over n = 1..4 of
    the cosine between two captions' tf-idf vectors of n-grams, counted and weighted by
    captionkit's CIDEr-D code (metrics.Corpus, metrics.tf_idf), each image's captions being one
    document for the idf. Not CIDEr-D: its clipping makes the matrix asymmetric, and the
    measure reads the matrix as a Gram matrix (kernelised LSA), whose eigenvalues are the
    squared singular values. An image whose captions have no n-gram of non-zero weight (an
    empty kernel) is left out."""
    keys = list(sets)
    c = M.Corpus.build({k: "" for k in keys}, sets)  # every caption a reference; no candidates
    N = len(keys)
    w, norm = M.tf_idf(c)
    ref = c.sent >= N
    rows = c.sent[ref] - N  # (E,) caption of each entry
    unit = w[ref] / np.where(norm[c.sent[ref], c.order[ref]] > 0, norm[c.sent[ref], c.order[ref]], 1.0)
    gram = c.gram[ref]
    img = c.ref_img[rows]
    first = np.searchsorted(c.ref_img, np.arange(N))  # (N,) first caption row of each image
    order = np.argsort(img, kind="stable")
    bounds = np.searchsorted(img[order], np.arange(N + 1))
    out = {}
    for i, k in enumerate(keys):
        m = len(sets[k])
        if m < 2:
            continue
        e = order[bounds[i]:bounds[i + 1]]
        cols, gid = np.unique(gram[e], return_inverse=True)
        A = np.zeros((m, len(cols)))  # (m, n-grams of the image) unit tf-idf per order
        np.add.at(A, (rows[e] - first[i], gid.reshape(-1)), unit[e])
        K = A @ A.T / c.n  # (m, m) CIDEr similarities: the mean of the n orders' cosines
        lam = np.linalg.eigvalsh(K)
        # rounding leaves the zero eigenvalues of a rank-deficient K at +-1e-17, whose roots
        # (3e-9) would move the score: below 1e-12 of the largest, an eigenvalue is zero
        root = np.sqrt(np.where(lam > 1e-12 * lam.max(), lam, 0.0))
        if root.sum() <= 0:
            continue
        out[k] = max(0.0, -math.log(root.max() / root.sum()) / math.log(m))  # (not -0.0 for one caption m times)
    return out


def self_cider(sets: dict[str, list[str]]) -> float | None:
    per = self_cider_per_image(sets)
    return float(np.mean(list(per.values()))) if per else None


def measure(tokens: dict[str, list[str]], train: set[str] | None = None) -> Diversity:
    """The figures of tokenised sets {image: ["space separated tokens", ...]}; ``train``: the
    training captions' token strings, for novelty."""
    caps = [c for v in tokens.values() for c in v]
    words = [c.split() for c in caps]
    multi = any(len(v) >= 2 for v in tokens.values())
    d = Diversity(
        images=len(tokens), captions=len(caps), captions_per_image=max((len(v) for v in tokens.values()), default=0),
        vocabulary=len({w for c in words for w in c}),
        distinct_captions=len(set(caps)),
        novel_captions=None if train is None else sum(1 for c in caps if c and c not in train),
        div_1=_div(words, 1), div_2=_div(words, 2),
        mean_length=float(np.mean([len(c) for c in words])) if words else 0.0,
        repeated_phrase=sum(1 for c in words if repeated_phrase(c)))
    if multi:
        per_image = [[c.split() for c in v] for v in tokens.values() if len(v) >= 2]
        d.div_1_per_image = float(np.mean([_div(c, 1) for c in per_image]))
        d.div_2_per_image = float(np.mean([_div(c, 2) for c in per_image]))
        d.mbleu_4 = mbleu_4(tokens)
        d.self_cider = self_cider(tokens)
    return d


# A line of these characters keeps its letters and digits, in order, through the PTB tokenizer
# (which splits, lower-cases and drops punctuation, but changes letters and digits only for
# entities, currency signs, fractions, brackets and characters it does not know).
_PLAIN = re.compile(r"[A-Za-z0-9 \t\r\n.,;:!?'\"-]*")
_NOT_ALNUM = re.compile(r"[^a-z0-9]+")


def _squash(text: str) -> str:
    return _NOT_ALNUM.sub("", text.lower())


def training_tokens(train: list[str], tokens: list[str], tokenizer: str = "auto") -> set[str]:
    """The token strings of the training captions that could equal one of ``tokens`` (token
    strings): for novelty. Tokenising all of a large training split (COCO: 560,000 captions)
    would cost seconds; a plain caption (_PLAIN) whose letters and digits differ from every one
    of ``tokens``' cannot tokenise to any of them, so only the others are tokenised."""
    wanted = {_squash(t) for t in tokens}
    maybe = [t for t in train if not _PLAIN.fullmatch(t) or _squash(t) in wanted]
    if not maybe:
        return set()
    (got,), _ = tokenize_sets([{"": maybe}], tokenizer)
    return set(got[""])


def diversity_rows(captions: dict, refs: dict[str, list[str]] | None = None, train: list[str] | None = None,
                   tokenizer: str = "auto") -> dict[str, Diversity]:
    """{"captions": the set's figures, "human": the references' (when given)}.

    captions: {image: caption or [caption, ...]}. The human row takes from each image of the
    references as many references as the set has captions per image (the first ones: one for a
    set of one caption each), except for the per-image figures (PER_IMAGE_FIELDS: Div per image,
    mBLEU-4, Self-CIDEr), which take all of them: an image's references are its human n-best.
    train: the training split's captions (raw), for the novel captions of both rows. Every set
    is tokenised as coco-caption tokenises, each as its own text."""
    sets = as_sets(captions)
    toks, _ = tokenize_sets([sets] + ([refs] if refs is not None else []), tokenizer)
    seen = None if train is None else training_tokens(train, [c for t in toks for v in t.values() for c in v],
                                                      tokenizer)
    rows = {"captions": measure(toks[0], seen)}
    if refs is not None:
        k = max(len(v) for v in sets.values())
        human = measure({img: r[:k] for img, r in toks[1].items()}, seen)
        everyone = measure(toks[1])  # all references, for the per-image fields
        for name in PER_IMAGE_FIELDS:
            setattr(human, name, getattr(everyone, name))
        rows["human"] = human
    return rows


# ---- printing ---------------------------------------------------------------------------------
LABELS = {"vocabulary": "vocabulary (words)", "distinct_captions": "distinct captions",
           "novel_captions": "novel captions", "div_1": "Div-1", "div_2": "Div-2",
           "mean_length": "mean length (words)", "repeated_phrase": "repeated content phrase",
           "div_1_per_image": "Div-1 per image", "div_2_per_image": "Div-2 per image",
           "mbleu_4": "mBLEU-4 (x100)", "self_cider": "Self-CIDEr"}


def cell(d: Diversity, name: str) -> str:
    v = getattr(d, name)
    if v is None:
        return "-"
    if name in ("distinct_captions", "novel_captions", "repeated_phrase"):
        return f"{v:,} ({100 * v / d.captions:.1f}%)" if d.captions else f"{v:,}"
    if name == "vocabulary":
        return f"{v:,}"
    if name == "mean_length":
        return f"{v:.2f}"
    if name == "mbleu_4":
        return f"{100 * v:.2f}"
    return f"{v:.3f}"


def shown_fields(rows: dict[str, Diversity]) -> list[str]:
    """The fields worth a line: those that are None in every row are left out."""
    return [n for n in LABELS if any(getattr(d, n) is not None for d in rows.values())]


def format_diversity(rows: dict[str, Diversity]) -> str:
    """The rows side by side, one figure a line, as evaluate and score print them."""
    names = shown_fields(rows)
    cells = {label: [cell(d, n) for n in names] for label, d in rows.items()}
    widths = {label: max(len(label), *(len(c) for c in col)) for label, col in cells.items()}
    lines = ["  " + " " * 24 + "  ".join(f"{label:>{widths[label]}}" for label in rows)]
    for i, n in enumerate(names):
        lines.append(f"  {LABELS[n]:24s}" + "  ".join(f"{cells[label][i]:>{widths[label]}}" for label in rows))
    return "\n".join(lines)


def markdown_table(rows: dict[str, Diversity]) -> str:
    """The rows as a markdown table, one row each (benchmarks/diversity_table.py, docs)."""
    names = shown_fields(rows)
    out = ["| captions | " + " | ".join(LABELS[n] for n in names) + " |",
           "| --- |" + " ---: |" * len(names)]
    for label, d in rows.items():
        out.append(f"| {label} | " + " | ".join(cell(d, n) for n in names) + " |")
    return "\n".join(out)
