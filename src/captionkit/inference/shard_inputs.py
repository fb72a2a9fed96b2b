"""WebDataset shards given to ``captionkit caption`` (or ``zero-shot``): their image members as
the caption writer's images (captionkit.inference.writer.CaptionWriter; the shards are read by
captionkit.data.shard_images).

Each image member stands in the writer as a file that does not exist yet, under the folder
:func:`unpack_folder` names. It is written under its sample key (``shard-000.tar``'s
``0001.jpg`` is ``0001``). A key that two images share (two shards, or a sample with two images,
``0001.jpg`` and ``0001.png``) is written as ``SHARD/MEMBER`` instead. Nothing is unpacked
until the run knows which images it still has to caption (a resumed run skips those done).
Then those members are unpacked, each shard read once, and captioned like any file: the local
engine and ``--engine ray`` read the same files. The folder is removed when the run ends.

The folder sits beside the ``--jsonl``/``--csv`` output (``.OUT.shard-images``), where the Ray
engine's workers already read and write (shared storage on a cluster), and its files keep the
same names from run to run (a shard's place, a member's place), so the Ray engine's finished
parts are reused by a rerun. Without such an output it is a temporary folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from ..core.errors import ImageError, OutputError
from ..core.outputs import MARKER, display_name, owner_kind, write_marker
from ..data.shard_images import ShardImage, extract_members, scan_shard

UNPACK_KIND = "shard-images"  # the outputs.MARKER kind of the unpack folder


def unpack_folder(output: str | None) -> Path:
    """Where a run's shard members are unpacked: ``.OUT.shard-images`` beside ``output`` (a
    --jsonl/--csv file), or a new name in the temporary folder."""
    if output:
        out = Path(output).absolute()
        return out.with_name(f".{out.name}.shard-images")
    return Path(tempfile.gettempdir()) / f"captionkit-shard-images-{os.getpid()}-{os.urandom(4).hex()}"


class ShardInputs:
    """The image members of ``shards`` (each a file found by scan_images): :attr:`members`
    (a stand-in file -> its member), :attr:`refused` (a shard that could not be read to its end
    -> why: written as its own error line), and :meth:`keys` for the writer."""

    def __init__(self, shards: list[Path], folder: Path):
        self.folder = folder
        self.members: dict[Path, ShardImage] = {}
        self.refused: dict[Path, str] = {}
        for s, shard in enumerate(shards):
            scan = scan_shard(shard)
            for m in scan.images:
                ext = Path(m.member).suffix.lower()  # (only for whoever looks in the folder)
                self.members[folder / f"{s:05d}" / f"{m.index:07d}{ext}"] = m
            if scan.error:
                self.refused[shard] = scan.error

    def keys(self, taken: set[str]) -> dict[Path, str]:
        """Each stand-in's key: its sample key, or ``SHARD/MEMBER`` where that key is another
        image's too (among these and ``taken``, the keys of the other images)."""
        count = Counter(m.key for m in self.members.values())
        keys = {}
        for path, m in self.members.items():
            key = m.key if count[m.key] == 1 and m.key not in taken else f"{m.shard}/{m.member}"
            keys[path] = display_name(key)  # (a member's name bytes that are not UTF-8 as \xNN, as a file's)
        return keys

    def label(self, path: Path) -> str:
        """How a stand-in is named in its error: the shard and the member."""
        m = self.members[path]
        return display_name(f"{m.shard}: {m.member}")

    def unpack(self, files: list[Path]) -> dict[Path, ImageError]:
        """Write the members among ``files`` into their stand-ins -> the errors of those that
        could not be read."""
        by_shard: dict[Path, dict[int, Path]] = {}
        for f in files:
            if f in self.members:
                f.parent.mkdir(parents=True, exist_ok=True)
                by_shard.setdefault(self.members[f].shard, {})[self.members[f].index] = f
        failed = {}
        for shard, wanted in by_shard.items():
            for index, why in extract_members(shard, wanted).items():
                failed[wanted[index]] = ImageError(f"{self.label(wanted[index])}: {why}")
        return failed

    def wrap(self, caption: Callable[[list[Path]], Iterator[tuple[Path, object]]]):
        """``caption`` (the writer's: paths -> (path, result or ImageError), in order) on the
        stand-ins: their members unpacked first; a member that could not be read is its error;
        an error of a stand-in names the shard and the member, not the stand-in."""
        def run(files: list[Path]) -> Iterator[tuple[Path, object]]:
            self.open()
            failed = self.unpack(files)
            good = [f for f in files if f not in failed]
            results = iter(caption(good) if good else ())  # (the model loads only for something to caption)
            for f in files:
                if f in failed:
                    yield f, failed[f]
                    continue
                path, res = next(results)
                if path in self.members and isinstance(res, ImageError):
                    res = ImageError(str(res).replace(str(path), self.label(path)))  # (Pillow names it too)
                yield path, res
        return run

    def open(self) -> None:
        """Make the unpack folder (emptied, if a killed run left it); one that captionkit did not
        make for this is refused rather than emptied."""
        if self.folder.exists():
            if owner_kind(self.folder) != UNPACK_KIND:
                raise OutputError(f"{self.folder}: exists and is not where captionkit unpacks shards; "
                                  f"move it away")
            shutil.rmtree(self.folder)
        self.folder.mkdir(parents=True)
        write_marker(self.folder, UNPACK_KIND)

    def close(self) -> None:
        """Remove the unpack folder (only captionkit's own)."""
        if self.folder.is_dir() and (self.folder / MARKER).is_file() and owner_kind(self.folder) == UNPACK_KIND:
            shutil.rmtree(self.folder, ignore_errors=True)
