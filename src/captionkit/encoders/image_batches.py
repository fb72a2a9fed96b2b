"""Photos -> batches of preprocessed pixels on the device that encodes them.

The one loader of batch captioning and feature extraction (:meth:`Captioner.caption_files`,
:func:`captionkit.encoders.features.build_features`). For a GPU, JPEG decoding and resizing run in
``workers`` DataLoader worker processes, so they neither hold the GIL nor wait for the model,
and the GPU never waits for them while they keep up; on CUDA the batch is put in pinned
(page-locked) memory by the DataLoader's pinning thread and copied with ``non_blocking=True``,
so the copy overlaps the previous batch's work. For the CPU, reader threads decode one batch
ahead, as before devices existed (see :func:`image_batches` for why), and processes sharing
the work read the batches each one claims (:func:`claimed_batches`). An image that cannot be
read is an :class:`ImageError` in its batch's ``errors``; the rest of the batch goes on.
Order is the order of ``paths``.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

from ..core.errors import ImageError
from ..data.images import Preprocess, load_rgb, to_tensor


class _ImageFiles(Dataset):
    """path i -> its preprocessed pixels (3, S, S), or the ImageError naming it."""

    def __init__(self, paths: list[Path], pre: Preprocess):
        self.paths, self.pre = paths, pre

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor | ImageError:
        try:
            return to_tensor(load_rgb(self.paths[i]), self.pre)
        except ImageError as e:
            return e


@dataclass
class PixelBatch:
    """A batch of ``paths``: ``pixels`` (G, 3, S, S) of the G readable ones, which are the
    batch positions ``good``; ``errors`` maps the other positions to their ImageError."""

    paths: list[Path]
    good: list[int]
    pixels: torch.Tensor | None
    errors: dict[int, ImageError] = field(default_factory=dict)

    def pin_memory(self) -> "PixelBatch":
        """Called by the DataLoader's pinning thread (its custom-batch protocol)."""
        if self.pixels is not None:
            self.pixels = self.pixels.pin_memory()
        return self


class _Collate:
    """Stacks a batch's readable images (in the worker process); picklable for any start method."""

    def __init__(self, paths: list[Path]):
        self.paths = paths

    def __call__(self, items: list[tuple[int, torch.Tensor | ImageError]]) -> PixelBatch:
        good = [k for k, (_, x) in enumerate(items) if isinstance(x, torch.Tensor)]
        return PixelBatch(paths=[self.paths[i] for i, _ in items], good=good,
                          pixels=torch.stack([items[k][1] for k in good]) if good else None,
                          errors={k: x for k, (_, x) in enumerate(items) if not isinstance(x, torch.Tensor)})


class _Indexed(Dataset):
    """Each item with its index (the collate names the batch's files by it)."""

    def __init__(self, inner: Dataset):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int):
        return i, self.inner[i]


def image_batches(paths: list[Path], pre: Preprocess, batch_size: int, workers: int,
                  device: torch.device) -> Iterator[PixelBatch]:
    """``paths`` in batches of ``batch_size``, each batch's pixels already on ``device``. On a
    GPU (or MPS) ``workers`` DataLoader processes decode them (0: this process), with pinned
    memory on CUDA; on the CPU, ``workers`` threads of this process (at least one)."""
    if workers < 0:
        raise ValueError(f"workers must be 0 (decode in this process) or more, got {workers}")
    device = torch.device(device)
    if device.type == "cpu":
        # The CPU's loader: reader threads decode the next batch while this one is encoded (one
        # batch ahead, so memory stays flat), the path captioning had before devices existed.
        # Measured on 2 busy cores, the DataLoader path took several times the CPU time of this
        # one with two torch threads, and the same with one (docs/devices.md).
        batches = iter(range(math.ceil(len(paths) / batch_size)))
        for _, batch in claimed_batches(paths, pre, batch_size, workers, lambda: next(batches, None)):
            yield batch
        return
    files, collate = _Indexed(_ImageFiles(list(paths), pre)), _Collate(list(paths))
    loader = DataLoader(files, batch_size=batch_size, shuffle=False, num_workers=workers, collate_fn=collate,
                        pin_memory=device.type == "cuda",
                        # its own generator: a DataLoader draws its workers' seed from it, and
                        # drawing from the global one would change a training run's random numbers
                        generator=torch.Generator())
    for batch in loader:
        if batch.pixels is not None:
            batch.pixels = batch.pixels.to(device, non_blocking=True)
        yield batch


def claimed_batches(paths: list[Path], pre: Preprocess, batch_size: int, workers: int,
                    claim: Callable[[], int | None]) -> Iterator[tuple[int, PixelBatch]]:
    """CPU reading of the batches ``claim()`` hands out: batch k is ``paths[k * batch_size:
    (k + 1) * batch_size]``, and ``claim()`` gives this reader's next k (None: no more; the local
    engine counts 0, 1, 2...; processes sharing the work draw from one counter,
    captionkit.inference.processes). ``workers`` threads (at least one) read the next claimed
    batch while the caller works on this one. -> (k, batch k)."""
    files, collate = _Indexed(_ImageFiles(list(paths), pre)), _Collate(list(paths))
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        def read(k: int | None):  # a batch's reads, under way
            if k is None:
                return None
            return k, [pool.submit(files.__getitem__, i) for i in range(k * batch_size,
                                                                        min((k + 1) * batch_size, len(files)))]

        ahead = read(claim())
        while ahead is not None:
            k, reads = ahead
            items = [f.result() for f in reads]
            ahead = read(claim())
            yield k, collate(items)
