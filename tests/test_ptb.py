"""The Python PTB tokenizer against the jar pycocoevalcap runs: the hand-written cases of
tests/data/ptb_cases.json (tokens recorded from the jar, so they check the Python tokenizer where
Java is absent too), random lines, code points, every Flickr8k caption, and the line-break rule
on both paths."""

import json
import os
import subprocess
from pathlib import Path

import pytest
from helpers import FLICKR8K, needs_java
from ptb_fuzz import random_lines

from captionkit.scoring import ptb
from captionkit.scoring.ptb_tokenize import (
    LINE_BREAKS,
    jar_command,
    java_available,
    one_line,
    tokenize_java,
    tokenize_python,
)

CASES = json.loads((Path(__file__).parent / "data" / "ptb_cases.json").read_text())


def python_tokens(lines: list[str], dispatch: bool = True) -> list[str]:
    return [" ".join(toks).lower() for toks in ptb.tokenize_lines(lines, dispatch=dispatch)]


def jar_tokens(lines: list[str]) -> list[str]:
    """The jar's lines for ``lines`` (before punctuation is dropped), as coco-caption runs it."""
    out = subprocess.run(jar_command(), input="\n".join(lines).encode(), capture_output=True, check=True).stdout
    return out.decode().split("\n")


@pytest.mark.parametrize("case", CASES, ids=[c["why"] for c in CASES])
def test_cases_give_the_jars_tokens(case):
    assert python_tokens(case["lines"]) == case["jar"]


def test_the_shortcuts_give_what_the_rules_give():
    """Plain words, periods and whole plain lines skip the rules; trying every rule everywhere
    gives the same tokens."""
    lines = [x for c in CASES for x in c["lines"]] + random_lines(600, seed=3)
    assert python_tokens(lines) == python_tokens(lines, dispatch=False)


def test_a_line_depends_on_the_next_as_in_the_jar():
    # "U." before a line opening with "A": initial and period apart; before "a": one token
    assert python_tokens(["the new Wii U.", "A man"])[0] == "the new wii u ."
    assert python_tokens(["the new Wii U.", "a man"])[0] == "the new wii u."
    # an abbreviation before a capital gets a period token as well, kept before a lower-case word
    assert python_tokens(["on Main St. and 5th Ave. The end"]) == ["on main st. and 5th ave. the end"]
    assert python_tokens(["a dog etc. The end"]) == ["a dog etc. . the end"]


def test_clean_tokens_drop_punctuation_after_lower_casing():
    toks = tokenize_python({"a": ["A (big) dog, \u201crunning\u201d\u2026"]})
    assert toks == {"a": ["a -lrb- big -rrb- dog running"]}


@pytest.mark.slow  # one Java start per case
@needs_java
def test_recorded_cases_are_what_the_jar_gives():
    for case in CASES:
        assert jar_tokens(case["lines"]) == case["jar"], case["why"]


@needs_java
@pytest.mark.slow  # starts the PTB jar
def test_random_lines_equal_the_jar():
    lines = random_lines(2000, seed=0)
    assert python_tokens(lines) == jar_tokens(lines)


@needs_java
@pytest.mark.slow  # starts the PTB jar
def test_code_points_equal_the_jar():
    """Every code point below U+0800 and every 7th above (the full sweep is in
    benchmarks/ptb_parity.py --chars), alone and inside a word."""
    chars = [chr(c) for c in list(range(1, 0x800)) + list(range(0x800, 0x10000, 7))
             if not 0xD800 <= c <= 0xDFFF and chr(c) not in LINE_BREAKS]
    lines = [x for ch in chars for x in (f"a{ch}b", ch, f"x {ch} y")]
    assert python_tokens(lines) == jar_tokens(lines)


