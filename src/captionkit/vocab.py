"""Word vocabulary with pad/start/end/unknown tokens, saved with the model as JSON."""

from __future__ import annotations

from collections import Counter
from typing import Iterable

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS = (PAD, START, END, UNK)


class Vocab:
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
        out = []
        for i in ids:
            i = int(i)
            if i == self.end:
                break
            if i in (self.start, self.pad):
                continue
            out.append(self.words[i])
        return out

    def to_json(self) -> list[str]:
        return list(self.words)

    @classmethod
    def from_json(cls, words: list[str]) -> "Vocab":
        return cls(words)
