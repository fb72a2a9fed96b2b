"""Training on several processes: torchrun's environment, the process group, and the few
collectives the trainer needs.

``torchrun --nproc_per_node N -m captionkit train --config ...`` (or ``captionkit train
--nproc N``, which starts torchrun's launcher here) runs N copies of the trainer. Each reads
its place from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK); the trainer then
wraps its model in DistributedDataParallel over gloo (CPU) or nccl (CUDA). See
docs/distributed-training.md for the rules: the global batch, what rank 0 alone does, resume
under another world size.

An error on one rank ends every rank at once (:func:`abort`, :func:`peer_failure`; the run's
entry point, captionkit.training.run.train, uses them): no rank waits on an error path.

A single process (no torchrun) is a world of one: every helper here is then a no-op, so the
single-process path runs exactly as it did before any of this existed.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core.errors import UserError

# Two timeouts. The process group's collectives (every step's gradient all-reduce, the
# figures' all-reduce) give up after STEP_TIMEOUT: inside the training loop the longest a rank
# waits for another is rank 0 writing a ``last`` checkpoint (train.checkpoint_every), seconds to
# a minute. It bounds only a rank that hangs: one that fails ends the others at once (abort()).
STEP_TIMEOUT = timedelta(minutes=15)
# Rank 0 alone does long work while the others wait for its result: the feature cache of a
# first run, validation after an epoch (a dev pass of a large split on a CPU can take an hour),
# the choice of decoding settings after the last one. Those waits, and only those (barrier,
# main_first, broadcast_json), go through a second group, gloo on the CPU, allowed WAIT_TIMEOUT.
WAIT_TIMEOUT = timedelta(hours=3)
CPU = torch.device("cpu")

_waits: Any = None  # the gloo group of the long waits (start() makes it; None before and after)


class WaitTimeout(UserError):
    """A rank waited WAIT_TIMEOUT for rank 0's work; the message says which work and what to do."""


@dataclass(frozen=True)
class World:
    """This process's place: ``rank`` of ``size`` processes, ``local_rank`` on its machine."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 0  # processes on this machine (torchrun's LOCAL_WORLD_SIZE; 0: not known)

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


SINGLE = World()  # one process, no torchrun


def world_from_env() -> World:
    """The world torchrun describes in the environment (one process when it is not set)."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    return World(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")),
                 int(os.environ.get("LOCAL_WORLD_SIZE", "0")))


def device_for(world: World, device: torch.device) -> torch.device:
    """Each process's device: on CUDA, the GPU of its local rank (``cuda`` and ``auto`` name
    none in particular); CPU and MPS are shared. More processes on this machine than GPUs is
    one line (check_gpus) on every rank, before anything loads."""
    if world.distributed and device.type == "cuda":
        check_gpus(max(world.local_size, world.local_rank + 1), device)
        return torch.device("cuda", world.local_rank)
    return device


def check_gpus(processes: int, device: torch.device) -> None:
    """``processes`` processes on this machine that train on ``device``: on CUDA each needs a
    GPU of its own (without this, CUDA's "invalid device ordinal" in the process that has none,
    while the others wait for it in the process group)."""
    if device.type != "cuda" or processes <= 1:
        return
    count = torch.cuda.device_count()
    if processes > count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else ""
        raise UserError(f"{processes} processes on this machine train on CUDA, one GPU each, but {count} "
                        f"GPU(s) are visible{shown}: start at most {count} (--nproc, torchrun "
                        f"--nproc_per_node) or train on the CPU (--device cpu)")


def start(world: World, device: torch.device) -> None:
    """Join the process group of ``world`` (nccl on CUDA, gloo elsewhere) and make the group of
    the long waits; nothing for one process."""
    global _waits
    if not world.distributed or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=world.rank,
                            world_size=world.size, timeout=STEP_TIMEOUT, store=_attempt_store(world))
    _waits = dist.new_group(backend="gloo", timeout=WAIT_TIMEOUT)


