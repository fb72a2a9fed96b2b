"""Kill-anywhere harness: a tiny training run is killed with SIGKILL again and again and resumed
with ``captionkit train --config C --out OUT --resume`` until it finishes; then its checkpoints
must equal those of a run never interrupted.

Two kinds of kill (a plan per launch):

- ``timer``: the harness SIGKILLs the process at a random moment of its training, between 0 and
  ``timer_s`` seconds after it is set up (where it was is told by its last progress output:
  inside an epoch's steps, validating, saving/tuning after the dev scores, or before its first
  report);
- a named point (``save:model``, ``save:files``, ``save:swap``, ``save:done``, ``validate``): the
  process kills itself the N-th time it gets there (``CAPTIONKIT_TEST_KILL``, see
  ``captionkit.core.checkpoint.kill_point``), the only way to land inside a checkpoint write every time.

Before every resume the harness reads the checkpoint on disk (``last``, or ``.last.old`` when a
save was killed between its renames): both tensor files must pass their digests, its step must
never be below the one before the kill (no complete checkpoint is ever lost; after a kill just
past a save of ``last``, it is that save's), and the resumed process must say it resumes from
that folder and step. A kill before the first checkpoint starts
the run afresh. Used by tests/test_kill_resume.py and benchmarks/kill_resume.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import tomllib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from captionkit.core.checkpoint import KILL_ENV, read_config, read_weights, resolve

ROOT = Path(__file__).resolve().parents[1]
HOOKS = ("save:model", "save:files", "save:swap", "save:done", "validate")
# a tiny run whose every step is checkpointed every other step, with dropout (so the resumed
# random state matters) and one validation per epoch
KILL_CONFIG_CHANGES = {"checkpoint_every = 0": "checkpoint_every = 2", "dropout = 0.0": "dropout = 0.3"}
TENSOR_FILES = ("model.safetensors", "optimizer.safetensors")


def kill_config(tiny_config_text: str) -> str:
    for old, new in KILL_CONFIG_CHANGES.items():
        assert old in tiny_config_text, old
        tiny_config_text = tiny_config_text.replace(old, new)
    return tiny_config_text


@dataclass
class Report:
    kills: Counter = field(default_factory=Counter)  # where each kill landed
    resumes: int = 0  # launches with --resume from a checkpoint
    fresh_starts: int = 0  # launches with nothing to resume (the first, and after a kill before any checkpoint)
    resumed_steps: list[int] = field(default_factory=list)
    via_old: int = 0  # resumes from .last.old (a save killed between its renames)
    seconds: float = 0.0

    def summary(self) -> str:
        where = ", ".join(f"{k} {v}" for k, v in sorted(self.kills.items()))
        return (f"{sum(self.kills.values())} kills ({where}); {self.resumes} resumes (from steps "
                f"{self.resumed_steps}, {self.via_old} from .last.old); {self.fresh_starts} fresh starts; "
                f"{self.seconds:.0f} s")


def _env(extra: dict[str, str]) -> dict[str, str]:
    """One thread, this checkout's captionkit, no kill hook but the one asked for, and progress
    bars although stderr is a pipe (where_it_was reads them)."""
    env = {k: v for k, v in os.environ.items() if k != KILL_ENV}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1", CAPTIONKIT_PROGRESS="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
    return env


class Child:
    """A child process, ``python -m MODULE ARGS`` (captionkit's command line by default), its
    stderr collected as it comes; ``env``: variables added to the harness's environment."""

    def __init__(self, *args: str, module: str = "captionkit.cli.main", env: dict[str, str] | None = None):
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, env=_env(env or {}))
        self.err = ""
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while chunk := self.proc.stderr.read1(65536):
            self.err += chunk.decode(errors="replace")

    def wait_for(self, text: str, timeout: float = 120.0) -> bool:
        """Wait until stderr shows ``text``; False if the process ended first."""
        end = time.monotonic() + timeout
        while text not in self.err:
            if self.proc.poll() is not None or time.monotonic() > end:
                return text in self.err
            time.sleep(0.005)
        return True

    def finish(self, timeout: float = 300.0) -> int:
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc


class Launch(Child):
    """One ``captionkit train`` process (``--resume`` or not; ``kill_at``: the kill hook's plan)."""

    def __init__(self, config: Path, out: Path, resume: bool, kill_at: str | None = None):
        super().__init__("train", "--config", str(config), "--out", str(out), *(["--resume"] if resume else []),
                         env={KILL_ENV: kill_at} if kill_at else None)


def where_it_was(err: str, epochs: int) -> str:
    """Where a timer kill landed, from the last thing the run printed (a run of ``epochs``):
    its progress bars (captionkit.core.progress: ``epoch E/N: ...`` over an epoch's steps, kept
    with a newline when it ends; ``validating: ...`` over the dev images, cleared) and lines."""
    if re.search(rf"resuming from .* \(epoch {epochs}, ", err):
        return "timer: saving or tuning"  # resumed after its last epoch: only the tuning is left
    shown = [c for c in re.split(r"[\r\n]", err) if c.strip()]  # each drawing of a bar, each line
    last = shown[-1] if shown else ""
    before = next((c for c in reversed(shown) if not c.startswith("validating")), "")
    epoch_bar = re.match(r"epoch \d+/\d+: ", last)
    if epoch_bar and not err.endswith("\n"):
        return "timer: inside an epoch"
    if epoch_bar or last.startswith("validating"):
        # after an epoch's bar: its validation; after its dev scores: the final tuning's
        return "timer: validating" if re.match(r"epoch \d+/\d+: ", before) else "timer: saving or tuning"
    if re.match(r"epoch \d+: ", last):
        return "timer: saving or tuning"
    return "timer: before its first report"  # set up (or resumed), no step reported yet


