"""Sweeps: many training runs of one base config with some fields changed.

``captionkit sweep --config base.toml --set train.lr=1e-4,3e-5 --set model.hidden_dim=256,512
--out sweeps/NAME`` trains every combination (a grid; or ``--random N --seed S`` of them, or N
draws when a value is ``loguniform(a,b)`` / ``uniform(a,b)``). Each trial is an ordinary run
folder written by :func:`captionkit.training.run.train` under ``NAME/trials/``, from its own config file
under ``NAME/configs/`` (the base with the trial's overrides: rerunnable with ``captionkit train``).

The sweep folder holds its definition (``sweep.json``), each trial's status (``status/``) and the
summary (``summary.csv``, ``summary.json``): the overrides, the best dev scores, captions seen and
time of every trial, rewritten as trials end. Rerunning the same command resumes: finished trials
are kept, unfinished ones continue from their last checkpoint; a different grid into the same
folder is refused. Engines: ``local`` (one trial after another, in this process) and ``ray`` (Ray
Tune: trials in parallel, ASHA stopping the weaker ones early on the dev metric; see
:func:`run_ray`).
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import math
import os
import random
import re
import sys
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.errors import OutputError, UserError
from ..core.fields import is_dotted_key, parse_value
from ..core.outputs import atomic_write_text, check_folder_target, owner_kind, write_marker
from ..core.progress import lines_above_bars
from ..core.progress import progress as progress_bar
from ..core.signals import Preempted
from ..scoring.evaluation import METRICS
from .runs import (
    LOSS_METRIC,
    SWEEP_FILE,
    best_entry,
    flatten,
    format_value,
    read_history,
    seen,
    short_keys,
    trained_parameters,
    trial_folder,
)

_DISTRIBUTIONS = ("loguniform", "uniform")
FINISHED = ("finished", "stopped early")  # a trial in either state is not run again
ROOT = ""  # the key of an axis of inline tables merged into the whole config


# ---- the definition: axes, trials, configs --------------------------------------------------
@dataclass
class Axis:
    """One ``--set KEY=VALUES``: the dotted config key and its values, or a distribution
    ``{"dist": "loguniform", "low": a, "high": b}`` for random sweeps. Fields that vary together
    are one axis without a key (``ROOT``) whose values are inline tables with dotted keys, each
    merged into the config: ``{model.lm_training = "frozen"},{model.lm_training = "lora",
    train.lr_groups.lora = 5e-4}``."""

    key: str
    values: list[Any] | None = None
    dist: dict | None = None


def _split_top(text: str, sep: str = ",") -> list[str]:
    """Split at ``sep`` outside brackets, parentheses, braces and quotes."""
    parts, depth, quote, cur = [], 0, "", []
    for ch in text:
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append("".join(cur))
            cur = []
            continue
        cur.append(ch)
    parts.append("".join(cur))
    return [p.strip() for p in parts]


def parse_set(text: str) -> Axis:
    """``train.lr=1e-4,3e-5``, ``train.lr=loguniform(1e-5,1e-3)`` or ``{a.b = 1, c.d = 2},{...}`` -> Axis."""
    if text.lstrip().startswith("{"):  # fields varying together
        tables = [parse_value(v) for v in _split_top(text.strip())]
        if not all(isinstance(t, dict) and t for t in tables):
            raise UserError(f"--set {text}: expected inline tables of TABLE.FIELD = VALUE, e.g. "
                             f"{{model.lm_training = \"lora\", train.lr_groups.lora = 5e-4}},{{model.lm_training = \"frozen\"}}")
        return Axis(ROOT, values=tables)
    key, eq, values = text.partition("=")
    key = key.strip()
    if not eq or not values.strip() or not is_dotted_key(key):
        raise UserError(f"--set {text}: expected TABLE.FIELD=VALUE[,VALUE...], e.g. train.lr=1e-4,3e-5")
    m = re.fullmatch(r"(\w+)\((.*)\)", values.strip())
    if m and m.group(1) in _DISTRIBUTIONS:
        bounds = [parse_value(v) for v in _split_top(m.group(2))]
        if len(bounds) != 2 or not all(isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds) \
                or not bounds[0] < bounds[1] or (m.group(1) == "loguniform" and bounds[0] <= 0):
            raise UserError(f"--set {text}: {m.group(1)}(LOW,HIGH) needs two numbers, 0 < LOW < HIGH for loguniform")
        return Axis(key, dist={"dist": m.group(1), "low": float(bounds[0]), "high": float(bounds[1])})
    return Axis(key, values=[parse_value(v) for v in _split_top(values)])


def _draw(dist: dict, rng: random.Random) -> float:
    lo, hi = dist["low"], dist["high"]
    x = math.exp(rng.uniform(math.log(lo), math.log(hi))) if dist["dist"] == "loguniform" else rng.uniform(lo, hi)
    return float(f"{x:.3g}")  # three significant digits: readable trial names, no false precision


def trial_overrides(axes: list[Axis], random_count: int | None = None, seed: int = 0) -> list[dict[str, Any]]:
    """The trials' overrides: the whole grid (the first axis varying slowest), or ``random_count``
    of its combinations drawn without repeats, or ``random_count`` draws when an axis is a
    distribution."""
    keys = [a.key for a in axes]
    if len(set(keys)) != len(keys):
        raise UserError(f"--set {next(k for k in keys if keys.count(k) > 1) or '{...}'} is given twice")
    if any(a.dist for a in axes):
        if not random_count:
            raise UserError(f"--set {next(a.key for a in axes if a.dist)}=...(LOW,HIGH) needs --random N")
        rng = random.Random(seed)
        return [{a.key: _draw(a.dist, rng) if a.dist else rng.choice(a.values) for a in axes}
                for _ in range(random_count)]
    grid = [dict(zip(keys, combo)) for combo in itertools.product(*(a.values for a in axes))]
    if random_count is None:
        return grid
    if not 1 <= random_count <= len(grid):
        raise UserError(f"--random {random_count}: the grid has {len(grid)} combinations; "
                         f"ask for 1 to {len(grid)}, or give a value as loguniform(LOW,HIGH)")
    picked = sorted(random.Random(seed).sample(range(len(grid)), random_count))
    return [grid[i] for i in picked]


def trial_names(overrides: list[dict[str, Any]]) -> list[str]:
    """Folder names: the trial's number, then its overrides by field name (the whole key where
    two keys share a field name), e.g. ``002-lr=3e-05-hidden_dim=512``."""
    names = []
    for i, ov in enumerate(overrides):
        columns = override_columns(ov)
        short = short_keys(list(columns))
        slug = "-".join(f"{short[k]}={format_value(v)}" for k, v in columns.items())
        names.append(f"{i:03d}" + ("-" + re.sub(r"[^\w.=+,-]", "_", slug)[:100] if slug else ""))
    return names


def override_columns(overrides: dict[str, Any]) -> dict[str, Any]:
    """A trial's overrides by dotted key, the inline tables of a ROOT axis spelt out."""
    out: dict[str, Any] = {}
    for k, v in overrides.items():
        out.update(flatten(v) if k == ROOT else {k: v})
    return out


