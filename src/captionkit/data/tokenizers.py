"""Caption tokenizers: how a caption's words become the decoder's token ids and back.

(Not to be confused with :mod:`captionkit.scoring.ptb_tokenize`, the PTB tokenisation the scorers use.)

Four kinds, one contract, saved with the model in ``config.json``:

- ``word``: :class:`captionkit.data.vocab.Vocab`, one token per word (min count / top-K); saved
  as a plain list of words, the format every checkpoint so far uses.
- ``char``: one token per character, a space token between words.
- ``bpe``: byte-pair-encoding subwords trained on the training captions with the
  HuggingFace ``tokenizers`` library (an optional dependency, imported only here); the
  trained tokenizer's own JSON is stored inside ``config.json``.
- ``lm``: a pretrained language model's own tokenizer (the LM families), its ids
  shifted up by 4; ``config.json`` names the LM source, from which it is loaded again.

Every kind keeps the special ids decoding and self-critical training rely on:
<pad> 0, <start> 1, <end> 2, <unk> 3. The contract::

    encode(words) -> [start, ..., end]       ids of one caption (a list of words)
    decode(ids) -> words                     detokenised: pieces joined back into words
    spans(ids) -> [(word, [positions])]      which positions of ``ids`` spell each word
                                             (attention figures average a word's pieces)
    to_json() / load_tokenizer(obj)          saved in, and read from, config.json
    len(tok)                                 the number of token ids

Scores are always computed on ``decode``'s words, whatever the tokens are.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from typing import Iterable

from ..core.errors import UserError
from .vocab import SPECIALS, UNK, Vocab
from .vocab import content_positions as _content

KINDS = ("word", "char", "bpe")  # learnt from the training captions
PRETRAINED_KINDS = ("lm",)  # brought by a pretrained model


def _positions_to_words(pieces: list[tuple[int, str, bool]]) -> list[tuple[str, list[int]]]:
    """(position, text, starts a new word) pieces -> [(word, positions)]; empty text (a word
    separator) closes the current word."""
    out: list[tuple[str, list[int]]] = []
    open_word = False
    for pos, text, new_word in pieces:
        if not text:
            open_word = False
            continue
        if new_word or not open_word:
            out.append((text, [pos]))
        else:
            word, where = out[-1]
            out[-1] = (word + text, where + [pos])
        open_word = True
    return out


class CharTokenizer:
    """One token per character; words are separated by a space token. Characters seen fewer
    than ``min_count`` times in the training captions become <unk>."""

    kind = "char"
    pad, start, end, unk = Vocab.pad, Vocab.start, Vocab.end, Vocab.unk
    SPACE = " "

    def __init__(self, chars: list[str]):
        if tuple(chars[:4]) != SPECIALS or self.SPACE not in chars:
            raise ValueError(f"a character vocabulary must begin with {SPECIALS} and hold the space")
        if len(set(chars)) != len(chars) or any(len(c) != 1 for c in chars[4:]):
            raise ValueError("a character vocabulary lists single characters, each once")
        self.chars = list(chars)
        self.index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def build(cls, captions: Iterable[list[str]], min_count: int = 1) -> "CharTokenizer":
        counts = Counter(c for words in captions for w in words for c in w)
        kept = sorted(c for c, n in counts.items() if n >= min_count and c != cls.SPACE)
        return cls(list(SPECIALS) + [cls.SPACE] + kept)

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, words: list[str]) -> list[int]:
        text = self.SPACE.join(words)
        return [self.start] + [self.index.get(c, self.unk) for c in text] + [self.end]

    def spans(self, ids: Iterable[int]) -> list[tuple[str, list[int]]]:
        space = self.index[self.SPACE]
        return _positions_to_words([(pos, "" if i == space else self.chars[i], False)
                                    for pos, i in _content(ids)])

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [w for w, _ in self.spans(ids)]

    def to_json(self) -> dict:
        return {"kind": self.kind, "chars": list(self.chars)}

    @classmethod
    def from_json(cls, obj: dict) -> "CharTokenizer":
        return cls(obj["chars"])


class BPETokenizer:
    """Byte-pair-encoding subwords (Sennrich et al. 2016) learnt on the training captions.

    Words are split on spaces first, so a piece never spans two words; pieces that continue
    a word carry the ``##`` prefix, which is how :meth:`spans` joins them back. The merges are
    learnt up to ``vocab_size`` tokens (the four specials and every character of the
    training captions included), so every training caption encodes without <unk>."""

    kind = "bpe"
    pad, start, end, unk = Vocab.pad, Vocab.start, Vocab.end, Vocab.unk
    PREFIX = "##"

    def __init__(self, tok):
        self.tok = tok  # a tokenizers.Tokenizer
        for i, s in enumerate(SPECIALS):
            if tok.token_to_id(s) != i:
                raise ValueError(f"BPE tokenizer: {s} must have id {i}, has {tok.token_to_id(s)}")
        self.pieces = [tok.id_to_token(i) for i in range(tok.get_vocab_size())]

    @staticmethod
    def _library():
        try:
            import tokenizers
        except ImportError:  # a ValueError, so the command line prints it as one line
            raise UserError("the bpe tokenizer needs the 'tokenizers' package "
                             "(pip install 'captionkit[bpe]' or pip install tokenizers)") from None
        return tokenizers

    @classmethod
    def build(cls, captions: Iterable[list[str]], vocab_size: int = 2000, min_count: int = 2) -> "BPETokenizer":
        """Learn merges on the captions; pairs seen fewer than ``min_count`` times are not merged."""
        tk = cls._library()
        tok = tk.Tokenizer(tk.models.BPE(unk_token=UNK, continuing_subword_prefix=cls.PREFIX))
        tok.pre_tokenizer = tk.pre_tokenizers.WhitespaceSplit()
        trainer = tk.trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_count, special_tokens=list(SPECIALS),
                                         continuing_subword_prefix=cls.PREFIX, show_progress=False)
        tok.train_from_iterator((" ".join(words) for words in captions), trainer=trainer)
        return cls(tok)

    def __len__(self) -> int:
        return len(self.pieces)

    def encode(self, words: list[str]) -> list[int]:
        ids = self.tok.encode(" ".join(words), add_special_tokens=False).ids
        return [self.start] + ids + [self.end]

    def spans(self, ids: Iterable[int]) -> list[tuple[str, list[int]]]:
        pieces = []
        for pos, i in _content(ids):
            p = self.pieces[i]
            cont = p.startswith(self.PREFIX) and len(p) > len(self.PREFIX)
            pieces.append((pos, p[len(self.PREFIX):] if cont else p, not cont))
        return _positions_to_words(pieces)

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [w for w, _ in self.spans(ids)]

    def to_json(self) -> dict:
        return {"kind": self.kind, "tokenizer": json.loads(self.tok.to_str())}

    @classmethod
    def from_json(cls, obj: dict) -> "BPETokenizer":
        return cls(cls._library().Tokenizer.from_str(json.dumps(obj["tokenizer"])))


class LMTokenizer:
    """A causal language model's own tokenizer (loaded with ``transformers`` from the LM source,
    see :mod:`captionkit.core.hf`), LM id i being captionkit id i + 4 so that the
    special ids keep their meaning; <end> stands for the LM's end-of-sequence token.

    Words for scoring are the decoded text split on whitespace and normalised as the training
    captions are (lower case, punctuation dropped: :func:`captionkit.data.datasets.normalize`); a token
    belongs to the word its decoded text falls in."""

    kind = "lm"
    pad, start, end, unk = Vocab.pad, Vocab.start, Vocab.end, Vocab.unk
    OFFSET = len(SPECIALS)

    def __init__(self, source: str, tok):
        self.source, self.tok = source, tok  # tok: a transformers tokenizer
        self.size = len(tok) + self.OFFSET

    @classmethod
    def build(cls, source: str | None = None) -> "LMTokenizer":
        from ..core.hf import DEFAULT_LM, load_lm_tokenizer
        source = source or DEFAULT_LM
        return cls(source, load_lm_tokenizer(source))

    def __len__(self) -> int:
        return self.size

    def encode(self, words: list[str]) -> list[int]:
        ids = self.tok.encode(" ".join(words), add_special_tokens=False)
        return [self.start] + [i + self.OFFSET for i in ids] + [self.end]

    def spans(self, ids: Iterable[int]) -> list[tuple[str, list[int]]]:
        from .datasets import normalize
        tokens = [(pos, i - self.OFFSET) for pos, i in _content(ids) if i >= self.OFFSET]
        words: list[tuple[str, list[int]]] = []
        open_word, shown = False, ""
        for n, (pos, _) in enumerate(tokens):
            # what this token adds to the decoded text (decoding token by token would lose the
            # spaces some tokenizers only produce between tokens)
            text = self.tok.decode([i for _, i in tokens[:n + 1]])
            same = next((j for j, (a, b) in enumerate(zip(shown, text)) if a != b), min(len(shown), len(text)))
            piece, shown = text[same:], text
            for part in re.split(r"(\s+)", piece):
                if not part:
                    continue
                if part.isspace():
                    open_word = False
                    continue
                if open_word:
                    word, where = words[-1]
                    words[-1] = (word + part, where + [pos])
                else:
                    words.append((part, [pos]))
                    open_word = True
        out = [("".join(normalize(w)), where) for w, where in words]
        return [(w, where) for w, where in out if w]

    def decode(self, ids: Iterable[int]) -> list[str]:
        return [w for w, _ in self.spans(ids)]

    def to_json(self) -> dict:
        return {"kind": self.kind, "source": self.source, "size": self.size}

    @classmethod
    def from_json(cls, obj: dict) -> "LMTokenizer":
        tok = cls.build(obj["source"])
        if len(tok) != obj["size"]:
            raise UserError(f"the tokenizer of {obj['source']!r} now has {len(tok)} ids, the model was trained "
                             f"with {obj['size']}")
        return tok


Tokenizer = Vocab | CharTokenizer | BPETokenizer | LMTokenizer


def build_tokenizer(kind: str, captions: list[list[str]], min_count: int = 5, top_k: int | None = None,
                    vocab_size: int = 2000, lm: str | None = None) -> Tokenizer:
    """A tokenizer of ``kind`` fitted to the training captions (lists of words); ``lm``: the
    language model whose tokenizer the ``lm`` kind is (None: the default LM)."""
    if kind == "word":
        return Vocab.build(captions, min_count, top_k)
    if kind == "char":
        return CharTokenizer.build(captions, min_count)
    if kind == "bpe":
        return BPETokenizer.build(captions, vocab_size, min_count)
    if kind == "lm":
        return LMTokenizer.build(lm)
    raise UserError(f"data.tokenizer must be one of {', '.join(KINDS + PRETRAINED_KINDS)}, not {kind!r}")


def load_tokenizer(obj) -> Tokenizer:
    """A tokenizer from its ``to_json()`` form; a plain list is a word vocabulary (the format
    of every checkpoint written before other kinds existed)."""
    if isinstance(obj, list):
        return Vocab.from_json(obj)
    if isinstance(obj, dict) and obj.get("kind") == "char":
        return CharTokenizer.from_json(obj)
    if isinstance(obj, dict) and obj.get("kind") == "bpe":
        return BPETokenizer.from_json(obj)
    if isinstance(obj, dict) and obj.get("kind") == "lm":
        return LMTokenizer.from_json(obj)
    kind = obj.get("kind") if isinstance(obj, dict) else type(obj).__name__
    raise UserError(f"unknown tokenizer {kind!r} (known: {', '.join(KINDS + PRETRAINED_KINDS)})")

