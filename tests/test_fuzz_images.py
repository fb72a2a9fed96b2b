"""Property-based tests (Hypothesis) of the image loader: random bytes, real images of every
format and colour mode, the same truncated, bit-flipped or spliced, and headers that declare
huge or zero sizes. ``load_rgb`` returns an RGB image of a usable size or raises ImageError,
one line naming the file; no other exception escapes. Bounded here (see test_fuzz_datasets
for the settings); benchmarks/fuzz.py runs it longer."""

from __future__ import annotations

import io
import struct
import tempfile
import zlib
from pathlib import Path

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from PIL import Image
from test_fuzz_datasets import FUZZ

from captionkit.data.images import MAX_PIXELS, MIN_SIDE, ImageError, load_rgb

# (format, colour mode) pairs Pillow writes
SAVES = [("PNG", m) for m in ("RGB", "RGBA", "L", "LA", "P", "1", "I;16")] + \
        [("JPEG", m) for m in ("RGB", "L", "CMYK")] + [("GIF", "P"), ("GIF", "L"), ("BMP", "RGB"), ("BMP", "P")] + \
        [("TIFF", m) for m in ("RGB", "RGBA", "CMYK", "F", "I;16", "I", "1")] + [("WEBP", "RGB"), ("WEBP", "RGBA")]


@st.composite
def images(draw) -> bytes:
    fmt, mode = draw(st.sampled_from(SAVES))
    w, h = draw(st.integers(1, 48)), draw(st.integers(1, 48))
    pixels = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).integers(0, 256, (h, w, 3), dtype=np.uint8)
    im = Image.fromarray(pixels, "RGB").convert(mode if mode not in ("I;16", "I", "F") else "L")
    if mode in ("I;16", "I", "F"):
        im = im.convert("I").point(lambda v: v * 257) if mode != "F" else im.convert("F")
        im = im.convert(mode) if mode == "I;16" else im
    out = io.BytesIO()
    im.save(out, fmt)
    return out.getvalue()


def _png_with_size(data: bytes, w: int, h: int, fix_crc: bool) -> bytes:
    """A PNG whose IHDR declares w x h (its CRC fixed, or left wrong)."""
    ihdr = data[12:16] + struct.pack(">II", w, h) + data[24:29]
    crc = struct.pack(">I", zlib.crc32(ihdr)) if fix_crc else data[29:33]
    return data[:16] + struct.pack(">II", w, h) + data[24:29] + crc + data[33:]


sizes = st.one_of(st.integers(0, 2**31 - 1), st.sampled_from([0, 1, 7, 8, 9459, 9460, 20000, 65535, 2**31 - 1]))


@st.composite
def damaged(draw) -> bytes:
    data = bytearray(draw(images()))
    how = draw(st.sampled_from(["truncate", "flip", "splice", "size"]))
    if how == "truncate":
        return bytes(data[:draw(st.integers(0, max(len(data) - 1, 0)))])
    if how == "flip":
        for _ in range(draw(st.integers(1, 8))):
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        return bytes(data)
    if how == "splice":
        i = draw(st.integers(0, len(data)))
        return bytes(data[:i]) + draw(st.binary(min_size=1, max_size=64)) + bytes(data[i:])
    w, h = draw(sizes), draw(sizes)  # a header that declares another size than the data holds
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return _png_with_size(bytes(data), w, h, draw(st.booleans()))
    if data[:2] == b"BM":
        return bytes(data[:18]) + struct.pack("<ii", w, h) + bytes(data[26:])
    if data[:3] == b"GIF":
        return bytes(data[:6]) + struct.pack("<HH", w & 0xFFFF, h & 0xFFFF) + bytes(data[10:])
    return bytes(data)


def check_load(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "photo.img"
        path.write_bytes(data)
        try:
            im = load_rgb(path)
        except ImageError as e:
            msg = str(e)
            assert "\n" not in msg and msg.startswith(f"{path}: "), f"not one line naming the file: {msg!r}"
            return
        assert im.mode == "RGB" and min(im.size) >= MIN_SIDE and im.size[0] * im.size[1] <= MAX_PIXELS


@FUZZ
@given(data=st.binary(max_size=4096))
def test_random_bytes(data):
    check_load(data)


@FUZZ
@given(data=images())
def test_every_format_and_mode_loads_or_is_refused_in_one_line(data):
    check_load(data)


@FUZZ
@given(data=damaged())
def test_truncated_corrupted_or_lying_images(data):
    check_load(data)
