"""Issue 32, item 1: the diversity figures (captionkit.scoring.diversity), checked against values
worked out by hand on small sets, the human row, and evaluate, score and report printing and
writing them beside BLEU..CIDEr-D.

The hand values (docs/scoring.md defines each figure):
- Div-n: distinct n-grams over the number of words.
- mBLEU-4: coco-caption's corpus BLEU-4 of each image's i-th caption against its others, averaged
  over i. "a dog runs on grass" against "a dog runs on sand" matches 4/5 unigrams, 3/4 bigrams,
  2/3 trigrams, 1/2 4-grams: (4/5 * 3/4 * 2/3 * 1/2) ** (1/4) = 0.2 ** 0.25; adding an image
  whose captions "a bird flies" / "a cat sleeps" share only "a" pools the counts: 5/8, 3/6, 2/4,
  1/2, so (5/64) ** 0.25.
- Self-CIDEr: with two images, an n-gram in both images' captions ("a") has idf 0 and one in a
  single image idf log 2. For "a dog runs" / "a dog sleeps" the unigram and bigram cosines are
  1/2, the trigram cosine 0 and there are no 4-grams: K = [[3/4, 1/4], [1/4, 3/4]], eigenvalues
  1 and 1/2, so -log2(1 / (1 + sqrt(1/2))) = log2(1 + 1/sqrt 2). For "a dog runs on grass" /
  "a dog runs on sand" the cosines are 3/4, 3/4, 2/3, 1/2: K = [[1, 2/3], [2/3, 1]], eigenvalues
  5/3 and 1/3: log2(1 + 1/sqrt 5). Captions sharing no weighted n-gram: 1; one caption twice: 0.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from captionkit.cli.main import main
from captionkit.data.datasets import load_dataset
from captionkit.scoring.diversity import (diversity_rows, is_content_word, mbleu_4, measure, repeated_phrase,
                                          self_cider, self_cider_per_image)

# the worked example of the human row: two test images, two training captions
REFS = {"a.jpg": ["A dog runs on grass.", "a dog runs on sand"], "b.jpg": ["A bird flies.", "a cat sleeps"]}
TRAIN = ["a bird flies", "A cat sleeps."]
CAPTIONS = {"a.jpg": "A dog runs.", "b.jpg": "a dog runs"}
SELF_CIDER_A = math.log2(1 + 1 / math.sqrt(5))  # "a dog runs on grass" / "a dog runs on sand"


# ---- each figure on hand-made sets ----------------------------------------------------------------
def test_counts_div_and_length_on_a_hand_made_set():
    d = measure({"x": ["a dog runs"], "y": ["a dog sleeps"], "z": ["a dog runs"]}, train={"a dog sleeps"})
    assert (d.images, d.captions, d.captions_per_image) == (3, 3, 1)
    assert d.vocabulary == 4  # a dog runs sleeps
    assert d.distinct_captions == 2
    assert d.novel_captions == 2  # the two "a dog runs"; "a dog sleeps" is a training caption
    assert d.div_1 == pytest.approx(4 / 9)  # 4 distinct words of 9
    assert d.div_2 == pytest.approx(3 / 9)  # a dog, dog runs, dog sleeps over 9 words
    assert d.mean_length == 3.0 and d.repeated_phrase == 0
    # bigrams are counted inside a caption, never across two: "runs a" is none
    assert measure({"x": ["a dog runs", "a cat"]}).div_2 == pytest.approx(3 / 5)
    # one caption per image: no per-image figures; no training captions: no novelty
    assert d.mbleu_4 is None and d.self_cider is None and d.div_1_per_image is None
    assert measure({"x": ["a dog"]}).novel_captions is None


def test_per_image_div_of_several_captions():
    d = measure({"a": ["a dog runs on grass", "a dog runs on sand"], "b": ["a bird flies", "a cat sleeps"]})
    assert d.captions_per_image == 2 and d.captions == 4
    assert d.div_1_per_image == pytest.approx((6 / 10 + 5 / 6) / 2)
    assert d.div_2_per_image == pytest.approx((5 / 10 + 4 / 6) / 2)
    assert d.div_1 == pytest.approx(10 / 16)  # a dog runs on grass sand bird flies cat sleeps


@pytest.mark.parametrize("caption, phrase", [
    ("a boat is riding a boat in the water", ("a", "boat")),
    ("a little girl in a pink dress is riding a little girl in a parade", ("a", "little")),
    ("a crowd of people are standing in front of a crowd", ("a", "crowd")),
    ("a man 's hat and a man 's coat", ("a", "man")),
    ("a dog dog dog", ("dog", "dog")),  # overlapping occurrences count
    ("a dog runs in a park in a city", None),  # "in a" twice: two stop words, not a content phrase
    ("a man in a red hat is wearing a hat", None),  # "hat" twice, but no two-word phrase
    ("a dog chases another dog", None),
    ("a boat", None),
], ids=lambda v: v if isinstance(v, str) else None)
def test_repeated_content_phrase(caption, phrase):
    assert repeated_phrase(caption.split()) == phrase


def test_content_words():
    assert [w for w in "a boy 's red ball is in the 2 cars n't -- there".split() if is_content_word(w)] == \
        ["boy", "red", "ball", "2", "cars"]
    d = measure({"x": ["a boat is riding a boat"], "y": ["a boat in a lake"], "z": ["in a park in a city"]})
    assert d.repeated_phrase == 1


def test_mbleu_4_hand_values():
    assert mbleu_4({"a": ["a dog runs on grass", "a dog runs on sand"]}) == pytest.approx(0.2 ** 0.25, rel=1e-8)
    pooled = {"a": ["a dog runs on grass", "a dog runs on sand"], "b": ["a bird flies", "a cat sleeps"]}
    assert mbleu_4(pooled) == pytest.approx((5 / 64) ** 0.25, rel=1e-8)  # not the mean of sentence scores
    assert mbleu_4({"a": ["a dog runs on grass"] * 3}) == pytest.approx(1.0)
    assert mbleu_4({"a": ["a dog"], "b": ["a cat"]}) is None  # one caption per image


def test_mbleu_4_images_with_fewer_captions():
    """Caption i is scored on the images that have an i-th caption; an image of one caption is
    left out."""
    sets = {"a": ["a dog runs on grass", "a dog runs on sand", "a dog runs on grass"], "c": ["a lone cat"]}
    # i = 0: "grass" against (sand, grass): 1; i = 1: "sand" against (grass, grass): 0.2 ** 0.25; i = 2: 1
    assert mbleu_4(sets) == pytest.approx((2 + 0.2 ** 0.25) / 3, rel=1e-8)


def test_self_cider_hand_values():
    sets = {"a": ["a dog runs", "a dog sleeps"], "b": ["a bird flies", "a bird flies"]}
    per = self_cider_per_image(sets)
    assert per["a"] == pytest.approx(math.log2(1 + 1 / math.sqrt(2)), rel=1e-9)
    assert per["b"] == 0.0  # one caption twice
    assert self_cider(sets) == pytest.approx(math.log2(1 + 1 / math.sqrt(2)) / 2, rel=1e-9)
    long = {"a": ["a dog runs on grass", "a dog runs on sand"], "b": ["a bird flies", "a cat sleeps"]}
    per = self_cider_per_image(long)
    assert per["a"] == pytest.approx(SELF_CIDER_A, rel=1e-9)
    assert per["b"] == pytest.approx(1.0)  # nothing shared but "a", whose idf is 0
    # three captions: log base 3, 1 when they share nothing
    assert self_cider_per_image({"a": ["a red car", "one blue bus", "the green tram"], "b": ["x y z"] * 3}) == \
        pytest.approx({"a": 1.0, "b": 0.0})


# ---- the human row -------------------------------------------------------------------------------
def test_human_row_of_a_tiny_set():
    rows = diversity_rows(CAPTIONS, REFS, TRAIN, tokenizer="python")
    cap, human = rows["captions"], rows["human"]
    # the captions: "a dog runs" twice (tokenised: lower case, no period)
    assert (cap.vocabulary, cap.distinct_captions, cap.novel_captions) == (3, 1, 2)
    assert (cap.div_1, cap.div_2, cap.mean_length) == (pytest.approx(3 / 6), pytest.approx(2 / 6), 3.0)
    assert cap.mbleu_4 is None and cap.self_cider is None
    # the human row: each image's first reference ("a dog runs on grass", "a bird flies")...
    assert (human.captions, human.vocabulary, human.distinct_captions) == (2, 7, 2)
    assert human.novel_captions == 1  # "a bird flies" is a training caption
    assert (human.div_1, human.div_2, human.mean_length) == (pytest.approx(7 / 8), pytest.approx(6 / 8), 4.0)
    # ... and all references for the per-image figures
    assert human.mbleu_4 == pytest.approx((5 / 64) ** 0.25, rel=1e-8)
    assert human.self_cider == pytest.approx((SELF_CIDER_A + 1.0) / 2, rel=1e-9)
    assert human.div_1_per_image == pytest.approx((6 / 10 + 5 / 6) / 2)
    # a set of two captions per image: the human row takes two references of each
    two = diversity_rows({"a.jpg": ["a dog", "a dog runs"], "b.jpg": ["a bird", "a bird"]}, REFS, tokenizer="python")
    assert two["human"].captions == 4 and two["human"].vocabulary == 10
    assert two["captions"].mbleu_4 is not None and two["captions"].novel_captions is None


def test_novelty_counts_on_the_scorers_tokens_and_tokenises_only_what_could_match():
    """Novel: not equal, as PTB tokens, to a training caption. Only the training captions that
    could equal a caption are tokenised (a large split would cost seconds): the plain ones whose
    letters and digits match a caption's, and every one the tokenizer might rewrite (entities,
    brackets, non-ASCII letters)."""
    from captionkit.scoring.diversity import training_tokens
    from captionkit.scoring.ptb_tokenize import tokenize
    train = ["A dog &amp; a cat.", "the (dog) runs", "A dog runs.", "Two dogs.", "\u00dcber dog", "a cat"]
    caps = {"1": "a dog & a cat", "2": "the (dog) runs", "3": "a dog runs", "4": "\u00fcber dog", "5": "two cats"}
    d = diversity_rows(caps, train=train, tokenizer="python")["captions"]
    assert d.novel_captions == 1  # only "two cats"
    full, _ = tokenize({"": train}, "python")
    toks, _ = tokenize({k: [v] for k, v in caps.items()}, "python")
    got = training_tokens(train, [v[0] for v in toks.values()], "python")
    assert got <= set(full[""]) and "two dogs" not in got and "a cat" not in got  # plain, no caption's letters
    assert {"a dog & a cat", "the -lrb- dog -rrb- runs", "a dog runs", "\u00fcber dog"} <= got


def test_java_and_python_tokenizers_give_the_same_figures():
    pytest.importorskip("pycocoevalcap")
    from captionkit.scoring.ptb_tokenize import java_available
    if not java_available():
        pytest.skip("no Java")
    py = diversity_rows(CAPTIONS, REFS, TRAIN, tokenizer="python")
    jar = diversity_rows(CAPTIONS, REFS, TRAIN, tokenizer="java")
    assert {k: v.as_dict() for k, v in py.items()} == {k: v.as_dict() for k, v in jar.items()}


# ---- the commands --------------------------------------------------------------------------------
def _tiny_flickr(root: Path) -> Path:
    """REFS as the test split of a Flickr8k layout, TRAIN as its training split (empty image
    files: score never opens them)."""
    (root / "Flicker8k_Dataset").mkdir(parents=True)
    split = {"t.jpg": "train", "u.jpg": "train", "d.jpg": "dev", "a.jpg": "test", "b.jpg": "test"}
    caps = {"t.jpg": [TRAIN[0]], "u.jpg": [TRAIN[1]], "d.jpg": ["a dog"], **REFS}
    for name in split:
        (root / "Flicker8k_Dataset" / name).write_bytes(b"")
    (root / "Flickr8k.token.txt").write_text("".join(f"{n}#{j}\t{c}\n" for n, cs in caps.items() for j, c in enumerate(cs)))
    for s in ("train", "dev", "test"):
        (root / f"Flickr_8k.{s}Images.txt").write_text("".join(f"{n}\n" for n, v in split.items() if v == s))
    return root


FAST = ["--tokenizer", "python", "--meteor", "none", "--metrics", "bleu,cider"]


def test_score_prints_and_writes_diversity_beside_the_scores(tmp_path, capsys):
    data = _tiny_flickr(tmp_path / "f8k")
    (tmp_path / "caps.json").write_text(json.dumps(CAPTIONS))
    assert main(["score", "--captions", str(tmp_path / "caps.json"), "--dataset", str(data), "--json",
                 str(tmp_path / "s.json"), *FAST]) == 0
    out = capsys.readouterr().out
    assert "Bleu_4" in out and "CIDEr" in out
    assert "diversity: PTB words, 2 captions of 2 images; human: the references, the first of each image" in out
    lines = {line.split("  ")[1].strip(): line.split() for line in out.splitlines() if line.startswith("  ")}
    assert lines["vocabulary (words)"][-2:] == ["3", "7"]
    assert lines["novel captions"][-4:] == ["2", "(100.0%)", "1", "(50.0%)"]
    assert lines["mBLEU-4 (x100)"][-2:] == ["-", f"{100 * (5 / 64) ** 0.25:.2f}"]
    doc = json.loads((tmp_path / "s.json").read_text())
    assert {"Bleu_4", "CIDEr", "implementation", "tokenizer", "empty_captions", "notes"} <= set(doc)  # kept
    div = doc["diversity"]
    assert div["captions"]["vocabulary"] == 3 and div["captions"]["novel_captions"] == 2
    assert div["captions"]["div_2"] == pytest.approx(2 / 6, abs=1e-6) and div["captions"]["mbleu_4"] is None
    assert div["human"]["novel_captions"] == 1
    assert div["human"]["self_cider"] == pytest.approx((SELF_CIDER_A + 1) / 2, abs=1e-6)
    # --refs: no training split known, so no novelty
    (tmp_path / "refs.json").write_text(json.dumps(REFS))
    assert main(["score", "--captions", str(tmp_path / "caps.json"), "--refs", str(tmp_path / "refs.json"),
                 "--json", str(tmp_path / "r.json"), *FAST]) == 0
    assert "novel captions" not in capsys.readouterr().out
    assert json.loads((tmp_path / "r.json").read_text())["diversity"]["human"]["novel_captions"] is None


def test_score_captions_alone_and_n_best_sets(tmp_path, capsys):
    sets = {"a.jpg": ["A dog runs on grass.", "a dog runs on sand"], "b.jpg": ["a bird flies", "a cat sleeps"]}
    (tmp_path / "nbest.json").write_text(json.dumps(sets))
    assert main(["score", "--captions", str(tmp_path / "nbest.json"), "--json", str(tmp_path / "d.json"),
                 "--tokenizer", "python"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("diversity: PTB words, 4 captions of 2 images\n") and "Bleu" not in out
    assert json.loads((tmp_path / "d.json").read_text()) == {"diversity": {"captions": {
        "images": 2, "captions": 4, "captions_per_image": 2, "vocabulary": 10, "distinct_captions": 4,
        "novel_captions": None, "div_1": 10 / 16, "div_2": 9 / 16, "mean_length": 4.0, "repeated_phrase": 0,
        "div_1_per_image": round((6 / 10 + 5 / 6) / 2, 6), "div_2_per_image": round((5 / 10 + 4 / 6) / 2, 6),
        "mbleu_4": round((5 / 64) ** 0.25, 6), "self_cider": round((SELF_CIDER_A + 1) / 2, 6)}}}
    # with references: BLEU..CIDEr-D score each image's first caption, and say so
    (tmp_path / "refs.json").write_text(json.dumps(REFS))
    (tmp_path / "first.json").write_text(json.dumps({k: v[0] for k, v in sets.items()}))
    for name in ("nbest", "first"):
        assert main(["score", "--captions", str(tmp_path / f"{name}.json"), "--refs", str(tmp_path / "refs.json"),
                     "--json", str(tmp_path / f"{name}-s.json"), *FAST]) == 0
    nbest, first = (json.loads((tmp_path / f"{n}-s.json").read_text()) for n in ("nbest", "first"))
    assert nbest["CIDEr"] == first["CIDEr"] and nbest["Bleu_4"] == first["Bleu_4"]
    assert any("first of each image" in n for n in nbest["notes"]) and first["notes"] == []
    assert nbest["diversity"]["captions"]["captions"] == 4 and first["diversity"]["captions"]["captions"] == 2
    # what needs references says so, before reading anything
    for extra in (["--per-image", str(tmp_path / "p.csv")], ["--bootstrap", "10"]):
        assert main(["score", "--captions", str(tmp_path / "nbest.json"), *extra]) == 2
        assert f"{extra[0]} needs the references" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text(json.dumps({"a.jpg": ["a dog", 3]}))
    assert main(["score", "--captions", str(tmp_path / "bad.json")]) == 2
    assert "image 'a.jpg': caption 1 is the number 3, not a string" in capsys.readouterr().err


def test_evaluate_writes_diversity(picky_models, picky_data, tmp_path, capsys):
    a, _ = picky_models
    assert main(["evaluate", "--model", str(a), "--dataset", str(picky_data), "--split", "test", "--beam", "1",
                 "--out", str(tmp_path / "e.json"), *FAST]) == 0
    out = capsys.readouterr().out
    assert "Bleu_4" in out and "diversity: PTB words, 4 captions of 4 images; human: the references" in out
    doc = json.loads((tmp_path / "e.json").read_text())
    words = [c.split() for c in doc["captions"].values()]  # the picky words: lower case, no punctuation
    div = doc["diversity"]["captions"]
    assert div["vocabulary"] == len({w for c in words for w in c})
    assert div["distinct_captions"] == len(set(doc["captions"].values()))
    assert div["mean_length"] == pytest.approx(sum(map(len, words)) / 4, abs=1e-6)
    data = load_dataset(str(picky_data))
    train = {c for it in data.split("train") for c in it.raw}
    assert div["novel_captions"] == sum(c not in train for c in doc["captions"].values())
    refs = {it.name: it.raw for it in data.split("test")}
    assert doc["diversity"]["human"]["vocabulary"] == len({w.strip(".").lower() for r in refs.values()
                                                           for w in r[0].split() if w.strip(".")})
    assert doc["diversity"]["human"]["mbleu_4"] is not None and {"scores", "captions", "notes"} <= set(doc)


def test_report_shows_and_writes_diversity(picky_models, picky_data, tmp_path):
    from captionkit.core.checkpoint import read_config, read_weights, save_checkpoint
    a, _ = picky_models
    run = tmp_path / "run"
    save_checkpoint(run / "best", read_weights(a), {**read_config(a), "train": {"data": {"dataset": str(picky_data)}}})
    assert main(["report", str(run), "--out", str(tmp_path / "r.html"), "--data", str(tmp_path / "r.json"),
                 "--split", "test", "--beam", "1", "--metrics", "bleu", "--tokenizer", "python",
                 "--bootstrap", "0"]) == 0
    saved = json.loads((tmp_path / "r.json").read_text())
    caps = saved["runs"][0]["captions"]
    data = load_dataset(str(picky_data))
    refs = {it.name: it.raw for it in data.split("test")}
    want = diversity_rows(caps, refs, [c for it in data.split("train") for c in it.raw], "python")
    assert saved["runs"][0]["diversity"] == want["captions"].as_dict()
    assert saved["diversity"] == {"human": want["human"].as_dict()}
    assert saved["runs"][0]["diversity"]["vocabulary"] == len({w for c in caps.values() for w in c.split()})
    page = (tmp_path / "r.html").read_text()
    table = page.split("<h2>Diversity</h2>")[1].split("</table>")[0]
    assert table.count("<tr>") == 3  # the header, the run, the human row
    assert f"<td class=\"num\">{want['captions'].vocabulary:,}</td>" in table and "human (the references" in table
