"""Two writers: an advisory lock on what a command writes (a run folder, a ``--jsonl`` file, a
feature-cache entry), so that a second process pointed at the same place is refused in one line
instead of interleaving its writes with the first one's.

The lock is ``fcntl.flock`` on a small file beside the target (``.<name>.lock``), holding the
holder's pid and host for the message. flock belongs to the open file, so the operating system
drops it when the holder exits in any way, kill -9 included: a crashed holder never blocks, and
a lock file left behind is only a name -- the next process opens it and takes the lock. The
holder removes the file when it is done; a process that opened the old file just before it was
removed notices (its file is no longer the one at that name) and tries again, so two processes
never both believe they hold it.

Light on imports: ``captionkit score`` may use it without torch. Where ``fcntl`` does not exist
(Windows) nothing is locked.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import UserError

try:
    import fcntl
except ImportError:  # pragma: no cover - not on the platforms captionkit is tested on
    fcntl = None  # type: ignore[assignment]


class Locked(UserError):
    """The target is being written by another process; the message names its pid and host."""

    def __init__(self, message: str, pid: int | None = None, host: str | None = None):
        super().__init__(message)
        self.pid, self.host = pid, host


def lock_path(path: str | Path) -> Path:
    """The lock file of ``path`` (a file or a folder): ``.<name>.lock`` beside it, so that it
    never lands inside a folder that ``--overwrite`` may rename away."""
    path = Path(path)
    return path.with_name(f".{path.name}.lock")


def _holder(lock: Path) -> tuple[int | None, str | None, str]:
    """(pid, host, what) written in a lock file; the holder writes them right after taking
    the lock, so an empty file is read again for a moment before giving up."""
    for _ in range(20):
        try:
            text = lock.read_text()
        except OSError:
            text = ""
        if text.strip():
            fields = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
            pid = fields.get("pid", "")
            return (int(pid) if pid.isdigit() else None), fields.get("host"), fields.get("what", "")
        time.sleep(0.01)
    return None, None, ""


def _same_file(fd: int, lock: Path) -> bool:
    """Whether ``fd`` is still the file at ``lock`` (a holder removes it when done)."""
    try:
        st = os.stat(lock)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _refusal(path: Path, lock: Path) -> Locked:
    pid, host, their_what = _holder(lock)
    holder = f"pid {pid if pid is not None else '?'} on {host or '?'}"
    doing = f" ({their_what})" if their_what else ""
    return Locked(f"{path}: in use by {holder}{doing}; wait for it to finish or stop it "
                  f"(a lock of a process that died is released by the system)", pid, host)


def check_unlocked(path: str | Path) -> None:
    """Raise :class:`Locked` if another holder has ``path`` locked now, creating nothing: the
    early check of a command, before its expensive work and before it takes the lock itself
    (with :func:`hold_lock`, which is what settles a race between two that both passed)."""
    path = Path(path)
    lock = lock_path(path)
    if fcntl is None:  # pragma: no cover
        return
    try:
        fd = os.open(lock, os.O_RDONLY)
    except OSError:
        return  # no lock file (or none this process may read): nobody holds it
    try:
        # shared: it conflicts with a holder's exclusive lock all the same, and works on a file
        # opened read-only where flock is emulated with fcntl locks (NFS)
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # released by the close below
    except BlockingIOError:
        raise _refusal(path, lock) from None
    except OSError:
        pass  # a file system without locks: hold_lock says so, or not, when it is taken
    finally:
        os.close(fd)


def _take(fd: int, tries: int = 5) -> None:
    """flock ``fd`` without waiting on a holder; a few quick tries, as a :func:`check_unlocked`
    of another process holds it for a moment too."""
    for i in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if i == tries - 1:
                raise
            time.sleep(0.02)


@contextmanager
def hold_lock(path: str | Path, what: str) -> Iterator[Path]:
    """Hold the advisory lock of ``path`` for the block; yields the lock file's path.

    ``what`` says what the holder does ("training", "captioning to JSONL"); it appears in the
    message a second holder gets. Raises :class:`Locked` (a UserError, one line) at once if
    another process -- or another open of the same lock in this one -- holds it; never waits.
    """
    path = Path(path)
    lock = lock_path(path)
    if fcntl is None:  # pragma: no cover
        yield lock
        return
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            _take(fd)
        except BlockingIOError:
            os.close(fd)
            raise _refusal(path, lock) from None
        except BaseException:
            os.close(fd)
            raise
        if _same_file(fd, lock):
            break
        os.close(fd)  # the holder we waited on removed this file as we opened it: take the new one
    try:
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"pid={os.getpid()}\nhost={socket.gethostname()}\nwhat={what}\n".encode())
        except OSError:
            pass  # a full disk: the lock holds all the same, a second holder's message lacks the pid
        yield lock
    finally:
        # removed while still held, so whoever opens the name next gets a fresh file
        try:
            os.unlink(lock)
        except OSError:
            pass
        os.close(fd)  # releases the flock
