"""Stopping on a scheduler's signal (preemption): SLURM, Kubernetes and spot instances send
SIGTERM (or, with ``sbatch --signal=USR1@60``, SIGUSR1) and give a job some seconds before
SIGKILL. :class:`StopSignals` turns those signals into a flag that long loops poll at points
where stopping is safe (``train`` after an optimizer step, then it writes its resumable
``last`` checkpoint); the command then exits with :data:`EXIT_PREEMPTED`, and a rerun resumes
(``train --resume auto``). See docs/robustness.md, "Preemption".

Light on imports on purpose (no torch): the command line parses ``--stop-signals`` with it.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from types import FrameType

from .errors import UserError

# "preempted: the state is saved, run the same command again (train: --resume auto)". EX_TEMPFAIL
# of sysexits.h ("temporary failure, the user is invited to retry"): non-zero, so that torchrun's
# elastic agent (--max-restarts) restarts the workers and a scheduler sees the job unfinished, and
# not 128 + 15 = 143, which a shell also shows for a process SIGTERM killed before it saved.
EXIT_PREEMPTED = 75
DEFAULT_STOP_SIGNALS = ("SIGTERM", "SIGUSR1")
# the documented bound from the signal to the exit of a training run (docs/robustness.md): the
# current step (under DDP up to the next agreed read, see Trainer.fit), one checkpoint write. The
# same as torchrun's default wait (its agent's shutdown_timeout) before it SIGKILLs its workers.
STOP_BOUND_S = 30
_ACTIVE: list[StopSignals] = []  # the installed ones, innermost last (see reinstall)


class Preempted(Exception):
    """The command stopped on a stop signal after saving what a rerun resumes from. Not a
    :class:`UserError` (nothing to fix) nor an internal error: the command line prints its
    message as one line and exits :data:`EXIT_PREEMPTED`."""

    def __init__(self, message: str, signal_name: str):
        super().__init__(message)
        self.signal_name = signal_name


def parse_stop_signals(names: str | Iterable[str]) -> tuple[signal.Signals, ...]:
    """``"SIGTERM,SIGUSR1"`` (or names without ``SIG``, any case; ``"none"``: no handlers) ->
    the signals. A name this system lacks, or one that cannot be caught, is one line."""
    if isinstance(names, str):
        names = [n for n in names.split(",") if n.strip()]
    names = [n.strip().upper() for n in names]
    if names == ["NONE"]:
        return ()
    out = []
    for n in names:
        full = n if n.startswith("SIG") else "SIG" + n
        sig = getattr(signal.Signals, full, None) if full.isidentifier() else None
        if sig is None or sig in (signal.SIGKILL, getattr(signal, "SIGSTOP", None)):
            raise UserError(f"--stop-signals: {n!r} is not a signal that can be caught here "
                            f"(e.g. SIGTERM,SIGUSR1,SIGUSR2,SIGINT, or none)")
        out.append(sig)
    return tuple(dict.fromkeys(out))


class StopSignals:
    """A context that catches ``signals`` (default SIGTERM and SIGUSR1) and restores the old
    handlers on exit. A caught signal sets :attr:`requested` (its name) and :attr:`at` (its
    ``time.monotonic()``); the loop that polls :meth:`check` (or reads :attr:`requested`) stops
    where it is safe. While :attr:`immediate` is true (set-up, when nothing is worth saving yet)
    the handler raises :class:`Preempted` at once instead. Outside the main thread (where Python
    cannot install handlers) it installs nothing and never requests a stop."""

    def __init__(self, signals: str | Iterable[str] = DEFAULT_STOP_SIGNALS, immediate: bool = False):
        self.signals = parse_stop_signals(signals)
        self.immediate = immediate
        # what an immediate stop says ({signal}: the signal's name)
        self.message = ("stopped on {signal} before anything was worth saving; run the same command again "
                        "to start (train: --resume auto)")
        self.requested: str | None = None
        self.at: float | None = None
        self._old: dict[signal.Signals, object] = {}

    def install(self) -> StopSignals:
        """Catch the signals from now on (the old handlers kept for :meth:`restore`)."""
        if threading.current_thread() is threading.main_thread():
            for sig in self.signals:
                self._old.setdefault(sig, signal.signal(sig, self._handle))
            _ACTIVE.append(self)
        return self

    def restore(self) -> None:
        """Put the handlers found by :meth:`install` back."""
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.requested is None:
            self.requested, self.at = name, time.monotonic()
            print(f"\n{name} received: stopping at the next safe point", file=sys.stderr, flush=True)
        if self.immediate:
            raise Preempted(self.message.format(signal=name), name)

    def request(self, name: str = "SIGTERM") -> None:
        """Ask for a stop as a signal would (tests; a caller's own reason to stop)."""
        if self.requested is None:
            self.requested, self.at = name, time.monotonic()

    def check(self, message: str) -> None:
        """Raise :class:`Preempted` with ``message`` if a stop was requested."""
        if self.requested is not None:
            raise Preempted(message, self.requested)

    def reinstall(self) -> None:
        """Catch the signals again after a library replaced the handlers (Ray's ``ray.init``
        sets SIGTERM to exit at once); the handlers found at :meth:`install` stay the ones restored."""
        for sig in self._old:
            signal.signal(sig, self._handle)

    def seconds(self) -> float:
        """Seconds since the signal came (0 if none)."""
        return 0.0 if self.at is None else time.monotonic() - self.at


def reinstall() -> None:
    """Re-install the handlers of every installed :class:`StopSignals`, innermost last (call it
    after a library that replaces signal handlers has started, e.g. ``ray.init``)."""
    if threading.current_thread() is threading.main_thread():
        for stop in _ACTIVE:
            stop.reinstall()


@contextmanager
def deferred() -> Iterator[None]:
    """Within: a stop signal only sets the flag, also where a :class:`StopSignals` is
    :attr:`~StopSignals.immediate`; on leaving, a stop that came meanwhile raises
    :class:`Preempted` as the signal would have. For calls into compiled code that runs Python's
    signal handlers itself and does not pass their exception on: Ray's ``ray.wait``/``ray.get``
    turn it into a ``SystemError`` ("returned a result with an exception set"), an internal
    error instead of exit 75. Keep what runs within short (poll with a timeout): the stop waits
    for it."""
    held = [stop for stop in _ACTIVE if stop.immediate]
    for stop in held:
        stop.immediate = False
    try:
        yield
    finally:
        for stop in held:
            stop.immediate = True
    for stop in reversed(held):  # (innermost first, as its handler would have raised)
        if stop.requested is not None:
            raise Preempted(stop.message.format(signal=stop.requested), stop.requested)
