"""The host side of the coming training batches, prepared on a background thread while the
current step runs.

A step's host work -- reading its feature rows from the memory-mapped store, building the
index tensors, pinning them on CUDA -- does not depend on the step before it (the epoch's
batches are known when it starts), so :class:`Prefetcher` does it ``depth`` batches ahead and
the training thread only copies (non-blocking on CUDA) and computes. The thread draws no
random numbers and touches no device: every draw of a step (dropout, hard attention's
locations, SCST's samples) stays on the training thread in the order it had, so a run is
the same with or without it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Shard:
    """This process's part of a global batch (see :func:`captionkit.training.distributed.shard`).

    share: its share of the batch's figures (target tokens, or images for SCST; the shares of
    a step sum to 1). loss_weight: what its loss is weighted by so that the processes' weighted
    losses add up to the whole batch's (the token share for cross-entropy; 1 for SCST, whose
    loss is normalised by the global batch's sampled words). A stand-in part (``real`` False:
    the batch had no item left for this process) has both 0."""

    part: list[int]
    real: bool = True
    share: float = 1.0
    loss_weight: float = 1.0


@dataclass
class HostBatch:
    """One global batch as this process trains on it: its shard, the global batch's size (what
    the epoch counts as seen) and the shard's tensors, built on the CPU (pinned for CUDA)."""

    shard: Shard
    size: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class Prefetcher(Generic[T, R]):
    """``make(item)`` for each of ``items`` in order, on a daemon thread, at most ``depth``
    results ahead of the consumer. Iterate it for the results; an exception in ``make`` is
    raised where its result would have been read. Use it as a context manager: leaving (at
    the epoch's end, or early) stops the thread."""

    def __init__(self, make: Callable[[T], R], items: Iterable[T], depth: int = 2):
        self._make, self._items = make, items
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="captionkit-prefetch", daemon=True)

    def __enter__(self) -> Prefetcher[T, R]:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        while self._thread.is_alive():  # free a put waiting for room, then let the thread end
            try:
                self._queue.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()

    def __iter__(self) -> Iterator[R]:
        while True:
            done, value = self._queue.get()
            if done:
                return
            if isinstance(value, _Failed):
                raise value.error
            yield value

    def _run(self) -> None:
        try:
            for item in self._items:
                if self._stop.is_set():
                    return
                self._put((False, self._make(item)))
        except BaseException as e:  # handed to the consumer, which raises it with its traceback
            self._put((False, _Failed(e)))
            return
        self._put((True, None))

    def _put(self, entry: tuple) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(entry, timeout=0.05)
                return
            except queue.Full:
                continue


@dataclass
class _Failed:
    error: BaseException
