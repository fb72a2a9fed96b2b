"""The one caption writer behind ``captionkit caption`` and ``captionkit zero-shot``
(docs/captioning.md is the user's guide).

Outputs: a ``filename<TAB>caption`` line per image on stdout; ``--json OUT`` ({key: caption},
written once at the end); ``--jsonl OUT`` / ``--csv OUT`` (a line per image, appended as it is
captioned, resumable); ``--attention DIR`` (one figure per image, ``caption`` only).

- Every target is checked before the model loads (captionkit.core.outputs): an existing ``--json``
  file needs ``--overwrite``; an existing ``--jsonl``/``--csv`` file is resumed when captionkit
  wrote it with the same settings, recorded in ``OUT.meta.json``; ``--overwrite`` starts it
  again; an ``--attention`` folder must be new, empty or captionkit's own.
- JSONL/CSV files are appended one complete line at a time (one ``write`` per line), so a
  killed run leaves every finished image and at most one torn last line, dropped on resume.
  JSONL lines: ``{"image": KEY, "caption": TEXT}`` or ``{"image": KEY, "error": MESSAGE}``;
  CSV columns ``image,caption,error``. With ``--num-captions K`` > 1 (the setting
  ``num_captions``) an image has a list of captions: ``{"image": KEY, "captions": [TEXT, ...]}``,
  CSV columns ``image,caption_1,...,caption_K,error`` (fewer captions: empty cells), ``--json``
  ``{KEY: [TEXT, ...]}``, and on stdout a ``KEY<TAB>TEXT`` line per caption. Images recorded with an error are kept as they are on
  resume (the run says so and exits 1); ``--retry-failed`` removes those lines and tries again.
- An image's KEY is its file name, or its path as given where two images share a file name.
  File-name bytes that are not UTF-8 are written as ``\\xNN`` (:func:`display_name`).
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import signal
import sys
import time
from collections import Counter
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

from ..core.diskspace import disk_errors, translate
from ..core.errors import ImageError, OutputError
from ..core.locks import check_unlocked, hold_lock
from ..core.outputs import (
    MARKER,
    atomic_write_bytes,
    atomic_write_text,
    check_file_target,
    check_folder_target,
    display_name,
    write_marker,
)
from ..core.progress import lines_above_bars, progress
from ..core.signals import StopSignals

META_SUFFIX = ".meta.json"  # OUT.meta.json beside a --jsonl/--csv OUT: the settings it was written with
META_KIND = "caption-settings"
FIGURES_KIND = "attention"  # the outputs.MARKER kind of an --attention folder
EXIT_STDOUT_CLOSED = 128 + signal.SIGPIPE  # what a shell shows for a command ended by a closed pipe
SKIPPED_SHOWN = 5  # skipped files named without --verbose


def image_keys(paths: list[Path]) -> tuple[dict[Path, str], list[tuple[Path, str]]]:
    """The key each image is written under -- its file name, or its path as given where two
    images share a name -- and the images left out because their key would repeat another's
    (only possible when one name holds non-UTF-8 bytes and another the text ``\\xNN``)."""
    counts = Counter(display_name(p.name) for p in paths)
    keys: dict[Path, str] = {}
    owner: dict[str, Path] = {}
    clashes = []
    for p in paths:
        key = display_name(p.name) if counts[display_name(p.name)] == 1 else display_name(str(p))
        if key in owner:
            clashes.append((p, f"its name is written as {key!r}, as {display_name(str(owner[key]))}'s is"))
            continue
        keys[p], owner[key] = key, p
    return keys, clashes


def figure_names(keys: Iterable[str]) -> dict[str, str]:
    """A distinct figure file name per key, even on a case-insensitive file system: the key with
    ``%`` and ``/`` percent-escaped, plus ``.png`` (``x.jpg`` -> ``x.jpg.png``, so ``x.png``'s
    figure is another file); a long name or a case clash gets a hash of the key instead."""
    names: dict[str, str] = {}
    taken: set[str] = set()
    for key in keys:
        stem = key.replace("%", "%25").replace("/", "%2F")
        if len(stem.encode()) > 200 or stem.casefold() in taken:  # file names end at 255 bytes
            stem = f"{stem[:60]}~{hashlib.sha1(key.encode()).hexdigest()[:16]}"
        taken.add(stem.casefold())
        names[key] = stem + ".png"
    return names


# the order in which a resume refusal looks for the setting that differs: the options a user
# types before the ones they imply (--rerank mbr implies --nbest 5; --model or --onnx, one of them)
SETTINGS_ORDER = ("command", "model", "rerank", "nbest", "matcher", "match_weight", "match_rare_weight", "tta", "beam",
                  "length_penalty", "prompt", "max_new_tokens", "dtype")
# what a setting's absence means, said as the user would (None recorded: the option was not given)
ABSENT = {"length_penalty": "the model's length penalty (no --length-penalty)",
          "precision": "--precision fp32"}  # recorded only when not fp32 (cli/caption.py)


def _option(name: str) -> str:
    return "--" + name.replace("_", "-")


def _typed(value) -> str:
    """A recorded value as it is typed on the command line (no JSON quotes, nulls or lists)."""
    import shlex

    if isinstance(value, bool):
        return "" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, (list, tuple)):
        return ",".join(_typed(v) for v in value)
    return shlex.quote(str(value))


def _as_given(name: str, value, settings: dict) -> str:
    """A setting of ``settings`` as the options that gave it: ``--beam 3``, ``--model a --model b
    --weights 1,2``, ``--onnx DIR``, ``no --rerank``."""
    if name == "model":
        if value is None and settings.get("onnx"):
            return f"--onnx {_typed(settings['onnx'])}"
        if isinstance(value, dict):  # an ensemble named by several --model
            given = " ".join(f"--model {_typed(m)}" for m in value.get("members", []))
            return given + (f" --weights {_typed(value['weights'])}" if value.get("weights") else "")
    if name == "command":
        return f"captionkit {value}"
    if name == "prompt":
        text = str(value)
        return "the prompt (--prompts/--template) " + repr(text if len(text) <= 60 else text[:57] + "...")
    if value is None:
        return ABSENT.get(name, f"no {_option(name)}")
    return f"{_option(name)} {_typed(value)}".rstrip()


def settings_difference(recorded: dict, settings: dict) -> str | None:
    """The first setting in which ``settings`` (this run's) differs from ``recorded`` (a file's),
    said in the user's options: "with --rerank mbr, this run has no --rerank"; None if none."""
    names = [k for k in SETTINGS_ORDER if k in recorded or k in settings]
    names += sorted((set(recorded) | set(settings)) - set(names) - {"onnx"})  # onnx: said with model
    for k in names:
        if k == "model":
            differs = (recorded.get("model"), recorded.get("onnx")) != (settings.get("model"), settings.get("onnx"))
        else:
            differs = recorded.get(k) != settings.get(k)
        if differs:
            before, now = _as_given(k, recorded.get(k), recorded), _as_given(k, settings.get(k), settings)
            return f"by {before}, this run is {now}" if k == "command" else f"with {before}, this run has {now}"
    return None


