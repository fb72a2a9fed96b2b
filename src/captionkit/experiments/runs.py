"""Reading finished (or running) training runs for comparison: ``captionkit plot`` and
``captionkit report`` take run folders and sweep folders alike.

A run folder is what ``captionkit train`` writes: ``history.jsonl`` (one line per epoch) and the
checkpoints ``best`` and ``last``, whose config.json holds the run's whole config. A sweep folder
(``captionkit sweep``) stands for its trials that have started.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.checkpoint import read_config, resolve
from ..core.errors import UserError
from ..core.outputs import owner_kind


@dataclass
class Run:
    path: Path
    config: dict  # the run's full config ([data], [encoder], [model], [train]), as it trained
    history: list[dict]  # history.jsonl, one entry per epoch
    label: str = ""  # what tells it apart from the other runs compared (see label_runs)

    @property
    def checkpoint(self) -> Path:
        """The run's best checkpoint, or its last one while no best was kept."""
        best = resolve(self.path / "best")
        return best if (best / "config.json").is_file() else resolve(self.path / "last")


LOSS_METRIC = "val_loss"  # ranked lowest first; every other metric highest first


def best_entry(history: list[dict], metric: str) -> dict | None:
    """The validated epoch with the best ``metric`` (lowest val_loss, else highest score)."""
    scored = [h for h in history if metric in h]
    if not scored:
        return None
    sign = -1 if metric == LOSS_METRIC else 1
    return max(scored, key=lambda h: sign * h[metric])


def seen(entry: dict) -> int:
    """Captions trained on in a history entry's epoch (images, for self-critical epochs)."""
    return int(entry.get("captions", entry.get("images", 0)))


def trained_parameters(folder: str | Path) -> int | None:
    """The parameter count a run trains (its checkpoints' config), None before its first save."""
    for name in ("last", "best"):
        if (resolve(Path(folder) / name) / "config.json").is_file():
            return read_config(Path(folder) / name).get("trained_parameters", {}).get("total")
    return None


def read_history(run: str | Path) -> list[dict]:
    path = Path(run) / "history.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def load_run(folder: str | Path) -> Run:
    folder = Path(folder)
    for name in ("last", "best"):
        if (resolve(folder / name) / "config.json").is_file():
            return Run(folder, read_config(folder / name)["train"], read_history(folder))
    raise UserError(f"{folder}: not a training run (no best/ or last/ checkpoint; "
                     f"give run folders written by captionkit train, or sweep folders)")


SWEEP_FILE = "sweep.json"  # a sweep folder's definition (captionkit.experiments.sweep writes it)


def trial_folder(sweep_folder: str | Path, name: str) -> Path:
    """Where a sweep keeps the run folder of its trial ``name``."""
    return Path(sweep_folder) / "trials" / name


def sweep_trial_folders(sweep_folder: Path) -> list[Path]:
    """The run folders of a sweep's trials, in the sweep's order (read here rather than through
    captionkit.experiments.sweep, which imports this module)."""
    path = sweep_folder / SWEEP_FILE
    if not path.is_file():
        raise UserError(f"{sweep_folder}: not a captionkit sweep folder (no {SWEEP_FILE})")
    return [trial_folder(sweep_folder, t["name"]) for t in json.loads(path.read_text())["trials"]]


def find_runs(paths: list[str | Path]) -> list[Run]:
    """Run folders, and each sweep folder's trials that have a checkpoint, in the order given;
    labelled by what differs between them."""
    runs = []
    for p in paths:
        p = Path(p)
        if not p.is_dir():
            raise UserError(f"{p}: no such run or sweep folder")
        if owner_kind(p) == "sweep":
            started = sweep_trial_folders(p)
            started = [r for r in started if (resolve(r / "last") / "config.json").is_file()]
            if not started:
                raise UserError(f"{p}: no trial of this sweep has a checkpoint yet")
            runs += [load_run(r) for r in started]
        else:
            runs.append(load_run(p))
    label_runs(runs)
    return runs


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """{"train": {"lr": 1e-4}} -> {"train.lr": 1e-4}; lists stay values."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def differing_settings(runs: list[Run]) -> list[str]:
    """The dotted config keys whose values are not the same in every run, in config order."""
    flat = [flatten(r.config) for r in runs]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    return [k for k in keys if any(f.get(k, None) != flat[0].get(k, None) for f in flat[1:])]


def short_keys(keys: list[str]) -> dict[str, str]:
    """Each key by its field name, or whole where two keys share a field name."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: s if last.count(s) == 1 else k for k, s in zip(keys, last)}


def format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))


LABEL_SETTINGS = 4  # runs differing in more settings than this are labelled by their folders


def label_runs(runs: list[Run]) -> None:
    """Label each run by its differing settings ("lr=0.0001, hidden_dim=512"), or by its folder
    when they are more than LABEL_SETTINGS, none (a single run) or the same as another run's."""
    keys = differing_settings(runs)
    short = short_keys(keys)
    for r in runs:
        flat = flatten(r.config)
        r.label = ", ".join(f"{short[k]}={format_value(flat.get(k, '-'))}" for k in keys)
        if not keys or len(keys) > LABEL_SETTINGS:
            r.label = r.path.name
    labels = [r.label for r in runs]
    for r in runs:  # the same label twice (e.g. one run given twice, folders of one name): the path
        if labels.count(r.label) > 1:
            r.label = str(r.path)
