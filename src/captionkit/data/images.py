"""Reading photos safely and turning them into encoder input."""

from __future__ import annotations

import contextlib
import io
import os
import stat
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageFile

from ..core.errors import ImageError
from ..core.outputs import MARKER, owner_kind

if TYPE_CHECKING:  # imported where a tensor is made: scanning and reading photos need no torch
    import torch

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"}
MAX_PIXELS = 89_478_485  # Pillow's own default bomb threshold (about 9459 x 9459)
MIN_SIDE = 8  # smaller images hold nothing to describe
ImageFile.LOAD_TRUNCATED_IMAGES = False


@dataclass(frozen=True)
class Preprocess:
    """How a photo becomes an encoder's input tensor (an encoder declares its own; it is part
    of the encoder's feature-cache key).

    size: the square side the photo is resized to (aspect ratio is not kept: Show, Attend
        and Tell resizes whole images, and the Flickr8k copy is already squashed).
    mean, std: per-channel normalisation applied to pixels scaled to [0, 1].
    """

    size: int
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    resample: str = "bicubic"


def load_rgb(path: str | Path) -> Image.Image:
    """Open ``path`` as an RGB image, converting any colour mode, or raise ImageError."""
    path = Path(path)
    try:
        return _open_rgb(path, str(path))
    except FileNotFoundError:
        raise ImageError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise ImageError(f"{path}: is a directory") from None
    except OSError as e:  # unreadable, truncated, empty, not an image
        if path.exists() and path.stat().st_size == 0:
            raise ImageError(f"{path}: empty file") from None
        raise ImageError(f"{path}: cannot read image ({e})") from None


def decode_rgb(data: bytes, name: str = "upload", formats: set[str] | None = None) -> Image.Image:
    """Like :func:`load_rgb` for the bytes of an uploaded file; ``formats`` limits the
    accepted Pillow formats (e.g. {"JPEG", "PNG"})."""
    with _upload_errors(data, name):
        return _open_rgb(io.BytesIO(data), name, formats)


@contextlib.contextmanager
def _upload_errors(data: bytes, name: str):
    """An empty upload, and Pillow's errors on reading one, as ImageError."""
    if not data:
        raise ImageError(f"{name}: empty file")
    try:
        yield
    except Image.UnidentifiedImageError:
        raise ImageError(f"{name}: cannot read image (not an image file, or a format Pillow does not know)") from None
    except OSError as e:
        raise ImageError(f"{name}: cannot read image ({e})") from None


def _open_rgb(source, name: str, formats: set[str] | None = None) -> Image.Image:
    with _opened(source, name, formats, MAX_PIXELS) as im:
        im.load()
        return to_rgb(im)


