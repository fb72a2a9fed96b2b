"""What `captionkit score` and `evaluate` accept: each wrong input of the captions or the
references is one line naming the file and the image, before anything is scored; empty captions
are counted; over-long captions reach METEOR cut, with a note; line breaks inside a reference do
not shift the captions; outputs follow captionkit.core.outputs (an existing file needs --overwrite).
Hypothesis feeds the readers arbitrary JSON and bytes."""

import json
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from helpers import needs_java

from captionkit.cli.main import main
from captionkit.core.errors import DatasetError
from captionkit.scoring.evaluation import METEOR_MAX_WORDS, _cut_for_meteor, score_captions
from captionkit.scoring.score_inputs import read_captions, read_references

TOKENIZERS = ["python", pytest.param("java", marks=needs_java)]
REFS = {"1.jpg": ["a dog sitting on a couch", "a dog on a couch"], "2.jpg": ["a cat lying on a bed", "a cat on a bed"]}
CAPS = {"1.jpg": "a dog on a couch", "2.jpg": "a cat on a bed"}


def write(path: Path, obj) -> Path:
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return path


def score(tmp_path, caps, refs, *extra) -> int:
    c = caps if isinstance(caps, Path) else write(tmp_path / "caps.json", caps)
    r = refs if isinstance(refs, Path) else write(tmp_path / "refs.json", refs)
    return main(["score", "--captions", str(c), "--refs", str(r), "--metrics", "bleu,rouge,cider",
                 "--tokenizer", "python", *extra])


WRONG = {
    "a reference given as a plain string": (CAPS, {**REFS, "1.jpg": "a dog on a couch"},
                                            "refs.json: image '1.jpg': the references are one string"),
    "an image named twice in the captions": ('{"1.jpg": "a dog", "2.jpg": "a cat", "1.jpg": "a bird"}', REFS,
                                             "caps.json: image '1.jpg' is given twice"),
    "an image named twice in the references": (CAPS, '{"1.jpg": ["a"], "2.jpg": ["b"], "2.jpg": ["c"]}',
                                               "refs.json: image '2.jpg' is given twice"),
    "a list of names": (["1.jpg", "2.jpg"], REFS, "caps.json: item 0 is a string"),
    "a number as a caption": ({**CAPS, "1.jpg": 42}, REFS, "caps.json: image '1.jpg': the caption is the number 42"),
    "null as a caption": ({**CAPS, "2.jpg": None}, REFS, "caps.json: image '2.jpg': the caption is null"),
    "an empty reference list": (CAPS, {**REFS, "2.jpg": []}, "refs.json: image '2.jpg': no references"),
    "a number as a reference": (CAPS, {**REFS, "2.jpg": ["a cat", 7]}, "refs.json: image '2.jpg': reference 1 is"),
    "references as a list": (CAPS, [["a dog"], ["a cat"]], "refs.json: expected {image: [reference, ...]}"),
    "no captions": ({}, REFS, "caps.json: no captions"),
    "a results item without a caption": ([{"image_id": 1}], REFS, "caps.json: item 0 needs an \"image_id\" and"),
    "invalid JSON": ('{"1.jpg": "a dog",\n', REFS, "caps.json:2: invalid JSON"),
    "a stray image": ({**CAPS, "3.jpg": "a bird"}, REFS, "1 only in"),
}


@pytest.mark.parametrize("caps, refs, message", WRONG.values(), ids=WRONG.keys())
def test_each_wrong_input_is_one_line_naming_file_and_image(tmp_path, capsys, caps, refs, message):
    assert score(tmp_path, caps, refs) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing scored
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_a_latin1_file_is_named(tmp_path, capsys):
    latin1 = tmp_path / "latin1.json"
    latin1.write_bytes('{"1.jpg": "a caf\u00e9", "2.jpg": "a cat"}'.encode("latin-1"))
    assert score(tmp_path, latin1, REFS) == 2
    err = capsys.readouterr().err
    assert "latin1.json: not UTF-8 text (byte 0xe9 at offset 16)" in err and err.count("\n") == 1