def _attempt_store(world: World) -> Any:
    """The key-value store of this attempt of a torchrun job, or None (init_process_group's own,
    from MASTER_ADDR/MASTER_PORT) outside torchrun's agent. The agent keeps one store for all
    the attempts of a job (--max-restarts): a restarted rank would find the addresses the
    previous attempt's ranks published under the same keys and connect to processes that are
    gone (gloo: "connectFullMesh failed ... Connection refused"; seen for the group of the
    waits). Each attempt gets keys of its own."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        return None
    store, _, _ = next(dist.rendezvous("env://", world.rank, world.size, timeout=STEP_TIMEOUT))
    return dist.PrefixStore(f"captionkit/attempt-{attempt}", store)


def stop(world: World) -> None:
    """Leave the process group after a run that ended well: every rank waits for the others
    (rank 0 may still be choosing the decoding settings), then the group is destroyed. Never on
    an error: see abort."""
    global _waits
    if world.distributed and dist.is_initialized():
        barrier(world, "the other ranks to finish")
        dist.destroy_process_group()
        _waits = None


def abort(world: World) -> None:
    """Leave the process group on an error, waiting for no one. No barrier: the other ranks may
    be waiting in another collective (the next step's all-reduce, rank 0's broadcast after
    validation), and the two would wait for each other until the timeout. nccl: the
    communicators are aborted, so that this process's exit does not wait on collectives that
    can never complete. gloo: nothing to do; destroying the group would wait out the timeout on
    a collective still pending, while this process's exit closes its connections, and the
    other ranks' collectives fail at once ("Connection closed by peer", ~1 s after, measured).
    The process then exits non-zero, and torchrun's agent stops the other ranks."""
    global _waits
    _waits = None
    if not (world.distributed and dist.is_initialized()) or dist.get_backend() != "nccl":
        return
    with contextlib.suppress(Exception):  # a broken group may refuse; this process is ending with its own error
        dist.group.WORLD.abort()  # (nccl's alone: the gloo group of the waits ends with the process)


# How a gloo collective ends when the other side has gone (its process exited, or it stopped
# answering): plain RuntimeErrors, told apart by their text only. nccl's are DistErrors.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Timed out waiting")


def peer_failure(world: World, error: BaseException) -> str | None:
    """When ``error`` is how this rank's collective ended because another rank failed or left:
    the one line this rank prints instead of a traceback (the failing rank prints its own error,
    the one the user needs, and it should be seen once, not under N - 1 tracebacks of lost
    connections). None for an error of this rank's own."""
    if not world.distributed or isinstance(error, WaitTimeout):
        return None
    text = str(error).strip()
    if not (isinstance(error, dist.DistError) or (isinstance(error, RuntimeError)
                                                   and any(s in text for s in _PEER_GONE))):
        return None
    first = text.splitlines()[0] if text else type(error).__name__
    if first.startswith("[") and "] " in first:  # gloo's "[.../pair.cc:561] " source position
        first = first.split("] ", 1)[1]
    first = first.split(". ", 1)[0]  # "Connection closed by peer [ADDR]:PORT. This is typically ..."
    return f"rank {world.rank} stopped: another rank failed or stopped answering (its own error says why); here: {first}"


def barrier(world: World, waiting_for: str = "rank 0", hint: str = "") -> None:
    """Every rank waits here for the others, up to WAIT_TIMEOUT: after rank 0's long work
    (``waiting_for`` names it in the timeout's message, with ``hint``)."""
    if world.distributed:
        _wait(world, lambda group: dist.barrier(group=group), waiting_for, hint)


def _wait(world: World, collective: Callable[[Any], None], waiting_for: str, hint: str = "") -> None:
    """Run ``collective`` on the group of the long waits; its timeout is one line (WaitTimeout)
    naming what this rank waited for. Told by the clock, as gloo's timeout is a plain RuntimeError."""
    limit = WAIT_TIMEOUT if _waits is not None else STEP_TIMEOUT  # (no wait group: a process group started elsewhere)
    t0 = time.monotonic()
    try:
        collective(_waits)
    except RuntimeError:
        if time.monotonic() - t0 < 0.99 * limit.total_seconds():
            raise
        raise WaitTimeout(f"rank {world.rank} waited {_span(limit)} for {waiting_for} and gave up"
                          + (f"; {hint}" if hint else "")) from None


def _span(t: timedelta) -> str:
    s = t.total_seconds()
    return f"{s / 3600:g} h" if s >= 3600 else f"{s / 60:g} min" if s >= 60 else f"{s:g} s"


