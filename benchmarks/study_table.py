"""The table of a study (docs/experiments.md): one row per run, with the sweep's trained
parameters and time and the scores that ``captionkit report --data`` saved for each split.

    python benchmarks/study_table.py SWEEP [SWEEP ...] --report dev=dev.json --report test=test.json \
        [--no-bp test] [--columns Bleu_1,Bleu_2,Bleu_4,ROUGE_L,METEOR,CIDEr]

Prints a Markdown table, scores x100. Each run is matched to its sweep row by its folder.
``--no-bp SPLIT`` adds that split's BLEU-4 without the brevity penalty (as the Show, Attend and
Tell paper and its re-implementations report BLEU), rescored from the captions the report saved,
so no captioning is repeated.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from captionkit.core.checkpoint import read_config  # noqa: E402
from captionkit.data.datasets import load_dataset  # noqa: E402
from captionkit.scoring.evaluation import score_captions  # noqa: E402

SHORT = {"Bleu_1": "B-1", "Bleu_2": "B-2", "Bleu_3": "B-3", "Bleu_4": "B-4", "ROUGE_L": "ROUGE-L",
         "METEOR": "METEOR", "CIDEr": "CIDEr-D"}


def sweep_rows(sweeps: list[str]) -> dict[str, dict]:
    """{trial folder (resolved): its summary row}."""
    rows = {}
    for s in sweeps:
        summary = json.loads((Path(s) / "summary.json").read_text())
        for row in summary["trials"]:
            rows[str((Path(s) / "trials" / row["trial"]).resolve())] = row
    return rows


@functools.cache
def references(dataset: str, images: str | None) -> dict[str, list[str]]:
    """{image: its reference captions}, read once per dataset (the runs of a study share it)."""
    return {it.name: it.raw for it in load_dataset(dataset, images).all_items()}


def no_bp_bleu4(run: dict) -> float:
    """BLEU-4 of the run's saved captions without the brevity penalty."""
    data = read_config(Path(run["checkpoint"]))["train"]["data"]  # the run config it trained with
    refs = references(data["dataset"], data.get("images") or None)
    refs = {name: refs[name] for name in run["captions"]}
    rep = score_captions(run["captions"], refs, metrics=["bleu"], brevity_penalty=False, quiet=True)
    return rep.scores["Bleu_4"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("sweeps", nargs="+")
    ap.add_argument("--report", action="append", required=True, metavar="SPLIT=FILE",
                    help="a report's --data file, named by its split (repeat)")
    ap.add_argument("--no-bp", action="append", default=[], metavar="SPLIT")
    ap.add_argument("--columns", default="Bleu_1,Bleu_2,Bleu_4,ROUGE_L,METEOR,CIDEr")
    args = ap.parse_args()
    rows = sweep_rows(args.sweeps)
    columns = args.columns.split(",")
    reports = {}
    for spec in args.report:
        split, _, path = spec.partition("=")
        reports[split] = {str(Path(r["run"]).resolve()): r for r in json.loads(Path(path).read_text())["runs"]}
    first = next(iter(reports.values()))  # the runs, in the first report's order
    head = ["run", "trained parameters", "time"]
    for split in reports:
        head += [f"{split} {SHORT.get(c, c)}" for c in columns]
        if split in args.no_bp:
            head.append(f"{split} B-4 no BP")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|")
    for run in first:
        row = rows[run]
        cells = [first[run]["label"], f"{row['trained_parameters']:,}", f"{row['seconds'] / 60:.0f} min"]
        for split, rep in reports.items():
            scores = rep[run]["scores"]
            cells += [f"{100 * scores[c]:.2f}" for c in columns]
            if split in args.no_bp:
                cells.append(f"{100 * no_bp_bleu4(rep[run]):.2f}")
        print("| " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
