"""Property-based tests (Hypothesis) of every dataset reader: whatever a dataset file holds --
random bytes, broken encodings, near-valid lines, JSON of any shape, names that are no file
names -- a reader returns a dataset or raises DatasetError, one line naming the file; no other
exception escapes. Bounded here (FUZZ_EXAMPLES per test, derandomised); benchmarks/fuzz.py runs
them longer with fresh random examples."""

from __future__ import annotations

import json
import os
import tempfile
from datetime import timedelta
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from captionkit.data.datasets import CaptionDataset, DatasetError, load_dataset, read_coco, read_karpathy

FUZZ_EXAMPLES = int(os.environ.get("CAPTIONKIT_FUZZ_EXAMPLES", "30"))
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=timedelta(seconds=5), database=None,
                derandomize=not os.environ.get("CAPTIONKIT_FUZZ_RANDOM"),
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
IMAGES = ["a.jpg", "b.jpg", "c d.jpg", "é.jpg"]  # present in every fuzzed dataset's image folder

# names: real ones, odd but valid ones, and ones no file system takes (NUL, too long, a folder)
names = st.one_of(st.sampled_from(IMAGES), st.text(max_size=20), st.just("x" * 300 + ".jpg"),
                  st.sampled_from(["a\x00.jpg", "\ud800.jpg", "", ".", "..", "/", "sub/", "../a.jpg", "a.jpg/x"]))
captions = st.one_of(st.text(max_size=40), st.just("A dog runs ."))
scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10)
json_values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                                               max_size=4), max_leaves=12)


def anything(valid: st.SearchStrategy) -> st.SearchStrategy:
    """Mostly the valid value, sometimes any JSON value in its place."""
    return st.one_of(valid, valid, valid, json_values)


def encoded(text: st.SearchStrategy) -> st.SearchStrategy:
    """The text as UTF-8, in another encoding, or with random bytes spliced in."""
    def utf8(t: str) -> bytes:
        return t.encode(errors="surrogatepass")  # a lone surrogate becomes bytes UTF-8 refuses

    return st.one_of(text.map(utf8), text.map(lambda t: t.encode("utf-16", errors="surrogatepass")),
                     st.tuples(text, st.binary(max_size=16), text).map(lambda p: utf8(p[0]) + p[1] + utf8(p[2])),
                     st.binary(max_size=200))


def check(read, where: Path) -> CaptionDataset | None:
    """Call a reader: a dataset, or one DatasetError line naming ``where``; anything else fails."""
    try:
        return read()
    except DatasetError as e:
        msg = str(e)
        assert "\n" not in msg and str(where) in msg, f"not one line naming {where}: {msg!r}"
        return None


def _folder_with_images(root: Path, folder: str) -> Path:
    images = root / folder
    images.mkdir(parents=True)
    for n in IMAGES:
        (images / n).write_bytes(b"")  # the readers only look for the file
    return images


token_lines = st.one_of(st.tuples(names, st.integers(-2, 12), captions).map(lambda t: f"{t[0]}#{t[1]}\t{t[2]}"),
                        st.text(max_size=40))


@FUZZ
@given(token=encoded(st.lists(token_lines, max_size=12).map("\n".join)),
       split=st.one_of(st.none(), encoded(st.lists(names, max_size=5).map("\n".join))))
def test_flickr8k_token_file(token, split):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _folder_with_images(root, "Flicker8k_Dataset")
        (root / "Flickr8k.token.txt").write_bytes(token)
        if split is not None:
            (root / "Flickr_8k.trainImages.txt").write_bytes(split)
        check(lambda: load_dataset(root), root)


csv_rows = st.one_of(st.tuples(names, captions).map(lambda t: f'{t[0]},"{t[1]}"'),
                     st.tuples(names, captions).map(lambda t: f"{t[0]},{t[1]}"), st.text(max_size=40))


@FUZZ
@given(header=st.sampled_from(["image,caption", "Image, Caption", "caption,image", "", "image"]),
       body=encoded(st.lists(csv_rows, max_size=12).map("\n".join)), huge=st.booleans())
def test_kaggle_captions_csv(header, body, huge):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        _folder_with_images(root, "Images")
        tail = b'\na.jpg,"' + b"x" * 200_000 + b'"\n' if huge else b""  # over csv's field size limit
        (root / "captions.txt").write_bytes(header.encode() + b"\n" + body + tail)
        check(lambda: load_dataset(root), root / "captions.txt")


karpathy_images = st.lists(st.fixed_dictionaries({
    "filename": anything(names), "split": anything(st.sampled_from(["train", "val", "test", "restval", ""])),
    "sentences": anything(st.lists(st.fixed_dictionaries({"raw": anything(captions)}), max_size=3)),
}, optional={"filepath": anything(st.sampled_from(["", "sub", "..", "/"]))}) | json_values, max_size=5)


def check_json(doc, reader=None) -> None:
    """``doc`` as a JSON dataset file beside an image folder, read by load_dataset and, when
    given, by ``reader`` itself (as its other callers may)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        images = _folder_with_images(root, "images")
        path = root / "dataset.json"
        path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
        check(lambda: load_dataset(path, images), path)
        if reader is not None:
            check(lambda: reader(path, images), path)


@FUZZ
@given(doc=st.one_of(st.fixed_dictionaries({"images": anything(karpathy_images)},
                                           optional={"dataset": anything(st.text(max_size=8))}),
                     json_values, st.just("[" * 100_000 + "]" * 100_000), st.text(max_size=30)))
def test_karpathy_json(doc):
    check_json(doc, read_karpathy if isinstance(doc, dict) else None)


coco_docs = st.fixed_dictionaries({
    "images": anything(st.lists(st.fixed_dictionaries({"id": anything(st.integers(0, 3)), "file_name": anything(names)})
                                | json_values, max_size=4)),
    "annotations": anything(st.lists(st.fixed_dictionaries({"image_id": anything(st.integers(0, 4)),
                                                            "caption": anything(captions)}) | json_values, max_size=6)),
})


@FUZZ
@given(doc=st.one_of(coco_docs, st.fixed_dictionaries({"annotations": json_values})))
def test_coco_json(doc):
    check_json(doc, read_coco)


title_rows = st.one_of(st.tuples(st.text(max_size=20), names.map(lambda n: n.removesuffix(".jpg")))
                       .map(lambda t: f'"{t[0]}",{t[1]}'), st.text(max_size=40))


@FUZZ
@given(header=st.sampled_from(["Title,Image_Name", "\ufeffTitle,Image_Name", "Image_Name", "Title,Image_Name,Title", ""]),
       body=encoded(st.lists(title_rows, max_size=10).map("\n".join)),
       split_file=st.one_of(st.none(), json_values.map(json.dumps), st.binary(max_size=30).map(repr)))
def test_title_csv(header, body, split_file):
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        images = _folder_with_images(root, "images")
        path = root / "titles.csv"
        path.write_bytes(header.encode() + b"\n" + body)
        if split_file is not None:  # a saved split beside it, of any shape
            (root / "titles.split.json").write_text(split_file)
        check(lambda: load_dataset(path, images), root)  # (the error may name the split file)