def apply_overrides(base: dict, overrides: dict[str, Any], where: str) -> dict:
    """The config dict ``base`` with ``overrides`` ({"train.lr": 1e-4}) applied and validated as a
    config file is: the one place sweeps turn overrides into a config."""
    from ..models import family_fields
    from ..training.config import RunConfig, set_fields

    d = set_fields(base, override_columns(overrides), where)
    try:
        cfg = RunConfig.from_dict(d, where)
    except ValueError as e:  # the field checks of the config's tables do not know the file
        raise UserError(str(e) if str(e).startswith(where) else f"{where}: {e}") from None
    if "family" in cfg.model:  # the [model] table's fields are otherwise checked when the model is built
        unknown = sorted(set(cfg.model) - {"family"} - family_fields(cfg.model["family"]))
        if unknown:
            raise UserError(f"{where}: unknown field(s) in [model] for family {cfg.model['family']!r}: "
                             f"{', '.join(unknown)}")
    return d


def _toml_key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else json.dumps(k)


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # repr(float) round-trips; inf and nan are TOML's spelling too
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON's escapes are TOML basic-string escapes
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{_toml_key(str(k))} = {_toml_value(x)}" for k, x in v.items()) + "}"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def to_toml(d: dict) -> str:
    """A config dict (tables of values) as TOML; ``tomllib.loads`` gives ``d`` back."""
    lines = [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in d.items() if not isinstance(v, dict)]
    for table, body in d.items():
        if isinstance(body, dict):
            lines += ["", f"[{_toml_key(table)}]"] + [f"{_toml_key(k)} = {_toml_value(v)}" for k, v in body.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


@dataclass
class Sweep:
    """A sweep folder and its definition."""

    folder: Path
    definition: dict  # base config path and dict, axes, mode, metric, trials [{name, overrides}]

    @property
    def trials(self) -> list[dict]:
        return self.definition["trials"]

    @property
    def metric(self) -> str:
        return self.definition["metric"]

    def run_dir(self, name: str) -> Path:
        return trial_folder(self.folder, name)

    def config_path(self, name: str) -> Path:
        return self.folder / "configs" / f"{name}.toml"

    def status(self, name: str) -> dict:
        path = self.folder / "status" / f"{name}.json"
        return json.loads(path.read_text()) if path.is_file() else {"status": "pending", "seconds": 0.0}

    def set_status(self, name: str, status: str, seconds: float, **extra) -> None:
        atomic_write_text(self.folder / "status" / f"{name}.json",
                          json.dumps({"status": status, "seconds": round(seconds, 1), **extra}))

    def todo(self) -> list[str]:
        return [t["name"] for t in self.trials if self.status(t["name"])["status"] not in FINISHED]


def define(config: str | Path, sets: list[str], out: str | Path, metric: str | None = None,
           random_count: int | None = None, seed: int = 0, engine: str = "local") -> Sweep:
    """Parse and validate a sweep (every trial's config) and prepare its folder; nothing is
    trained. A folder holding this same sweep is taken up again; any other is refused."""
    from ..training.config import VAL_METRICS, RunConfig

    config, out = Path(config), Path(out)
    base_cfg = RunConfig.load(config)  # the base must be a valid config on its own
    base = tomllib.loads(config.read_text())
    axes = [parse_set(s) for s in sets]
    if metric is None:
        metric = base_cfg.train.val_metric
    if metric not in (*VAL_METRICS, LOSS_METRIC):
        raise UserError(f"--metric must be one of {', '.join((*VAL_METRICS, LOSS_METRIC))}, not {metric!r}")
    fixed = {"train.val_metric": metric} if metric != LOSS_METRIC and metric != base_cfg.train.val_metric else {}
    if any(a.key == "train.val_metric" for a in axes) and metric != LOSS_METRIC:
        raise UserError("--set train.val_metric: the sweep's --metric sets every trial's train.val_metric")
    overrides = trial_overrides(axes, random_count, seed)
    names = trial_names(overrides)
    trials = []
    for name, ov in zip(names, overrides):
        shown = " ".join(f"{k}={format_value(v)}" for k, v in override_columns(ov).items())
        full = apply_overrides(base, {**fixed, **ov}, f"{config} with --set {shown}")
        trials.append({"name": name, "overrides": ov, "config": full})
    definition = {"base_config": str(config), "base": base, "axes": [a.__dict__ for a in axes],
                  "random": random_count, "seed": seed if random_count else None, "metric": metric,
                  "fixed": fixed, "trials": trials}
    sweep = Sweep(out, definition)
    existing, kind = out / SWEEP_FILE, owner_kind(out)
    if kind == "sweep" and existing.is_file():
        old = json.loads(existing.read_text())
        if _comparable(old) != _comparable(definition):
            raise OutputError(f"{out}: holds a different sweep (another base config, grid or metric); "
                              f"rerun its own command to resume it, or choose another --out")
        return Sweep(out, old)
    if kind != "sweep":
        if out.is_dir() and any(out.iterdir()):
            raise OutputError(f"{out}: exists and is not a captionkit sweep "
                              f"({f'a captionkit {kind}' if kind else 'not written by captionkit'}); choose another --out")
        check_folder_target(out, overwrite=False)  # a file, a dangling link, an unwritable parent
        write_marker(out, "sweep")
    for t in trials:
        atomic_write_text(sweep.config_path(t["name"]), to_toml(t["config"]))
    atomic_write_text(existing, json.dumps({**definition, "engine": engine}, indent=1))  # last: the sweep is defined
    return sweep


def _comparable(definition: dict) -> dict:
    """What makes two sweeps the same: not the engine, nor how the base config's path was typed."""
    return {k: v for k, v in definition.items() if k not in ("engine", "base_config")}


def load_sweep(folder: str | Path) -> Sweep:
    folder = Path(folder)
    path = folder / SWEEP_FILE
    if owner_kind(folder) != "sweep" or not path.is_file():
        raise UserError(f"{folder}: not a captionkit sweep folder (no {SWEEP_FILE})")
    return Sweep(folder, json.loads(path.read_text()))


# ---- results -------------------------------------------------------------------------------
def trial_row(sweep: Sweep, trial: dict) -> dict:
    """One summary row: the overrides, status, the best epoch's dev scores (x100) and loss,
    epochs, captions seen and seconds."""
    history = read_history(sweep.run_dir(trial["name"]))
    status = sweep.status(trial["name"])
    best = best_entry(history, sweep.metric) or {}
    row = {"trial": trial["name"], **override_columns(trial["overrides"]),
           "status": status["status"], "best_epoch": best.get("epoch", ""),
           "epochs": max((h["epoch"] for h in history), default=0)}
    for m in METRICS:
        if m in best:
            row[m] = round(100 * best[m], 2)
    if "val_loss" in best:
        row["val_loss"] = round(best["val_loss"], 4)
    row["captions"] = sum(seen(h) for h in history)
    row["trained_parameters"] = trained_parameters(sweep.run_dir(trial["name"])) or ""
    row["seconds"] = status["seconds"]
    return row



def summarize(sweep: Sweep) -> list[dict]:
    """The summary rows, best trial first (by the sweep's metric; trials without a score last),
    written to summary.json and summary.csv."""
    rows = [trial_row(sweep, t) for t in sweep.trials]
    metric, sign = sweep.metric, (-1 if sweep.metric == LOSS_METRIC else 1)
    rows.sort(key=lambda r: (metric not in r, -sign * r.get(metric, 0)))
    columns = list(dict.fromkeys(k for r in rows for k in r))
    atomic_write_text(sweep.folder / "summary.json",
                      json.dumps({"metric": metric, "scale": "scores x100", "columns": columns, "trials": rows},
                                 indent=1))
    buf = io.StringIO()
    w = csv.DictWriter(buf, columns)
    w.writeheader()
    w.writerows(rows)
    atomic_write_text(sweep.folder / "summary.csv", buf.getvalue())
    return rows


def format_table(rows: list[dict]) -> str:
    """The summary as an aligned text table (scores x100)."""
    columns = list(dict.fromkeys(k for r in rows for k in r))
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    width = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, width))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, width)) for row in cells]
    return "\n".join(lines)


