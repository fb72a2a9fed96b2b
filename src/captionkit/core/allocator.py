"""glibc's allocator, tuned for captioning (Linux only; a no-op elsewhere or without glibc).

:func:`tune_allocator` keeps freed tensor memory in the process. By default glibc maps every
large tensor afresh and returns it to the OS when freed, so each batch pays the page faults
again; this made captioning ~1.5x slower. Process-wide, so done by the command line (and a Ray
replica, the command line's stand-in in its own process), not by the library. (A replica's
malloc arenas are capped by its environment instead: glibc reads that only as a process
starts; captionkit.inference.ray_engine.REPLICA_ENV.)
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters (malloc.h)


def tune_allocator() -> None:
    """Keep freed memory in the process (module docstring)."""
    if platform.system() != "Linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    libc.mallopt(M_MMAP_THRESHOLD, 128 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 256 << 20)
