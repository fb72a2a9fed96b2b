"""Caption tokenizers: one contract for word, character and BPE tokens; every kind
round-trips the training captions and keeps the special ids decoding relies on."""

import json
from pathlib import Path

import pytest
from helpers import FLICKR8K, SHAPES, TEMPLATES

from captionkit.data.datasets import load_dataset, normalize
from captionkit.data.tokenizers import KINDS, BPETokenizer, CharTokenizer, build_tokenizer, load_tokenizer
from captionkit.data.vocab import Vocab


def synthetic_captions() -> list[list[str]]:
    extra = ["two dogs play in the snow", "a man rides a bicycle down a hill", "children jump into a pool",
             "an old woman sits on a bench", "the zebra's stripes"]
    return [normalize(t.format(c=c, s=s)) for c, _, s in SHAPES for t in TEMPLATES] + [normalize(e) for e in extra]


def build(kind, captions):
    return build_tokenizer(kind, captions, min_count=1, vocab_size=60)


@pytest.mark.parametrize("kind", KINDS)
def test_each_tokenizer_round_trips_the_training_captions(kind):
    caps = synthetic_captions()
    tok = build(kind, caps)
    for words in caps:
        ids = tok.encode(words)
        assert ids[0] == Vocab.start and ids[-1] == Vocab.end and Vocab.unk not in ids
        assert tok.decode(ids) == words
        assert tok.decode(ids[1:]) == words  # <start> is optional, decoding stops at <end>
        assert tok.decode(ids + [Vocab.pad, 5]) == words


@pytest.mark.parametrize("kind", KINDS)
def test_special_ids_and_saving_inside_config_json(kind):
    caps = synthetic_captions()
    tok = build(kind, caps)
    assert (tok.pad, tok.start, tok.end, tok.unk) == (0, 1, 2, 3)
    again = load_tokenizer(json.loads(json.dumps(tok.to_json())))  # as config.json stores it
    assert type(again) is type(tok) and len(again) == len(tok)
    for words in caps:
        assert again.encode(words) == tok.encode(words)


def test_word_vocabularies_stay_plain_lists_so_old_checkpoints_load():
    tok = build("word", synthetic_captions())
    assert isinstance(tok.to_json(), list) and isinstance(load_tokenizer(tok.to_json()), Vocab)
    shipped = Path(__file__).resolve().parents[1] / "src/captionkit/pretrained/sat-lite2-flickr8k/config.json"
    vocab = load_tokenizer(json.loads(shipped.read_text())["vocab"])
    assert len(vocab) == 2541 and vocab.decode(vocab.encode(["a", "dog", "runs"])) == ["a", "dog", "runs"]


def test_spans_say_which_tokens_spell_each_word():
    caps = synthetic_captions()
    char = build("char", caps)
    ids = char.encode(["a", "red", "circle"])  # <start> a _ r e d _ c i r c l e <end>
    assert char.spans(ids) == [("a", [1]), ("red", [3, 4, 5]), ("circle", [7, 8, 9, 10, 11, 12])]
    bpe = build("bpe", caps)
    ids = bpe.encode(["zebras", "circle"])
    spans = bpe.spans(ids)
    assert [w for w, _ in spans] == ["zebras", "circle"]
    assert sorted(p for _, pos in spans for p in pos) == list(range(1, len(ids) - 1))  # every piece, once
    assert len(spans[0][1]) > 1  # a rare word is spelt by several pieces
    word = build("word", caps)
    assert word.spans(word.encode(["a", "red"])) == [("a", [1]), ("red", [2])]


def test_unknown_characters_and_words_become_unk():
    caps = synthetic_captions()
    assert build("char", caps).encode(["x"]) == [Vocab.start, Vocab.unk, Vocab.end]
    assert build("word", caps).encode(["quokka"]) == [Vocab.start, Vocab.unk, Vocab.end]
    assert Vocab.unk in build("bpe", caps).encode(["x"])
    # a decoded continuation piece with no word before it starts a word of its own
    bpe = build("bpe", caps)
    cont = next(i for i, p in enumerate(bpe.pieces) if p.startswith("##"))
    assert bpe.decode([cont]) == [bpe.pieces[cont][2:]]


def test_bad_tokenizer_json_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown tokenizer 'wordpiece'"):
        load_tokenizer({"kind": "wordpiece"})
    with pytest.raises(ValueError, match="must begin with"):
        CharTokenizer(["a", "b"])
    with pytest.raises(ValueError, match="data.tokenizer must be one of word, char, bpe"):
        build_tokenizer("sentencepiece", [["a"]])


@pytest.mark.skipif(not FLICKR8K.is_dir(), reason=f"Flickr8k not found at {FLICKR8K}")
@pytest.mark.parametrize("kind", ["char", "bpe"])
@pytest.mark.slow  # every Flickr8k training caption
def test_char_and_bpe_round_trip_every_flickr8k_training_caption(kind):
    caps = [t for it in load_dataset(FLICKR8K).split("train") for t in it.tokens if t]
    tok = build_tokenizer(kind, caps, min_count=1, vocab_size=2000)
    assert all(tok.decode(tok.encode(c)) == c for c in caps)
    if kind == "bpe":
        assert isinstance(tok, BPETokenizer) and len(tok) == 2000
        mean_pieces = sum(len(tok.encode(c)) - 2 for c in caps) / len(caps)
        assert mean_pieces < 1.2 * sum(len(c) for c in caps) / len(caps)  # ~ one piece per word


@pytest.mark.skipif(not FLICKR8K.is_dir(), reason=f"Flickr8k not found at {FLICKR8K}")
@pytest.mark.slow  # Flickr8k's captions
def test_word_vocabulary_round_trips_flickr8k_captions_of_known_words():
    caps = [t for it in load_dataset(FLICKR8K).split("train") for t in it.tokens if t]
    tok = build_tokenizer("word", caps, min_count=1)
    assert all(tok.decode(tok.encode(c)) == c for c in caps)
