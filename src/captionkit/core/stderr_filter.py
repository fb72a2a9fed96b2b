"""Drop known-harmless lines that native libraries write to the process's standard error.

Some libraries log from C++ straight to file descriptor 2, where no Python logging setting
reaches. :func:`dropping_lines` points descriptor 2 at a pipe for the length of a ``with``
block; a thread copies what comes through to the real standard error at once, except whole
lines that match one of the given patterns. Python's own ``sys.stderr`` writes to the same
descriptor, so progress lines and warnings still appear, in order.

Only for lines known to say nothing a user can act on (each caller names its pattern and
why). Processes started inside the block inherit the pipe: start long-lived ones (a local
Ray's daemons) before it.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import sys
import threading
from collections.abc import Iterator

_HOLD_S = 0.2  # how long an unfinished line waits for its end before it is written as it is


def _pump(read_fd: int, out_fd: int, patterns: list[re.Pattern[bytes]]) -> None:
    pending = b""

    def write(data: bytes) -> None:
        while data:
            data = data[os.write(out_fd, data):]

    while True:
        ready, _, _ = select.select([read_fd], [], [], _HOLD_S)
        if not ready:  # a partial line (a prompt, a progress bar's \r update): let it through
            if pending:
                write(pending)
                pending = b""
            continue
        chunk = os.read(read_fd, 65536)
        if not chunk:
            break
        pending += chunk
        *lines, pending = pending.split(b"\n")
        write(b"".join(line + b"\n" for line in lines if not any(p.search(line) for p in patterns)))
        if b"\r" in pending:  # carriage-return updates are never dropped: write them now
            head, _, pending = pending.rpartition(b"\r")
            write(head + b"\r")
    if pending and not any(p.search(pending) for p in patterns):
        write(pending)
    os.close(read_fd)


@contextlib.contextmanager
def dropping_lines(*patterns: str) -> Iterator[None]:
    """Inside the block, lines written to descriptor 2 that match any of ``patterns`` (regular
    expressions, searched) are dropped; everything else reaches standard error unchanged."""
    compiled = [re.compile(p.encode()) for p in patterns]
    sys.stderr.flush()
    saved = os.dup(2)
    read_fd, write_fd = os.pipe()
    os.dup2(write_fd, 2)
    os.close(write_fd)
    pump = threading.Thread(target=_pump, args=(read_fd, saved, compiled), name="stderr-filter", daemon=True)
    pump.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end here: the pump reads to its end
        pump.join(timeout=5)
        if not pump.is_alive():  # (a child still holding the pipe keeps the pump, and its copy, alive)
            os.close(saved)
