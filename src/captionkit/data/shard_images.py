"""The images inside WebDataset tar shards as captioning input: ``captionkit caption
shard-000.tar shard-001.tar`` or a folder that holds shards (captionkit.inference.writer).

Unlike a training dataset (captionkit.data.webdataset), a shard to caption needs no captions: each
image member (``KEY.jpg``, ``KEY.png``, ... by webdataset's rule: the key is the member's path up to
the first dot of its file name) is one image, written under its sample KEY. Other members
(``.txt``, ``.json``, ``.cls``) are ignored, and so are webdataset's ``__meta__`` members and
hidden files.

A damaged shard does not stop a run. An image member whose bytes do not decode is that image's
one-line error, as a bad JPEG file is. A member cut short (a truncated shard) is that member's
error, and the shard gets one more line saying it is cut short. A tar header that is not one (a
corrupt shard) ends what can be read of the shard: the images before it are captioned, and the
shard itself gets one error line saying where it broke. Python's tarfile stops at such a header
silently, as if the archive ended there, so :func:`scan_shard` looks at the block where it stopped.
"""

from __future__ import annotations

import tarfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from .webdataset import IMAGE_EXTENSIONS, _split_member

BLOCK = 512  # a tar header's size; an archive ends with blocks of zeros
# what reading a damaged tar (or its gzip/bz2/xz stream) raises
TAR_ERRORS = (tarfile.TarError, EOFError, OSError, zlib.error)


@dataclass(frozen=True)
class ShardImage:
    """An image member of a shard: its place among the tar's members, its name, its sample key."""

    shard: Path
    index: int
    member: str
    key: str


@dataclass
class ShardScan:
    """The image members of a shard that could be listed, and why the rest could not (None:
    the whole shard was listed)."""

    images: list[ShardImage] = field(default_factory=list)
    error: str | None = None


def _is_image_member(m: tarfile.TarInfo) -> bool:
    base = m.name.rsplit("/", 1)[-1]
    if not m.isfile() or base.startswith(".") or (base.startswith("__") and base.endswith("__")):
        return False
    _, ext = _split_member(m.name)
    return ext.lower() in IMAGE_EXTENSIONS


def _open(shard: Path) -> tarfile.TarFile:
    return tarfile.open(shard, "r:*")


def scan_shard(shard: Path) -> ShardScan:
    """The image members of ``shard`` (names only; no image is read)."""
    scan = ShardScan()
    last = None  # the last member listed, to say where a shard broke
    try:
        with _open(shard) as tar:
            for i, m in enumerate(tar):
                last = m.name
                if _is_image_member(m):
                    scan.images.append(ShardImage(shard, i, m.name, _split_member(m.name)[0]))
            # tarfile ends its listing at a header that does not parse as it does at the
            # archive's end: tell the two apart by the block where it stopped
            tar.fileobj.seek(tar.offset)
            block = tar.fileobj.read(BLOCK)
    except TAR_ERRORS as e:
        if not last:
            scan.error = f"not a readable tar file ({e})"
        elif str(e) == "unexpected end of data":  # (tarfile's check that the last member's data is whole)
            scan.error = f"the file ends inside member {last}: the shard is cut short, and what followed is lost"
        else:
            scan.error = f"cannot read the tar after member {last} ({e})"
        return scan
    # an empty block: the file ends there (some writers leave out the end-of-archive blocks); a
    # member whose data is cut short is found when it is read (extract_members)
    if block and (len(block) < BLOCK or block.count(0) != BLOCK):
        what = "a cut-off tar header" if len(block) < BLOCK else "a damaged tar header"
        where = f", after member {last}" if last else ""
        scan.error = f"{what} at byte {tar.offset}{where}: the rest of the shard cannot be read"
    return scan


def extract_members(shard: Path, wanted: dict[int, Path]) -> dict[int, str]:
    """Write the members at the places ``wanted`` names (a ShardImage's index -> a file) into
    their files, reading the shard once -> {index: why it could not be read} for those that
    could not (a member cut short, or the tar broken before it). The files' own write errors
    (a full disk) are raised as they are: they are not the shard's."""
    left, errors = dict(wanted), {}
    broken = "the shard ends before it"
    try:
        with _open(shard) as tar:
            for i, m in enumerate(tar):
                if i not in left:
                    continue
                target = left.pop(i)
                try:
                    data = tar.extractfile(m).read()
                except TAR_ERRORS as e:
                    errors[i] = f"cannot read the member ({e})"
                    broken = f"the shard cannot be read past {m.name}"
                    break
                target.write_bytes(data)
                if not left:
                    break
    except TAR_ERRORS as e:
        broken = f"the shard cannot be read ({e})"
    errors.update({i: broken for i in left})
    return errors
