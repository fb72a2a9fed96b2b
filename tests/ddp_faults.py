"""One DDP rank of ``captionkit`` with a fault injected: the process that tests/test_ddp_faults.py
starts twice (as ``python tests/ddp_faults.py train --config ...``, each with RANK, WORLD_SIZE and
MASTER_ADDR/PORT in its environment, or under torchrun), to see what the run does when one
rank fails while the others wait for it in a collective.

``CAPTIONKIT_TEST_FAULT=RANK:POINT[@N]`` names the rank that fails and where; the others run
normally. Points:

- ``step``: the rank's N-th training step (default the 2nd) raises from inside the forward of
  DistributedDataParallel, as a CUDA out-of-memory error does: the other ranks are then in that
  step's gradient all-reduce.
- ``validate``: the rank's N-th validation (default the 1st) raises the same error: the other
  ranks wait meanwhile for rank 0's training state (only rank 0 validates).

The rank says when it fails (``CAPTIONKIT_TEST_FAULT: rank R fails at UNIX_TIME``, on stderr).
The error's message ends with "(injected: rank R, POINT N)", built at run time, so the
traceback's source lines never contain it: a test can count the message in the output.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from torch.nn.parallel import DistributedDataParallel

from captionkit.cli.main import main
from captionkit.training.trainer import Trainer

FAULT_ENV = "CAPTIONKIT_TEST_FAULT"


def fault_message(rank: int, point: str, n: int) -> str:
    return f"CUDA out of memory. Tried to allocate 2.00 GiB (injected: rank {rank}, {point} {n})"


def inject(spec: str, rank: int) -> None:
    """Wrap the method where ``spec``'s fault happens, on the rank it names."""
    who, _, where = spec.partition(":")
    point, _, nth = where.partition("@")
    if int(who) != rank:
        return
    owner, name, default = {"step": (DistributedDataParallel, "forward", 2),
                            "validate": (Trainer, "validate", 1)}[point]
    n = int(nth or default)
    original = getattr(owner, name)
    calls = [0]

    def failing(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            print(f"{FAULT_ENV}: rank {rank} fails at {time.time():.3f}", file=sys.stderr, flush=True)
            raise torch.OutOfMemoryError(fault_message(rank, point, n))
        return original(self, *args, **kwargs)

    setattr(owner, name, failing)


if __name__ == "__main__":
    if os.environ.get(FAULT_ENV):
        inject(os.environ[FAULT_ENV], int(os.environ.get("RANK", "0")))
    sys.exit(main(sys.argv[1:]))
