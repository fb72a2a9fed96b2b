"""glibc's allocator, tuned for captioning (Linux only; a no-op elsewhere or without glibc).

- :func:`tune_allocator`: keep freed tensor memory in the process. By default glibc maps every
  large tensor afresh and returns it to the OS when freed, so each batch pays the page faults
  again; this made captioning ~1.5x slower. Process-wide, so done by the command line (and a
  Ray replica, the command line's stand-in in its own process), not by the library.
- ``arenas``: at most that many malloc arenas. glibc gives threads arenas of their own, up to 8
  per core; a process that starts new reader threads for every chunk of work (a Ray replica)
  spreads freed memory over all of them and grows: a replica captioning 2,000 Flickr8k photos
  peaked 150 MiB higher with glibc's default than with 2 arenas (docs/scale.md).
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # mallopt's parameters (malloc.h)


def tune_allocator(keep_freed: bool = True, arenas: int | None = None) -> None:
    """``keep_freed``: keep freed memory in the process (module docstring); ``arenas``: cap
    the malloc arenas (None: glibc's own number)."""
    if platform.system() != "Linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    if keep_freed:
        libc.mallopt(M_MMAP_THRESHOLD, 128 << 20)
        libc.mallopt(M_TRIM_THRESHOLD, 256 << 20)
    if arenas is not None:
        libc.mallopt(M_ARENA_MAX, arenas)
