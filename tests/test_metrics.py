"""captionkit's scorers against pycocoevalcap's: equal to 1e-6 on Flickr8k caption sets (when
../shared is there) and on randomly generated captions, with Java and Python tokenisation."""

import json
import os
import random
from pathlib import Path

import numpy as np
import pytest
from helpers import FLICKR8K, needs_java

from captionkit.scoring import metrics as M
from captionkit.scoring.evaluation import bootstrap, paired_bootstrap, score_captions
from captionkit.scoring.ptb_tokenize import tokenize_java, tokenize_python

MODEL_CAPTIONS = Path(__file__).parent / "data" / "flickr8k_test_sat_lite2.json"
needs_flickr = pytest.mark.skipif(not (FLICKR8K / "Flickr8k.token.txt").is_file(),
                                  reason=f"Flickr8k not found at {FLICKR8K}")


def reference_scores(gts: dict, res: dict) -> dict:
    """pycocoevalcap on already tokenised text."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.rouge.rouge import Rouge
    res = {k: [v] for k, v in res.items()}
    b, _ = Bleu(4).compute_score(gts, res, verbose=0)
    return {**{f"Bleu_{i + 1}": s for i, s in enumerate(b)},
            "ROUGE_L": Rouge().compute_score(gts, res)[0], "CIDEr": Cider().compute_score(gts, res)[0]}


def ours(gts: dict, res: dict) -> dict:
    b = M.bleu_stats(res, gts).corpus()
    return {**{f"Bleu_{i + 1}": s for i, s in enumerate(b)},
            "ROUGE_L": M.rouge_l_scores(res, gts).mean(), "CIDEr": M.cider_d_scores(res, gts).mean()}


def assert_parity(cands: dict, refs: dict, tokenizers=("java", "python")) -> None:
    both = {**{("r", k): v for k, v in refs.items()}, **{("c", k): [v] for k, v in cands.items()}}
    for name in tokenizers:
        toks = tokenize_java(both) if name == "java" else tokenize_python(both)
        gts = {k: toks[("r", k)] for k in refs}
        res = {k: toks[("c", k)][0] for k in refs}
        want, got = reference_scores(gts, res), ours(gts, res)
        for k in want:
            assert got[k] == pytest.approx(want[k], abs=1e-6), (name, k)


def random_captions(n: int, seed: int) -> tuple[dict, dict]:
    rng = random.Random(seed)
    words = ("a the dog dogs man woman girl boy runs jumps on in grass red blue ball two people water "
             "snow bike t-shirt it's man's don't").split()
    punct = ["", "", "", ".", ",", "!", " .", " ,", "'s"]

    def sent():
        return " ".join(rng.choice(words) + rng.choice(punct) for _ in range(rng.randint(1, 15)))
    refs = {f"img{i}": [sent() for _ in range(rng.randint(1, 5))] for i in range(n)}
    cands = {k: sent() if rng.random() > 0.05 else "" for k in refs}
    return cands, refs


def test_random_captions_parity_python_tokens():
    cands, refs = random_captions(300, seed=0)
    assert_parity(cands, refs, tokenizers=("python",))


@needs_java
@pytest.mark.slow  # starts the PTB jar
def test_random_captions_parity_and_tokenizers_agree():
    cands, refs = random_captions(300, seed=1)
    assert_parity(cands, refs)
    both = {**{("r", k): v for k, v in refs.items()}, **{("c", k): [v] for k, v in cands.items()}}
    assert tokenize_python(both) == tokenize_java(both)


def _flickr_sets():
    from captionkit.data.datasets import load_dataset
    items = load_dataset(FLICKR8K).split("test")
    rest = {it.name: it.raw[1:] for it in items}
    first = {it.name: it.raw[0] for it in items}
    names = sorted(first)
    shuffled = dict(zip(names, [first[n] for n in random.Random(0).sample(names, len(names))]))
    sets = {"first reference vs the other four": (first, rest),
            "shuffled assignment": (shuffled, {it.name: it.raw for it in items})}
    if MODEL_CAPTIONS.is_file():
        sets["sat-lite2-flickr8k, beam 3"] = (json.loads(MODEL_CAPTIONS.read_text()), {it.name: it.raw for it in items})
    return sets


@needs_java
@needs_flickr
@pytest.mark.slow  # the PTB jar over the Flickr8k test split
def test_flickr8k_test_split_parity_java_and_python_tokens():
    sets = _flickr_sets()
    assert len(sets) == 3, "tests/data/flickr8k_test_sat_lite2.json is missing"
    for name, (cands, refs) in sets.items():
        assert_parity(cands, refs)
        both = {**{("r", k): v for k, v in refs.items()}, **{("c", k): [v] for k, v in cands.items()}}
        assert tokenize_python(both) == tokenize_java(both), name


@needs_java
@pytest.mark.slow  # three starts of the METEOR jar
def test_the_meteor_jar_reads_no_jvm_log_line_as_an_answer(monkeypatch):
    """A log line of the JVM on standard output (Java 9+'s default: a warning on a loaded
    machine, or what JAVA_TOOL_OPTIONS turns on) would be taken for the first caption's
    statistics: the logs go to standard error, and without that the same call fails."""
    from captionkit.scoring import evaluation as ev

    res = {"a": "a dog runs on the grass", "b": "a man rides a bike", "c": "two girls play"}
    gts = {"a": ["a brown dog runs in the grass", "a dog running"], "b": ["a man on a bicycle"],
           "c": ["two young girls are playing", "children play outside"]}
    want, want_per, _ = ev.meteor_jar(res, gts)
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-Xlog:gc*=info")
    got, got_per, _ = ev.meteor_jar(res, gts)
    assert got == want and list(got_per) == list(want_per) and 0 < want < 1
    monkeypatch.setattr(ev, "jvm_log_flags", lambda: ())
    with pytest.raises(RuntimeError, match="METEOR jar answered"):
        ev.meteor_jar(res, gts)


@needs_java
@pytest.mark.slow  # two starts of the METEOR jar
def test_one_meteor_jar_serves_a_process_and_one_that_failed_is_replaced(monkeypatch):
    """The jar takes ~10 s to load: a process keeps one for all its METEOR calls (`score
    --compare` with bootstrap started four). A call midway that fails leaves the jar's answers
    out of step with its questions, so that jar is stopped, and the next call's new one answers
    what the first did; a dead jar is replaced; a forked child never writes to its parent's."""
    from captionkit.scoring import evaluation as ev

    res = {"a": "a dog runs on the grass", "b": "a man rides a bike", "c": "two girls play"}
    gts = {"a": ["a brown dog runs in the grass", "a dog running"], "b": ["a man on a bicycle"],
           "c": ["two young girls are playing", "children play outside"]}
    first = ev.meteor_jar(res, gts)
    server = ev.meteor_server()
    other = ev.meteor_jar({"a": "a cat sleeps"}, {"a": ["a dog runs"]})
    assert other[0] != first[0]
    repeat = ev.meteor_jar(res, gts)  # after another call: the answers of a fresh jar
    assert repeat[0] == first[0] and list(repeat[1]) == list(first[1]) and repeat[2] == first[2]
    resampled = ev.meteor_jar_resampled(first[2], np.array([[1, 1, 1], [2, 0, 1]]))
    assert resampled[0] == first[0] and resampled[1] != first[0]
    assert ev.meteor_server() is server and server.alive()  # one jar for the four calls

    with pytest.raises(KeyError):  # fails after some of its questions were asked
        ev.meteor_jar(res, {**gts, "d": ["a missing caption"]})
    assert not server.alive()
    again = ev.meteor_jar(res, gts)
    assert ev.meteor_server() is not server
    assert again[0] == first[0] and list(again[1]) == list(first[1]) and again[2] == first[2]

    current = ev.meteor_server()
    current.meteor_p.kill()
    current.meteor_p.wait()
    parent = ev.meteor_server()  # (not asked anything: the test does not wait for it to load)
    assert parent is not current and parent.alive()
    real = os.getpid()
    monkeypatch.setattr(ev.os, "getpid", lambda: real + 1)
    child = ev.meteor_server()
    assert child is not parent and parent.alive()  # the child's own; the parent's left running
    child.stop()
    monkeypatch.undo()
    parent.stop()


