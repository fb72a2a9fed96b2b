"""How many model processes a CPU job runs: ``caption --processes auto`` (the local engine's helper
processes, captionkit.inference.processes) and ``--replicas auto`` on a local Ray (its replicas,
captionkit.inference.ray_engine). One rule for both, so the two engines hold the same number of
models on the same machine; torch-free, because Ray's driver never imports torch."""

from __future__ import annotations

import math
from pathlib import Path

# What one captioning process holds at its peak with the default model, batches of 16, one torch
# thread (measured: 1.15 GB of resident memory, torch included); ``auto`` starts no more
# processes than half the memory available can hold at this size.
PROCESS_BYTES = 1.2 * 2**30
# Batches a process should have for a helper to pay for its start (a fresh interpreter importing
# torch and loading the model: 3-4 s on 2 cores, about two batches' captioning at one thread).
MIN_BATCHES = 4


def available_memory() -> int | None:
    """The memory the kernel says is available (Linux's MemAvailable), in bytes; None elsewhere."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def cpu_processes(threads: int, images: int, batch_size: int) -> int:
    """Model processes for ``images`` images on a CPU of ``threads`` threads: one per thread (each
    then runs one), no more than the batches keep busy (MIN_BATCHES each) nor than half the
    available memory holds (PROCESS_BYTES each); at least one."""
    if threads < 2:
        return 1
    batches = math.ceil(images / batch_size)
    memory = available_memory()
    fit = threads if memory is None else int(memory / 2 // PROCESS_BYTES)
    return max(1, min(threads, batches // MIN_BATCHES, fit))