def test_the_python_api_refuses_wrong_shapes_too():
    with pytest.raises(DatasetError, match="the references: image '1.jpg': the references are one string"):
        score_captions(CAPS, {**REFS, "1.jpg": "a dog"}, metrics=("bleu",), tokenizer="python")
    with pytest.raises(DatasetError, match="the captions: image '2.jpg': the caption is the number 3"):
        score_captions({**CAPS, "2.jpg": 3}, REFS, metrics=("bleu",), tokenizer="python")


def test_coco_results_list_scores_like_the_mapping(tmp_path, capsys):
    assert score(tmp_path, CAPS, REFS, "--json", str(tmp_path / "a.json")) == 0
    listed = [{"image_id": k, "caption": v} for k, v in CAPS.items()]
    assert score(tmp_path, listed, REFS, "--json", str(tmp_path / "b.json")) == 0
    a, b = (json.loads((tmp_path / n).read_text()) for n in ("a.json", "b.json"))
    assert a == b and a["CIDEr"] > 0
    assert score(tmp_path, listed + [listed[0]], REFS) == 2
    assert "image '1.jpg' is given twice" in capsys.readouterr().err


def test_empty_captions_are_counted(tmp_path, capsys):
    assert score(tmp_path, {"1.jpg": "", "2.jpg": "a cat on a bed"}, REFS, "--json", str(tmp_path / "s.json")) == 0
    assert "note: 1 of 2 captions have no words after tokenisation and score 0 (e.g. 1.jpg)" in capsys.readouterr().out
    doc = json.loads((tmp_path / "s.json").read_text())
    assert doc["empty_captions"] == 1 and len(doc["notes"]) == 1


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_the_issues_minimal_repro(tokenizer):
    """A comma without a space and &amp; tokenise as the jar does: every caption equals its
    reference."""
    caps = {"1": "a pizza with sauce,mushrooms and cheese", "2": "a man with a hat &amp; long-sleeved shirt"}
    refs = {"1": ["a pizza with sauce, mushrooms and cheese"], "2": ["a man with a hat & long-sleeved shirt"]}
    got = score_captions(caps, refs, metrics=("bleu", "cider"), tokenizer=tokenizer).scores
    assert got["Bleu_1"] == pytest.approx(1.0) and got["CIDEr"] == pytest.approx(10.0)


@pytest.mark.parametrize("tokenizer", TOKENIZERS)
def test_a_carriage_return_in_a_reference_does_not_shift_the_captions(tokenizer):
    """The issue's repro: the answer is the one where the line break is a space."""
    refs = {"1": ["a dog\r\non a couch", "a dog sitting on a couch"], "2": ["a cat lying on a bed", "a cat on a bed"]}
    spaced = {k: [r.replace("\r\n", " ") for r in v] for k, v in refs.items()}
    caps = {"1": "a dog on a couch", "2": "a cat on a bed"}
    got = score_captions(caps, refs, metrics=("bleu", "cider"), tokenizer=tokenizer)
    want = score_captions(caps, spaced, metrics=("bleu", "cider"), tokenizer=tokenizer)
    assert got.scores == want.scores and got.scores["Bleu_4"] == pytest.approx(1.0)
    assert got.per_image["CIDEr"].tolist() == want.per_image["CIDEr"].tolist()


def test_captions_are_cut_for_meteor_only_beyond_the_limit():
    res = {"a": " ".join(["dog"] * (METEOR_MAX_WORDS + 5)), "b": "a cat"}
    gts = {"a": ["a dog"], "b": [" ".join(["cat"] * (METEOR_MAX_WORDS + 1)), "a cat"]}
    res_m, gts_m, cut = _cut_for_meteor(res, gts)
    assert cut == 2 and len(res_m["a"].split()) == METEOR_MAX_WORDS and res_m["b"] == "a cat"
    assert len(gts_m["b"][0].split()) == METEOR_MAX_WORDS and gts_m["b"][1] == "a cat"


