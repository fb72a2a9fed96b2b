"""Where captionkit writes: one rule for every command that writes a file or a folder.

- A target that does not exist is created (with its parent folders).
- An existing target is refused with one line, unless the user passed ``--overwrite``.
- ``--overwrite`` replaces a regular file, or a folder that captionkit itself wrote (one holding
  :data:`MARKER`, or a checkpoint folder recognised by its ``config.json``); never a folder it did
  not write, never a device, FIFO or other special file.
- Commands call the ``check_*`` functions first, before any dataset, model or feature loads, so a
  refused target costs nothing; the writes themselves go through :func:`atomic_write_bytes` /
  :func:`atomic_write_text` (a temporary file beside the target, fsynced, renamed into place), so a
  killed command leaves either the old file or the new one, never half of one and never a ``.tmp``.
- A full disk, a full quota or a read-only folder met by a write is one line naming the path and
  the bytes (captionkit.core.diskspace), with the old file in place; a folder to write into that
  is on a read-only file system is refused as such by the checks.
- Two processes never write one target at once: a run folder and a ``--jsonl``/``--csv`` file are
  locked while written (captionkit.core.locks).

Light on imports on purpose: ``captionkit score`` uses it without torch.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path

from .diskspace import disk_errors
from .errors import OutputError

MARKER = ".captionkit.json"  # {"written_by": "captionkit", "kind": ...} in every folder captionkit writes
CHECKPOINT_FORMAT = "captionkit-checkpoint"  # config.json "format" of checkpoints (see checkpoint.py)
ONNX_FORMAT = "captionkit-onnx"  # manifest.json "format" of ONNX exports (see export/exporters.py)
OVERWRITE_FLAG = "--overwrite"


def _nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def _check_parent(path: Path) -> None:
    """The folder ``path`` would be written into exists as a folder, or can be created."""
    base = _nearest_existing(path.parent)
    if not base.is_dir():
        raise OutputError(f"{path}: cannot write here: {base} is a file, not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        if _read_only_fs(base):
            raise OutputError(f"{path}: cannot write here: {base} is on a read-only file system")
        raise OutputError(f"{path}: cannot write here: {base} is not writable")


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def check_file_target(path: str | Path, *, overwrite: bool, flag: str = OVERWRITE_FLAG) -> Path:
    """Refuse a file target that cannot or must not be written; return it as a Path.

    A path ending in a separator, or naming an existing folder, is refused (a file name is
    needed); an existing file needs ``overwrite``; a special file (FIFO, device) is never replaced.
    """
    text = os.fspath(path)
    p = Path(text)
    if text.endswith(os.sep) or p.is_dir():
        raise OutputError(f"{text}: is a folder; give a file name to write")
    if p.is_symlink() and not p.exists():
        raise OutputError(f"{text}: is a dangling symbolic link; refusing to write through it")
    if p.exists():
        if not stat.S_ISREG(p.stat().st_mode):
            raise OutputError(f"{text}: exists and is not a regular file; refusing to replace it")
        if not overwrite:
            raise OutputError(f"{text}: exists; pass {flag} to replace it, or choose another name")
    _check_parent(p)
    return p


def _json_format(path: Path) -> str | None:
    """The "format" of a JSON file, or None."""
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return doc.get("format") if isinstance(doc, dict) else None


def owner_kind(folder: str | Path) -> str | None:
    """What captionkit wrote this folder as ("checkpoint", "run", "onnx", ...), or None if
    nothing shows that captionkit wrote it."""
    folder = Path(folder)
    marker = folder / MARKER
    if marker.is_file():
        try:
            doc = json.loads(marker.read_text())
        except (OSError, ValueError):
            return None
        if isinstance(doc, dict) and doc.get("written_by") == "captionkit":
            return str(doc.get("kind") or "unknown")
        return None
    # folders written before the marker existed, recognised by captionkit's own formats
    if _json_format(folder / "config.json") == CHECKPOINT_FORMAT:
        return "checkpoint"
    if _json_format(folder / "manifest.json") == ONNX_FORMAT:
        return "onnx"
    if any(_json_format(folder / name / "config.json") == CHECKPOINT_FORMAT for name in ("last", "best")):
        return "run"
    return None


def check_folder_target(path: str | Path, *, overwrite: bool, kinds: tuple[str, ...] | None = None,
                        flag: str = OVERWRITE_FLAG) -> Path:
    """Refuse a folder target that must not be written; return it as a Path.

    A missing or empty folder is fine. A non-empty one needs ``overwrite`` and must be one that
    captionkit wrote (:func:`owner_kind`), of one of ``kinds`` when given; a file is refused.
    """
    p = Path(path)
    if p.is_symlink() and not p.exists():
        raise OutputError(f"{p}: is a dangling symbolic link; refusing to write through it")
    if p.exists() and not p.is_dir():
        raise OutputError(f"{p}: exists and is not a folder; refusing to replace it")
    if p.is_dir() and any(p.iterdir()):
        if not overwrite:
            raise OutputError(f"{p}: exists and is not empty; pass {flag} to replace it "
                              f"(only a folder captionkit wrote is replaced), or choose another folder")
        kind = owner_kind(p)
        if kind is None:
            raise OutputError(f"{p}: was not written by captionkit (no {MARKER}); refusing to replace "
                              f"it even with {flag}: remove it yourself or choose another folder")
        if kinds is not None and kind not in kinds:
            raise OutputError(f"{p}: holds a captionkit {kind}, not a {' or '.join(kinds)}; "
                              f"refusing to replace it")
    _check_parent(p)
    return p


def check_writable_folder(folder: str | Path) -> Path:
    """A folder captionkit writes files into but does not own (a cache root): an existing
    folder or one that can be created, and writable; one line otherwise."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise OutputError(f"{folder}: is a file, not a folder")
    _check_parent(folder / MARKER)
    return folder


