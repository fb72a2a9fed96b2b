"""The Python PTB tokenizer (captionkit.scoring.ptb) against the Stanford PTBTokenizer jar that
pycocoevalcap runs: how many captions get different tokens, on every data set at hand, and the
time each takes. Needs Java.

    python benchmarks/ptb_parity.py [--fuzz 20000] [--seed 0] [--chars]

Compared, each as one text the way coco-caption tokenises a set (tokens before punctuation is
dropped, lower-cased):
- coco_magic (../shared/data/parity/coco_magic): all references, then all captions;
- Flickr8k (../shared/data/flickr8k): all 40,460 captions;
- tests/data/ptb_cases.json: the hand-written cases, each case's lines as one text;
- --fuzz N random lines (tests/ptb_fuzz.py: caption-like lines and random characters);
- --chars: every code point up to U+FFFF (surrogates and line breaks aside) in three contexts,
  "a{c}b", "{c}" and "x {c} y", which checks the character classes in captionkit/scoring/_ptb_chars.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
sys.path.insert(0, str(ROOT / "tests"))

from ptb_fuzz import random_lines  # noqa: E402

from captionkit.scoring.ptb import tokenize_lines  # noqa: E402
from captionkit.scoring.ptb_tokenize import LINE_BREAKS, jar_command, one_line  # noqa: E402


def jar_lines(lines: list[str]) -> tuple[list[str], float]:
    t = time.perf_counter()
    out = subprocess.run(jar_command(), input="\n".join(lines).encode(), capture_output=True, check=True).stdout
    got = out.decode().split("\n")
    assert len(got) == len(lines), (len(got), len(lines))
    return got, time.perf_counter() - t


def python_lines(lines: list[str]) -> tuple[list[str], float]:
    t = time.perf_counter()
    got = [" ".join(toks).lower() for toks in tokenize_lines(lines)]
    return got, time.perf_counter() - t


def compare(name: str, texts: list[list[str]], show: int) -> int:
    """Compare the tokens of each text (its lines tokenised together); print one summary line."""
    n = t_jar = t_py = 0
    differ = []
    for lines in texts:
        lines = [one_line(x) for x in lines]
        want, dt_jar = jar_lines(lines)
        got, dt_py = python_lines(lines)
        n, t_jar, t_py = n + len(lines), t_jar + dt_jar, t_py + dt_py
        differ += [(x, a, b) for x, a, b in zip(lines, want, got) if a != b]
    print(f"{name:40s} {n:7,d} lines  {len(differ):5,d} differ   jar {t_jar:6.2f} s  python {t_py:6.2f} s")
    for x, a, b in differ[:show]:
        print(f"    {x!r}\n      jar    {a!r}\n      python {b!r}")
    return len(differ)


def code_point_lines() -> list[str]:
    chars = [chr(c) for c in range(1, 0x10000)
             if not 0xD800 <= c <= 0xDFFF and chr(c) not in LINE_BREAKS]
    return [line for ch in chars for line in (f"a{ch}b", ch, f"x {ch} y")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fuzz", type=int, default=20000, help="random lines to compare")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chars", action="store_true", help="also every code point up to U+FFFF")
    ap.add_argument("--show", type=int, default=5, help="differing lines to print per set")
    args = ap.parse_args()
    total = 0
    coco = SHARED / "parity" / "coco_magic"
    if (coco / "refs.json").is_file():
        refs = json.loads((coco / "refs.json").read_text())
        caps = json.loads((coco / "caps.json").read_text())
        total += compare("coco_magic references", [[r for v in refs.values() for r in v]], args.show)
        total += compare("coco_magic captions", [list(caps.values())], args.show)
    flickr = SHARED / "flickr8k" / "Flickr8k.token.txt"
    if flickr.is_file():
        lines = [x.split("\t", 1)[1] for x in flickr.read_text().splitlines() if "\t" in x]
        total += compare("Flickr8k captions", [lines], args.show)
    cases = json.loads((ROOT / "tests" / "data" / "ptb_cases.json").read_text())
    total += compare(f"tests/data/ptb_cases.json ({len(cases)} texts)", [c["lines"] for c in cases], args.show)
    if args.fuzz:
        total += compare(f"random lines (seed {args.seed})", [random_lines(args.fuzz, args.seed)], args.show)
    if args.chars:
        total += compare("every code point in 3 contexts", [code_point_lines()], args.show)
    print(f"lines with different tokens, all sets: {total}")


if __name__ == "__main__":
    main()