@needs_java
@needs_flickr
@pytest.mark.slow  # the METEOR jar over 600 Flickr8k test captions and 17 resamples
def test_meteor_of_resamples_from_the_jars_statistics_is_the_jars_bit_for_bit():
    """`score --bootstrap` and `--compare` need METEOR for 1,000 resamples: computed from the
    jar's statistics lines by its own arithmetic (milliseconds), not by the jar (~0.2 s each)."""
    from captionkit.scoring import evaluation as ev

    res, gts = {}, {}
    for tag, (cands, refs) in list(_flickr_sets().items())[:2]:  # matching captions, and unrelated ones
        for name in sorted(refs)[:300]:
            res[f"{tag}/{name}"], gts[f"{tag}/{name}"] = cands[name], refs[name]
    res["same"], gts["same"] = "a dog runs on the grass", ["a dog runs on the grass"]  # one chunk: none counted
    res["none"], gts["none"] = "zebra", ["a dog runs on the grass"]  # nothing matches: 0
    corpus, per, stats = ev.meteor_jar(res, gts)
    n = len(stats)
    weights = np.vstack([np.ones(n, dtype=int), np.eye(n, dtype=int)[[0, 1, n - 2, n - 1]],
                         np.random.default_rng(0).multinomial(n, np.ones(n) / n, size=12)])
    mine = ev.meteor_from_stats(stats, weights)
    assert mine[0] == corpus and list(mine[1:5]) == [per[0], per[1], per[-2], per[-1]]
    assert per[-2] > 0.9 and per[-1] == 0.0
    assert list(mine) == list(ev.meteor_jar_resampled(stats, weights))
    assert list(ev.meteor_resampled(stats, weights, corpus)) == list(mine)