@pytest.mark.slow  # starts the METEOR jar
@needs_java
def test_a_100000_word_caption_is_scored_with_a_note(tmp_path, capsys):
    caps = {"1.jpg": " ".join(["dog"] * 100_000), "2.jpg": "a cat on a bed"}
    assert main(["score", "--captions", str(write(tmp_path / "c.json", caps)), "--refs",
                 str(write(tmp_path / "r.json", REFS)), "--metrics", "bleu,meteor", "--meteor", "jar"]) == 0
    out = capsys.readouterr().out
    assert "METEOR" in out and f"cut to their first {METEOR_MAX_WORDS} words" in out


def test_score_outputs_follow_the_one_write_rule(tmp_path, capsys):
    target, per_image = tmp_path / "s.json", tmp_path / "pi.csv"
    target.write_text("mine")
    assert score(tmp_path, CAPS, REFS, "--json", str(target), "--per-image", str(per_image)) == 2
    assert "s.json: exists; pass --overwrite" in capsys.readouterr().err
    assert target.read_text() == "mine" and not per_image.exists()  # refused before any work
    assert score(tmp_path, CAPS, REFS, "--json", str(target), "--per-image", str(per_image), "--overwrite") == 0
    assert "CIDEr" in json.loads(target.read_text()) and per_image.read_text().startswith("image,caption")
    assert score(tmp_path, CAPS, REFS, "--per-image", str(tmp_path)) == 2
    assert "is a folder" in capsys.readouterr().err
    assert score(tmp_path, CAPS, REFS, "--json", str(target), "--per-image", str(target), "--overwrite") == 2
    assert "given for two outputs" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


def test_evaluate_refuses_an_existing_out_before_loading_anything(tmp_path, capsys):
    out = tmp_path / "eval.json"
    out.write_text("mine")
    assert main(["evaluate", "--model", str(tmp_path / "no-model"), "--dataset", str(tmp_path / "no-data"),
                 "--out", str(out)]) == 2
    assert "eval.json: exists; pass --overwrite" in capsys.readouterr().err and out.read_text() == "mine"


# ---- property tests: no exception escapes the readers but their one-line errors --------------
FLOATS = st.floats(allow_nan=False)
JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**9, 10**9) | FLOATS | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
CAPTIONS_LIKE = st.dictionaries(st.text(max_size=8), st.text(max_size=30) | JSON, max_size=5) | \
    st.lists(st.fixed_dictionaries({"image_id": st.integers(-10**9, 10**9) | st.text(max_size=5) | JSON,
                                     "caption": st.text(max_size=30) | JSON}), max_size=4) | JSON
REFS_LIKE = st.dictionaries(st.text(max_size=8), st.lists(st.text(max_size=30), max_size=3) | JSON, max_size=5) | JSON
FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _read(reader, data: bytes):
    """``reader`` on a file holding ``data``: its result, or the one-line error it raised."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "in.json"
        path.write_bytes(data)
        try:
            return reader(path)
        except DatasetError as e:
            assert str(e).startswith(str(path)) and "\n" not in str(e)
            return None


@FAST
@given(CAPTIONS_LIKE)
def test_captions_reader_accepts_exactly_image_caption_pairs(doc):
    got = _read(read_captions, json.dumps(doc).encode())
    if got is not None:
        assert got and all(isinstance(k, str) and isinstance(v, str) for k, v in got.items())


@FAST
@given(REFS_LIKE)
def test_references_reader_accepts_exactly_nonempty_string_lists(doc):
    got = _read(read_references, json.dumps(doc).encode())
    if got is not None:
        assert got and all(isinstance(v, list) and v and all(isinstance(r, str) for r in v) for v in got.values())


@FAST
@given(st.binary(max_size=200) | st.text(max_size=100).map(lambda t: ("{" + t).encode("utf-8", "surrogatepass")))
def test_readers_survive_any_bytes(data):
    _read(read_captions, data)
    _read(read_references, data)
