"""Pretrained word vectors (GloVe, Pennington et al. 2014) for a word vocabulary.

The file is the user's: GloVe's text format, one word per line followed by its numbers,
separated by spaces (word2vec's text format, whose first line is "count dim", is read too).
Only the vocabulary's words are kept, so a 400,000-word file costs one pass and no memory.

:func:`glove_embedding` turns it into an embedding matrix for the vocabulary: found words
get their vector; missing words and the special tokens get small random vectors (a tenth of
the found vectors' spread, so an unknown word starts near the origin, where it says little,
until training moves it); <pad> gets zeros. :class:`Coverage` says how many vocabulary words
were found and lists the missing ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.errors import UserError
from ..data.vocab import SPECIALS, Vocab


@dataclass
class Coverage:
    path: str
    dim: int
    found: int  # vocabulary words (specials excluded) that have a vector in the file
    total: int  # vocabulary words, specials excluded
    missing: list[str] = field(default_factory=list)  # in vocabulary order (most frequent first)

    @property
    def fraction(self) -> float:
        return self.found / self.total if self.total else 0.0

    def summary(self, show: int = 20) -> str:
        more = f" ... and {len(self.missing) - show} more" if len(self.missing) > show else ""
        listed = f"; missing: {' '.join(self.missing[:show])}{more}" if self.missing else ""
        return (f"{self.path}: {self.found:,} of {self.total:,} vocabulary words have vectors "
                f"({100 * self.fraction:.1f}%, {self.dim}-d){listed}")

    def to_json(self) -> dict:
        return {"path": self.path, "dim": self.dim, "found": self.found, "total": self.total,
                "missing": self.missing}


def read_vectors(path: str | Path, words: set[str]) -> tuple[dict[str, torch.Tensor], int]:
    """The vectors of ``words`` found in a GloVe-format text file -> ({word: (dim,)}, dim).
    Errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such word-vector file")
    vectors: dict[str, torch.Tensor] = {}
    dim = 0
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            parts = line.rstrip("\n").rstrip(" ").split(" ")
            if lineno == 1 and len(parts) == 2 and all(p.isdigit() for p in parts):
                continue  # word2vec's header line: "count dim"
            if len(parts) < 2:
                if line.strip():
                    raise UserError(f"{path}:{lineno}: expected a word and its numbers")
                continue
            if not dim:
                dim = len(parts) - 1
            elif len(parts) - 1 != dim and parts[0] in words:
                raise UserError(f"{path}:{lineno}: {len(parts) - 1} numbers, the file's first vector has {dim}")
            if parts[0] not in words or parts[0] in vectors:  # the first vector of a word wins
                continue
            try:
                vectors[parts[0]] = torch.tensor([float(x) for x in parts[1:]])
            except ValueError:
                raise UserError(f"{path}:{lineno}: not a number in the vector of {parts[0]!r}") from None
    if not dim:
        raise UserError(f"{path}: no word vectors in the file")
    return vectors, dim


def vector_dim(path: str | Path) -> int:
    """The dimension of a word-vector file, from its first vector (a word2vec header line is
    skipped): cheap enough to check a config with, before any vector is read."""
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            parts = line.rstrip("\n").rstrip(" ").split(" ")
            if lineno == 1 and len(parts) == 2 and all(p.isdigit() for p in parts):
                continue
            if len(parts) >= 2:
                return len(parts) - 1
    raise ValueError(f"{path}: no word vectors in the file")


def glove_embedding(vocab: Vocab, path: str | Path, seed: int = 0) -> tuple[torch.Tensor, Coverage]:
    """(len(vocab), dim) initial embedding for ``vocab`` from the file, and its coverage."""
    if getattr(vocab, "kind", "word") != "word":
        raise UserError(f"word vectors need a word tokenizer (data.tokenizer = \"word\"), not {vocab.kind!r}")
    words = vocab.words[len(SPECIALS):]
    found, dim = read_vectors(path, set(words))
    gen = torch.Generator().manual_seed(seed)
    spread = torch.stack(list(found.values())).std() if len(found) > 1 else torch.tensor(1.0)
    weight = torch.randn(len(vocab), dim, generator=gen) * 0.1 * spread  # (V, dim)
    weight[Vocab.pad] = 0.0
    for i, w in enumerate(vocab.words):
        if w in found:
            weight[i] = found[w]
    missing = [w for w in words if w not in found]
    return weight, Coverage(str(path), dim, len(words) - len(missing), len(words), missing)
