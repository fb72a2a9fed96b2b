"""Training a decoder on cached encoder features: the entry points, the checks of what the
user gave, and the run folder.

``captionkit train --config FILE [--max-steps N] [--out DIR] [--resume]`` runs :func:`train`.
The config is TOML with [data], [encoder], [model] and [train] tables (see configs/). The config
is checked in full when it is read (:mod:`captionkit.training.config`), the run folder by
:func:`check_run_folder` (and :func:`check_resumable`), and the files it names by
:func:`check_inputs`, all before any stage (:func:`check_run`). :func:`build_trainer` runs the
stages (:mod:`captionkit.training.stages`) and gives the :class:`Trainer` that trains
(:mod:`captionkit.training.trainer`).
"""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from ..core.checkpoint import CheckpointError, read_config, resolve
from ..core.devices import resolve_device
from ..core.errors import OutputError, UserError
from ..core.locks import check_unlocked, hold_lock
from ..core.outputs import MARKER, atomic_write_text, check_folder_target, owner_kind, write_marker
from ..core.signals import DEFAULT_STOP_SIGNALS, Preempted, StopSignals
from ..data.tokenizers import Tokenizer, load_tokenizer
from ..models.matcher import check_matcher_folder
from .config import ConfigError, RunConfig
from .distributed import (
    SINGLE,
    World,
    abort,
    barrier,
    broadcast_json,
    check_gpus,
    device_for,
    main_first,
    peer_failure,
    start,
    world_from_env,
)
from .distributed import stop as stop_world
from .glove import vector_dim
from .stages import CPU, TrainData, build_model, build_optimizer, build_tokenizer, prepare_data
from .trainer import Trainer, TrainState


# what a rank that waited too long for rank 0's feature cache is told to do
FILL_CACHE_FIRST = ("fill the cache in one process first (the same captionkit train without --nproc/torchrun, "
                    "--max-steps 1 --out a scratch folder), then start the DDP run")


def build_trainer(cfg: RunConfig, out: Path, data: TrainData | None = None, vocab: Tokenizer | None = None,
                  saved: dict | None = None, device: torch.device = CPU, world: World = SINGLE) -> Trainer:
    """The stages in order: data, tokenizer, model, optimizer, then the Trainer. ``vocab``
    replaces the built tokenizer; ``saved``: the config of a checkpoint to resume (its
    tokenizer, and its model config checked against the one built). Under DDP rank 0 fills the
    feature cache before the others read it, and its tokenizer is every rank's."""
    if data is None:
        with main_first(world, "the feature cache", hint=FILL_CACHE_FIRST):
            data = prepare_data(cfg, device)
    if saved is not None:
        vocab = load_tokenizer(saved["vocab"])
    if vocab is None:
        vocab = build_tokenizer(cfg, data) if world.main else None
        if world.distributed:
            shared = broadcast_json(world, vocab.to_json() if world.main else None, device)
            vocab = vocab or load_tokenizer(shared)
    built = build_model(cfg, data, vocab, device)
    if saved is not None and (saved["model"] != built.config or saved["family"] != built.family):
        raise CheckpointError(f"{out / 'last'}: saved with a different model config than {cfg.model}")
    return Trainer(cfg, out, data, vocab, built, build_optimizer(cfg, data, built.model), device=device, world=world)