@contextlib.contextmanager
def _opened(source, name: str, formats: set[str] | None, max_pixels: int):
    """Open an image, reading its header only, and check its format and pixel count before
    anything is decoded; Pillow's errors inside the block become ImageError."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            Image.MAX_IMAGE_PIXELS = MAX_PIXELS
            with Image.open(source) as im:
                if formats is not None and im.format not in formats:
                    raise ImageError(f"{name}: {im.format} images are not accepted")
                w, h = im.size
                if w * h > max_pixels:
                    raise ImageError(f"{name}: {w}x{h} image is too large (over {max_pixels:,} pixels)")
                if min(w, h) < MIN_SIDE:
                    raise ImageError(f"{name}: {w}x{h} image is too small to caption (under {MIN_SIDE} px)")
                yield im
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise ImageError(f"{name}: refused as a decompression bomb ({e})") from None
    except (ValueError, SyntaxError) as e:  # (OSError, e.g. not an image, goes to the caller)
        raise ImageError(f"{name}: cannot read image ({e})") from None


def to_rgb(im: Image.Image, value_range: tuple[float, float] | None = None) -> Image.Image:
    """Any Pillow mode -> 8-bit RGB (alpha composited on white, 16-bit scaled down).
    ``value_range``: the (min, max) of the whole image for modes I and F, when ``im`` is a
    strip of it (their scaling depends on it); by default ``im``'s own."""
    if im.mode in ("I;16", "I;16B", "I;16L", "I"):
        arr = np.asarray(im, dtype=np.float64)
        hi = value_range[1] if value_range else arr.max()
        top = 65535.0 if im.mode.startswith("I;16") or hi > 255 else 255.0
        arr = np.clip(arr / top * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(arr, "L").convert("RGB")
    if im.mode == "F":
        arr = np.asarray(im, dtype=np.float64)
        lo, hi = map(float, value_range) if value_range else (float(arr.min()), float(arr.max()))
        arr = (arr - lo) / (hi - lo if hi > lo else 1.0) * 255.0
        return Image.fromarray(arr.astype(np.uint8), "L").convert("RGB")
    if im.mode in ("RGBA", "LA", "PA") or (im.mode == "P" and "transparency" in im.info):
        rgba = im.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(bg, rgba).convert("RGB")
    return im.convert("RGB")


# Decoding uploads with bounded memory (the server). A photo much larger than the model's input
# is decoded reduced: a JPEG by its decoder at 1/2, 1/4 or 1/8 scale (draft mode), any other
# format in full and then box-reduced by integer factors strip by strip, each strip converted to
# RGB on its own, so no full-size copy is ever made. Both stop at REDUCE_GAP times the model's
# input side, where Pillow finds the final bicubic resize indistinguishable from a resize of the
# full image (Image.resize, reducing_gap); smaller photos are decoded exactly as load_rgb does.
REDUCE_GAP = 3
STRIP_PIXELS = 1 << 20  # pixels per strip converted at a time
# Memory a decoder holds beside the image, in units of the decoded image: libtiff may read a
# whole strip (often the whole image) into a buffer of its own, libwebp decodes into canvases of
# its own that Pillow then copies. A progressive JPEG also keeps all its DCT coefficients
# (2 bytes per component and pixel, at full size). Converting to RGB works on a strip at a time:
# bytes per strip pixel, numpy's float64 temporaries for the 16- and 32-bit modes. All measured
# with benchmarks/decode_memory.py, which checks that the estimate is an upper bound.
DECODER_COPIES = {"TIFF": 1.0, "WEBP": 3.5}
CONVERT_BYTES = {"I": 64, "I;16": 64, "I;16B": 64, "I;16L": 64, "F": 64}
CONVERT_BYTES_DEFAULT = 32


def mode_bytes(mode: str) -> int:
    """Bytes per pixel Pillow stores for an image of this mode."""
    if mode in ("1", "L", "P"):
        return 1
    if mode.startswith("I;16"):
        return 2
    return 4


@dataclass(frozen=True)
class DecodePlan:
    """How an upload will be decoded, known from its header alone."""
    size: tuple[int, int]  # pixels the decoder produces (a JPEG in draft mode: already scaled down)
    mode: str
    format: str
    factor: tuple[int, int]  # then box-reduced by these factors (1, 1: not reduced)
    bytes: int  # the most memory decoding holds at once, an upper estimate


def plan_decode(im: Image.Image, side: int) -> DecodePlan:
    """The plan for an opened, not yet decoded image (puts a JPEG in draft mode)."""
    goal = REDUCE_GAP * side
    coefficients = 0
    if im.format in ("JPEG", "MPO"):
        if im.info.get("progressive"):
            coefficients = 2 * len(im.getbands()) * im.size[0] * im.size[1]
        if min(im.size) >= 2 * goal:
            im.draft(im.mode, (goal, goal))  # the decoder itself scales down by 2, 4 or 8
    w, h = im.size
    factor = (max(1, w // goal), max(1, h // goal))
    out_pixels = -(-w // factor[0]) * -(-h // factor[1])
    # converted whole when not reduced, else one strip of whole factor-rows at a time
    converted = w * h if factor == (1, 1) else min(w * h, max(STRIP_PIXELS, w * factor[1]))
    work = converted * CONVERT_BYTES.get(im.mode, CONVERT_BYTES_DEFAULT) + 4 * out_pixels
    decoded = w * h * mode_bytes(im.mode)
    total = int(decoded * (1 + DECODER_COPIES.get(im.format, 0.0))) + coefficients + work
    return DecodePlan((w, h), im.mode, im.format, factor, total)


def decode_reduced(data: bytes, side: int, name: str = "upload", formats: set[str] | None = None,
                   max_pixels: int = MAX_PIXELS, max_bytes: int | None = None) -> tuple[Image.Image, DecodePlan]:
    """Like :func:`decode_rgb`, for a model whose input is ``side`` pixels square, and with the
    plan it followed: a photo larger than REDUCE_GAP * ``side`` is decoded reduced (see above);
    one whose header says it has more than ``max_pixels`` pixels, or would need more than
    ``max_bytes`` to decode, is refused with an ImageError before any pixel is decoded."""
    with _upload_errors(data, name), _opened(io.BytesIO(data), name, formats, max_pixels) as im:
        plan = plan_decode(im, side)
        if max_bytes is not None and plan.bytes > max_bytes:
            w, h = im.size
            raise ImageError(f"{name}: {w}x{h} {plan.mode} {plan.format} image would need "
                             f"{plan.bytes / 2 ** 20:.0f} MiB to decode; the limit is {max_bytes / 2 ** 20:.0f} MiB")
        im.load()
        return _reduce_rgb(im, plan.factor), plan


# Modes whose conversion to RGB commutes with averaging, so a strip is reduced first and then
# converted (LA and RGBA: Image.reduce averages them premultiplied by alpha, and compositing on
# white after averaging gives what it gives before). Other modes (palette, bilevel, integer,
# CMYK and other colour spaces, whose conversion looks up or clips) are converted first.
REDUCIBLE_MODES = {"L", "LA", "RGB", "RGBA", "RGBX", "F"}


def _reduce_rgb(im: Image.Image, factor: tuple[int, int]) -> Image.Image:
    """to_rgb(im) reduced by ``factor``, one strip of whole factor-rows at a time, so that no
    full-size copy of ``im`` is made."""
    if factor == (1, 1):
        return to_rgb(im)
    fx, fy = factor
    w, h = im.size
    value_range = im.getextrema() if im.mode in ("I", "F") else None
    out = Image.new("RGB", (-(-w // fx), -(-h // fy)))
    rows = fy * max(1, STRIP_PIXELS // (w * fy))
    for y in range(0, h, rows):
        strip = im.crop((0, y, w, min(h, y + rows)))
        if im.mode in REDUCIBLE_MODES:
            small = to_rgb(strip.reduce(factor), value_range)
        else:
            small = to_rgb(strip, value_range).reduce(factor)
        out.paste(small, (0, y // fy))
    return out


_RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}


def to_tensor(im: Image.Image, pre: Preprocess) -> torch.Tensor:
    """RGB PIL image -> normalised (3, S, S) float tensor."""
    import torch

    im = im.resize((pre.size, pre.size), _RESAMPLE[pre.resample])
    # The arithmetic in numpy, in place on one new array: reader threads run this beside the
    # model, and torch's operations on a tensor this size would each start an OpenMP team of
    # their own in the reader thread, fighting the model's threads for the cores (captioning
    # ran 1.2x faster end to end without them). The same IEEE float32 operations in the same
    # order as torch's (x / 255 - mean) / std: bit for bit the same pixels.
    x = np.array(im, dtype=np.float32)  # (S, S, 3)
    x /= np.float32(255.0)
    x -= np.asarray(pre.mean, dtype=np.float32)
    x /= np.asarray(pre.std, dtype=np.float32)
    return torch.from_numpy(x).permute(2, 0, 1)  # (3, S, S)


@dataclass(frozen=True)
class Skipped:
    """A file left out of a run, and why (named to the user, never dropped silently)."""
    path: Path
    reason: str


@dataclass
class Scan:
    """What :func:`scan_images` found: the files to caption, in order; the files inside the
    given folders that were left out; and the paths named on the command line that are refused,
    each with the rest of its one-line error after ``path: `` (a missing file; a FIFO or device,
    which would block or stream forever when read)."""
    images: list[Path] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    refused: list[Skipped] = field(default_factory=list)
    shards: list[Path] = field(default_factory=list)  # WebDataset shards, with scan_images(shards=True)


_KINDS = [(stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a folder")]


def _not_regular(mode: int) -> str | None:
    """Why a file of this mode cannot be read as a photo, or None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "a special file")
    return f"not a regular file ({kind})"


def _classify(path: Path, shards: bool = False) -> str | None:
    """Why a file found in a folder is left out, or None if it is an image file to caption
    (or, with ``shards``, a WebDataset shard)."""
    try:
        mode = path.stat().st_mode  # follows symbolic links: a link to a photo is a photo
    except FileNotFoundError:
        return "dangling symbolic link" if path.is_symlink() else "vanished while listing"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    why = _not_regular(mode)
    if why:
        return why
    if shards:
        from .webdataset import is_shard
        if is_shard(path):
            return None
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        return f"unsupported extension {path.suffix!r}" if path.suffix else "no extension"
    return None


def _marked(folder: Path, kinds: tuple[str, ...]) -> str | None:
    """The kind of ``folder`` when captionkit marked it as one of ``kinds`` (core.outputs.MARKER)."""
    if not kinds or not (folder / MARKER).is_file():  # one stat for most folders
        return None
    kind = owner_kind(folder)
    return kind if kind in kinds else None


def _walk(folder: Path, scan: Scan, exclude: set[Path], skip_kinds: tuple[str, ...] = (),
          shards: bool = False) -> list[Path]:
    """Image files under ``folder`` (recursively, sorted); everything else goes to scan.skipped.
    Symbolic links to folders are not followed (as Path.rglob does not), and are named; so are
    the folders captionkit marked as one of ``skip_kinds``, which are not entered."""
    found: list[Path] = []

    def unlistable(e: OSError) -> None:
        scan.skipped.append(Skipped(Path(e.filename), f"folder cannot be listed ({e.strerror})"))

    for top, dirs, files in os.walk(folder, onerror=unlistable):
        here = Path(top)
        entered = []
        for d in sorted(dirs):
            sub = here / d
            if sub.is_symlink():
                scan.skipped.append(Skipped(sub, "symbolic link to a folder (not followed)"))
            elif sub.resolve() in exclude:
                scan.skipped.append(Skipped(sub, "an output folder of this command"))
            elif kind := _marked(sub, skip_kinds):
                scan.skipped.append(Skipped(sub, f"{kind} figures captionkit wrote (not captioned)"))
            else:
                entered.append(d)
        dirs[:] = entered
        for name in files:
            path = here / name
            why = _classify(path, shards)
            if why:
                scan.skipped.append(Skipped(path, why))
            else:
                found.append(path)
    return sorted(found)


def scan_images(paths: list[str | Path], exclude: list[str | Path] = (), skip_kinds: tuple[str, ...] = (),
                shards: bool = False) -> Scan:
    """Expand folders (recursively, sorted) into image files, and say what was left out.

    A file named directly is kept whatever its extension (the user chose it); a missing one is
    refused here, so that it is reported before any model loads, and so is one that is not a
    regular file (a FIFO, a device), since reading it could block forever. Inside folders, only
    regular files (or links to them) with an image extension are kept; every other entry is
    listed in ``skipped`` with its reason. Folders in ``exclude`` (a command's own output
    folder) are not entered, nor the folders inside them that captionkit marked as one of
    ``skip_kinds`` (an earlier run's attention figures; a folder named directly is scanned).
    A path given twice is captioned once. With ``shards``, WebDataset tar shards (named directly
    or found in the folders) go to ``scan.shards`` instead (captionkit.data.shard_images)."""
    from .webdataset import is_shard

    scan = Scan()
    excluded = {Path(p).resolve() for p in exclude}
    seen: set[Path] = set()
    for p in map(Path, paths):
        if p.is_dir():
            found = _walk(p, scan, excluded, skip_kinds, shards)
        else:
            try:
                why = _not_regular(p.stat().st_mode)
                why = why and f"{why}; refused"
            except FileNotFoundError:  # said now, before a model loads for it
                why = "dangling symbolic link" if p.is_symlink() else "no such file"
            except OSError:  # unreadable: load_rgb names it when it reads it
                why = None
            if why:
                scan.refused.append(Skipped(p, why))
                continue
            found = [p]
        for f in found:
            if f not in seen:
                seen.add(f)
                (scan.shards if shards and is_shard(f) else scan.images).append(f)
    return scan


def find_images(paths: list[str | Path]) -> list[Path]:
    """The image files of :func:`scan_images`, for callers that need no report of the rest."""
    return scan_images(paths).images