def _read_meta(path: Path) -> dict | None:
    """The settings recorded in ``path`` (None if there is no such file); a file there that
    captionkit did not write is refused."""
    if not path.exists():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        doc = None
    if not (isinstance(doc, dict) and doc.get("written_by") == "captionkit" and doc.get("kind") == META_KIND
            and isinstance(doc.get("settings"), dict)):
        raise OutputError(f"{path}: exists and is not captionkit's record of a run's settings; "
                          f"move it away or write to another file")
    return doc["settings"]


@dataclass
class _Record:
    key: str
    failed: bool
    line: str  # the line as it is written back when failed lines are removed


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class _Output:
    """A resumable line-per-image file. Constructed: checked and read, nothing written (so a
    refused run changes nothing); :meth:`open`: locked (captionkit.core.locks: a second process
    writing it is refused), repaired, prepared, opened for appending; :meth:`close` unlocks."""

    def __init__(self, path: str | Path, settings: dict, overwrite: bool, late: tuple[str, ...] = ()):
        # a folder, a FIFO or a dangling link is refused; an existing file is resumed or replaced
        self.late = set(late)  # settings given later (CaptionWriter.add_settings): not compared yet
        self.path = check_file_target(path, overwrite=True)
        self.meta_path = self.path.with_name(self.path.name + META_SUFFIX)
        self.settings, self.overwrite = settings, overwrite
        self.several = int(settings.get("num_captions", 1))  # captions per image (K; 1: one, as a string)
        check_unlocked(self.path)  # another run writing it now: one line, before any model loads
        self._load()
        self.fd: int | None = None
        self._lock = ExitStack()

    def _load(self) -> None:
        """Read the file as it is now (the constructor; :meth:`open` again if another run
        changed it in between)."""
        overwrite = self.overwrite
        self.seen = (_stamp(self.path), _stamp(self.meta_path))
        self.fresh = overwrite or not self.path.exists()
        data = b"" if self.fresh else self.path.read_bytes()
        self.torn = len(data) - (data.rfind(b"\n") + 1)  # a last line without its newline
        self.records = self._read(data[:len(data) - self.torn])
        if self.torn and not self._could_be_torn(data[:len(data) - self.torn], data[len(data) - self.torn:]):
            raise OutputError(f"{self.path}: not a captionkit {self.kind} file (its last line is not one "
                              f"of its lines); move it away or write to another file")
        self.unrecorded = False  # resumed from a file whose settings were never recorded
        if overwrite:  # its settings file is replaced too (but never a folder or a FIFO)
            check_file_target(self.meta_path, overwrite=True)
        else:
            self._check_settings(_read_meta(self.meta_path))
        self.done = {r.key for r in self.records}
        self.failed = {r.key for r in self.records if r.failed} - {r.key for r in self.records if not r.failed}

    def _check_settings(self, recorded: dict | None) -> None:
        self.unrecorded = bool(self.records) and recorded is None
        if self.unrecorded or not self.records:
            return
        difference = settings_difference({k: v for k, v in recorded.items() if k not in self.late}, self.settings)
        if difference:
            raise OutputError(f"{self.path}: was written {difference} (see {self.meta_path.name}); use the same "
                              f"options to resume it, --overwrite to start it again, or write to another file")

    def open(self, retry: set[str]) -> None:
        """Start the file (fresh), or resume it: drop a torn last line, remove the failed lines
        of the images in ``retry``, record the settings. Locked until :meth:`close`."""
        self._lock.enter_context(hold_lock(self.path, f"writing captions to {self.kind}"))
        try:
            if (_stamp(self.path), _stamp(self.meta_path)) != self.seen:
                self._load()  # another run wrote it after this one read it: resume what it left
            self._open(retry)
        except BaseException:
            self.close()
            raise

    def _open(self, retry: set[str]) -> None:
        if self.fresh:
            atomic_write_text(self.meta_path, self._meta_text())
            atomic_write_bytes(self.path, self.header().encode())
        else:
            if self.torn:
                with disk_errors(self.path, None, "its lines are as they were"), open(self.path, "r+b") as f:
                    f.truncate(f.seek(0, os.SEEK_END) - self.torn)
                print(f"{self.path}: dropped a torn last line ({self.torn} bytes) from an interrupted run",
                      file=sys.stderr)
            again = self.failed & retry
            if again:
                kept = [r.line for r in self.records if not (r.failed and r.key in again)]
                atomic_write_bytes(self.path, (self.header() + "".join(kept)).encode())
                self.done -= again
                self.failed -= again
            elif self.path.stat().st_size == 0:
                atomic_write_bytes(self.path, self.header().encode())
            if self.unrecorded:
                print(f"{self.path}: no record of the settings it was written with (an older captionkit); "
                      f"recording this run's in {self.meta_path.name}", file=sys.stderr)
            if self.unrecorded or not self.records:
                atomic_write_text(self.meta_path, self._meta_text())
        with disk_errors(self.path, None, "its lines are as they were"):
            self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND)

    def _meta_text(self) -> str:
        from ..core.version import __version__
        return json.dumps({"written_by": "captionkit", "kind": META_KIND, "version": __version__,
                           "output": self.path.name, "settings": self.settings}, indent=1, ensure_ascii=False) + "\n"

    def header(self) -> str:
        return ""

    def _write(self, text: str) -> None:
        data = text.encode()
        end = os.fstat(self.fd).st_size  # where this line starts (the file is appended to)
        try:
            while data:
                n = os.write(self.fd, data)
                data = data[n:]
        except OSError as e:
            try:
                os.ftruncate(self.fd, end)  # the part of the line that fitted goes: no torn line
            except OSError:
                pass  # (a resume drops a torn last line anyway)
            kept = f"the {len(self.done)} images written before it are whole and a rerun resumes after them"
            err = translate(e, self.path, len(text.encode()), kept)
            if err is e:
                raise
            raise err from None

    def write(self, key: str, caption: str | list[str] | None, error: str | None) -> None:
        if key in self.done:
            return
        self._write(self.line(key, caption, error))
        self.done.add(key)
        if error is not None:
            self.failed.add(key)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        self._lock.close()