@needs_java
@pytest.mark.skipif(not (FLICKR8K / "Flickr8k.token.txt").is_file(), reason=f"Flickr8k not found at {FLICKR8K}")
@pytest.mark.slow  # the PTB jar over Flickr8k's captions
def test_every_flickr8k_caption_equals_the_jar():
    lines = [x.split("\t", 1)[1] for x in (FLICKR8K / "Flickr8k.token.txt").read_text().splitlines()]
    assert len(lines) == 40460
    got, want = python_tokens(lines), jar_tokens(lines)
    assert [x for x, a, b in zip(lines, got, want) if a != b] == []


@pytest.mark.parametrize("tokenize", [tokenize_python, pytest.param(tokenize_java, marks=needs_java)],
                         ids=["python", "java"])
def test_line_breaks_inside_a_caption_are_spaces(tokenize):
    """Each character the jar ends a line at is a space first, so no caption takes another's
    tokens (pycocoevalcap replaces only LF)."""
    caps = {f"i{k}": [f"a dog{br}on a couch", "a cat"] for k, br in enumerate(LINE_BREAKS)}
    caps["crlf"] = ["a dog\r\non a couch", "a cat"]
    want = {k: ["a dog on a couch", "a cat"] for k in caps}
    assert tokenize(caps) == want
    assert one_line("a\r\nb\u2028c") == "a  b c"


@needs_java
def test_the_jar_path_refuses_a_line_count_it_did_not_expect(monkeypatch):
    """If the jar ever gave more or fewer lines than captions, the tokens would be paired with
    the wrong images: it fails loudly instead."""
    import captionkit.scoring.ptb_tokenize as tk

    monkeypatch.setattr(tk, "one_line", lambda text: text)  # let a line break through
    with pytest.raises(RuntimeError, match="returned 3 lines for 2 captions"):
        tk.tokenize_java({"a": ["a dog\ron a couch"], "b": ["a cat"]})


@needs_java
def test_the_jvms_log_lines_are_not_read_as_tokens(monkeypatch):
    """Java 9+ logs to standard output unless told otherwise: a warning of the JVM on a loaded
    machine, or a log an environment's JAVA_TOOL_OPTIONS turns on, would be one line too many.
    They go to standard error; without that redirection the same call fails."""
    import captionkit.scoring.ptb_tokenize as tk

    caps = {"a": ["A dog, on a couch."], "b": ["a cat"], "c": ["two men"]}
    want = {"a": ["a dog on a couch"], "b": ["a cat"], "c": ["two men"]}
    monkeypatch.setenv("JAVA_TOOL_OPTIONS", "-Xlog:gc*=info")  # several log lines at start-up
    assert tk.tokenize_java(caps) == want
    monkeypatch.setattr(tk, "jvm_log_flags", lambda: ())
    with pytest.raises(RuntimeError, match=r"lines for 3 captions.*\[gc"):
        tk.tokenize_java(caps)


def test_a_java_without_xlog_gets_only_the_flags_it_knows(monkeypatch, tmp_path):
    """Java 8 has no -Xlog and would refuse to start with it: the flags are asked of the java on
    PATH once, and there only -XX:+DisplayVMOutputToStderr (its VM warnings) is given."""
    import captionkit.scoring.ptb_tokenize as tk

    java8 = tmp_path / "java"  # a stand-in that refuses -Xlog as Java 8 does
    java8.write_text('#!/bin/sh\ncase "$*" in *-Xlog*) echo "Unrecognized option: -Xlog:disable" >&2; exit 1;; esac\n')
    java8.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    tk.jvm_log_flags.cache_clear()
    try:
        assert tk.jvm_log_flags() == ("-XX:+DisplayVMOutputToStderr",)
        assert not any(a.startswith("-Xlog") for a in tk.jar_command())
    finally:
        tk.jvm_log_flags.cache_clear()
    if java_available():  # the real one (Java 9+ here) takes both
        monkeypatch.undo()
        assert tk.jvm_log_flags()[:2] == ("-Xlog:disable", "-Xlog:all=warning:stderr")
