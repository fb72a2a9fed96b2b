"""Sums over the processes of one data-parallel training step, for the few statistics that a
model or an objective must take over the *global* batch rather than its own shard: a
normaliser (self-critical training's sampled-word count) or a running statistic (hard
attention's REINFORCE baseline). DistributedDataParallel averages gradients, nothing else.

The trainer runs each step's forward inside :func:`summed_over` with a reducer that all-reduces
across the processes; everywhere else (one process, validation on rank 0 alone, inference,
tests) :func:`process_sum` is the identity, so no collective can start on one rank only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Reducer = Callable[["torch.Tensor"], "torch.Tensor"]

_REDUCER: ContextVar[Reducer | None] = ContextVar("captionkit_process_sum", default=None)


def process_sum(t: torch.Tensor) -> torch.Tensor:
    """``t`` summed over the processes of the current training step (``t`` itself outside
    one, or with one process). Every process must call it the same number of times per step,
    in the same order, with tensors of one shape: it is a collective."""
    reduce = _REDUCER.get()
    return t if reduce is None else reduce(t)


@contextlib.contextmanager
def summed_over(reduce: Reducer | None) -> Iterator[None]:
    """Inside: :func:`process_sum` is ``reduce`` (None: the identity)."""
    token = _REDUCER.set(reduce)
    try:
        yield
    finally:
        _REDUCER.reset(token)
