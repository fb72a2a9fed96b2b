"""Batch captioning outputs for ``captionkit caption DIR --jsonl OUT`` / ``--csv OUT``.

Both files are appended to one complete line at a time (one ``write`` per line, flushed), so a
run that is killed leaves every finished image on disk and at most one torn last line. Run the
same command again to resume: the torn line is dropped, and images already in the file --
captioned or listed as unreadable -- are skipped.

JSONL lines: ``{"image": NAME, "caption": TEXT}``, or ``{"image": NAME, "error": MESSAGE}`` for
an image that could not be read. CSV columns: ``image,caption,error``.
"""

from __future__ import annotations

import csv
import io
import json
import os
import sys
import time
from pathlib import Path


class OutputError(ValueError):
    pass


def _repair_tail(path: Path) -> bytes:
    """The file's complete lines; a torn last line (no newline: the run was killed while
    writing it) is cut off the file."""
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
        print(f"{path}: dropped a torn last line ({len(data) - keep} bytes) from an interrupted run",
              file=sys.stderr)
        data = data[:keep]
    return data


class _Output:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.done: set[str] = set()
        if self.path.exists():
            self.done = self._read(_repair_tail(self.path))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        if fresh:
            self._write(self.header())

    def header(self) -> str:
        return ""

    def _write(self, text: str) -> None:
        data = text.encode()
        while data:
            n = os.write(self.fd, data)
            data = data[n:]

    def write(self, key: str, caption: str | None, error: str | None) -> None:
        if key in self.done:
            return
        self._write(self.line(key, caption, error))
        self.done.add(key)

    def close(self) -> None:
        os.close(self.fd)


class JsonlOutput(_Output):
    def _read(self, data: bytes) -> set[str]:
        done = set()
        for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
            if not line.strip():
                continue
            try:
                done.add(json.loads(line)["image"])
            except (json.JSONDecodeError, KeyError, TypeError):
                raise OutputError(f"{self.path}:{n}: not a captionkit JSONL line; "
                                  f"fix or remove it, or write to another file") from None
        return done

    def line(self, key: str, caption: str | None, error: str | None) -> str:
        rec = {"image": key, "caption": caption} if error is None else {"image": key, "error": error}
        return json.dumps(rec, ensure_ascii=False) + "\n"


class CsvOutput(_Output):
    COLUMNS = ["image", "caption", "error"]

    def header(self) -> str:
        return self._row(self.COLUMNS)

    @staticmethod
    def _row(values) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(values)
        return buf.getvalue()

    def _read(self, data: bytes) -> set[str]:
        rows = list(csv.reader(io.StringIO(data.decode("utf-8", errors="replace"))))
        if not rows:
            return set()
        if rows[0] != self.COLUMNS:
            raise OutputError(f"{self.path}: not a captionkit CSV (its header is not {','.join(self.COLUMNS)})")
        return {r[0] for r in rows[1:] if r}

    def line(self, key: str, caption: str | None, error: str | None) -> str:
        return self._row([key, caption or "", error or ""])


class Progress:
    """One status line on stderr: done/total, images/s, ETA. Redrawn in place on a terminal,
    a new line every ``every`` seconds otherwise (logs)."""

    def __init__(self, total: int, skipped: int = 0, every: float = 10.0, stream=None):
        self.total, self.skipped, self.done, self.failed = total, skipped, 0, 0
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = 0.2 if self.tty else every
        self.t0 = self.last = time.perf_counter()

    def update(self, n: int = 1, failed: int = 0) -> None:
        self.done += n
        self.failed += failed
        now = time.perf_counter()
        if now - self.last >= self.every:
            self.last = now
            self._show(now)

    def _line(self, now: float) -> str:
        rate = self.done / max(now - self.t0, 1e-9)
        left = self.total - self.done
        eta = left / rate if rate > 0 else float("inf")
        eta_s = "?" if eta == float("inf") else time.strftime("%H:%M:%S", time.gmtime(eta))
        pct = 100 * self.done / self.total if self.total else 100.0
        extra = f", {self.skipped} already done" if self.skipped else ""
        return (f"{self.done}/{self.total} images ({pct:.1f}%), {rate:.1f} images/s, ETA {eta_s}"
                f", {self.failed} unreadable{extra}")

    def _show(self, now: float) -> None:
        if self.tty:
            self.stream.write("\r" + self._line(now) + "\x1b[K")
        else:
            self.stream.write(self._line(now) + "\n")
        self.stream.flush()

    def close(self) -> None:
        now = time.perf_counter()
        if self.tty:
            self.stream.write("\r" + self._line(now) + "\x1b[K\n")
        else:
            self.stream.write(self._line(now) + f", {now - self.t0:.1f} s\n")
        self.stream.flush()
