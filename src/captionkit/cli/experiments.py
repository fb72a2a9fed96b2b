"""The experiment commands: sweep (a grid or random sample of configs, local or Ray Tune), plot
(training curves) and report (an HTML page comparing runs); each one's options beside its code."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from .argtypes import positive_int
from .common import UsageError, _add_overwrite, _add_score_opts, _score_opts


def add_sweep(sub: argparse._SubParsersAction) -> None:
    w = sub.add_parser("sweep", help="train a grid (or a random sample) of config variations; see docs/experiments.md")
    w.set_defaults(func=cmd_sweep)
    w.add_argument("--config", required=True, help="the base TOML config")
    w.add_argument("--set", dest="sets", action="append", metavar="TABLE.FIELD=V1,V2",
                   help="values to sweep (repeat for a grid over several fields); "
                        "loguniform(LOW,HIGH) or uniform(LOW,HIGH) with --random")
    w.add_argument("--out", required=True, help="the sweep folder (rerun the same command to resume)")
    w.add_argument("--metric", help="dev metric to rank (and stop early) by: CIDEr, Bleu_4, METEOR, ... or "
                   "val_loss (default: the config's train.val_metric; a score also becomes every trial's)")
    w.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local: one trial after another; ray: Ray Tune with ASHA early stopping")
    w.add_argument("--random", type=int, metavar="N", help="N random trials instead of the whole grid")
    w.add_argument("--seed", type=int, default=0, help="seed of --random")
    w.add_argument("--cpus", type=int, default=2, help="ray: CPUs of the local Ray")
    w.add_argument("--cpus-per-trial", type=float, default=1, help="ray: CPUs each trial holds (and torch threads)")
    w.add_argument("--gpus-per-trial", type=float, help="ray: GPUs each trial holds (a fraction shares one; default 1 "
                   "when the trials train on CUDA: train.device cuda, or auto on a Ray with GPUs; else 0)")
    w.add_argument("--address", help="ray: an existing Ray cluster (its nodes must see --out)")
    w.add_argument("--grace-epochs", type=int, default=1, help="ray: epochs before ASHA may stop a trial")


def cmd_sweep(config: str, sets: list[str] | None, out: str, metric: str | None, engine: str,
              random: int | None, seed: int, cpus: int, cpus_per_trial: float, address: str | None,
              grace_epochs: int, gpus_per_trial: float | None = None) -> int:
    from ..experiments.sweep import define, format_table, ray_missing, run_local, run_ray

    if engine == "ray" and ray_missing():
        raise UsageError(ray_missing())
    if cpus < 1 or cpus_per_trial <= 0 or grace_epochs < 1:
        raise UsageError("--cpus, --cpus-per-trial and --grace-epochs must be positive")
    if gpus_per_trial is not None and gpus_per_trial < 0:
        raise UsageError("--gpus-per-trial must be 0 or more")
    sweep = define(config, sets or [], out, metric=metric, random_count=random, seed=seed, engine=engine)
    print(f"{out}: {len(sweep.trials)} trials, {len(sweep.todo())} to run ({engine}); metric {sweep.metric}",
          file=sys.stderr)
    if engine == "local":
        rows = run_local(sweep)
    else:
        rows = run_ray(sweep, cpus=cpus, cpus_per_trial=cpus_per_trial, address=address, grace_epochs=grace_epochs,
                       gpus_per_trial=gpus_per_trial)
    print(format_table(rows))
    print(f"summary: {Path(out) / 'summary.csv'}, {Path(out) / 'summary.json'} (scores x100)", file=sys.stderr)
    return 0


def add_plot(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("plot", help="training curves of runs and sweeps, one panel per metric")
    g.set_defaults(func=cmd_plot)
    g.add_argument("runs", nargs="+", metavar="RUN_OR_SWEEP", help="run folders (captionkit train --out) or sweep folders")
    g.add_argument("--out", required=True, help="the PNG to write")
    g.add_argument("--metrics", help="comma-separated history fields, e.g. loss,val_loss,CIDEr,lr "
                   "(default: loss, val_loss and the runs' train.val_metric)")
    g.add_argument("--x", choices=("captions", "epochs"), default="captions", help="the x axis")
    g.add_argument("--data", metavar="JSON", help="also write the plotted numbers here")
    _add_overwrite(g, "replace existing output files")


def cmd_plot(runs: list[str], out: str, metrics: str | None, x: str, data: str | None, overwrite: bool) -> int:
    from ..core.outputs import atomic_write_bytes, atomic_write_text, check_file_target
    from ..experiments.plot import curve_series, default_metrics, draw_curves
    from ..experiments.runs import find_runs

    target = check_file_target(out, overwrite=overwrite)
    data_target = check_file_target(data, overwrite=overwrite) if data else None
    found = find_runs(runs)
    names = [m.strip() for m in metrics.split(",") if m.strip()] if metrics else default_metrics(found)
    series = curve_series(found, names, x)
    atomic_write_bytes(target, draw_curves(series))
    if data_target:
        atomic_write_text(data_target, json.dumps(series, indent=1))
    print(f"wrote {out}: {len(series['panels'])} panels ({', '.join(names)}), {len(found)} runs")
    return 0


def add_report(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("report", help="one self-contained HTML page comparing runs and sweeps")
    r.set_defaults(func=cmd_report)
    r.add_argument("runs", nargs="+", metavar="RUN_OR_SWEEP", help="run folders (captionkit train --out) or sweep folders")
    r.add_argument("--out", required=True, help="the HTML file to write")
    r.add_argument("--split", default="dev", help="the split to caption and score (dev; test for final numbers)")
    r.add_argument("--images", type=int, default=10, help="images in the captions table")
    r.add_argument("--max-images", type=int, default=0, metavar="N",
                   help="caption and score the split's first N images only (0: all; default), e.g. "
                   "the dev images a run validated on (train.val_max_images)")
    r.add_argument("--beam", type=positive_int, default=3, help="beam width (1: greedy; default 3)")
    r.add_argument("--bootstrap", type=int, default=1000, metavar="N",
                   help="resamples for the 95%% intervals (0: none)")
    r.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling")
    r.add_argument("--data", metavar="FILE", help="also write the scores, intervals and every caption as JSON")
    _add_overwrite(r, "replace an existing report")
    _add_score_opts(r)


def cmd_report(runs: list[str], out: str, split: str, images: int, beam: int, bootstrap: int, seed: int,
               overwrite: bool, tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str,
               data: str | None = None, max_images: int = 0) -> int:
    from ..core.outputs import atomic_write_text, check_file_target
    from ..experiments.report import build_report, report_data
    from ..experiments.runs import find_runs

    if images < 0 or bootstrap < 0 or max_images < 0:
        raise UsageError("--images, --max-images and --bootstrap must be >= 0")
    target = check_file_target(out, overwrite=overwrite)
    data_target = check_file_target(data, overwrite=overwrite) if data else None
    found = find_runs(runs)
    page, results = build_report(found, split=split, images=images, beam=beam, rounds=bootstrap, seed=seed,
                                 score_opts=_score_opts(tokenizer, meteor, no_brevity_penalty, metrics),
                                 progress=lambda line: print(line, file=sys.stderr, flush=True),
                                 max_images=max_images)
    atomic_write_text(target, page)
    if data_target:
        atomic_write_text(data_target, json.dumps(report_data(results, split, beam, bootstrap), indent=1))
    print(f"wrote {out} ({len(page.encode()) / 1e6:.1f} MB): {len(found)} runs, {images} images")
    return 0