# ---- engines -------------------------------------------------------------------------------
class _Clock:
    """A trial's wall time, carried over from earlier attempts, written to its status at every
    epoch (so an interrupted attempt keeps all but its last epoch's time)."""

    def __init__(self, sweep: Sweep, name: str):
        self.sweep, self.name = sweep, name
        self.before = float(sweep.status(name).get("seconds", 0.0))
        self.start = time.time()

    def seconds(self) -> float:
        return self.before + time.time() - self.start

    def __call__(self, entry: dict) -> None:
        self.sweep.set_status(self.name, "running", self.seconds())


def run_trial(sweep: Sweep, name: str, progress: bool = False, on_epoch=None, device: str | None = None) -> dict:
    """Train (or resume) one trial with the ordinary trainer; mark it finished. ``device``
    replaces the trial's train.device (a Ray trial's GPU is its cuda:0)."""
    from ..training.run import train

    clock = _Clock(sweep, name)
    sweep.set_status(name, "running", clock.seconds())

    def each_epoch(entry: dict) -> None:
        clock(entry)
        if on_epoch:
            on_epoch(entry)
    # "auto": from its checkpoint if it has one (an attempt killed or preempted: SIGTERM/SIGUSR1
    # stop it with its `last` saved and its status left "running"), else afresh
    try:
        state = train(sweep.config_path(name), out=sweep.run_dir(name), resume="auto", progress=progress,
                      on_epoch=each_epoch, device=device)
    except Preempted as e:
        sweep.set_status(name, "running", clock.seconds())
        raise Preempted(f"trial {name}: stopped on {e.signal_name} with its checkpoint saved; run the same "
                        f"sweep command again to resume it", e.signal_name) from None
    sweep.set_status(name, "finished", clock.seconds())
    return state


