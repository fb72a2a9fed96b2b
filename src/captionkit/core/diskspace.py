"""Full disks and read-only folders: the one place a failed write becomes one line.

Every writer of a user's file goes through :func:`disk_errors` (directly, or through
``outputs.atomic_write_bytes``, ``checkpoint.atomic_folder``/``save_checkpoint`` and the
``--jsonl``/``--csv`` appends of inference/writer.py). An ``OSError`` of a full disk (ENOSPC),
a full quota (EDQUOT) or a read-only file system (EROFS) becomes a :class:`DiskFull` or
:class:`ReadOnlyFolder`: a UserError naming the path and, for a full disk, the bytes the write
needed and the bytes free, so the command line prints one line and exits 2. Any other
``OSError`` stays as it is (a bug or a fault to trace). The writers themselves leave the
previous good state in place (a temporary file or folder renamed over it, removed when the
write fails), which the messages say.

:func:`check_free` refuses a write before it starts, where its size is known up front (a
checkpoint's tensors), so that training stops before a checkpoint it cannot finish.

Light on imports: ``captionkit score`` uses it without torch.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import OutputError, UserError

FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded"}
CODES = (*FULL, errno.EROFS)


class DiskFull(OutputError):
    """A write that the disk (or the user's quota) has no room for; the message names the
    path, the bytes needed and the bytes free."""

    def __init__(self, message: str, path: Path, needed: int | None, free: int | None):
        super().__init__(message)
        self.path, self.needed, self.free = path, needed, free


class ReadOnlyFolder(OutputError):
    """A write into a folder on a read-only file system; the message names the path."""


def _existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to an unprivileged writer on the file system holding ``path`` (or the
    nearest folder above it that exists); None where that cannot be known."""
    try:
        return shutil.disk_usage(_existing(Path(path))).free
    except OSError:
        return None


def _size(n: int | None) -> str:
    if n is None:
        return "?"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit} ({n:,} bytes)"
    return f"{n:,} bytes"


def disk_full(path: str | Path, needed: int | None, why: str = FULL[errno.ENOSPC],
              kept: str = "nothing was replaced", at_least: bool = False) -> DiskFull:
    path = Path(path)
    free = free_bytes(path.parent)
    need = "needs more room" if needed is None else f"needs {'more than ' if at_least else ''}{_size(needed)}"
    return DiskFull(f"{path}: {why}: the write {need}, {_size(free)} free in {_existing(path.parent)}; "
                    f"{kept}. Free some space or write elsewhere", path, needed, free)


def disk_error_of(e: BaseException) -> OSError | None:
    """The full disk or read-only folder behind ``e``, or None: ``e`` itself, an OSError it was
    raised from, or a library's own error type that only says it in its text (safetensors: "...
    (os error 28)"; torch and transformers pass the system's words on)."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen and not isinstance(e, UserError):
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in CODES:
            return e
        text = str(e)
        code = re.search(r"\(os error (\d+)\)", text)
        found = [int(code.group(1))] if code else [c for c in CODES if os.strerror(c) in text]
        if found and found[0] in CODES:
            return OSError(found[0], os.strerror(found[0]))
        e = e.__cause__ or e.__context__
    return None


def translate(e: BaseException, path: str | Path, needed: int | None = None,
              kept: str = "nothing was replaced", at_least: bool = False) -> BaseException:
    """The UserError for ``e`` if a full disk or a read-only folder is behind it
    (:func:`disk_error_of`), else ``e`` itself."""
    found = disk_error_of(e)
    if found is None:
        return e
    if found.errno in FULL:
        return disk_full(path, needed, FULL[found.errno], kept, at_least)
    if found.errno == errno.EROFS:
        return ReadOnlyFolder(f"{path}: the folder is on a read-only file system; {kept}. "
                              f"Remount it read-write or write elsewhere")
    return e  # (not reached: disk_error_of finds only CODES)


@contextmanager
def disk_errors(path: str | Path, needed: int | None = None, kept: str = "nothing was replaced") -> Iterator[None]:
    """Turn a full disk or a read-only folder met in the block into one line about ``path``
    (``needed``: the bytes the write needs, if known; ``kept``: what the user still has)."""
    try:
        yield
    except Exception as e:
        err = translate(e, path, needed, kept)
        if err is e:
            raise
        raise err from None


def check_free(folder: str | Path, needed: int, what: str) -> None:
    """Refuse (:class:`DiskFull`) to start writing ``needed`` bytes into ``folder`` when its
    file system has fewer free; ``what`` names the write ("checkpoint runs/x/last")."""
    free = free_bytes(folder)
    if free is not None and needed > free:
        raise DiskFull(f"{folder}: not starting {what}: it needs {_size(needed)}, only {_size(free)} free "
                       f"in {_existing(Path(folder))}; nothing was written. Free some space or write elsewhere",
                       Path(folder), needed, free)


def dir_bytes(folder: str | Path) -> int:
    """The bytes of the files in ``folder`` (recursively); 0 where it cannot be read."""
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try:
                total += os.lstat(os.path.join(root, f)).st_size
            except OSError:
                pass
    return total
