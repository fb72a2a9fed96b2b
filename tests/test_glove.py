"""GloVe word vectors: reading a GloVe-format file, the vocabulary's coverage, the initial
embedding (found words' vectors, small random vectors for the rest)."""

from pathlib import Path

import pytest
import torch

from captionkit.data.tokenizers import build_tokenizer
from captionkit.data.vocab import Vocab
from captionkit.training.glove import glove_embedding, read_vectors

FIXTURE = Path(__file__).parent / "data" / "glove_tiny.6d.txt"


def fixture_vectors() -> dict[str, list[float]]:
    rows = [line.split() for line in FIXTURE.read_text().splitlines()]
    return {r[0]: [float(x) for x in r[1:]] for r in rows}


def test_coverage_and_embedding_from_the_fixture_file():
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>", "a", "red", "green", "circle", "triangle", "dog"])
    weight, cov = glove_embedding(vocab, FIXTURE, seed=0)
    assert weight.shape == (10, 6) and cov.dim == 6
    assert (cov.found, cov.total, cov.missing) == (4, 6, ["green", "triangle"])
    assert cov.fraction == pytest.approx(4 / 6)
    assert "4 of 6 vocabulary words" in cov.summary() and "missing: green triangle" in cov.summary()
    ref = fixture_vectors()
    for w in ("a", "red", "circle", "dog"):
        torch.testing.assert_close(weight[vocab.index[w]], torch.tensor(ref[w]))
    assert torch.equal(weight[Vocab.pad], torch.zeros(6))
    spread = torch.tensor([v for w in ("a", "red", "circle", "dog") for v in ref[w]]).std()
    for w in ("green", "triangle", "<start>", "<unk>"):  # small random vectors, not zeros
        row = weight[vocab.index[w]]
        assert 0 < row.abs().max() < spread
    again, _ = glove_embedding(vocab, FIXTURE, seed=0)
    assert torch.equal(again, weight)  # seeded


def test_word2vec_header_and_errors_name_the_file_and_line(tmp_path):
    f = tmp_path / "w2v.txt"
    f.write_text("2 3\ncat 1 2 3\ndog 4 5 6\n")
    vecs, dim = read_vectors(f, {"cat", "dog", "emu"})
    assert dim == 3 and set(vecs) == {"cat", "dog"} and vecs["dog"].tolist() == [4, 5, 6]
    f.write_text("cat 1 2 3\ndog 4 5\n")
    with pytest.raises(ValueError, match=r"w2v.txt:2: 2 numbers, the file's first vector has 3"):
        read_vectors(f, {"dog"})
    f.write_text("cat 1 2 3\ndog 4 five 6\n")
    with pytest.raises(ValueError, match=r"w2v.txt:2: not a number in the vector of 'dog'"):
        read_vectors(f, {"dog"})
    with pytest.raises(ValueError, match="no such word-vector file"):
        read_vectors(tmp_path / "absent.txt", {"dog"})
    f.write_text("\n")
    with pytest.raises(ValueError, match="no word vectors"):
        read_vectors(f, {"dog"})


def test_word_vectors_need_a_word_tokenizer():
    char = build_tokenizer("char", [["a", "red", "circle"]], min_count=1)
    with pytest.raises(ValueError, match="word vectors need a word tokenizer"):
        glove_embedding(char, FIXTURE)