def run_local(sweep: Sweep, progress: bool = True) -> list[dict]:
    """Every unfinished trial, one after another in this process."""
    todo = sweep.todo()
    done = len(sweep.trials) - len(todo)
    if done:
        print(f"{sweep.folder}: {done} of {len(sweep.trials)} trials already done; "
              f"{len(todo)} to run", file=sys.stderr)
    # the trials' own bars (features, epochs) and lines (dev scores) go beneath and above this one
    bar = progress_bar(total=len(sweep.trials), initial=done, desc="sweep", unit="trial", show=progress)
    with bar, lines_above_bars():
        for i, name in enumerate(todo):
            # (kept without bars too: it heads the trial's lines in a log)
            print(f"trial {name} ({done + i + 1}/{len(sweep.trials)})", file=sys.stderr)
            bar.set_postfix_str(name)
            run_trial(sweep, name, progress=progress)
            summarize(sweep)
            bar.update()
    return summarize(sweep)


def ray_missing() -> str | None:
    """Why the ray engine cannot run here (None when it can)."""
    try:
        import ray  # noqa: F401
        from ray import tune  # noqa: F401
    except ImportError:
        return "--engine ray needs Ray Tune: pip install 'captionkit[ray]' (or pip install 'ray[tune]')"
    return None


def trial_devices(sweep: Sweep) -> dict[str, str]:
    """Each trial's train.device (the base config's, or the trial's --set)."""
    from ..training.config import RunConfig

    return {t["name"]: RunConfig.from_dict(t["config"]).train.device for t in sweep.trials}


