"""coco-caption's tokenisation: the Stanford PTBTokenizer jar pycocoevalcap ships (Java), or its
re-implementation in Python (:mod:`captionkit.scoring.ptb`), which gives the jar's tokens.

coco-caption writes the captions of a set one per line, runs the jar over them with
``-preserveLines -lowerCase``, and drops these punctuation tokens: '' ' `` ` -LRB- -RRB- -LCB-
-RCB- . ? ! , : - -- ... ; (the bracket names in upper case only, so after lower-casing "-lrb-"
and its kin survive, as in the reference).

Three things differ from pycocoevalcap on purpose:

- Line breaks inside a caption (CR, LF, CR LF, VT, FF, U+0085, U+2028, U+2029: the jar ends a
  line at each) become spaces first, on both paths. pycocoevalcap replaces only LF, so a CR
  inside a reference gives the jar one line too many and every later caption is paired with the
  previous one's tokens.
- The JVM's own log lines go to standard error. Java 9 and later print their log warnings (a
  thread the JVM could not start on a loaded machine, large pages it could not get, or what a
  ``JAVA_TOOL_OPTIONS`` of the environment turns on) to standard output by default, where they
  would be read as tokens: one line too many, and the captions paired with the wrong tokens.
- The jar path checks that it got exactly one line back per caption, and fails loudly if not.

A set's captions are tokenised as one text, in order, as coco-caption does: the jar's tokens of a
line can depend on how the next line starts (see :mod:`captionkit.scoring.ptb`).
"""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

from ..core.errors import UserError
from .ptb import tokenize_lines

PUNCTUATIONS = {"''", "'", "``", "`", "-LRB-", "-RRB-", "-LCB-", "-RCB-",
                ".", "?", "!", ",", ":", "-", "--", "...", ";"}
LINE_BREAKS = "\r\n\x0b\x0c\x85\u2028\u2029"
_AS_SPACES = str.maketrans({c: " " for c in LINE_BREAKS})

# the JVM's unified logging (Java 9+) writes to standard output unless told otherwise; these come
# after JAVA_TOOL_OPTIONS on the JVM's command line, so they also redirect what it turns on
_XLOG_TO_STDERR = ("-Xlog:disable", "-Xlog:all=warning:stderr")

Captions = dict[str, list[str]]  # {key: [caption, ...]}


def one_line(text: str) -> str:
    """``text`` with each line break as a space."""
    return text.translate(_AS_SPACES)


def _lines(captions: Captions) -> list[str]:
    return [one_line(c) for v in captions.values() for c in v]


def _regroup(captions: Captions, lines: list[str]) -> Captions:
    """Per-caption results, in one flat list, back into {key: [...]}."""
    out: Captions = {}
    it = iter(lines)
    for k, v in captions.items():
        out[k] = [next(it) for _ in v]
    return out


def _clean(tokens: list[str]) -> str:
    # lower-case first, then drop: as coco-caption, whose list names brackets in upper case
    return " ".join(t for t in (t.lower() for t in tokens) if t not in PUNCTUATIONS)


def tokenize_python(captions: Captions) -> Captions:
    """{key: [caption, ...]} -> {key: ["lower-cased tokens", ...]} the coco-caption way, in Python."""
    return _regroup(captions, [_clean(toks) for toks in tokenize_lines(_lines(captions))])


def java_available() -> bool:
    return shutil.which("java") is not None


@functools.lru_cache(maxsize=None)
def jvm_log_flags() -> tuple[str, ...]:
    """The java options that send the JVM's own messages to standard error: its unified logging
    (Java 9+; Java 8 has no -Xlog and would refuse to start, so it is asked once whether this
    java takes it) and its "VM warning" lines (-XX:+DisplayVMOutputToStderr, Java 8 and later)."""
    try:
        xlog = subprocess.run(["java", *_XLOG_TO_STDERR, "-version"], capture_output=True,
                              timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):  # no java: the jar's own call says so
        xlog = False
    return (*(_XLOG_TO_STDERR if xlog else ()), "-XX:+DisplayVMOutputToStderr")


def jar_command() -> list[str]:
    """How coco-caption runs the PTBTokenizer jar (it reads the text on standard input), with the
    JVM's log lines sent to standard error."""
    from pycocoevalcap.tokenizer import ptbtokenizer as ptb

    jar = Path(ptb.__file__).with_name(ptb.STANFORD_CORENLP_3_4_1_JAR)
    return ["java", *jvm_log_flags(), "-cp", str(jar), "edu.stanford.nlp.process.PTBTokenizer",
            "-preserveLines", "-lowerCase"]


class _JarRun:
    """The jar tokenising one set of captions in a subprocess (several can run at once)."""

    def __init__(self, captions: Captions):
        self.captions = captions
        self.lines = _lines(captions)
        self.proc = subprocess.Popen(jar_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE) if self.lines else None

    def result(self) -> Captions:
        if self.proc is None:
            return {k: [] for k in self.captions}
        # as coco-caption writes them: joined by newlines, none after the last
        out, err = self.proc.communicate("\n".join(self.lines).encode())
        if self.proc.returncode != 0:
            raise RuntimeError(f"the PTBTokenizer jar failed (exit status {self.proc.returncode}): "
                               f"{err.decode(errors='replace').strip()[-2000:]}")
        got = out.decode().split("\n")
        if len(got) != len(self.lines):
            raise RuntimeError(f"the PTBTokenizer jar returned {len(got)} lines for {len(self.lines)} "
                               "captions: tokens would be paired with the wrong captions. First lines "
                               f"out: {got[:3]!r}; its standard error: "
                               f"{err.decode(errors='replace').strip()[-1000:]!r}")
        return _regroup(self.captions, [" ".join(w for w in line.rstrip().split(" ") if w not in PUNCTUATIONS)
                                        for line in got])


def tokenize_java(captions: Captions) -> Captions:
    """The same through the Stanford PTBTokenizer jar (needs Java): coco-caption's command, quiet,
    and without writing a temporary file into site-packages."""
    return _JarRun(captions).result()


def resolve_backend(backend: str) -> str:
    """"java", "python", or for "auto" Java when it is installed."""
    if backend == "auto":
        return "java" if java_available() else "python"
    if backend not in ("java", "python"):
        raise UserError(f"unknown tokenizer {backend!r} (java, python or auto)")
    return backend


def tokenize_sets(sets: list[Captions], backend: str = "auto") -> tuple[list[Captions], str]:
    """Tokenise each set of captions as its own text (coco-caption tokenises the references and
    the captions separately); the jar runs on all sets at once. Returns the tokens of each set
    and the backend used."""
    backend = resolve_backend(backend)
    if backend == "python":
        return [tokenize_python(s) for s in sets], backend
    runs = [_JarRun(s) for s in sets]
    try:
        return [r.result() for r in runs], backend
    finally:
        for r in runs:
            if r.proc is not None and r.proc.poll() is None:  # after a failure: stop the others
                r.proc.kill()
                r.proc.wait()


def tokenize(captions: Captions, backend: str = "auto") -> tuple[Captions, str]:
    """Tokenise with ``backend`` "java", "python" or "auto" (Java when present); returns the
    tokens and the backend used."""
    (toks,), backend = tokenize_sets([captions], backend)
    return toks, backend