def marker_text(kind: str) -> str:
    from .version import __version__

    return json.dumps({"written_by": "captionkit", "kind": kind, "version": __version__}) + "\n"


def write_marker(folder: str | Path, kind: str) -> None:
    """Mark ``folder`` as written by captionkit (so ``--overwrite`` may replace it later)."""
    atomic_write_text(Path(folder) / MARKER, marker_text(kind))


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically: a temporary file beside it, fsynced, renamed over
    it. The temporary file is removed if anything fails, and a full disk or a read-only folder
    is one line (:class:`captionkit.core.diskspace.DiskFull` / ``ReadOnlyFolder``) naming the
    path and the bytes. Parent folders are created."""
    path = Path(path)
    kept = f"{path} is as it was" if path.exists() else "nothing was written"
    # a full disk or a read-only folder: one line (captionkit.core.diskspace), after the cleanup
    with disk_errors(path, len(data), kept):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private; outputs are ordinary files
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
    return path


def atomic_write_text(path: str | Path, text: str) -> Path:
    return atomic_write_bytes(path, text.encode("utf-8"))


def append_whole(path: str | Path, data: bytes) -> Path:
    """Append ``data`` (a line, or lines) to ``path``, created if missing, all of it or none:
    a write the disk has no room for is cut off again, so the file keeps only whole lines, and
    is one line naming the path and the bytes (captionkit.core.diskspace)."""
    path = Path(path)
    with disk_errors(path, len(data), f"the lines before it in {path.name} are whole"):
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            start, rest = os.fstat(fd).st_size, data
            try:
                while rest:
                    rest = rest[os.write(fd, rest):]
            except OSError:
                os.ftruncate(fd, start)  # the part that fitted goes: no torn line
                raise
        finally:
            os.close(fd)
    return path


def display_name(text: str) -> str:
    """``text`` as it is written to outputs: the bytes of a file name that are not valid UTF-8
    (held by Python as lone surrogates, PEP 383) become the four characters ``\\xNN``."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