def check_trial_gpus(sweep: Sweep, gpus_per_trial: float | None) -> None:
    """A Ray trial given no GPU sees none (Ray hides them: CUDA_VISIBLE_DEVICES is empty), so
    a trial that trains on CUDA would fail at its start: one line before Ray starts instead."""
    if gpus_per_trial is None or gpus_per_trial > 0:
        return
    on_cuda = sorted(name for name, device in trial_devices(sweep).items() if device.startswith("cuda"))
    if on_cuda:
        raise UserError(f"--gpus-per-trial 0, but trial {on_cuda[0]} trains on {trial_devices(sweep)[on_cuda[0]]} "
                        f"(train.device): give each trial a GPU (--gpus-per-trial 1, or a fraction to share one) "
                        f"or train on the CPU (--set train.device=cpu)")


def trial_gpus(sweep: Sweep, gpus_per_trial: float | None, cluster_gpus: float) -> float:
    """The GPUs each Ray trial holds: ``gpus_per_trial`` when given, else what the trials'
    train.device asks for: 1 when one trains on CUDA (``cuda``, ``cuda:N``, or ``auto`` on a
    Ray with ``cluster_gpus`` > 0), else 0. (One figure for every trial: a grid over
    train.device holds a GPU for its CPU trials too.)"""
    if gpus_per_trial is not None:
        return gpus_per_trial
    devices = trial_devices(sweep).values()
    wants = any(d.startswith("cuda") or (d == "auto" and cluster_gpus > 0) for d in devices)
    return 1.0 if wants else 0.0


