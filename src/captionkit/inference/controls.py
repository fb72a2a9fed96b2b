"""Caption controls: what a user may ask of decoding besides the beam width and the length
penalty (docs/decoding-controls.md). Plain values, checked here without torch, so the command
line refuses a wrong one before anything loads; :mod:`captionkit.inference.decoding` applies them.

- ``no_repeat_ngram`` N: a word that would complete an N-gram the caption already holds is
  blocked (0: none).
- ``repetition_penalty`` P: CTRL's penalty (Keskar et al. 2019) on the words a caption already
  holds, as Hugging Face applies it to log-probabilities: a negative one is multiplied by P
  (1: none; above 1 repeats less).
- ``rare_word_bonus`` B: each word is favoured by B * ln(rank / RARE_FROM) added to its
  log-probability when its rank among the training captions' words (1: the most frequent) is
  above RARE_FROM, so "a", "dog", "man" and the other 30 most frequent words get nothing and a
  word 10 times rarer than the 30th gets about B * ln 10 (by Zipf's law the rank is inversely
  proportional to the count, so this is the word's inverse-frequency information beyond the
  30th word's). A word vocabulary lists its words in that order (``Vocab.build``); the other
  tokenizers do not, and are refused (0: none).
- ``min_words`` / ``max_words``: <end> is blocked before ``min_words`` words, and forced at
  ``max_words`` (never beyond the model's own longest caption, its ``max_len``). Words are the
  decoder's tokens: one per word for word vocabularies (every shipped model but the LM one).
- ``sample`` with ``temperature``, ``top_k``, ``top_p`` (nucleus, Holtzman et al. 2020) and
  ``seed``: each word drawn from the model's distribution instead of the most probable one.
- ``num_captions`` K: K distinct captions per image, from sampling, the beam's K best, or
  diverse beam search (Vijayakumar et al. 2018) with ``beam_groups`` G and
  ``diversity_strength`` (Hamming diversity).

A caption's reported log-probability is always the model's own (what decoding ranked by is
the shaped score: penalties and blocks included)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..core.errors import UserError

DEFAULT_BEAM = 3  # the beam width when none is given (and the command line's)
SEED_LIMIT = 2 ** 32  # seeds are 32-bit (the sampling noise is a 32-bit hash)
# what a model's config may set by default in its "decoding" table (the rules, not sampling)
MODEL_DEFAULTS = ("no_repeat_ngram", "repetition_penalty", "rare_word_bonus", "min_words", "max_words")
# rare_word_bonus favours only the words rarer than this rank (the 30 most frequent words of
# Flickr8k's captions are its articles, prepositions and "dog", "man", "woman", "water", ...)
RARE_FROM = 30
RANKED_TOKENS = ("word",)  # the tokenizer kinds whose ids are frequency ranks (after the specials)
SAMPLING_ONLY = ("temperature", "top_k", "top_p", "seed")


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class Controls:
    no_repeat_ngram: int = 0
    repetition_penalty: float = 1.0
    rare_word_bonus: float = 0.0
    min_words: int = 0
    max_words: int | None = None
    sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    num_captions: int = 1
    beam_groups: int = 1
    diversity_strength: float = 0.5

    @property
    def shapes_steps(self) -> bool:
        """Whether the per-step rules change any log-probability (n-gram blocks, the penalty,
        the rare-word bonus, the minimum length)."""
        return self.no_repeat_ngram > 0 or self.repetition_penalty != 1.0 or self.rare_word_bonus > 0 \
            or self.min_words > 0

    def given(self) -> dict:
        """The fields that differ from the defaults (what a run records beside its outputs)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default}

    def with_options(self, **options) -> "Controls":
        """These controls with ``options`` (field names; None: keep this one's) replacing theirs."""
        unknown = sorted(set(options) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise TypeError(f"unknown caption control {unknown[0]!r}")
        return dataclasses.replace(self, **{k: v for k, v in options.items() if v is not None})

    def check(self, beam: int | None = None) -> "Controls":
        """Refuse, with one UserError line, a value out of range or controls that do not fit
        together or with ``beam`` (None: not given, so DEFAULT_BEAM for beam search and
        nothing to refuse for sampling); returns self."""
        _whole(self.no_repeat_ngram, "no_repeat_ngram", 0)
        _number(self.repetition_penalty, "repetition_penalty", 0, above=True)
        _number(self.rare_word_bonus, "rare_word_bonus", 0)
        _whole(self.min_words, "min_words", 0)
        if self.max_words is not None:
            _whole(self.max_words, "max_words", 1)
            if self.min_words > self.max_words:
                raise UserError(f"--min-words {self.min_words} is more than --max-words {self.max_words}")
        _number(self.temperature, "temperature", 0)
        _whole(self.top_k, "top_k", 0)
        _number(self.top_p, "top_p", 0, above=True)
        if self.top_p > 1:
            raise UserError(f"--top-p must be more than 0 and at most 1, not {self.top_p:g}")
        _whole(self.seed, "seed", 0)
        if self.seed >= SEED_LIMIT:
            raise UserError(f"--seed must be below 2**32, not {self.seed}")
        _whole(self.num_captions, "num_captions", 1)
        _whole(self.beam_groups, "beam_groups", 1)
        _number(self.diversity_strength, "diversity_strength", 0)
        if not isinstance(self.sample, bool):
            raise UserError(f"sample must be True or False, not {self.sample!r}")
        K = self.num_captions
        if self.sample:
            if beam not in (None, 1):
                raise UserError(f"--sample draws each word; --beam {beam} is beam search's: give one of them")
            if self.beam_groups > 1:
                raise UserError("--beam-groups is diverse beam search's; --sample draws: give one of them")
            if self.temperature == 0 and K > 1:
                raise UserError(f"--temperature 0 draws the most probable word every time, so one caption: "
                                f"--num-captions {K} needs a temperature above 0")
            return self
        changed = [n for n in SAMPLING_ONLY if getattr(self, n) != getattr(DEFAULT, n)]
        if changed:
            raise UserError(f"{_option(changed[0])} is a sampling option: give --sample too")
        G, beam = self.beam_groups, self.beam(beam)
        if G > 1 and beam % G:
            raise UserError(f"--beam-groups {G} splits the beam into groups of one size: --beam {beam} "
                            f"is not a multiple of {G}")
        if K > beam:
            how = "the best of the beam" if G == 1 else "the best of the groups' beams"
            raise UserError(f"--num-captions {K} takes {how}: it needs --beam {K} or more, not {beam} "
                            f"(or --sample)")
        return self

    def fit_tokens(self, kind: str) -> "Controls":
        """Refuse, in one UserError line, a control the model's tokenizer ``kind`` cannot serve
        (the rare-word bonus needs ids in frequency order: RANKED_TOKENS); returns self."""
        if self.rare_word_bonus > 0 and kind not in RANKED_TOKENS:
            raise UserError(f"--rare-word-bonus ranks words by their frequency in a word vocabulary; this "
                            f"model's tokens are {kind!r} tokens, in no such order")
        return self

    def gives_the_beams_best(self, beam: int | None) -> bool:
        """Whether decoding under these controls at ``beam`` gives the beam's one best caption
        -- what a reranker chooses among -- and not greedy, sampled, several or grouped ones."""
        return self.num_captions == 1 and not self.sample and self.beam_groups == 1 and self.beam(beam) > 1

    def beam(self, beam: int | None) -> int:
        """The beam width decoding uses: as given, else 1 for sampling and DEFAULT_BEAM for
        beam search."""
        return beam if beam is not None else 1 if self.sample else DEFAULT_BEAM

    def max_len(self, model_max_len: int) -> int:
        """The longest caption decoded: ``max_words``, never beyond the model's own ``max_len``.
        Refuses a ``min_words`` the model cannot reach."""
        longest = model_max_len if self.max_words is None else min(self.max_words, model_max_len)
        if self.min_words > longest:
            raise UserError(f"--min-words {self.min_words} is more than this model's longest caption, "
                            f"{longest} words")
        return longest


DEFAULT = Controls()


def model_controls(decoding: dict, where: str) -> Controls:
    """The controls a model's config sets by default in its ``decoding`` table (the rules of
    MODEL_DEFAULTS; none: the plain defaults). ``where`` names the file in a refusal."""
    given = {k: decoding[k] for k in MODEL_DEFAULTS if k in decoding}
    try:
        return DEFAULT.with_options(**given).check(1)
    except UserError as e:
        raise UserError(f"{where}: decoding: {e}") from None


def _whole(value, name: str, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise UserError(f"{_option(name)} must be a whole number >= {low}, not {value!r}")


def _number(value, name: str, low: float, above: bool = False) -> None:
    ok = not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) \
        and (value > low if above else value >= low)
    if not ok:
        raise UserError(f"{_option(name)} must be a finite number {'>' if above else '>='} {low:g}, not {value!r}")


FIELDS = tuple(f.name for f in dataclasses.fields(Controls))
_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def parse_fields(fields: dict[str, str]) -> dict:
    """Text values by field name (a form's, say) -> the controls' typed values (those given; an
    empty text is not given). One UserError line naming the field for text that is no value of
    its type; ranges are :meth:`Controls.check`'s."""
    types = {f.name: f.type for f in dataclasses.fields(Controls)}
    out: dict = {}
    for name, text in fields.items():
        if text is None or text == "":
            continue
        kind = types[name]
        text = text.strip()
        if kind == "bool":
            if text.lower() not in _TRUE + _FALSE:
                raise UserError(f"'{name}' must be true or false, got {text[:20]!r}")
            out[name] = text.lower() in _TRUE
            continue
        try:
            out[name] = float(text) if kind == "float" else int(text)
        except ValueError:
            what = "a number" if kind == "float" else "an integer"
            raise UserError(f"'{name}' must be {what}, got {text[:20]!r}") from None
    return out
