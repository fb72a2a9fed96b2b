"""What the Python API captions: a photo given as a path, an http(s) URL, a PIL image, a numpy
array or the bytes of an image file, turned into an RGB PIL image -- or an :class:`ImageError`
whose message names the input, so that one bad input is reported in its place and the others
go on (captionkit.inference.captioner.Captioner.__call__; docs/python-api.md).

Each kind is read as the command line reads a file: the same colour conversion
(:func:`captionkit.data.images.to_rgb`) and the same limits (too small, too many pixels), so a
photo gives the same caption whichever way it is handed over.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

from ..core.errors import ImageError
from .fetch import fetch_url, url_scheme
from .images import MAX_PIXELS, MIN_SIDE, decode_rgb, load_rgb, to_rgb

KINDS = "a path, an http(s) URL, a PIL image, a numpy array (H, W, 3) of uint8 or the bytes of an image file"


def input_label(item, index: int | None) -> str:
    """How an input is named in its result and its error: a path or URL as given; an
    in-memory image by its place, ``images[2]`` (``image`` for a single one)."""
    if isinstance(item, (str, os.PathLike)):
        return os.fspath(item)
    return "image" if index is None else f"images[{index}]"


def read_input(item, label: str, max_bytes: int | None = None, timeout: float | None = None) -> Image.Image:
    """``item`` (see :data:`KINDS`) as an RGB image, or an ImageError starting with ``label``.
    ``max_bytes``, ``timeout``: a URL's limits (captionkit.data.fetch.url_limits)."""
    if isinstance(item, str):
        if url_scheme(item) is not None:  # fetch_url refuses schemes other than http(s)
            return decode_rgb(fetch_url(item, max_bytes, timeout), item)
        return load_rgb(item)
    if isinstance(item, os.PathLike):
        return load_rgb(Path(item))
    if isinstance(item, (bytes, bytearray, memoryview)):
        return decode_rgb(bytes(item), f"{label} (bytes)")
    if isinstance(item, Image.Image):
        return pil_to_rgb(item, f"{label} (PIL image)")
    if isinstance(item, np.ndarray):
        return array_to_rgb(item, f"{label} (numpy array)")
    kind = type(item).__qualname__ if type(item).__module__ == "builtins" else \
        f"{type(item).__module__}.{type(item).__qualname__}"
    raise ImageError(f"{label}: cannot caption a value of type {kind}; give {KINDS}")


def _check_size(w: int, h: int, name: str) -> None:
    if min(w, h) < MIN_SIDE:
        raise ImageError(f"{name}: {w}x{h} image is too small to caption (under {MIN_SIDE} px)")
    if w * h > MAX_PIXELS:
        raise ImageError(f"{name}: {w}x{h} image is too large (over {MAX_PIXELS:,} pixels)")


def pil_to_rgb(im: Image.Image, name: str) -> Image.Image:
    """A PIL image of any mode as RGB (as :func:`load_rgb` converts a file); one still lazily
    opened from a file is read here, and its read errors are this input's."""
    _check_size(*im.size, name)
    try:
        return to_rgb(im)
    except (OSError, ValueError, SyntaxError) as e:  # a truncated file behind Image.open
        raise ImageError(f"{name}: cannot read image ({e})") from None


def array_to_rgb(arr: np.ndarray, name: str) -> Image.Image:
    """A uint8 array as an RGB image: (H, W, 3) RGB, and also (H, W) or (H, W, 1) grey and
    (H, W, 4) RGBA (composited on white, as a file with alpha is). Anything else -- floats,
    channels first, other channel counts -- is refused with what to give instead, rather than
    guessed at (a float array might hold 0-1 or 0-255)."""
    shape = "x".join(map(str, arr.shape))
    if arr.dtype != np.uint8:
        hint = " (e.g. (x * 255).round().astype(np.uint8) for floats in 0-1)" if arr.dtype.kind == "f" else ""
        raise ImageError(f"{name}: a {arr.dtype} array; give uint8 pixels 0-255{hint}")
    if arr.ndim == 3 and arr.shape[0] in (1, 3, 4) and arr.shape[2] not in (1, 3, 4):
        raise ImageError(f"{name}: shape {shape} looks channels-first; give (H, W, 3) "
                         f"(x.transpose(1, 2, 0))")
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if not (arr.ndim == 2 or (arr.ndim == 3 and arr.shape[2] in (3, 4))):
        raise ImageError(f"{name}: shape {shape}; give (H, W, 3) RGB, (H, W) grey or (H, W, 4) RGBA")
    _check_size(arr.shape[1], arr.shape[0], name)
    return to_rgb(Image.fromarray(np.ascontiguousarray(arr)))  # uint8: L, RGB or RGBA by shape
