"""coco-caption's tokenisation, in Java (the Stanford PTBTokenizer jar pycocoevalcap ships) or
re-implemented in Python for caption text.

coco-caption lower-cases the PTB tokens of every caption and then drops these punctuation
tokens: '' ' `` ` -LRB- -RRB- -LCB- -RCB- . ? ! , : - -- ... ;  (the bracket names in upper
case only, so after lower-casing "-lrb-" and its kin survive, as in the reference).

The Python tokenizer covers what captions contain: words, hyphenated words, clitics ('s n't
're 've 'll 'd 'm), quotes, brackets, numbers with , . : / inside, $ # % & = * symbols, runs of
dots, and abbreviations with inner periods (u.s., e.g.). It does not replicate the Java
tokenizer's sentence-boundary guess after an abbreviation followed by a capitalised word
("p.m. Then" -> "p.m. . then"); tests compare both on every Flickr8k caption.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

PUNCTUATIONS = {"''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-",
                ".", "?", "!", ",", ":", "-", "--", "...", ";"}

_BRACKETS = {"(": "-LRB-", ")": "-RRB-", "[": "-LSB-", "]": "-RSB-", "{": "-LCB-", "}": "-RCB-"}
_ABBREV = {"mr", "mrs", "ms", "dr", "st", "jr", "sr", "vs", "etc", "inc", "ltd", "co", "corp", "mt",
           "ft", "no", "jan", "feb", "mar", "apr", "jun", "jul", "aug", "sep", "sept", "oct", "nov", "dec"}
_SPLIT_WORDS = {"cannot": ("can", "not"), "gonna": ("gon", "na"), "gotta": ("got", "ta"),
                "wanna": ("wan", "na"), "lemme": ("lem", "me"), "gimme": ("gim", "me"),
                "'tis": ("'t", "is"), "'twas": ("'t", "was"), "y'all": ("y'", "all")}
_CLITIC = re.compile(r"(?i)^(.+?)(n't|'s|'re|'ve|'ll|'d|'m)$")
_NUMBERISH = re.compile(r"^[0-9][0-9.,:/]*[0-9]$")
_ABBREV_DOTS = re.compile(r"^([a-zA-Z]\.){2,}$|^[a-zA-Z]\.$")


def _split_core(word: str) -> list[str]:
    """A chunk without leading/trailing punctuation -> tokens."""
    if not word:
        return []
    low = word.lower()
    if low in _SPLIT_WORDS:
        a, b = _SPLIT_WORDS[low]
        return [word[:len(a)], word[len(a):]]
    if "://" in word or _NUMBERISH.match(word):
        return [word]
    # symbols that always stand alone
    parts = re.split(r"([&=*%$#])", word)
    if len(parts) > 1:
        return [t for p in parts for t in (_split_core(p) if p not in "&=*%$#" else [p]) if t]
    m = _CLITIC.match(word)
    if m:  # don't -> do n't, dog's -> dog 's
        return _split_core(m.group(1)) + [m.group(2)]
    return [word]


def _tokenize_chunk(chunk: str) -> list[str]:
    lead: list[str] = []
    trail: list[str] = []
    # leading punctuation
    while chunk:
        c = chunk[0]
        if c == '"':
            lead.append("``")
        elif c in "([{":
            lead.append(_BRACKETS[c])
        elif c == "'" and re.match(r"'(s|re|ve|ll|d|m)-.", chunk.lower()):
            cl = chunk.index("-")  # "'s-eye-view" -> 's eye-view
            lead.append(chunk[:cl])
            chunk = chunk[cl:]
        elif c == "'" and not re.fullmatch(r"'(s|re|ve|ll|d|m|n'|tis|twas)", chunk.lower()):
            lead.append("`")
        elif c == "-" and len(chunk) > 1 and chunk[1].isalpha():
            lead.append("-")
        elif c in "$#":
            lead.append(c)
        else:
            break
        chunk = chunk[1:]
    # trailing punctuation
    while chunk:
        if re.fullmatch(r"[A-Za-z]\.\.\.", chunk):  # "a..." reads as the initial "a." and "..."
            return lead + [chunk[:2], "..."] + trail
        if chunk.endswith("..."):
            trail.insert(0, "...")
            chunk = chunk[:-3]
            continue
        c = chunk[-1]
        if c in ",;:":
            trail.insert(0, c)
        elif c in "!?":
            run = re.search(r"[!?]+$", chunk).group(0)
            trail.insert(0, run)
            chunk = chunk[:-len(run)]
            continue
        elif c == '"':
            trail.insert(0, "''")
        elif c in "()[]{}":
            trail.insert(0, _BRACKETS[c])
        elif c == "-" and len(chunk) > 1 and chunk[-2] != "-":
            trail.insert(0, "-")
        elif c == "%":
            trail.insert(0, "%")
        elif c == "'" and (len(chunk) > 2 if chunk.lower().endswith("s'")
                           else len(chunk) > 1 and not chunk.lower().endswith("'n'")):
            trail.insert(0, "'")  # a closing quote, or the possessive of a plural (dogs')
        elif c == ".":
            body = chunk[:-1]
            if body.endswith("."):  # ".." and the like: one token per dot
                trail.insert(0, ".")
            elif _ABBREV_DOTS.match(chunk) or body.lower() in _ABBREV:
                break  # an abbreviation keeps its period
            else:
                trail.insert(0, ".")
        else:
            break
        chunk = chunk[:-1]
    return lead + _split_core(chunk) + trail


def ptb_tokens_python(text: str) -> list[str]:
    """PTB tokens of one caption (before lower-casing and punctuation removal)."""
    out: list[str] = []
    for chunk in text.split():
        if chunk.isalnum() and chunk.lower() not in _SPLIT_WORDS:  # the common case: a plain word
            out.append(chunk)
            continue
        if chunk == "..":  # two dots stand alone as two periods
            out += [".", "."]
            continue
        if chunk == "/" or re.fullmatch(r"-+|\.+|[!?]+", chunk):
            out.append(chunk)
            continue
        out += _tokenize_chunk(chunk)
    return out


def _clean(tokens: list[str]) -> str:
    # lower-case first, then drop: as coco-caption, whose list names brackets in upper case
    return " ".join(t for t in (t.lower() for t in tokens) if t not in PUNCTUATIONS)


def tokenize_python(captions: dict[str, list[str]]) -> dict[str, list[str]]:
    """{key: [caption, ...]} -> {key: ["lower-cased tokens", ...]} the coco-caption way, in Python."""
    return {k: [_clean(ptb_tokens_python(c.replace("\n", " "))) for c in v] for k, v in captions.items()}


def java_available() -> bool:
    return shutil.which("java") is not None


def tokenize_java(captions: dict[str, list[str]]) -> dict[str, list[str]]:
    """The same through the Stanford PTBTokenizer jar (needs Java): coco-caption's own code path,
    quiet, and without writing a temporary file into site-packages."""
    from pycocoevalcap.tokenizer import ptbtokenizer as ptb

    keys = [k for k, v in captions.items() for _ in v]
    text = "\n".join(c.replace("\n", " ") for v in captions.values() for c in v)
    jar = Path(ptb.__file__).with_name(ptb.STANFORD_CORENLP_3_4_1_JAR)
    cmd = ["java", "-cp", str(jar), "edu.stanford.nlp.process.PTBTokenizer", "-preserveLines", "-lowerCase"]
    out = subprocess.run(cmd, input=(text + "\n").encode(), capture_output=True, check=True).stdout.decode()
    lines = out.split("\n")
    if len(lines) < len(keys):
        raise RuntimeError(f"PTBTokenizer returned {len(lines)} lines for {len(keys)} captions")
    result: dict[str, list[str]] = {}
    for k, line in zip(keys, lines):
        result.setdefault(k, []).append(" ".join(w for w in line.rstrip().split(" ") if w not in PUNCTUATIONS))
    return result


def tokenize(captions: dict[str, list[str]], backend: str = "auto") -> tuple[dict[str, list[str]], str]:
    """Tokenise with ``backend`` "java", "python" or "auto" (Java when present); returns the
    tokens and the backend used."""
    if backend == "auto":
        backend = "java" if java_available() else "python"
    if backend == "java":
        return tokenize_java(captions), "java"
    if backend == "python":
        return tokenize_python(captions), "python"
    raise ValueError(f"unknown tokenizer {backend!r} (java, python or auto)")