class JsonlOutput(_Output):
    kind = "JSONL"

    @staticmethod
    def _could_be_torn(complete: bytes, torn: bytes) -> bool:
        return b'{"image": '.startswith(torn[:10])  # how every line begins
    def _read(self, data: bytes) -> list[_Record]:
        records = []
        for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(keepends=True), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = rec["image"]
                if not isinstance(key, str):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError):
                raise OutputError(f"{self.path}:{n}: not a captionkit JSONL line; "
                                  f"fix or remove it, or write to another file") from None
            records.append(_Record(key, "error" in rec, line))
        return records

    def line(self, key: str, caption: str | list[str] | None, error: str | None) -> str:
        field = "captions" if isinstance(caption, list) else "caption"
        rec = {"image": key, field: caption} if error is None else {"image": key, "error": error}
        return json.dumps(rec, ensure_ascii=False) + "\n"


class CsvOutput(_Output):
    COLUMNS = ["image", "caption", "error"]
    kind = "CSV"

    @property
    def columns(self) -> list[str]:
        """COLUMNS, or with K captions per image one column for each: caption_1 .. caption_K."""
        if self.several == 1:
            return self.COLUMNS
        return ["image", *(f"caption_{i}" for i in range(1, self.several + 1)), "error"]

    @staticmethod
    def _could_be_torn(complete: bytes, torn: bytes) -> bool:
        return bool(complete)  # the header line is written whole when the file is made

    def header(self) -> str:
        return self._row(self.columns)

    @staticmethod
    def _row(values) -> str:
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerow(values)
        return buf.getvalue()

    def _read(self, data: bytes) -> list[_Record]:
        rows = list(csv.reader(io.StringIO(data.decode("utf-8", errors="replace"))))
        if not rows:
            return []
        if rows[0] != self.columns:
            raise OutputError(f"{self.path}: not a captionkit CSV (its header is not {','.join(self.columns)})")
        e = len(self.columns) - 1  # the error column
        return [_Record(r[0], len(r) > e and r[e] != "", self._row(r)) for r in rows[1:] if r]

    def line(self, key: str, caption: str | list[str] | None, error: str | None) -> str:
        if self.several == 1:
            return self._row([key, caption or "", error or ""])
        captions = list(caption or [])
        return self._row([key, *captions, *[""] * (self.several - len(captions)), error or ""])


