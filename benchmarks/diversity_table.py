"""The diversity table of docs/scoring.md: the references (the human row) and each captions file.

    python benchmarks/diversity_table.py --dataset ../shared/data/flickr8k --split test \\
        default=out/ensemble.jsonl sat=out/sat.jsonl ...

Each FILE is what `captionkit caption --jsonl` (one {"image": ..., "caption": ...} a line; a line
with an "error" is refused) or `--json` ({image: caption}) writes; a caption may be a list of
captions (an n-best or sampled set), then mBLEU-4 and Self-CIDEr are given too. LABEL=FILE names
the row (default: the file's name). Every file must caption every image of the split. The figures
are captionkit.scoring.diversity's (docs/scoring.md defines each); novel captions are counted
against the dataset's training split. The table is markdown, on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from captionkit.data.datasets import load_dataset
from captionkit.scoring.diversity import Diversity, diversity_rows, markdown_table
from captionkit.scoring.ptb_tokenize import resolve_backend


def read_captions(path: Path) -> dict:
    """{image: caption or [caption, ...]} from a --json or --jsonl file of `captionkit caption`."""
    text = path.read_text(encoding="utf-8-sig")
    if path.suffix != ".jsonl":
        return json.loads(text)
    out = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        rec = json.loads(line)
        if rec.get("error"):
            sys.exit(f"{path}:{lineno}: {rec['image']} has no caption ({rec['error']})")
        out[rec["image"]] = rec["captions"] if "captions" in rec else rec["caption"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", metavar="[LABEL=]FILE")
    ap.add_argument("--dataset", required=True, help="the dataset folder or file (its split's references)")
    ap.add_argument("--split", default="test")
    ap.add_argument("--tokenizer", choices=("auto", "java", "python"), default="auto")
    args = ap.parse_args()
    data = load_dataset(args.dataset)
    items = data.split(args.split)
    refs = {it.name: it.raw for it in items}
    train = [c for it in data.split("train") for c in it.raw] if "train" in data.splits else None
    rows: dict[str, Diversity] = {}
    human: dict[int, Diversity] = {}  # by captions per image: the human row takes as many references
    for spec in args.files:
        label, _, path = spec.rpartition("=")
        path = Path(path)
        caps = read_captions(path)
        missing = [k for k in refs if k not in caps]
        if missing:
            sys.exit(f"{path}: no caption for {len(missing)} of the {len(refs)} {args.split} images, e.g. {missing[0]}")
        got = diversity_rows({k: caps[k] for k in refs}, refs, train, args.tokenizer)
        rows[label or path.stem] = got["captions"]
        human.setdefault(got["captions"].captions_per_image, got["human"])
    if not human:  # no files: the references alone
        human[1] = diversity_rows({k: v[0] for k, v in refs.items()}, refs, train, args.tokenizer)["human"]
    table = {(f"references (human), first {k}" if k > 1 else "references (human)"): d for k, d in sorted(human.items())}
    print(f"{args.dataset}, {args.split} split, {len(refs):,} images; words: PTB tokens, lower case "
          f"({resolve_backend(args.tokenizer)} tokenizer); "
          f"novel: {'not a training caption' if train else '- (no training split)'}\n")
    print(markdown_table({**table, **rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
