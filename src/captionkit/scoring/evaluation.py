"""Scoring captions the coco-caption way, with confidence intervals and paired comparisons.

One entry point, :func:`score_captions`, used by ``captionkit evaluate``, ``captionkit score``
and the trainer's validation, so training-time and reported scores can never disagree.

- Tokenisation: coco-caption's PTB tokenisation, through the Java jar when Java is present or
  the Python re-implementation otherwise (:mod:`captionkit.scoring.ptb_tokenize`).
- BLEU-1..4, ROUGE-L, CIDEr-D: :mod:`captionkit.scoring.metrics`, equal to pycocoevalcap's to 1e-6.
- METEOR: the METEOR 1.5 jar shipped by pycocoevalcap (Java), or nltk's METEOR with WordNet,
  labelled as the approximation it is.
- SPICE: run when its jars and models are present; otherwise one line says what is missing.
Scores are unscaled (0..1, CIDEr 0..10); :func:`format_scores` prints them x100.
"""

from __future__ import annotations

import atexit
import math
import os
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import numpy as np

from ..core.errors import UserError
from . import metrics as M
from .ptb_tokenize import java_available, jvm_log_flags, tokenize_sets
from .score_inputs import check_captions, check_references

METRICS = ("Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "METEOR", "ROUGE_L", "CIDEr", "SPICE")
DEFAULT_METRICS = ("bleu", "meteor", "rouge", "cider")
# The METEOR 1.5 jar fails on very long segments (here a 50,000-word caption: "could not convert
# string to float"; 20,000 words still worked): it sees at most this many words of each caption
# and reference, and a note says when any was cut. The other metrics use every word.
METEOR_MAX_WORDS = 1000


@dataclass
class Report:
    """Corpus scores with what computed them, and what bootstrap needs."""

    scores: dict[str, float]
    implementation: dict[str, str]
    tokenizer: str
    images: list[str]
    per_image: dict[str, np.ndarray] = field(default_factory=dict)  # ROUGE_L, CIDEr, METEOR, BLEU sentence
    bleu: M.BleuStats | None = None
    bleu_brevity_penalty: bool = True
    meteor_stats: list[str] | None = None  # the METEOR jar's per-image statistics
    empty: list[str] = field(default_factory=list)  # images whose caption has no words after tokenisation
    notes: list[str] = field(default_factory=list)  # what the user should know about these scores

    def resampled(self, weights: np.ndarray) -> dict[str, np.ndarray]:
        """Corpus scores under image weights (R, N) -> {metric: (R,)}."""
        out: dict[str, np.ndarray] = {}
        if self.bleu is not None:
            b = np.asarray(self.bleu.corpus(weights, self.bleu_brevity_penalty))  # (R, 4)
            for k in range(b.shape[1]):
                out[f"Bleu_{k + 1}"] = b[:, k]
        for name, vals in self.per_image.items():
            if name == "METEOR" and self.meteor_stats is not None:
                out[name] = meteor_resampled(self.meteor_stats, weights, self.scores["METEOR"])
            elif name in self.scores:  # corpus score = mean of image scores
                out[name] = weights @ vals / weights.sum(1)
        return out


def _wordnet():
    """nltk's WordNet: the user's nltk data if present, else Debian's wordnet-base files (in a
    folder of links under the captionkit cache, with the lexnames table Debian leaves out)."""
    import nltk
    from nltk.corpus.reader.wordnet import WordNetCorpusReader

    from ..core.cache import cache_dir
    try:
        from nltk.corpus import wordnet
        wordnet.ensure_loaded()
        return wordnet
    except LookupError:
        pass
    debian = Path("/usr/share/wordnet")
    if not (debian / "data.noun").is_file():
        raise UserError("nltk METEOR needs WordNet: install nltk's wordnet data or Debian's "
                         "wordnet-base and wordnet-sense-index")
    root = cache_dir("wordnet")
    if not (root / "lexnames").is_file():  # copied once: nltk refuses links out of its root
        import shutil
        root.mkdir(parents=True, exist_ok=True)
        for f in debian.iterdir():
            if f.is_file():
                shutil.copyfile(f, root / f.name)
        (root / "lexnames").write_text("".join(f"{i:02d}\t{n}\t{p}\n" for i, (n, p) in enumerate(_LEXNAMES)))
    if str(root) not in nltk.data.path:  # nltk only opens files under its data paths
        nltk.data.path.append(str(root))
    class LocalWordNet(WordNetCorpusReader):
        def map_wn(self, version="wordnet"):
            return None  # no mapping to nltk's own WordNet copy, which is not there

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "multilingual functions are not available": not needed
        return LocalWordNet(str(root), None)


_LEXNAMES = [("adj.all", 3), ("adj.pert", 3), ("adv.all", 4)] + \
    [(f"noun.{n}", 1) for n in ("Tops act animal artifact attribute body cognition communication event "
                               "feeling food group location motive object person phenomenon plant "
                               "possession process quantity relation shape state substance time").split()] + \
    [(f"verb.{n}", 2) for n in ("body change cognition communication competition consumption contact "
                               "creation emotion motion perception possession social stative weather").split()] + \
    [("adj.ppl", 3)]


def meteor_nltk(res: dict[str, str], gts: dict[str, list[str]]) -> tuple[float, np.ndarray]:
    from nltk.translate.meteor_score import meteor_score
    wn = _wordnet()
    per = np.array([meteor_score([r.split() for r in gts[k]], res[k].split(), wordnet=wn) for k in gts])
    return float(per.mean()), per


def _meteor_eval(meteor, stats: list[str]) -> tuple[float, list[float]]:
    """The jar's corpus METEOR and segment scores from per-image statistics lines (what
    pycocoevalcap's Meteor.compute_score sends, in the same protocol)."""
    meteor.meteor_p.stdin.write(("EVAL ||| " + " ||| ".join(stats) + "\n").encode())
    meteor.meteor_p.stdin.flush()
    per = [_meteor_number(meteor) for _ in stats]
    return _meteor_number(meteor), per


def _meteor_number(meteor) -> float:
    line = meteor.meteor_p.stdout.readline().strip()
    try:
        return float(line)
    except ValueError:
        raise RuntimeError(f"the METEOR jar answered {line[:200]!r} instead of a score{meteor.log_tail()}") from None


def _meteor_key() -> tuple:
    """What a METEOR jar is started with: its command (pycocoevalcap's, the JVM's logs to standard
    error) and the environment's java options, which the JVM reads as it starts."""
    from pycocoevalcap.meteor import meteor as m

    cmd = ("java", *jvm_log_flags(), "-jar", "-Xmx2G", m.METEOR_JAR, "-", "-", "-stdio", "-l", "en", "-norm")
    return cmd, os.environ.get("JAVA_TOOL_OPTIONS"), os.environ.get("_JAVA_OPTIONS")


def start_meteor():
    """pycocoevalcap's METEOR 1.5 jar, started with its own command, except that the JVM's log
    lines go to standard error: on standard output (Java 9+'s default) the first would be read
    as the first caption's statistics and shift every later answer by one. Standard error goes
    to a temporary file (a pipe nobody reads would stop the jar once full; a failure quotes its
    end). A Java subprocess, stopped by :meth:`stop` or when the object is collected."""
    import subprocess
    import tempfile

    from pycocoevalcap.meteor import meteor as m

    class _Meteor(m.Meteor):
        def __init__(self):  # pycocoevalcap's __init__, with the JVM's logs redirected
            self.key = _meteor_key()
            self.meteor_cmd = list(self.key[0])
            self.pid = os.getpid()  # the process whose server this is (a forked child starts its own)
            self.log = tempfile.TemporaryFile()
            self.meteor_p = subprocess.Popen(self.meteor_cmd, cwd=os.path.dirname(os.path.abspath(m.__file__)),
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
            self.lock = threading.Lock()  # held across a whole call (_meteor_call)

        def alive(self) -> bool:
            return self.meteor_p.poll() is None

        def log_tail(self) -> str:
            try:
                self.log.seek(0, os.SEEK_END)
                self.log.seek(max(0, self.log.tell() - 400))
                tail = self.log.read().decode(errors="replace").strip()
            except (OSError, ValueError):
                return ""
            return f" (its standard error ends: {tail!r})" if tail else ""

        def stop(self) -> None:
            if self.pid != os.getpid():  # a forked child's copy: the parent's jar is not its own
                return
            if self.meteor_p.poll() is None:
                try:
                    self.meteor_p.stdin.close()
                except OSError:
                    pass
                self.meteor_p.kill()
            self.meteor_p.wait()
            self.log.close()

        def __del__(self):  # pycocoevalcap's would kill a jar a forked child inherited from its parent
            if hasattr(self, "meteor_p"):
                self.stop()

    return _Meteor()


# The jar loads its 60 MB paraphrase table as it starts, ~10 s on a 2-core machine, and then
# answers any number of calls (each line of its protocol stands alone): one jar a process serves
# every METEOR of it (`score --compare` and bootstrap made four; `report`, one a run).
_METEOR_SERVER = None
_METEOR_START = threading.Lock()


def meteor_server():
    """This process's running METEOR jar (:func:`start_meteor`), started on first use and kept
    until the process ends; a new one where the last has exited, where the java options it was
    started with changed (``JAVA_TOOL_OPTIONS``), or in a forked child."""
    global _METEOR_SERVER
    with _METEOR_START:
        old = _METEOR_SERVER
        if old is not None and old.pid == os.getpid() and old.alive() and old.key == _meteor_key():
            return old
        if old is not None:
            old.stop()
        _METEOR_SERVER = start_meteor()
        return _METEOR_SERVER


@contextmanager
def _meteor_call():
    """The process's METEOR jar for one call; one that failed midway (its answers no longer line
    up with its questions) is stopped, and the next call starts another."""
    global _METEOR_SERVER
    meteor = meteor_server()
    with meteor.lock:
        try:
            yield meteor
        except BaseException:
            with _METEOR_START:
                if _METEOR_SERVER is meteor:
                    _METEOR_SERVER = None
            meteor.stop()
            raise


@atexit.register
def _stop_meteor_server() -> None:
    if _METEOR_SERVER is not None:
        _METEOR_SERVER.stop()


def meteor_jar(res: dict[str, str], gts: dict[str, list[str]]) -> tuple[float, np.ndarray, list[str]]:
    """METEOR 1.5 as pycocoevalcap computes it, plus each image's statistics line, from which
    the corpus score of any resample is computed (its corpus score is not a mean of image
    scores: :func:`meteor_resampled`)."""
    with _meteor_call() as meteor:
        stats = [meteor._stat(res[k], gts[k]) for k in gts]
        if any(not st for st in stats):
            raise RuntimeError(f"the METEOR jar stopped answering (it gave no statistics for a caption)"
                               f"{meteor.log_tail()}")
        score, per = _meteor_eval(meteor, stats)
    return score, np.asarray(per, dtype=np.float64), stats


def sentence_meteor(captions: list[str], refs: list[list[str]]) -> np.ndarray:
    """METEOR 1.5 of each caption against its own references, by this process's METEOR jar (its
    segment scores, as :func:`meteor_jar` gives them): for rewards during self-critical training
    (a few hundred captions a call, ~0.3 s; the jar starts once, ~10 s). Needs Java."""
    if not java_available():
        raise UserError("METEOR 1.5 needs Java for its jar (apt-get install default-jre)")
    res = {str(i): c for i, c in enumerate(captions)}
    gts = {str(i): list(r) for i, r in enumerate(refs)}
    res, gts, _ = _cut_for_meteor(res, gts)
    return meteor_jar(res, gts)[1]


def meteor_jar_resampled(stats: list[str], weights: np.ndarray) -> np.ndarray:
    """Corpus METEOR of every bootstrap resample: weights (R, N) image counts -> (R,)."""
    with _meteor_call() as meteor:
        return np.array([_meteor_eval(meteor, [st for st, c in zip(stats, row) for _ in range(int(c))])[0]
                         for row in weights])


# METEOR 1.5's parameters as the jar runs them for pycocoevalcap (`-l en -norm`, its English
# defaults): alpha, beta, gamma, delta, and the weights of its four matching stages (exact, stem,
# synonym, paraphrase); Denkowski and Lavie 2014, "Meteor Universal". tests/test_metrics.py
# checks that they give the jar's scores bit for bit.
METEOR_PARAMETERS = (0.85, 0.2, 0.6, 0.75)
METEOR_STAGE_WEIGHTS = (1.0, 0.6, 0.8, 0.6)


def meteor_from_stats(stats: list[str], weights: np.ndarray) -> np.ndarray:
    """Corpus METEOR of image weights (R, N) from the jar's per-image statistics lines, by the
    arithmetic the jar's EVAL runs (its MeteorStats sums and MeteorScorer.computeMetrics), in
    the same order: the statistics are counts, so their weighted sums are exact whatever the
    order, and every later step is the jar's own sequence of float64 operations. -> (R,).

    A line holds 23 numbers: the test and reference lengths and function words, for each of the
    four stages the test and reference content and function matches, the chunks, and the test
    and reference word matches."""
    alpha, beta, gamma, delta = METEOR_PARAMETERS
    s = np.array([[float(x) for x in line.split()] for line in stats], dtype=np.float64).reshape(len(stats), 23)
    stages = s[:, 4:20].reshape(-1, 4, 4)  # (N, stage, [test content, ref content, test function, ref function])
    test_total = np.zeros(len(s))
    ref_total = np.zeros(len(s))
    for i in range(4):  # as the jar reads a line
        test_total, ref_total = test_total + stages[:, i, 0], ref_total + stages[:, i, 1]
        test_total, ref_total = test_total + stages[:, i, 2], ref_total + stages[:, i, 3]
    # an image whose caption is its reference (one chunk, every word matched) adds no chunks
    same = (test_total == s[:, 0]) & (ref_total == s[:, 1]) & (s[:, 20] == 1.0)
    w = np.asarray(weights, dtype=np.float64)  # (R, N)
    t_len, r_len, t_fn, r_fn = w @ s[:, 0], w @ s[:, 1], w @ s[:, 2], w @ s[:, 3]  # (R,)
    t_tot, r_tot, chunks = w @ test_total, w @ ref_total, w @ np.where(same, 0.0, s[:, 20])
    st = np.einsum("rn,nij->rij", w, stages)  # (R, 4, 4)
    with np.errstate(divide="ignore", invalid="ignore"):
        t_wlen = (delta * (t_len - t_fn)) + ((1.0 - delta) * t_fn)
        r_wlen = (delta * (r_len - r_fn)) + ((1.0 - delta) * r_fn)
        t_wm, r_wm = np.zeros(len(w)), np.zeros(len(w))
        for col, share in ((0, delta), (2, 1.0 - delta)):  # each sum: content, then function matches
            for i, mw in enumerate(METEOR_STAGE_WEIGHTS):
                t_wm = t_wm + st[:, i, col] * mw * share
                r_wm = r_wm + st[:, i, col + 1] * mw * share
        precision, recall = t_wm / t_wlen, r_wm / r_wlen
        f_mean = 1.0 / (((1.0 - alpha) / precision) + (alpha / recall))
        identical = (t_tot == t_len) & (r_tot == r_len) & (chunks == 1)
        frag = np.where(identical, 0.0, chunks / ((t_tot + r_tot) / 2))
        # frag ** beta by the C library's pow, one number at a time, as the jar's Math.pow gives
        # it: numpy's vectorised power (its AVX-512 loop) can differ from it in the last bit
        penalty = np.array([math.pow(f, beta) for f in frag.tolist()], dtype=np.float64)
        score = f_mean * (1.0 - gamma * penalty)
    return np.where(np.isnan(score), 0.0, np.maximum(score, 0.0))


def meteor_resampled(stats: list[str], weights: np.ndarray, corpus: float) -> np.ndarray:
    """Corpus METEOR of every bootstrap resample, weights (R, N): :func:`meteor_from_stats`
    (milliseconds for 1,000 resamples; the jar takes ~0.2 s a resample of 1,000 images), where
    it gives this jar's own corpus score ``corpus`` for the unweighted set; otherwise (a METEOR
    other than 1.5's) the jar recomputes each resample, and a line says so."""
    scores = meteor_from_stats(stats, np.vstack([np.ones((1, len(stats))), weights]))  # the unweighted set first
    if abs(scores[0] - corpus) <= 1e-12:
        return scores[1:]
    print("note: this METEOR jar's corpus score is not METEOR 1.5's arithmetic on its statistics; "
          "the jar recomputes each resample (slow)", file=sys.stderr)
    return meteor_jar_resampled(stats, weights)


SPICE_CORENLP_JARS = ("stanford-corenlp-3.6.0.jar", "stanford-corenlp-3.6.0-models.jar")


def spice_dir() -> Path:
    """The folder of pycocoevalcap's SPICE jar (its ``lib/`` holds the jars it needs)."""
    from pycocoevalcap.spice import spice as spice_mod
    return Path(spice_mod.__file__).parent


def run_spice(jar_dir: Path, res: dict[str, str], gts: dict[str, list[str]]) -> tuple[float, np.ndarray]:
    """The SPICE 1.0 jar of ``jar_dir`` on one caption an image -> (corpus F-score, per image).

    pycocoevalcap's ``Spice.compute_score`` runs the same jar with the same options, but writes
    its input, output and parse cache into the jar's own folder, which a read-only install (a
    system site-packages, a container layer) refuses with a traceback, and its constructor
    downloads CoreNLP. Here the input and output are temporary files and the parse cache is
    captionkit's (``$CAPTIONKIT_CACHE/spice``); nothing is written next to the jar."""
    import json
    import subprocess
    import tempfile

    from ..core.cache import cache_dir

    ids = sorted(gts)
    items = [{"image_id": i, "test": res[i], "refs": gts[i]} for i in ids]
    cache = cache_dir("spice")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="captionkit-spice-") as tmp:
        src, out = Path(tmp) / "input.json", Path(tmp) / "output.json"
        src.write_text(json.dumps(items))
        # cwd: the jar finds lib/ from its manifest's relative class path
        subprocess.run(["java", *jvm_log_flags(), "-jar", "-Xmx8G", str(jar_dir / "spice-1.0.jar"), str(src),
                        "-cache", str(cache), "-out", str(out), "-subset", "-silent"],
                       cwd=jar_dir, check=True)
        results = {r["image_id"]: r["scores"] for r in json.loads(out.read_text())}

    def f(scores) -> float:  # the jar writes NaN as null, or as the string "NaN"
        try:
            return float(scores["All"]["f"])
        except (TypeError, ValueError):
            return float("nan")

    per = np.array([f(results[i]) for i in ids], dtype=np.float64)
    return float(np.mean(per)), per


def _spice(res, gts, quiet: bool) -> tuple[float, np.ndarray] | None:
    jar_dir = spice_dir()
    missing = [n for n in SPICE_CORENLP_JARS if not (jar_dir / "lib" / n).is_file()]
    if not java_available() or missing:
        if not quiet:
            why = "Java is not installed" if not java_available() else f"{', '.join(missing)} not in {jar_dir / 'lib'}"
            print(f"SPICE skipped: {why} (its set-up downloads Stanford CoreNLP)", file=sys.stderr)
        return None
    return run_spice(jar_dir, res, gts)


def score_captions(captions: dict[str, str], refs: dict[str, list[str]],
                   metrics: Iterable[str] = DEFAULT_METRICS, tokenizer: str = "auto", meteor: str = "auto",
                   brevity_penalty: bool = True, quiet: bool = False, source: str = "the captions",
                   refs_source: str = "the references") -> Report:
    """Corpus scores of ``captions`` ({image: caption}) against ``refs`` ({image: [refs]}).

    metrics: any of bleu, meteor, rouge, cider, spice. tokenizer: java, python or auto.
    meteor: jar (METEOR 1.5, Java), nltk (approximation), or auto (the jar when Java is there).
    brevity_penalty: False gives BLEU without it, as the Show, Attend and Tell paper reports.
    source, refs_source: what to call the captions and the references in errors (e.g. their files).
    Captions and references of a wrong shape are refused (see :mod:`captionkit.scoring.score_inputs`).
    """
    captions = check_captions(captions, source)
    refs = check_references(refs, refs_source)
    only_c, only_r = sorted(set(captions) - set(refs)), sorted(set(refs) - set(captions))
    if only_c or only_r:
        raise UserError(f"captions and references cover different images: {len(only_c)} only in "
                         f"{source} (e.g. {only_c[:3]}), {len(only_r)} only in {refs_source} (e.g. {only_r[:3]})")
    wanted = set(metrics)
    unknown = wanted - {"bleu", "meteor", "rouge", "cider", "spice"}
    if unknown:
        raise UserError(f"unknown metric(s): {', '.join(sorted(unknown))}")
    keys = list(refs)
    # as coco-caption: the references and the captions are tokenised as two texts, in image order
    (gts, res_lists), tok_name = tokenize_sets([{k: refs[k] for k in keys}, {k: [captions[k]] for k in keys}],
                                               tokenizer)
    res = {k: res_lists[k][0] for k in keys}
    tok_label = "PTB tokenizer (Java jar)" if tok_name == "java" else "PTB tokenizer (Python re-implementation)"
    rep = Report({}, {}, tok_label, keys, bleu_brevity_penalty=brevity_penalty)
    rep.empty = [k for k in keys if not res[k].strip()]
    if rep.empty:
        rep.notes.append(f"{len(rep.empty)} of {len(keys)} captions have no words after tokenisation and "
                         f"score 0 (e.g. {', '.join(rep.empty[:3])})")
    corpus = M.Corpus.build(res, gts) if wanted & {"bleu", "cider"} else None
    if "bleu" in wanted:
        rep.bleu = M.bleu_stats(corpus)
        for i, s in enumerate(rep.bleu.corpus(brevity_penalty=brevity_penalty)):
            rep.scores[f"Bleu_{i + 1}"] = float(s)
            rep.implementation[f"Bleu_{i + 1}"] = "captionkit (= coco-caption BLEU, closest ref length" + \
                ("" if brevity_penalty else ", no brevity penalty") + ")"
    if "meteor" in wanted:
        kind = meteor if meteor != "auto" else ("jar" if java_available() else "nltk")
        if kind == "jar" and not java_available():
            raise UserError("METEOR 1.5 needs Java (apt-get install default-jre), or use --meteor nltk")
        if kind not in ("jar", "nltk", "none"):
            raise UserError(f"unknown METEOR implementation {meteor!r} (jar, nltk, none or auto)")
        got = None
        if kind == "jar":
            res_m, gts_m, cut = _cut_for_meteor(res, gts)
            if cut:
                rep.notes.append(f"METEOR: {cut} captions or references longer than {METEOR_MAX_WORDS} words "
                                 f"were cut to their first {METEOR_MAX_WORDS} words for the METEOR jar")
            score, per, rep.meteor_stats = meteor_jar(res_m, gts_m)
            got = score, per
        elif kind == "nltk":
            try:
                got = meteor_nltk(res, gts)
            except (ValueError, LookupError) as e:
                if meteor != "auto":
                    raise
                if not quiet:  # neither Java nor WordNet: say so, score the rest
                    print(f"METEOR skipped: no Java for the METEOR 1.5 jar, and {e}", file=sys.stderr)
        if got is not None:
            rep.scores["METEOR"], rep.per_image["METEOR"] = got
            rep.implementation["METEOR"] = ("METEOR 1.5 jar (coco-caption)" if kind == "jar" else
                                            "nltk METEOR with WordNet: an approximation, not coco-caption's")
    if "rouge" in wanted:
        per = M.rouge_l_scores(res, gts)
        rep.scores["ROUGE_L"], rep.per_image["ROUGE_L"] = float(per.mean()), per
        rep.implementation["ROUGE_L"] = "captionkit (= coco-caption ROUGE-L, beta 1.2)"
    if "cider" in wanted:
        per = M.cider_d_scores(corpus)
        rep.scores["CIDEr"], rep.per_image["CIDEr"] = float(per.mean()), per
        rep.implementation["CIDEr"] = "captionkit (= coco-caption CIDEr-D, sigma 6, x10)"
    if "spice" in wanted:
        got = _spice(res, gts, quiet)
        if got is not None:
            rep.scores["SPICE"], rep.per_image["SPICE"] = got
            rep.implementation["SPICE"] = "SPICE 1.0 jar (coco-caption)"
    rep.scores = {k: rep.scores[k] for k in METRICS if k in rep.scores}
    return rep


def _cut_for_meteor(res: dict[str, str], gts: dict[str, list[str]]) -> tuple[dict, dict, int]:
    """Captions and references with at most METEOR_MAX_WORDS words, and how many were cut."""
    cut = 0

    def first_words(text: str) -> str:
        nonlocal cut
        words = text.split(" ")
        if len(words) <= METEOR_MAX_WORDS:
            return text
        cut += 1
        return " ".join(words[:METEOR_MAX_WORDS])

    res_m = {k: first_words(v) for k, v in res.items()}
    gts_m = {k: [first_words(r) for r in v] for k, v in gts.items()}
    return res_m, gts_m, cut


def coco_scores(captions: dict[str, str], refs: dict[str, list[str]],
                metrics: Iterable[str] = DEFAULT_METRICS, quiet: bool = False) -> dict[str, float]:
    """Just the corpus scores (see :func:`score_captions`)."""
    return score_captions(captions, refs, metrics=metrics, quiet=quiet).scores


def _weights(n: int, rounds: int, seed: int) -> np.ndarray:
    """(rounds, n) bootstrap counts: each row draws n images with replacement."""
    return np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=rounds).astype(np.float64)