def checkpoint_on_disk(out: Path) -> tuple[Path, int] | None:
    """The checkpoint a resume would use, after checking both its tensor files' digests."""
    folder = resolve(out / "last")
    if not folder.exists():
        return None
    for name in TENSOR_FILES:
        read_weights(folder, name)  # raises CheckpointError on a digest mismatch
    return folder, read_config(folder)["state"]["step"]


def run_once(config: Path, out: Path) -> None:
    """The uninterrupted reference run."""
    launch = Launch(config, out, resume=False)
    if launch.finish() != 0:
        raise AssertionError(f"reference run failed:\n{launch.err}")


def kill_and_resume(config: Path, out: Path, plans: list[tuple[str, int | float]],
                    max_launches: int = 1000) -> Report:
    """Launch, kill by each plan in turn ((hook point, N) or ("timer", seconds after set-up)),
    resume, and after the plans run to the end. Raises AssertionError on any broken promise."""
    report, t0 = Report(), time.monotonic()
    epochs = tomllib.loads(config.read_text())["train"]["epochs"]
    plans = list(plans)
    floor = -1  # the step of the newest checkpoint seen on disk
    for _ in range(max_launches):
        found = checkpoint_on_disk(out)
        if found is None:
            shutil.rmtree(out, ignore_errors=True)  # nothing to resume: start afresh
            report.fresh_starts += 1
        else:
            folder, step = found
            assert step >= floor, f"the checkpoint went back from step {floor} to {step}"
            floor = step
        plan = plans.pop(0) if plans else None
        hook = f"{plan[0]}@{plan[1]}" if plan and plan[0] != "timer" else None
        launch = Launch(config, out, resume=found is not None, kill_at=hook)
        if found is not None:
            assert launch.wait_for("resuming from"), f"no resume line:\n{launch.err}"
            said = re.search(r"resuming from (.*) \(epoch \d+, step (\d+)\)", launch.err)
            assert said and (Path(said[1]), int(said[2])) == (folder, step), \
                f"expected to resume from {folder} at step {step}, the run said: {said and said[0]}"
            report.resumes += 1
            report.resumed_steps.append(step)
            report.via_old += folder.name == ".last.old"
        if plan and plan[0] == "timer" and launch.wait_for("trained parameters"):
            time.sleep(plan[1])
            where = where_it_was(launch.err, epochs)
            launch.proc.send_signal(signal.SIGKILL)
        rc = launch.finish()
        if rc == -signal.SIGKILL:
            if hook:
                said = re.search(rf"{KILL_ENV}: killed at (\S+) ?(.*)", launch.err)
                assert said and said[1] == plan[0], f"killed, but not by the {hook} hook:\n{launch.err[-3000:]}"
                where = f"hook: {plan[0]}" + (f" ({Path(said[2]).name})" if said[2] else "")
            report.kills[where] += 1
            if where == "hook: save:swap (last)":  # last renamed aside, the new one not in place
                assert not (out / "last").exists() and resolve(out / "last").name == ".last.old"
            if where == "hook: save:done (last)":  # the save just completed is the one to resume from
                assert read_config(out / "last")["state"]["step"] > (step if found else -1)
        elif rc == 0:  # done (if plans are left, the run ended before this plan's kill came)
            report.seconds = time.monotonic() - t0
            return report
        else:
            raise AssertionError(f"train exited {rc}:\n{launch.err[-3000:]}")
    raise AssertionError(f"not finished after {max_launches} launches")


def random_plans(kills: int, rng: random.Random, timer_s: float) -> list[tuple[str, int | float]]:
    """``kills`` plans: half timer kills, half at a named point (reached the 1st..3rd time)."""
    return [("timer", rng.uniform(0.0, timer_s)) if rng.random() < 0.5 else (rng.choice(HOOKS), rng.randint(1, 3))
            for _ in range(kills)]


def compare_runs(resumed: Path, whole: Path) -> list[str]:
    """What differs between the two runs' checkpoints and history (times aside); [] if nothing."""
    problems = []
    for ck, name in (("last", "model.safetensors"), ("last", "optimizer.safetensors"), ("best", "model.safetensors")):
        a, b = read_weights(resumed / ck, name), read_weights(whole / ck, name)
        if set(a) != set(b):
            problems.append(f"{ck}/{name}: tensor names differ")
        problems += [f"{ck}/{name}: {k} differs" for k in a if k in b and not torch.equal(a[k], b[k])]

    def untimed(history: list[dict]) -> list[dict]:
        return [{k: v for k, v in h.items() if k != "seconds"} for h in history]

    for ck in ("last", "best"):
        sa, sb = read_config(resumed / ck)["state"], read_config(whole / ck)["state"]
        ha, hb = untimed(sa.pop("history")), untimed(sb.pop("history"))
        if ha != hb or sa != sb:
            problems.append(f"{ck}/config.json: training state differs")
    lines = [untimed([json.loads(ln) for ln in (run / "history.jsonl").read_text().splitlines()])
             for run in (resumed, whole)]
    if lines[0] != lines[1]:
        problems.append(f"history.jsonl differs: {len(lines[0])} vs {len(lines[1])} lines")
    if read_config(resumed / "best")["decoding"] != read_config(whole / "best")["decoding"]:
        problems.append("best/config.json: decoding differs")
    left = sorted(p.name for p in resumed.iterdir())
    if left != sorted(p.name for p in whole.iterdir()):
        problems.append(f"the resumed run's folder holds {left}")
    return problems