@contextlib.contextmanager
def main_first(world: World, what: str = "its work", hint: str = "") -> Iterator[None]:
    """Rank 0 runs the block first (it fills caches, e.g. the feature store), the others after
    it, reading what it wrote; they wait for it up to WAIT_TIMEOUT (``what``, ``hint``: the
    timeout's message)."""
    if not world.main:
        barrier(world, f"rank 0 to finish {what}", hint)
    yield
    if world.main:
        barrier(world)


def broadcast_json(world: World, obj: Any, device: torch.device | None = None) -> Any:
    """Rank 0's ``obj`` (anything JSON can hold) on every rank, sent as UTF-8 bytes (not pickled).
    The others wait for it while rank 0 computes ``obj`` (its tokenizer; its training state
    after validation), so it goes through the group of the long waits, on the CPU; ``device``:
    where the bytes go when there is no such group (a process group started by someone else)."""
    if not world.distributed:
        return obj
    on = CPU if _waits is not None else device
    data = json.dumps(obj).encode() if world.main else b""
    size = torch.tensor([len(data)], dtype=torch.long, device=on)
    _wait(world, lambda group: dist.broadcast(size, 0, group=group), "rank 0 (validation, or its tokenizer)")
    buf = torch.zeros(int(size), dtype=torch.uint8, device=on)
    if world.main:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0, group=_waits)
    return obj if world.main else json.loads(bytes(buf.cpu().tolist()).decode())


def mean_figures(world: World, figures: torch.Tensor) -> list[list[float]]:
    """Figures of the global batches of several steps, read on the host: ``figures`` (N, K)
    float64 holds this rank's for N steps, each weighted by the rank's share of its step's
    batch (the shares of a step summing to 1) -> N rows of the sums over the ranks. The one
    host read (and under DDP the one collective) of the figures for those N steps."""
    if world.distributed:
        dist.all_reduce(figures)
    return figures.tolist()


def step_sum(world: World, real: bool) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The :func:`captionkit.core.collectives.process_sum` of one DDP step: a sum over the
    processes, to which a process without a real shard (it stands in with weight 0, see
    :func:`shard`) adds zeros. None (the identity) for one process."""
    if not world.distributed:
        return None

    def total(t: torch.Tensor) -> torch.Tensor:
        t = t.clone() if real else torch.zeros_like(t)
        dist.all_reduce(t)
        return t

    return total


def shard(batch: list[int], world: World, key: list[int] | None = None) -> tuple[list[int], bool]:
    """This rank's part of a global batch: every world.size-th item from its rank on, or, with
    ``key`` (e.g. each item's image), every world.size-th distinct key with all its items, so
    an image's captions stay on one rank. -> (part, real): a rank whose part would be empty
    gets the batch's first item with ``real`` False (it takes part in the step with weight 0,
    so every rank runs the same number of steps and collectives)."""
    if not world.distributed:
        return batch, True
    if key is None:
        part = batch[world.rank::world.size]
    else:
        keys = list(dict.fromkeys(key[i] for i in batch))  # in order of first appearance
        mine = set(keys[world.rank::world.size])
        part = [i for i in batch if key[i] in mine]
    return (part, True) if part else (batch[:1], False)


def launch(nproc: int, args: list[str]) -> int:
    """Run ``python -m captionkit ARGS`` in ``nproc`` processes on this machine under torchrun's
    elastic launcher (a standalone rendezvous on a free local port). -> the exit status."""
    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    from ..core.signals import EXIT_PREEMPTED

    # the agent passes these on to the ranks (SIGUSR1 too: sbatch --signal=USR1@60), then waits 30 s
    os.environ.setdefault("TORCHELASTIC_SIGNALS_TO_HANDLE", "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    try:
        torchrun(["--standalone", "--nproc_per_node", str(nproc), "-m", "captionkit", *args])
    except ChildFailedError as e:  # torchrun has printed which rank failed and how
        preempted = all(f.exitcode == EXIT_PREEMPTED for f in e.failures.values())
        return EXIT_PREEMPTED if preempted else 1
    except SignalException:  # the signal came to this launcher: passed on, the ranks saved and stopped
        return EXIT_PREEMPTED
    return 0