def check_run_folder(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a run folder this run must not write, before any expensive work: ``--resume``
    needs a checkpoint to continue; a new run needs a missing or empty folder, or ``overwrite``
    and a folder holding a captionkit run (never a folder captionkit did not write)."""
    if resume and overwrite:
        raise OutputError("give --resume (continue the run in OUT) or --overwrite (start it again), not both")
    has_run = (resolve(out / "last") / "config.json").is_file()
    if resume:
        if not has_run:
            raise OutputError(f"{out}: no checkpoint to resume ({out / 'last'} is missing); "
                              f"leave out --resume to start a new run there")
        return
    if has_run and not overwrite:
        raise OutputError(f"{out}: holds a training run; pass --resume to continue it, --overwrite to start "
                          f"it again (its checkpoints are replaced), or choose another --out")
    check_folder_target(out, overwrite=overwrite, kinds=("run",))


def check_resumable(cfg: RunConfig, out: Path, max_steps: int | None = None) -> None:
    """The config's family and [model] fields are those the checkpoint to resume was trained
    with (checked again, in full, once the model is built), and ``max_steps`` (which counts from
    the run's start) leaves steps to train: a run already there would only save itself again."""
    folder = resolve(out / "last")
    saved = read_config(folder)
    step = saved.get("state", {}).get("step")
    if max_steps is not None and isinstance(step, int) and step >= max_steps:
        raise UserError(f"{out}: the run is at step {step} already and --max-steps counts from its start, so "
                        f"--max-steps {max_steps} leaves nothing to train; give more than {step}, or leave it out "
                        f"to train to the end")
    if cfg.train.init:
        return  # the model comes from the init checkpoint, as it did for the saved run
    if saved.get("family") != cfg.model["family"]:
        raise ConfigError(f"{folder}: trained as family {saved.get('family')!r}, the config names "
                          f"model.family = {cfg.model['family']!r}; resume with the run's own config")
    for k, v in cfg.model.items():
        if k != "family" and saved["model"].get(k) != v:
            raise ConfigError(f"{folder}: trained with model.{k} = {saved['model'].get(k)!r}, the config says "
                              f"{v!r}; resume with the run's own config")


def changed_fields(cfg: RunConfig, saved: dict) -> list[str]:
    """The [data], [encoder] and [train] fields of ``cfg`` that differ from those the run in a
    checkpoint (``saved``: its config.json) was trained with, as "train.seed = 2 (was 0)"; a
    resumed run may change them on purpose (more epochs), or by a --set left out."""
    was = saved.get("train", {})
    now = cfg.to_dict()
    return [f"{table}.{k} = {v!r} (was {was[table][k]!r})" for table in ("data", "encoder", "train")
            if isinstance(was.get(table), dict) for k, v in now[table].items()
            if k in was[table] and was[table][k] != v]


def check_inputs(cfg: RunConfig, config: str | Path) -> None:
    """The files the config names that are cheap to check: the checkpoint to start from and
    the word-vector file (and its dimension against model.embed_dim)."""
    if cfg.train.init:
        read_config(cfg.train.init)  # one line naming the folder when it is not a checkpoint
    if cfg.train.scst_matcher:
        check_matcher_folder(cfg.train.scst_matcher)  # (its encoder: once the encoder is built)
    glove = cfg.train.glove
    if glove and not Path(glove).is_file():
        raise ConfigError(f"{config}: train.glove: {glove}: no such word-vector file")
    if glove and "embed_dim" in cfg.model:
        dim = vector_dim(glove)
        if dim != cfg.model["embed_dim"]:
            raise ConfigError(f"{config}: model.embed_dim is {cfg.model['embed_dim']} but train.glove {glove} holds "
                              f"{dim}-d vectors (leave embed_dim out to use the file's)")


@contextmanager
def lock_run_folder(out: Path, resume: bool, overwrite: bool) -> Iterator[None]:
    """Hold the run folder's lock (captionkit.core.locks) for the run: a second ``train --out``
    the same folder is refused in one line naming this process. The folder is checked again
    under the lock: another run may have written it after :func:`check_run` looked."""
    with hold_lock(out, "training"):
        check_run_folder(out, resume, overwrite)
        yield


def start_run_folder(out: Path, replace: bool) -> None:
    """Make ``out`` the folder of a new run, marked as captionkit's; with ``replace``, first
    empty it of the previous run that :func:`check_run_folder` found there."""
    if replace and out.is_dir():
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, "run")


def train(config: str | Path, out: str | Path | None = None, max_steps: int | None = None,
          resume: bool = False, progress: bool = True, init: str | None = None, overwrite: bool = False,
          on_epoch: Callable[[dict], None] | None = None, tensorboard: str | None = None,
          device: str | None = None, threads: int | None = None, busy_warning: bool = False,
          stop_signals: str | tuple[str, ...] = DEFAULT_STOP_SIGNALS, dataset=None,
          settings: dict[str, Any] | None = None) -> TrainState:
    """Train from a TOML config into the run folder ``out`` (default runs/<config name>).
    Everything the user gave is checked first (the config, the folder, the files it names);
    ``resume`` continues the run in ``out``, ``overwrite`` replaces a run there. ``on_epoch``:
    see Trainer.fit; ``tensorboard``: a folder for event files (replaces train.tensorboard);
    ``device`` replaces train.device; ``threads``: torch's CPU threads for this process (None:
    torch's default; set for the whole process, as the feature extraction uses them too);
    ``busy_warning``: one line when other work leaves fewer free cores than torch has threads
    (:func:`warn_busy_cores`; the command line's, not a sweep's trials, which share cores by design).
    Under torchrun (RANK/WORLD_SIZE in the environment) this process is one rank of a DDP run
    (see captionkit.training.distributed). ``resume="auto"``: resume the run in ``out`` if it has
    a checkpoint, else start one (see :func:`auto_resume`). ``stop_signals`` (core.signals): on
    one, the run saves ``last`` and raises Preempted. ``dataset`` replaces the config's
    data.dataset (which the file may then leave out): a path, or a ``datasets.Dataset`` or
    ``DatasetDict``, written once as an imagefolder in the cache whose folder the run records
    (captionkit.data.hf_datasets). ``settings`` ({"train.seed": 2}, the command line's ``--set``)
    replace the config's fields they name (:meth:`RunConfig.load`); a resumed run needs them again,
    as it needs the same config file."""
    world = world_from_env()
    stop = StopSignals(stop_signals, immediate=True)  # (a bad name: one line, before any work)
    auto = resume == "auto"
    if auto:
        resume, overwrite = auto_resume(Path(out) if out else Path("runs") / Path(config).stem, overwrite)
    in_memory = dataset is not None and not isinstance(dataset, (str, Path))
    cfg, out, run_device = check_run(config, out, max_steps, resume, init, overwrite, device,
                                     dataset=f"<{type(dataset).__name__}>" if in_memory else dataset,
                                     settings=settings)
    if in_memory:  # after the config's checks: the rows' own before any image is written
        from ..data.hf_datasets import as_imagefolder
        cfg.data.dataset = str(as_imagefolder(dataset))
    if auto and resume and (done := finished(cfg, out)) is not None:
        print(f"{out}: the run is finished ({done}); nothing to do (--resume auto)", file=sys.stderr)
        return TrainState.from_json(read_config(resolve(out / "last"))["state"], out / "last")
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise UserError(f"threads must be a positive integer, got {threads!r}")
        torch.set_num_threads(threads)
    if busy_warning and not world.distributed and run_device.type == "cpu":
        warn_busy_cores()
    run_device = device_for(world, run_device)
    tensorboard = tensorboard or cfg.train.tensorboard
    if tensorboard and world.main:  # its package is checked before the expensive work
        from .tblog import TensorBoardLog
        tb = TensorBoardLog(tensorboard)
        on_epoch = tb.chain(on_epoch)
    held = ExitStack()  # rank 0's lock of the run folder, released when the run ends in any way
    stop.install()  # set-up: a signal stops at once; the loop polls it (Trainer.fit)
    start(world, run_device)
    try:
        if world.main:
            held.enter_context(lock_run_folder(out, resume, overwrite))
        barrier(world)  # every rank has checked the folder before rank 0 writes into it
        if resume:
            saved = read_config(resolve(out / "last"))
            if world.main and (changed := changed_fields(cfg, saved)):
                print(f"{out}: resuming with {'; '.join(changed)}", file=sys.stderr, flush=True)
            trainer = build_trainer(cfg, out, saved=saved, device=run_device, world=world)
            if world.main and not (out / MARKER).is_file():  # a run written before folders were marked
                write_marker(out, "run")
            trainer.restore(resolve(out / "last"), saved)
        else:
            trainer = build_trainer(cfg, out, device=run_device, world=world)
            if world.main:
                start_run_folder(out, replace=overwrite)
        if trainer.glove_coverage is not None and world.main:
            atomic_write_text(out / "glove_coverage.json", json.dumps(trainer.glove_coverage.to_json(), indent=1))
        barrier(world)  # the run folder exists before any rank goes on
        state = trainer.fit(max_steps=max_steps, progress=progress, on_epoch=on_epoch, stop=stop)
        if world.main:
            print(end_of_run(cfg, out, state, max_steps), file=sys.stderr, flush=True)
        stop_world(world)
    except Preempted:  # from the loop every rank stops at the same step; in set-up on its own
        (abort if stop.immediate else stop_world)(world)
        raise
    except BaseException as e:
        # Any rank's error ends the run on every rank, at once: no barrier here (see abort). The
        # failing rank's error goes on to the user; a rank whose collective broke because of it
        # says so in one line, so that the user sees the one error that matters, once.
        abort(world)
        stopped = peer_failure(world, e)
        if stopped is None:
            raise
        lead = "\n" if world.main and progress else ""  # (after rank 0's progress line)
        print(lead + stopped, file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        stop.restore()
        held.close()
        if tensorboard and world.main:
            tb.close()
    return state


def warn_busy_cores() -> None:
    """One line when other work keeps the cores torch's threads need busy: each step then waits
    for its slowest thread (measured on 2 loaded cores: 12-14 captions/s on 2 threads against
    123-188 on one, docs/training.md#threads). A warning, not a default that follows the load:
    the thread count changes a run's numbers, and one command should give one model."""
    import os

    cpus, threads = os.cpu_count() or 1, torch.get_num_threads()
    try:
        load = os.getloadavg()[0]
    except OSError:  # not every system has it
        return
    if threads > 1 and load > cpus - threads + 0.5:
        free = max(1, min(threads - 1, int(cpus - load + 0.5)))  # the cores the load leaves, at least one
        print(f"warning: the load on this machine ({load:.1f} on {cpus} cores) leaves fewer than {threads} cores to "
              f"this run's {threads} torch threads, which can make it many times slower; --threads {free} "
              f"runs faster then", file=sys.stderr)


def end_of_run(cfg: RunConfig, out: Path, state: TrainState, max_steps: int | None) -> str:
    """The line a run ends with: why it stopped and what it saved where (a run that ended
    in silence left the user to guess both)."""
    tc = cfg.train
    last = f"{out / 'last'} (epoch {state.epoch}, step {state.step})"
    if state.epoch < tc.epochs and state.bad_epochs < tc.patience:  # fit returned before the end: max_steps
        return (f"stopped at --max-steps {max_steps}: saved {last}; "
                f"continue it with --resume and a larger --max-steps, or without one to train to the end")
    why = (f"all {tc.epochs} epochs done" if state.bad_epochs < tc.patience
           else f"stopped early at epoch {state.epoch} (no {tc.val_metric} gain for {tc.patience} "
                f"{'epochs' if tc.val_every == 1 else 'validations'})")
    best = resolve(out / "best")
    if state.best_score is None or not (best / "config.json").is_file():
        return f"{why}: saved {last} (no dev score chose a best checkpoint)"
    return (f"{why}: saved {out / 'best'} (epoch {state.best_epoch}, dev {tc.val_metric} "
            f"{100 * state.best_score:.2f}) and {last}")


def auto_resume(out: Path, overwrite: bool) -> tuple[bool, bool]:
    """``--resume auto`` -> (resume, overwrite): resume when ``out`` holds a checkpoint (``last``,
    or ``.last.old`` after a save cut short); start afresh in a run folder captionkit began but
    stopped before its first checkpoint (nothing in it to keep); else a new run, by the rules of
    a new run (a foreign or non-empty folder is refused)."""
    if overwrite:
        raise OutputError("give --resume auto (continue the run in OUT, or start it) or --overwrite, not both")
    if (resolve(out / "last") / "config.json").is_file():
        return True, False
    return False, out.is_dir() and owner_kind(out) == "run"


def finished(cfg: RunConfig, out: Path) -> str | None:
    """Why the run in ``out`` is over for this config (its epochs done or stopped early, and the
    decoding settings chosen on its best checkpoint), or None when training is left to do."""
    state = read_config(resolve(out / "last"))["state"]
    best = out / "best" / "config.json"
    if not (best.is_file() and "length_penalty_search" in json.loads(best.read_text())):
        return None
    if state["epoch"] >= cfg.train.epochs:
        return f"{state['epoch']} epochs"
    if state.get("bad_epochs", 0) >= cfg.train.patience:
        return f"stopped early after epoch {state['epoch']}"
    return None


def check_run(config: str | Path, out: str | Path | None = None, max_steps: int | None = None,
              resume: bool = False, init: str | None = None, overwrite: bool = False,
              device: str | None = None, nproc: int = 1, dataset: str | Path | None = None,
              settings: dict[str, Any] | None = None) -> tuple[RunConfig, Path, torch.device]:
    """Everything the user gave, checked before any expensive work (also by ``--nproc`` before
    it starts the ``nproc`` processes): -> (the config, the run folder, the training device).
    ``dataset`` replaces the config's data.dataset, ``settings`` the fields they name."""
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise UserError(f"max_steps must be a positive integer, got {max_steps!r}")
    cfg = RunConfig.load(config, init, None if dataset is None else str(dataset), settings)
    run_device = _training_device(cfg, config, device)
    check_gpus(nproc, run_device)
    out = Path(out) if out else Path("runs") / Path(config).stem
    check_unlocked(out)  # a run writing it now: one line naming it (train takes the lock itself)
    check_run_folder(out, resume, overwrite)
    if resume:
        check_resumable(cfg, out, max_steps)
    check_inputs(cfg, config)
    return cfg, out, run_device


def _training_device(cfg: RunConfig, config: str | Path, device: str | None) -> torch.device:
    """``--device`` or train.device as a device this machine has (one line naming the field if not)."""
    try:
        return resolve_device(device or cfg.train.device)
    except ValueError as e:
        raise ConfigError(f"--device: {e}" if device else f"{config}: train.device: {e}") from None
