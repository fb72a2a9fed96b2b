"""captionkit's scores equal pycocoevalcap 1.2's on COCO data nobody here tuned to:
../shared/data/parity/coco_magic holds 4,982 COCO Karpathy-test images (caps.json, the
published model captions; refs.json, the raw references) and reference_scores.json, computed by
pycocoevalcap 1.2 (pycotools' COCO + COCOEvalCap, SPICE off). Both tokenizers."""

import json
from pathlib import Path

import pytest
from helpers import needs_java

from captionkit.scoring.evaluation import score_captions
from captionkit.scoring.ptb_tokenize import tokenize_java, tokenize_python

COCO = Path(__file__).resolve().parents[2] / "shared" / "data" / "parity" / "coco_magic"
needs_coco = pytest.mark.skipif(not (COCO / "reference_scores.json").is_file(),
                                reason=f"the coco_magic parity set is not at {COCO}")
TOKENIZERS = ["python", pytest.param("java", marks=needs_java)]


def load():
    return (json.loads((COCO / "caps.json").read_text()), json.loads((COCO / "refs.json").read_text()),
            json.loads((COCO / "reference_scores.json").read_text()))


@needs_coco
@needs_java
@pytest.mark.slow  # the PTB jar over the COCO captions
def test_python_tokens_equal_the_jars_on_every_coco_caption():
    caps, refs, _ = load()
    for texts in (refs, {k: [v] for k, v in caps.items()}):  # two texts, as coco-caption tokenises them
        py, jar = tokenize_python(texts), tokenize_java(texts)
        differ = [(k, a, b) for k in texts for a, b in zip(py[k], jar[k]) if a != b]
        assert sum(map(len, texts.values())) in (24920, 4982)
        assert differ == []


@needs_coco
@pytest.mark.parametrize("tokenizer", TOKENIZERS)
@pytest.mark.slow  # pycocoevalcap's scorers over the COCO captions
def test_bleu_rouge_cider_equal_pycocoevalcap(tokenizer):
    caps, refs, want = load()
    got = score_captions(caps, refs, metrics=("bleu", "rouge", "cider"), tokenizer=tokenizer, quiet=True).scores
    assert set(got) == {"Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "ROUGE_L", "CIDEr"}
    for k, v in got.items():
        assert v == pytest.approx(want[k], abs=1e-6), k


@pytest.mark.slow  # the METEOR jar over 4,982 images: half a minute or more
@needs_coco
@needs_java
def test_meteor_equals_pycocoevalcap():
    """With the jar's tokens. The Python tokenizer's would give the jar the same input:
    test_python_tokens_equal_the_jars_on_every_coco_caption checks every one of these texts.
    (The METEOR parity check; until stop 70 tests/test_metrics.py also ran pycocoevalcap's own
    jar on the Flickr8k test references, the same check on a smaller set for ~30 s.)"""
    caps, refs, want = load()
    got = score_captions(caps, refs, metrics=("meteor",), tokenizer="java", meteor="jar", quiet=True)
    assert got.scores["METEOR"] == pytest.approx(want["METEOR"], abs=1e-6)
    assert "jar" in got.implementation["METEOR"]
