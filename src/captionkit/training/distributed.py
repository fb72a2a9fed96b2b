"""Training on several processes: torchrun's environment, the process group, and the few
collectives the trainer needs.

``torchrun --nproc_per_node N -m captionkit train --config ...`` (or ``captionkit train
--nproc N``, which starts torchrun's launcher here) runs N copies of the trainer. Each reads
its place from the environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK); the trainer then
wraps its model in DistributedDataParallel over gloo (CPU) or nccl (CUDA). See
docs/distributed-training.md for the rules: the global batch, what rank 0 alone does, resume
under another world size.

A single process (no torchrun) is a world of one: every helper here is then a no-op, so the
single-process path runs exactly as it did before any of this existed.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

# Rank 0 alone validates and writes checkpoints while the others wait in a collective: a dev
# pass of a large split on a CPU can take longer than torch's default 30 minutes.
TIMEOUT = timedelta(hours=3)


@dataclass(frozen=True)
class World:
    """This process's place: ``rank`` of ``size`` processes, ``local_rank`` on its machine."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

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
    return World(int(os.environ.get("RANK", "0")), size, int(os.environ.get("LOCAL_RANK", "0")))


def device_for(world: World, device: torch.device) -> torch.device:
    """Each process's device: on CUDA, the GPU of its local rank (``cuda`` and ``auto`` name
    none in particular); CPU and MPS are shared."""
    if world.distributed and device.type == "cuda":
        return torch.device("cuda", world.local_rank)
    return device


def start(world: World, device: torch.device) -> None:
    """Join the process group of ``world`` (nccl on CUDA, gloo elsewhere); nothing for one process."""
    if not world.distributed or dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=world.rank,
                            world_size=world.size, timeout=TIMEOUT)


def stop(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


@contextlib.contextmanager
def main_first(world: World) -> Iterator[None]:
    """Rank 0 runs the block first (it fills caches, e.g. the feature store), the others after
    it, reading what it wrote."""
    if not world.main:
        barrier(world)
    yield
    if world.main:
        barrier(world)


def broadcast_json(world: World, obj: Any, device: torch.device) -> Any:
    """Rank 0's ``obj`` (anything JSON can hold) on every rank, sent as UTF-8 bytes (not pickled)."""
    if not world.distributed:
        return obj
    data = json.dumps(obj).encode() if world.main else b""
    size = torch.tensor([len(data)], dtype=torch.long, device=device)
    dist.broadcast(size, 0)
    buf = torch.zeros(int(size), dtype=torch.uint8, device=device)
    if world.main:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buf, 0)
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
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(["--standalone", "--nproc_per_node", str(nproc), "-m", "captionkit", *args])
    except ChildFailedError:
        return 1  # torchrun has printed which rank failed and how
    return 0