def bootstrap(report: Report, rounds: int = 1000, seed: int = 0, level: float = 0.95) -> dict[str, tuple[float, float]]:
    """Percentile confidence intervals over images for every metric of ``report``."""
    samples = report.resampled(_weights(len(report.images), rounds, seed))
    lo, hi = (1 - level) / 2, 1 - (1 - level) / 2
    return {k: (float(np.quantile(v, lo)), float(np.quantile(v, hi))) for k, v in samples.items()}


def paired_bootstrap(a: Report, b: Report, rounds: int = 1000, seed: int = 0) -> dict[str, dict]:
    """Does system A beat system B? For each metric: both systems are rescored on the same
    resampled image sets; p is the share of resamples where A does not beat B."""
    if a.images != b.images:
        raise ValueError("the two systems were scored on different images")
    w = _weights(len(a.images), rounds, seed)
    sa, sb = a.resampled(w), b.resampled(w)
    out = {}
    for k in sa:
        if k in sb:
            delta = sa[k] - sb[k]
            out[k] = {"A": a.scores[k], "B": b.scores[k], "delta": a.scores[k] - b.scores[k],
                      "p_A_not_better": float(np.mean(delta <= 0)), "p_B_not_better": float(np.mean(delta >= 0))}
    return out


def format_scores(scores: dict[str, float]) -> str:
    return "  ".join(f"{k} {100 * v:.2f}" for k, v in scores.items())
