"""Progress bars (tqdm) on stderr: the one policy every long step uses (feature extraction,
captioning, evaluate, training epochs and validation, sweeps).

A bar is drawn only where someone watches it: stderr is a terminal, this process is rank 0 of a
DDP run (or no DDP run), and ``CAPTIONKIT_PROGRESS`` does not say otherwise (``0``: never, ``1``:
always, even into a pipe or a log file; any other value: as if unset). A log file or CI output
(not a terminal) gets no bar characters at all; what a step prints as a result (a summary line,
an epoch's dev scores) it prints itself, bar or not.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

ENV = "CAPTIONKIT_PROGRESS"


def _stream():
    """Where bars go: stderr (the terminal beneath :func:`lines_above_bars`'s redirection)."""
    return getattr(sys.stderr, "under", sys.stderr)


def bars_on() -> bool:
    """Whether bars are drawn now (see the module's note)."""
    # (read here, not checked at start-up: a stray value must not stop a run hours in)
    forced = os.environ.get(ENV, "").strip()
    if os.environ.get("RANK", "0") != "0":  # torchrun's other processes: rank 0 alone shows them
        return False
    if forced in ("0", "1"):
        return forced == "1"
    stream = _stream()
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def progress(iterable: Iterable | None = None, *, total: int | None = None, desc: str | None = None,
             unit: str = "it", initial: int = 0, leave: bool | None = True, show: bool = True, **options: Any):
    """A tqdm bar over ``iterable`` (or updated by hand: ``bar.update(n)``), drawn on stderr when
    ``show`` (the caller's own switch, e.g. ``progress=False``) and :func:`bars_on`; disabled it
    costs nothing and draws nothing. ``leave=None``: kept when it is
    the only bar, cleared when nested under another (a sweep's trial's epochs)."""
    from tqdm import tqdm

    return tqdm(iterable, total=total, desc=desc, unit=unit, initial=initial, leave=leave, file=_stream(),
                disable=not (show and bars_on()), dynamic_ncols=True, **options)


class _AboveBars(io.TextIOBase):
    """stderr while bars are drawn: each complete line goes above the bars (tqdm.write), not
    into the middle of one."""

    def __init__(self, under):
        self.under, self._pending = under, ""

    def write(self, s: str) -> int:
        from tqdm import tqdm

        *lines, self._pending = (self._pending + s).split("\n")
        for line in lines:
            tqdm.write(line, file=self.under)
        return len(s)

    def flush(self) -> None:
        self.under.flush()

    def isatty(self) -> bool:
        return self.under.isatty()

    def fileno(self) -> int:
        return self.under.fileno()

    @property
    def encoding(self):
        return getattr(self.under, "encoding", "utf-8")

    def __getattr__(self, name: str):  # the rest (buffer, errors, ...) as the stream beneath has them
        return getattr(self.under, name)


@contextmanager
def lines_above_bars() -> Iterator[None]:
    """While a long-lived bar stays on screen (a sweep's), lines others print to stderr (an epoch's
    scores, a warning) are written above it instead of onto it. Nothing changes without bars."""
    if not bars_on() or isinstance(sys.stderr, _AboveBars):
        yield
        return
    before = sys.stderr
    sys.stderr = _AboveBars(before)
    try:
        yield
    finally:
        pending = sys.stderr._pending if isinstance(sys.stderr, _AboveBars) else ""
        sys.stderr = before
        if pending:
            before.write(pending)
