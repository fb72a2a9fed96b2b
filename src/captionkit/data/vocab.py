"""Word vocabulary with pad/start/end/unknown tokens, saved with the model as JSON. The
``word`` kind of :mod:`captionkit.data.tokenizers`, whose contract it follows."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)


def content_positions(ids: Iterable[int]) -> list[tuple[int, int]]:
    """(position, id) of a caption's tokens: stops at <end>, drops <start> and <pad>."""
    out = []
    for pos, i in enumerate(ids):
        i = int(i)
        if i == Vocab.end:
            break
        if i not in (Vocab.start, Vocab.pad):
            out.append((pos, i))
    return out


class Vocab:
    kind = "word"
    pad, start, end, unk = 0, 1, 2, 3

    def __init__(self, words: list[str]):
        if tuple(words[:4]) != SPECIALS:
            raise ValueError(f"a vocabulary must begin with {SPECIALS}")
        if len(set(words)) != len(words):
            raise ValueError("a vocabulary lists a word twice")
        self.words = list(words)
        self.index = {w: i for i, w in enumerate(self.words)}

    @classmethod
    def build(cls, captions: Iterable[list[str]], min_count: int = 5, top_k: int | None = None) -> "Vocab":
        """Words seen at least ``min_count`` times, the ``top_k`` most frequent if given
        (ties broken alphabetically, so the result never depends on input order)."""
        counts = Counter(w for toks in captions for w in toks)
        kept = sorted((w for w, c in counts.items() if c >= min_count and w not in SPECIALS),
                      key=lambda w: (-counts[w], w))
        if top_k is not None:
            kept = kept[:top_k]
        return cls(list(SPECIALS) + kept)

    def __len__(self) -> int:
        return len(self.words)

    def encode(self, tokens: list[str]) -> list[int]:
        """Tokens -> ids framed by <start> ... <end>."""
        return [self.start] + [self.index.get(w, self.unk) for w in tokens] + [self.end]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Ids -> words, stopping at <end> and dropping <start>/<pad>."""
        return [self.words[i] for _, i in content_positions(ids)]

    def spans(self, ids: Iterable[int]) -> list[tuple[str, list[int]]]:
        """[(word, [its position in ids])]: one token per word."""
        return [(self.words[i], [pos]) for pos, i in content_positions(ids)]

    def to_json(self) -> list[str]:
        return list(self.words)

    @classmethod
    def from_json(cls, words: list[str]) -> "Vocab":
        return cls(words)