@needs_java
@pytest.mark.slow  # the METEOR jar
def test_a_meteor_whose_arithmetic_is_not_1_5s_is_resampled_by_its_jar(monkeypatch, capsys):
    from captionkit.scoring import evaluation as ev

    res = {"a": "a dog runs on the grass", "b": "a man rides a bike", "c": "two girls play"}
    gts = {"a": ["a brown dog runs in the grass", "a dog running"], "b": ["a man on a bicycle"],
           "c": ["two young girls are playing", "children play outside"]}
    corpus, _, stats = ev.meteor_jar(res, gts)
    weights = np.array([[1, 1, 1], [3, 0, 0], [0, 1, 2]])
    want = ev.meteor_jar_resampled(stats, weights)
    assert list(ev.meteor_resampled(stats, weights, corpus)) == list(want)
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(ev, "METEOR_PARAMETERS", (0.9, 3.0, 0.5, 1.0))  # another METEOR's arithmetic
    assert list(ev.meteor_resampled(stats, weights, corpus)) == list(want)
    assert "the jar recomputes each resample" in capsys.readouterr().err


def _wordnet_available() -> bool:
    from captionkit.scoring.evaluation import _wordnet
    try:
        _wordnet()
        return True
    except (ValueError, LookupError):
        return False


@pytest.mark.skipif(not _wordnet_available(), reason="no WordNet for nltk's METEOR (Debian wordnet-base)")
@pytest.mark.slow  # nltk's METEOR over the Flickr8k test split
def test_nltk_meteor_is_labelled_an_approximation():
    cands, refs = random_captions(20, seed=2)
    rep = score_captions(cands, refs, metrics=("meteor",), tokenizer="python", meteor="nltk")
    assert 0.0 <= rep.scores["METEOR"] <= 1.0
    assert "approximation" in rep.implementation["METEOR"]


def test_bleu_without_brevity_penalty():
    refs = {"a": ["a dog runs on the grass"]}
    short = {"a": "a dog"}
    with_bp = score_captions(short, refs, metrics=("bleu",), tokenizer="python")
    without = score_captions(short, refs, metrics=("bleu",), tokenizer="python", brevity_penalty=False)
    assert without.scores["Bleu_1"] == pytest.approx(1.0)
    assert with_bp.scores["Bleu_1"] == pytest.approx(np.exp(1 - 6 / 2))


def test_mismatched_images_are_named():
    with pytest.raises(ValueError, match=r"1 only in the captions \(e.g. \['extra.jpg'\]\)"):
        score_captions({"a": "x", "extra.jpg": "y"}, {"a": ["x"]})


def test_bootstrap_interval_contains_the_score_and_paired_test_detects_a_better_system():
    cands, refs = random_captions(200, seed=3)
    good = {k: v[0] for k, v in refs.items()}  # a reference itself: clearly better
    rep_bad = score_captions(cands, refs, metrics=("bleu", "rouge", "cider"), tokenizer="python")
    rep_good = score_captions(good, refs, metrics=("bleu", "rouge", "cider"), tokenizer="python")
    ci = bootstrap(rep_bad, rounds=300)
    for k, (lo, hi) in ci.items():
        assert lo <= rep_bad.scores[k] <= hi and lo < hi
    cmp = paired_bootstrap(rep_good, rep_bad, rounds=300)
    assert all(r["p_A_not_better"] < 0.01 for r in cmp.values())
    same = paired_bootstrap(rep_bad, rep_bad, rounds=300)
    assert all(r["delta"] == 0 for r in same.values())


def test_without_java_or_wordnet_the_rest_is_scored(monkeypatch, capsys):
    import captionkit.scoring.evaluation as ev
    import captionkit.scoring.ptb_tokenize as tk
    monkeypatch.setattr(ev, "java_available", lambda: False)
    monkeypatch.setattr(tk, "java_available", lambda: False)

    def no_wordnet():
        raise ValueError("nltk METEOR needs WordNet")

    monkeypatch.setattr(ev, "_wordnet", no_wordnet)
    cands, refs = random_captions(10, seed=4)
    rep = score_captions(cands, refs)
    assert "METEOR" not in rep.scores and {"Bleu_4", "ROUGE_L", "CIDEr"} <= set(rep.scores)
    assert "Python" in rep.tokenizer
    assert "METEOR skipped: no Java" in capsys.readouterr().err
    with pytest.raises(ValueError, match="METEOR 1.5 needs Java"):
        score_captions(cands, refs, meteor="jar")