class Progress:
    """Captioning's progress: a bar on stderr where bars are drawn (captionkit.core.progress), and
    at the end one summary line, bar or not (it is the run's result: done/total, images/s,
    unreadable, already done, seconds)."""

    def __init__(self, total: int, skipped: int = 0, desc: str = "caption"):
        self.total, self.skipped, self.done, self.failed = total, skipped, 0, 0
        self.t0 = time.perf_counter()
        # cleared when done: the summary line below says it all
        self.bar = progress(total=total, desc=desc, unit="image", leave=False, show=total > 0)

    def update(self, n: int = 1, failed: int = 0) -> None:
        self.done += n
        self.failed += failed
        if failed:
            self.bar.set_postfix(unreadable=self.failed, refresh=False)
        self.bar.update(n)

    def close(self) -> None:
        self.bar.close()
        seconds = time.perf_counter() - self.t0
        extra = f", {self.skipped} already done" if self.skipped else ""
        print(f"{self.done}/{self.total} images, {self.done / max(seconds, 1e-9):.1f} images/s, "
              f"{self.failed} unreadable{extra}, {seconds:.1f} s", file=sys.stderr, flush=True)


class _StdoutClosed(Exception):
    """stdout was closed (``| head``) and nothing else is being written: stop."""


def silence_stdout() -> None:
    """Point stdout at /dev/null, so neither later prints nor the flush at exit meet the
    closed pipe again (a BrokenPipeError traceback at shutdown otherwise)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)


@dataclass
class CaptionWriter:
    """Checks every target and finds the images (constructor: nothing loaded, nothing written),
    then writes what :meth:`run` is given. ``settings`` are what decides the captions (model,
    beam, prompt, ...): recorded beside a --jsonl/--csv file and compared on resume."""

    command: str
    paths: list[str]
    settings: dict
    json_out: str | None = None
    jsonl: str | None = None
    csv_out: str | None = None
    attention: str | None = None
    overwrite: bool = False
    retry_failed: bool = False
    verbose: bool = False
    late: tuple[str, ...] = ()  # settings that come with add_settings, compared then
    outputs: list[_Output] = field(init=False)

    def __post_init__(self) -> None:
        from ..data.images import Skipped, scan_images

        files = [p for p in (self.json_out, self.jsonl, self.csv_out) if p]
        where = Counter(Path(p).resolve() for p in files)
        if any(n > 1 for n in where.values()):
            raise OutputError(f"{max(where, key=where.get)}: given as more than one output; give each its own file")
        if self.json_out:
            check_file_target(self.json_out, overwrite=self.overwrite)
        settings = {"command": self.command, **self.settings}
        self.outputs = ([JsonlOutput(self.jsonl, settings, self.overwrite, self.late)] if self.jsonl else []) + \
                       ([CsvOutput(self.csv_out, settings, self.overwrite, self.late)] if self.csv_out else [])
        resuming = any(o.records for o in self.outputs)  # its figures so far are this run's too
        if self.attention:
            check_folder_target(self.attention, overwrite=self.overwrite or resuming, kinds=(FIGURES_KIND,))
        scan = scan_images(self.paths, exclude=[self.attention] if self.attention else [], skip_kinds=(FIGURES_KIND,),
                           shards=True)
        self.refused = {s.path: s.reason for s in scan.refused}
        self.keys, clashes = image_keys(scan.images + list(self.refused))
        self.shards = None  # WebDataset shards given: their images (captionkit.inference.shard_inputs)
        if scan.shards:
            from .shard_inputs import ShardInputs, unpack_folder
            self.shards = ShardInputs(scan.shards, unpack_folder(self.jsonl or self.csv_out))
            broken, _ = image_keys(list(self.shards.refused))  # (a shard read in part: its own error line)
            self.keys.update(self.shards.keys(set(self.keys.values()) | set(broken.values())))
            self.keys.update(broken)
            self.refused.update(self.shards.refused)
        self._report_skipped(scan.skipped + [Skipped(p, why) for p, why in clashes])
        self.figures = figure_names(self.keys.values()) if self.attention else {}

    def add_settings(self, **late) -> None:
        """Settings known only after the constructor (caption's precision, once its device is
        resolved): recorded with the others, and checked against what a resumed file recorded
        (the same one-line refusal, still before the model loads). None: not recorded, as an
        option not given is not."""
        given = {k: v for k, v in late.items() if v is not None}
        self.settings.update(given)
        for o in self.outputs:
            o.settings.update(given)
            o.late -= set(late)
            if not self.overwrite:
                o._check_settings(_read_meta(o.meta_path))

    def _report_skipped(self, skipped) -> None:
        if not skipped:
            return
        skipped = sorted(skipped, key=lambda s: s.path)
        n = len(skipped)
        head = f"skipped {n} " + ("file that is not an image" if n == 1 else "files that are not images") + " to caption"
        if self.verbose:
            print(head + ":", file=sys.stderr)
            for s in skipped:
                print(f"  {display_name(str(s.path))}: {s.reason}", file=sys.stderr)
            return
        shown = ", ".join(f"{display_name(str(s.path))} ({s.reason})" for s in skipped[:SKIPPED_SHOWN])
        more = f", and {n - SKIPPED_SHOWN} more (--verbose lists them all)" if n > SKIPPED_SHOWN else ""
        print(f"{head}: {shown}{more}", file=sys.stderr)

    @property
    def total(self) -> int:
        return len(self.keys)

    @property
    def readable(self) -> list[Path]:
        """The images found that were not refused (some may still fail to decode)."""
        return [p for p in self.keys if p not in self.refused]

    def run(self, caption: Callable[[list[Path]], Iterator[tuple[Path, object]]]) -> int:
        """Caption the images not yet in the outputs with ``caption(paths)`` -> (path, result
        or ImageError) and write each as it comes: the refused ones (missing files, FIFOs)
        first, and ``caption`` is not called when no other is left (so a caller that loads its
        model inside ``caption`` loads none); the exit status (0, 1 if any image is
        recorded as failed, EXIT_STDOUT_CLOSED if stdout closed with nothing else to write)."""
        retry = set(self.keys.values()) if self.retry_failed else set()
        try:
            for o in self.outputs:
                o.open(retry)
        except BaseException:
            for o in self.outputs:  # (the one that failed has closed itself)
                o.close()
            raise
        todo = [p for p, k in self.keys.items() if any(k not in o.done for o in self.outputs)] \
            if self.outputs else list(self.keys)
        self.progress = Progress(len(todo), skipped=self.total - len(todo)) if self.outputs else None
        self.captions: dict[str, str | list[str]] = {}
        self.failed, self.stdout_closed = 0, False
        # --jsonl/--csv: SIGTERM or SIGUSR1 (a scheduler's preemption) stops at once while the
        # model works (nothing of ours half-written then; Ray's shard files are atomic), after
        # the lines of an image once it is being written; a rerun resumes (Preempted: exit 75)
        stop = StopSignals(immediate=True) if self.outputs else StopSignals(())
        try:
            with lines_above_bars(), stop:  # (a warning while the bar is drawn goes above it, not into it)
                for path in todo:
                    if path in self.refused:
                        self._record(path, ImageError(f"{path}: {self.refused[path]}"))
                readable = [p for p in todo if p not in self.refused]
                if readable:  # else no model is loaded at all
                    results = iter((self.shards.wrap(caption) if self.shards else caption)(readable))
                    while (got := next(results, None)) is not None:  # (a generator yields no None)
                        stop.immediate = False
                        self._record(*got)
                        if self.outputs:  # (else no signal is caught)
                            stop.message = (f"stopped on {{signal}} after {self.progress.done} of {len(todo)} "
                                            f"images, each written whole; run the same command again for the rest")
                            stop.check(stop.message.format(signal=stop.requested))
                            stop.immediate = True
        except _StdoutClosed:
            return EXIT_STDOUT_CLOSED
        finally:
            for o in self.outputs:
                o.close()
            if self.progress:
                self.progress.close()
            if self.shards:
                self.shards.close()
        if self.json_out:
            atomic_write_text(self.json_out, json.dumps(self.captions, indent=1, ensure_ascii=False))
        return self._summary(len(todo))

    def _record(self, path: Path, res) -> None:
        key = self.keys[path]
        error = display_name(str(res)) if isinstance(res, ImageError) else None
        several = getattr(res, "captions", None)  # K captions (a list), when asked for
        for o in self.outputs:
            o.write(key, None if error else several if several is not None else res.text, error)
        if self.progress:
            self.progress.update(1, failed=int(error is not None))
        if error:
            self.failed += 1
            if not self.progress:
                print(f"error: {error}", file=sys.stderr)
            return
        if self.json_out:
            self.captions[key] = res.text if several is None else several
        if not self.progress:
            for text in [res.text] if several is None else several:
                self._print(f"{key}\t{text}")
        if self.attention:
            self._figure(path, key, res)

    def _print(self, line: str) -> None:
        if self.stdout_closed:
            return
        try:
            print(line, flush=True)
        except BrokenPipeError:
            silence_stdout()
            self.stdout_closed = True
            if not (self.json_out or self.attention):  # nothing else to write: end quietly
                raise _StdoutClosed from None

    def _figure(self, path: Path, key: str, res) -> None:
        from ..data.images import load_rgb
        from .figures import save_attention_figure

        folder = Path(self.attention)
        if not (folder / MARKER).exists():
            write_marker(folder, FIGURES_KIND)
        save_attention_figure(load_rgb(path), res.words, res.attention, res.grid, folder / self.figures[key])

    def _summary(self, ran: int) -> int:
        if not self.outputs:
            if self.failed:
                print(f"{self.failed} of {ran} images could not be captioned", file=sys.stderr)
            return 1 if self.failed else 0
        ours = set(self.keys.values())
        failed = set().union(*(o.failed for o in self.outputs)) & ours
        if not failed:
            return 0
        where = " and ".join(str(o.path) for o in self.outputs)
        earlier = len(failed) - self.failed
        note = f" ({earlier} in an earlier run)" if earlier > 0 else ""
        print(f"{len(failed)} of {self.total} images could not be captioned{note}; {where} lists them with "
              f"an error; --retry-failed tries them again", file=sys.stderr)
        return 1