def run_ray(sweep: Sweep, cpus: int | None = 2, cpus_per_trial: float = 1, address: str | None = None,
            grace_epochs: int = 1, reduction_factor: int = 2, gpus_per_trial: float | None = None) -> list[dict]:
    """The unfinished trials on Ray Tune: a local Ray of ``cpus`` CPUs (or the cluster at
    ``address``, whose nodes must see the sweep folder), ``cpus_per_trial`` each and
    ``gpus_per_trial`` (default: see :func:`trial_gpus`), and the ASHA
    scheduler on the sweep's metric, reported at every validation (time = the trial's epoch):
    at each rung (``grace_epochs`` x ``reduction_factor``^k epochs) a trial below the best
    1/``reduction_factor`` of those that reached it is stopped. A stopped trial keeps its run
    folder (its best checkpoint so far) and is not run again."""
    import ray
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    todo = sweep.todo()
    if not todo:
        return summarize(sweep)
    from ..training.config import RunConfig

    check_trial_gpus(sweep, gpus_per_trial)
    folder = sweep.folder.resolve()
    planned = {t["name"]: RunConfig.from_dict(t["config"]).train.epochs for t in sweep.trials}
    devices = trial_devices(sweep)
    threads = max(1, int(cpus_per_trial))

    def trainable(config: dict) -> None:
        import torch
        torch.set_num_threads(threads)
        name = config["trial"]

        def report(entry: dict) -> None:
            # validated epochs before the last: a trial stopped when its training is done would
            # lose the length-penalty search that follows
            if sweep.metric in entry and entry["epoch"] < planned[name]:
                tune.report({k: v for k, v in entry.items() if isinstance(v, (int, float))})
        # Ray shows a trial only the GPU(s) it holds, as cuda:0 on: cuda:N would not be there
        device = "cuda" if gpus and devices[name].startswith("cuda:") else None
        run_trial(load_sweep(folder), name, on_epoch=report, device=device)

    if not ray.is_initialized():
        ray.init(address=address, num_cpus=None if address else cpus, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
    cluster_gpus = ray.cluster_resources().get("GPU", 0)
    gpus = trial_gpus(sweep, gpus_per_trial, cluster_gpus)
    if gpus > cluster_gpus and not address:  # (a cluster may add GPU nodes as trials wait; this Ray will not)
        raise UserError(f"each trial needs {gpus:g} GPU(s) (--gpus-per-trial, or train.device) but this Ray has "
                        f"{cluster_gpus:g}: its trials would wait for ever")
    scheduler = ASHAScheduler(time_attr="epoch", max_t=max(planned.values()), grace_period=grace_epochs,
                              reduction_factor=reduction_factor)
    mode = "min" if sweep.metric == LOSS_METRIC else "max"
    tuner = tune.Tuner(
        tune.with_resources(trainable, {"cpu": cpus_per_trial, "gpu": gpus}),
        param_space={"trial": tune.grid_search(todo)},
        tune_config=tune.TuneConfig(metric=sweep.metric, mode=mode, scheduler=scheduler),
        run_config=tune.RunConfig(name="ray", storage_path=str(folder / "ray"), verbose=0))
    # Ctrl-C ends the sweep at once (Ray would stop the trials and return them as if
    # finished): their status stays "running" and a rerun resumes them
    before = os.environ.get("TUNE_DISABLE_SIGINT_HANDLER")
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"
    try:
        results = tuner.fit()
    finally:
        if before is None:
            del os.environ["TUNE_DISABLE_SIGINT_HANDLER"]
        else:
            os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = before
    for res in results:
        name = res.config["trial"]
        if sweep.status(name)["status"] == "finished":
            continue
        if res.error is not None:
            sweep.set_status(name, "failed", sweep.status(name)["seconds"], error=str(res.error).strip()[-2000:])
        else:  # ended by the scheduler, not by the trainer
            sweep.set_status(name, "stopped early", sweep.status(name)["seconds"])
    rows = summarize(sweep)
    failed = [n for n in todo if sweep.status(n)["status"] == "failed"]
    if failed:
        print(f"{len(failed)} trial(s) failed: {', '.join(failed)} (errors in {sweep.folder}/status/)",
              file=sys.stderr)
    return rows