def test_cider_d_reward_scorer_equals_pycocoevalcap_given_the_same_references():
    """metrics.CiderD (document frequencies fixed up front, one candidate at a time, as
    self-critical training uses it) gives coco-caption's per-image CIDEr-D."""
    from pycocoevalcap.cider.cider import Cider

    cands, refs = random_captions(60, seed=5)
    _, per_image = Cider().compute_score(refs, {k: [v] for k, v in cands.items()})
    scorer = M.CiderD({k: [r.split() for r in rs] for k, rs in refs.items()})
    ours = [scorer.score(k, cands[k].split()) for k in refs]
    np.testing.assert_allclose(ours, per_image, rtol=1e-9, atol=1e-12)


FAKE_SPICE = '''#!{python}
"""A stand-in for java -jar spice-1.0.jar: each image's F-score is its caption's word count / 10
(NaN for "nan"); it records its working folder and arguments."""
import json, os, sys
args = sys.argv[1:]
jar = next(a for a in args if a.endswith("spice-1.0.jar"))
src, out, cache = args[args.index(jar) + 1], args[args.index("-out") + 1], args[args.index("-cache") + 1]
items = json.load(open(src))
json.dump([{{"image_id": it["image_id"],
             "scores": {{"All": {{"f": "NaN" if it["test"] == "nan" else len(it["test"].split()) / 10}}}}}}
           for it in items], open(out, "w"))
json.dump({{"cwd": os.getcwd(), "cache": cache, "args": args}}, open(os.environ["FAKE_SPICE_LOG"], "w"))
'''


def test_spice_writes_nothing_into_its_install_folder(monkeypatch, tmp_path):
    """pycocoevalcap's Spice writes its input, output and cache next to its jar: a read-only
    install fails. captionkit's run keeps them in a temporary folder and its own cache; the jar's
    folder is left as it was, and the scores come back per image in the images' order."""
    import sys

    import captionkit.scoring.evaluation as ev

    install = tmp_path / "site-packages" / "spice"
    (install / "lib").mkdir(parents=True)
    for name in ("spice-1.0.jar", *(f"lib/{n}" for n in ev.SPICE_CORENLP_JARS)):
        (install / name).write_bytes(b"")
    before = sorted(p.relative_to(install) for p in install.rglob("*"))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "java").write_text(FAKE_SPICE.format(python=sys.executable))
    (bindir / "java").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SPICE_LOG", str(tmp_path / "log.json"))
    monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(ev, "spice_dir", lambda: install)
    monkeypatch.setattr(ev, "java_available", lambda: True)
    monkeypatch.setattr(ev, "jvm_log_flags", lambda: ())

    res = {"b": "two dogs run", "a": "a dog runs on the grass"}
    gts = {"a": ["a dog on grass"], "b": ["dogs running", "two dogs"]}
    score, per = ev.run_spice(install, res, gts)
    assert per.tolist() == [0.6, 0.3] and score == pytest.approx(0.45)  # sorted ids: a, b
    log = json.loads((tmp_path / "log.json").read_text())
    assert Path(log["cwd"]) == install and Path(log["cache"]) == tmp_path / "cache" / "spice"
    assert sorted(p.relative_to(install) for p in install.rglob("*")) == before

    score, per = ev.run_spice(install, {**res, "b": "nan"}, gts)  # the jar's NaN stays NaN
    assert per[0] == 0.6 and np.isnan(per[1]) and np.isnan(score)

    rep = score_captions(res, gts, metrics=["spice"], tokenizer="python", quiet=True)
    assert rep.scores["SPICE"] == pytest.approx(0.45)


def test_spice_without_corenlp_says_which_jar_is_missing(monkeypatch, tmp_path, capsys):
    import captionkit.scoring.evaluation as ev
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / ev.SPICE_CORENLP_JARS[0]).write_bytes(b"")
    monkeypatch.setattr(ev, "spice_dir", lambda: tmp_path)
    monkeypatch.setattr(ev, "java_available", lambda: True)
    rep = score_captions({"a": "a dog"}, {"a": ["a dog"]}, metrics=["bleu", "spice"], tokenizer="python")
    assert "SPICE" not in rep.scores and "Bleu_4" in rep.scores
    assert f"SPICE skipped: {ev.SPICE_CORENLP_JARS[1]} not in {tmp_path / 'lib'}" in capsys.readouterr().err
