"""Datasets as people keep them (issue 33, item 4): an imagefolder (metadata.jsonl or
metadata.csv, a split column or split folders), WebDataset tar shards and a Hugging Face
``datasets`` Dataset/DatasetDict (in memory or saved with save_to_disk) read into the dataset the
Flickr8k layout of the same photos and captions gives, and train the tiny model to the same
weights, byte for byte; each user's mistake is one line naming the file and row, before any
expensive work."""

from __future__ import annotations

import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import pytest
from helpers import TINY_CONFIG, local_ray, write_flickr8k
from hypothesis import given
from hypothesis import strategies as st
from test_fuzz_datasets import FUZZ, IMAGES, anything, captions, check, encoded, json_values, names

from captionkit.core.errors import DatasetError, UserError
from captionkit.data.datasets import load_dataset, read_flickr8k

HF_NAMES = {"train": "train", "dev": "validation", "test": "test"}  # captionkit's split -> Hugging Face's
ORDER = ("train", "dev", "test")


@pytest.fixture(scope="module")
def flickr(tmp_path_factory) -> Path:
    return write_flickr8k(tmp_path_factory.mktemp("flickr"))


@pytest.fixture(scope="module")
def ref(flickr):
    return read_flickr8k(flickr)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def contents(ds) -> dict:
    """What a dataset holds, whatever its layout: per split, each image's name, captions and bytes."""
    return {split: [(it.name, it.raw, digest(it.path)) for it in items] for split, items in ds.splits.items()}


# ---- the same data in each layout ----------------------------------------------------------------
def imagefolder_jsonl(ref, root: Path) -> Path:
    """One folder, metadata.jsonl: a list of captions per image and a split column."""
    root.mkdir()
    lines = []
    for split in ORDER:
        for it in ref.split(split):
            (root / it.name).write_bytes(it.path.read_bytes())
            lines.append(json.dumps({"file_name": it.name, "text": it.raw, "split": HF_NAMES[split]}))
    (root / "metadata.jsonl").write_text("\n".join(lines) + "\n")
    return root


def imagefolder_csv_split_folders(ref, root: Path) -> Path:
    """train/, validation/, test/, each with its metadata.csv: one row per caption, images in a subfolder."""
    for split in ORDER:
        folder = root / HF_NAMES[split]
        (folder / "photos").mkdir(parents=True)
        rows = ["file_name,caption"]
        for it in ref.split(split):
            (folder / "photos" / it.name).write_bytes(it.path.read_bytes())
            rows += [f'photos/{it.name},"{c}"' for c in it.raw]
        (folder / "metadata.csv").write_text("\n".join(rows) + "\n")
    return root


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def write_shard(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for key, members in samples:
            for ext, data in members.items():
                add_member(tar, f"{key}.{ext}", data)
    return path


def webdataset(ref, root: Path) -> Path:
    """Shards with the split in their names (train in two), each sample's five captions in a
    .json ``captions`` list, and a .cls member to ignore."""
    for split in ORDER:
        items = ref.split(split)
        chunks = [items[:5], items[5:]] if split == "train" else [items]
        for k, chunk in enumerate(chunks):
            write_shard(root / f"shapes-{HF_NAMES[split]}-{k:06d}.tar", [
                (it.name[:-4], {"jpg": it.path.read_bytes(), "json": json.dumps({"captions": it.raw}).encode(),
                                "cls": b"0"}) for it in chunk])
    return root


def hf_dict(ref):
    """A DatasetDict whose Image column holds the files' bytes and names (as a Hub dataset's parquet does)."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"image": datasets.Image(), "text": datasets.List(datasets.Value("string"))})
    return datasets.DatasetDict({HF_NAMES[s]: datasets.Dataset.from_dict(
        {"image": [{"bytes": it.path.read_bytes(), "path": it.name} for it in ref.split(s)],
         "text": [it.raw for it in ref.split(s)]}, features=features) for s in ORDER})


def hf_pil_rows(ref):
    """One Dataset of PIL images opened from the files, one row per caption, and a split column."""
    datasets = pytest.importorskip("datasets")
    from PIL import Image

    rows = [(it.path, c, HF_NAMES[s]) for s in ORDER for it in ref.split(s) for c in it.raw]
    return datasets.Dataset.from_dict({"image": [Image.open(p) for p, _, _ in rows],
                                       "caption": [c for _, c, _ in rows], "split": [s for _, _, s in rows]})


def hf_saved(ref, root: Path) -> Path:
    hf_dict(ref).save_to_disk(str(root))
    return root


def imagefolder_jsonl_in(ref, tmp: Path) -> Path:
    return imagefolder_jsonl(ref, tmp / "if")


def csv_folders_in(ref, tmp: Path) -> Path:
    return imagefolder_csv_split_folders(ref, tmp / "if")


LAYOUTS = {  # name -> (data from (ref, tmp folder), whether it is a path for [data] dataset)
    "imagefolder-jsonl": (imagefolder_jsonl_in, True),
    "imagefolder-csv-split-folders": (csv_folders_in, True),
    "webdataset": (lambda ref, tmp: webdataset(ref, tmp / "wds"), True),
    "datasets-dict-bytes": (lambda ref, tmp: hf_dict(ref), False),
    "datasets-pil-split-column": (lambda ref, tmp: hf_pil_rows(ref), False),
    "datasets-save-to-disk": (lambda ref, tmp: hf_saved(ref, tmp / "saved"), True),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_reads_as_the_flickr8k_layout_of_the_same_data(layout, ref, tmp_path):
    make, _ = LAYOUTS[layout]
    ds = load_dataset(make(ref, tmp_path))
    assert contents(ds) == contents(ref)


def hf_imagefolder_loader(make):
    """datasets' own imagefolder loader over one of the imagefolders above (it puts every row of
    a single metadata file in "train": captionkit takes the split column's)."""
    def load(ref, tmp: Path):
        datasets = pytest.importorskip("datasets")
        return datasets.load_dataset("imagefolder", data_dir=str(make(ref, tmp)), cache_dir=str(tmp / "hf-cache"))
    return load


@pytest.mark.parametrize("make", [hf_imagefolder_loader(imagefolder_jsonl_in), hf_imagefolder_loader(csv_folders_in)],
                         ids=["jsonl", "csv-split-folders"])
def test_datasets_own_imagefolder_loader_reads_the_same_layouts(make, ref, tmp_path):
    """The imagefolders captionkit reads are those datasets reads: through it, the same data."""
    assert contents(load_dataset(make(ref, tmp_path))) == contents(ref)


@pytest.fixture(scope="module")
def reference_weights(flickr, tmp_path_factory) -> bytes:
    from captionkit.training.run import train

    tmp = tmp_path_factory.mktemp("ref_run")
    config = tmp / "tiny.toml"
    config.write_text(TINY_CONFIG.format(dataset=flickr))
    train(config, out=tmp / "run", max_steps=4, progress=False)
    return (tmp / "run" / "last" / "model.safetensors").read_bytes()


@pytest.mark.slow  # a few training steps per layout (and its features)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layout_trains_the_tiny_model_to_the_same_weights(layout, ref, reference_weights, tmp_path):
    from captionkit.training.run import train

    make, is_path = LAYOUTS[layout]
    data = make(ref, tmp_path)
    config = tmp_path / "tiny.toml"
    if is_path:
        config.write_text(TINY_CONFIG.format(dataset=data))
        train(config, out=tmp_path / "run", max_steps=4, progress=False)
    else:  # the Python API: the object replaces [data] dataset, which the file leaves out
        config.write_text(TINY_CONFIG.replace('dataset = "{dataset}"\n', ""))
        train(config, out=tmp_path / "run", max_steps=4, progress=False, dataset=data)
    assert (tmp_path / "run" / "last" / "model.safetensors").read_bytes() == reference_weights
    saved = json.loads((tmp_path / "run" / "last" / "config.json").read_text())["train"]["data"]["dataset"]
    assert contents(load_dataset(saved)) == contents(ref)  # the run names data it can be read from again


# ---- imagefolder: a user's mistake is one line naming the file and row ----------------------------
def write_imagefolder(root: Path, metadata: str, name: str = "metadata.jsonl", images=("a.jpg", "b.jpg")) -> Path:
    from helpers import shape_image

    root.mkdir(parents=True, exist_ok=True)
    for k, image in enumerate(images):
        (root / image).parent.mkdir(parents=True, exist_ok=True)
        shape_image(k).save(root / image)
    (root / name).write_text(metadata)
    return root


def jsonl(*rows) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


JL, CSV = "metadata.jsonl", "metadata.csv"
IMAGEFOLDER_MISTAKES = [  # (the metadata file's text, its name, the message)
    (jsonl({"file_name": "a.jpg", "text": "a red circle"}, {"text": "a blue square"}), JL,
     r"metadata.jsonl:2: no 'file_name'$"),
    (jsonl({"file_name": "a.jpg", "text": "x"}, {"file_name": "gone.jpg", "text": "y"}), JL,
     r"metadata.jsonl:2: file_name 'gone.jpg': no such image file under .*if$"),
    (jsonl({"file_name": "a.jpg", "text": "  "}), JL, r"metadata.jsonl:1: 'text' is an empty caption$"),
    (jsonl({"file_name": "a.jpg", "caption": ["a red circle", ""]}), JL,
     r"metadata.jsonl:1: 'caption\[1\]' is an empty caption$"),
    (jsonl({"file_name": "a.jpg", "text": 3}), JL, r"metadata.jsonl:1: 'text' must be a caption"),
    (jsonl({"file_name": "a.jpg", "label": 3}), JL, r"metadata.jsonl:1: no caption: give 'text' or 'caption'$"),
    (jsonl({"file_name": "a.jpg", "text": "x", "caption": "y"}), JL, r"metadata.jsonl:1: 'text' and 'caption' both"),
    ('{"file_name": "a.jpg", "text": "x"}\n{"file_name": "b.jpg",\n', JL, r"metadata.jsonl:2: invalid JSON"),
    (jsonl({"file_name": "a.jpg", "text": "x", "split": "train"}, {"file_name": "b.jpg", "text": "y"}), JL,
     r"metadata.jsonl:2: no split, where .*metadata.jsonl:1 gives one \('train'\)"),
    (jsonl({"file_name": "a.jpg", "text": "x", "split": ""}), JL, r"metadata.jsonl:1: 'split' must name a split"),
    ("image,text\na.jpg,a red circle\n", CSV, r"metadata.csv: no 'file_name' column \(its columns: 'image', 'text'\)$"),
    ("file_name,label\na.jpg,3\n", CSV, r"metadata.csv: no caption column \(give 'text' or 'caption'"),
    ("file_name,text\na.jpg,a red circle\nb.jpg,\n", CSV, r"metadata.csv:3: 'text' is an empty caption$"),
    ('file_name,text\na.jpg,"a red\ncircle"\nnope.jpg,x\n', CSV, r"metadata.csv:4: file_name 'nope.jpg'"),
]


@pytest.mark.parametrize("metadata,name,message", IMAGEFOLDER_MISTAKES, ids=[m[2][:40] for m in IMAGEFOLDER_MISTAKES])
def test_an_imagefolder_mistake_is_one_line_naming_the_file_and_row(metadata, name, message, tmp_path):
    root = write_imagefolder(tmp_path / "if", metadata, name)
    with pytest.raises(DatasetError, match=message) as e:
        load_dataset(root)
    assert "\n" not in str(e.value)


def test_imagefolder_layouts_that_cannot_be_told_apart_are_refused(tmp_path):
    both = write_imagefolder(tmp_path / "both", jsonl({"file_name": "a.jpg", "text": "x"}))
    (both / "metadata.csv").write_text("file_name,text\na.jpg,x\n")
    with pytest.raises(DatasetError, match="both metadata.jsonl and metadata.csv; keep one"):
        load_dataset(both)
    rows = jsonl({"file_name": "x/a.jpg", "text": "x"}, {"file_name": "y/a.jpg", "text": "y"})
    twice = write_imagefolder(tmp_path / "twice", rows, images=("x/a.jpg", "y/a.jpg"))
    with pytest.raises(DatasetError, match=r"metadata.jsonl:2: .*y/a.jpg has the file name 'a.jpg' of .*x/a.jpg"):
        load_dataset(twice)
    mixed = write_imagefolder(tmp_path / "mixed", jsonl({"file_name": "a.jpg", "text": "x"}))
    write_imagefolder(mixed / "test", jsonl({"file_name": "b.jpg", "text": "y"}), images=("b.jpg",))
    with pytest.raises(DatasetError, match=r"a metadata.jsonl at the top and split folders with their own \(test/\)"):
        load_dataset(mixed)


def test_an_imagefolder_without_splits_is_split_by_a_seed_and_says_so(tmp_path, capsys):
    names = [f"p{k:02d}.jpg" for k in range(20)]
    rows = [{"file_name": n, "text": f"photo {k}"} for k, n in enumerate(names)]
    rows.append({"file_name": "p00.jpg", "text": "again"})
    root = write_imagefolder(tmp_path / "if", jsonl(*rows), images=names)
    ds = load_dataset(root)
    assert {k: len(v) for k, v in ds.splits.items()} == {"train": 16, "dev": 2, "test": 2}
    assert "no split given, so a seeded one: 16 train, 2 dev, 2 test images" in capsys.readouterr().err
    assert load_dataset(root).splits == ds.splits  # the same split every time
    assert next(it for it in ds.all_items() if it.name == "p00.jpg").raw == ["photo 0", "again"]  # rows joined


def test_a_bad_imagefolder_stops_training_before_any_expensive_work(tmp_path, monkeypatch):
    import captionkit.training.stages as stages
    from captionkit.training.run import train

    def expensive(*a, **k):
        raise AssertionError("expensive work started before the dataset was checked")

    monkeypatch.setattr(stages, "create_encoder", expensive)
    monkeypatch.setattr(stages, "build_features", expensive)
    root = write_imagefolder(tmp_path / "if", jsonl({"file_name": "a.jpg", "text": "x"},
                                                    {"file_name": "b.jpg", "text": ""}))
    config = tmp_path / "tiny.toml"
    config.write_text(TINY_CONFIG.format(dataset=root))
    with pytest.raises(DatasetError, match=r"metadata.jsonl:2: 'text' is an empty caption$"):
        train(config, out=tmp_path / "run", progress=False)


# ---- WebDataset ---------------------------------------------------------------------------------
def jpg(k: int = 0) -> bytes:
    from helpers import shape_image

    buf = io.BytesIO()
    shape_image(k).save(buf, "JPEG")
    return buf.getvalue()


WEBDATASET_MISTAKES = [
    ({"train-0.tar": [("a", {"jpg": jpg(), "txt": b"a red circle"}), ("b", {"jpg": jpg(1)})]},
     r"train-0.tar: sample 'b': no caption: give a .txt, or a .json with 'caption' or 'captions'$"),
    ({"train-0.tar": [("a", {"jpg": jpg(), "txt": b" \n"})]}, r"train-0.tar: sample 'a': '.txt' is an empty caption$"),
    ({"train-0.tar": [("a", {"jpg": jpg(), "json": b'{"caption": ""}'})]},
     r"train-0.tar: sample 'a': .json: 'caption' is an empty caption$"),
    ({"train-0.tar": [("a", {"jpg": jpg(), "json": b'{"url": "x"}'})]}, r"sample 'a': no caption: .*its .json has no"),
    ({"train-0.tar": [("a", {"jpg": jpg(), "png": jpg(), "txt": b"x"})]}, r"sample 'a': two images \(a.jpg, a.png\)"),
    ({"train-0.tar": [("x" * 300, {"jpg": jpg(), "txt": b"x"})]},
     r"train-0.tar: sample 'x+': its image's name is over 255 bytes"),
    ({"train-0.tar": [("a", {"txt": b"x"})]},
     r"train-0.tar: sample 'a': no image \(.jpg, .png, ...\) among its files$"),
    ({"train-0.tar": [("a", {"jpg": jpg(), "txt": b"x"})], "test-0.tar": [("a", {"jpg": jpg(), "txt": b"y"})]},
     r"train-0.tar: sample 'a' is named a.jpg, as a sample of .*test-0.tar is"),
    ({"train-0.tar": [("a", {"jpg": jpg(), "txt": b"x"})], "more-0.tar": [("b", {"jpg": jpg(), "txt": b"y"})]},
     r"more-0.tar: names no split .* where .*train-0.tar does \(train\)"),
]


@pytest.mark.parametrize("shards,message", WEBDATASET_MISTAKES, ids=[m[1][:40] for m in WEBDATASET_MISTAKES])
def test_a_webdataset_mistake_is_one_line_naming_the_shard_and_sample(shards, message, tmp_path, monkeypatch):
    monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / "cache"))
    for name, samples in shards.items():
        write_shard(tmp_path / "wds" / name, samples)
    with pytest.raises(DatasetError, match=message) as e:
        load_dataset(tmp_path / "wds")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "cache" / "webdataset").exists()  # every shard checked before any is unpacked


def test_a_shard_that_is_not_a_tar_is_named(tmp_path):
    (tmp_path / "train-0.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(DatasetError, match=r"train-0.tar: not a readable tar file"):
        load_dataset(tmp_path / "train-0.tar")


def test_a_shards_other_files_are_not_samples(tmp_path, monkeypatch):
    """Keys with folders, macOS's hidden ._ files, other kinds of image (.seg.png), .cls: ignored."""
    monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / "cache"))
    shard = write_shard(tmp_path / "train-0.tar", [("batch1/p0", {"jpg": jpg(0), "txt": b"a red circle\n",
                                                                  "seg.png": jpg(1), "cls": b"3"}),
                                                   ("batch1/._p0", {"jpg": b"AppleDouble"})])
    with tarfile.open(shard, "a") as tar:
        add_member(tar, "__meta__", b"x")
    items = load_dataset(shard).split("train")
    assert [(it.name, it.raw, it.path.read_bytes() == jpg(0)) for it in items] == [("p0.jpg", ["a red circle"], True)]


def test_shards_are_unpacked_once_and_again_when_they_change(tmp_path, monkeypatch):
    import captionkit.data.webdataset as wds

    monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / "cache"))
    shard = write_shard(tmp_path / "photos.tar", [(f"p{k}", {"jpg": jpg(k), "txt": f"photo {k}".encode()})
                                                  for k in range(10)])
    first = load_dataset(shard)
    assert sum(len(v) for v in first.splits.values()) == 10  # no split named: seeded, sample by sample
    item = first.all_items()[0]
    assert item.name == "p0.jpg" and item.path.read_bytes() == jpg(0) and item.raw == ["photo 0"]

    opened = []
    monkeypatch.setattr(wds.tarfile, "open", lambda *a, **k: opened.append(a) or pytest.fail("tar opened again"))
    assert load_dataset(shard).splits == first.splits and not opened  # the unpacked folder, the tar untouched
    monkeypatch.undo()

    monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / "cache"))
    write_shard(shard, [(f"p{k}", {"jpg": jpg(k), "txt": f"new {k}".encode()}) for k in range(10)])
    os.utime(shard, ns=(1, 1))  # (a rewrite within the clock's tick still differs in its time)
    assert load_dataset(shard).all_items()[0].raw == ["new 0"]


def test_features_of_shards_are_computed_from_their_images(tmp_path, monkeypatch):
    """captionkit features on shards: the store's images are the samples, by name."""
    from captionkit.cli import main as cli
    from captionkit.encoders import create_encoder
    from captionkit.encoders.features import build_features

    monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / "cache"))
    write_shard(tmp_path / "wds" / "train" / "0.tar", [(f"p{k}", {"jpg": jpg(k), "txt": b"x"}) for k in range(4)])
    write_shard(tmp_path / "wds" / "test" / "0.tar", [("q", {"png": jpg(5), "json": b'{"captions": ["y", "z"]}'})])
    ds = load_dataset(tmp_path / "wds")
    assert {k: [(it.name, it.raw) for it in v] for k, v in ds.splits.items()} == {
        "train": [(f"p{k}.jpg", ["x"]) for k in range(4)], "test": [("q.png", ["y", "z"])]}
    assert cli.main(["features", "--dataset", str(tmp_path / "wds"), "--encoder", "patches", "--workers", "0"]) == 0
    store = build_features(create_encoder("patches"), [it.path for it in ds.all_items()], progress=False)
    assert sorted(store.index) == ["p0.jpg", "p1.jpg", "p2.jpg", "p3.jpg", "q.png"]


@pytest.mark.slow  # starts a local Ray (~10 s)
def test_features_engine_ray_reads_the_shards_images(tmp_path, monkeypatch):
    """features --engine ray on shards: Ray's workers read the unpacked members, by name, as
    the local engine does."""
    import numpy as np

    from captionkit.cli import main as cli
    from captionkit.encoders import create_encoder
    from captionkit.encoders.features import ShardedFeatureStore, build_features
    monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / "cache"))
    write_shard(tmp_path / "wds" / "train-0.tar", [(f"p{k}", {"jpg": jpg(k), "txt": b"x"}) for k in range(5)])
    with local_ray():
        assert cli.main(["features", "--dataset", str(tmp_path / "wds"), "--encoder", "patches", "--engine", "ray",
                         "--shard-size", "2", "--batch-size", "2"]) == 0
    paths = [it.path for it in load_dataset(tmp_path / "wds").all_items()]
    store = build_features(create_encoder("patches"), paths, progress=False)  # the store Ray wrote
    assert isinstance(store, ShardedFeatureStore) and store.num_shards == 3
    names = [f"p{k}.jpg" for k in range(5)]
    assert sorted(store.index) == names
    local = build_features(create_encoder("patches"), paths, root=tmp_path / "local", progress=False, workers=0)
    np.testing.assert_array_equal(store.rows(names), local.rows(names))


# ---- datasets ------------------------------------------------------------------------------------
def test_a_datasets_mistake_is_one_line_naming_the_split_and_row(ref, tmp_path, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / "cache"))
    good = hf_dict(ref)
    no_text = good["train"].rename_column("text", "label")
    with pytest.raises(DatasetError, match=r"^the Dataset: no caption column 'text' or 'caption' \(its columns: "
                                           r"'image', 'label'\); give text_column=$"):
        load_dataset(no_text)
    bad = datasets.DatasetDict({**good, "validation": good["validation"].map(
        lambda row, i: {"text": ["a fine caption", " "] if i == 2 else row["text"]}, with_indices=True)})
    with pytest.raises(DatasetError,
                       match=r"^the DatasetDict's 'validation' split, row 2: 'text\[1\]' is an empty caption$"):
        load_dataset(bad)
    paths = datasets.Dataset.from_dict({"image": [str(tmp_path / "gone.jpg")], "text": ["x"]})
    with pytest.raises(DatasetError, match=r"^the Dataset, row 0: 'image' is '.*gone.jpg': no such image file$"):
        load_dataset(paths)
    with pytest.raises(UserError, match="streaming"):
        load_dataset(good["train"].to_iterable_dataset())
    assert not (tmp_path / "cache" / "datasets").exists()  # nothing written for data with a mistake


def test_datasets_data_is_written_once(ref, tmp_path, monkeypatch, capsys):
    pytest.importorskip("datasets")
    from captionkit.data.hf_datasets import as_imagefolder

    monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / "cache"))
    folder = as_imagefolder(hf_dict(ref))
    assert "15 images written to" in capsys.readouterr().err
    assert as_imagefolder(hf_dict(ref)) == folder and "written" not in capsys.readouterr().err
    changed = hf_dict(ref)
    changed["test"] = changed["test"].map(lambda row: {"text": row["text"][:4]})
    assert as_imagefolder(changed) != folder  # other captions, another folder


# ---- fuzzed: whatever the files hold, a dataset or one DatasetError line naming the file --------
splits = st.sampled_from(["train", "validation", "val", "test", "", "other"])
metadata_rows = st.fixed_dictionaries({}, optional={
    "file_name": anything(names), "text": anything(captions | st.lists(captions, max_size=3)),
    "caption": anything(captions), "split": anything(splits)}) | json_values


def _images(root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for n in IMAGES:
        (root / n).write_bytes(b"")  # the readers only look for the file


@FUZZ
@given(rows=encoded(st.lists(metadata_rows.map(json.dumps), max_size=8).map("\n".join)),
       csv_text=encoded(st.lists(st.lists(st.one_of(names, captions, splits), min_size=1, max_size=4)
                                 .map(",".join), max_size=8).map("\n".join)),
       header=st.sampled_from(["file_name,text", "file_name,caption,split", "file_name,text,caption", "image,text",
                               ""]))
def test_fuzzed_imagefolder(rows, csv_text, header):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "jsonl"
        _images(root)
        (root / "metadata.jsonl").write_bytes(rows)
        check(lambda: load_dataset(root), root)
        root = Path(tmp) / "csv"
        _images(root)
        (root / "metadata.csv").write_bytes(header.encode() + b"\n" + csv_text)
        check(lambda: load_dataset(root), root)


members = st.tuples(st.sampled_from(["a", "b", "sub/c", "", ".", "..", "x" * 300, "é", "a.b"]),
                    st.sampled_from(["jpg", "txt", "json", "png", "seg.png", "", "JPG", "cls"]),
                    st.one_of(encoded(captions), json_values.map(lambda v: json.dumps(v).encode()),
                              st.lists(captions, max_size=3).map(lambda c: json.dumps({"captions": c}).encode())))


@FUZZ
@given(shard_members=st.lists(members, max_size=8), name=st.sampled_from(["train-0.tar", "s.tar", "x.tgz"]))
def test_fuzzed_webdataset_shard(shard_members, name):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        mp.setenv("CAPTIONKIT_CACHE", str(Path(tmp) / "cache"))
        shard = Path(tmp) / name
        with tarfile.open(shard, "w:gz" if name.endswith("tgz") else "w") as tar:
            for key, ext, data in shard_members:
                add_member(tar, f"{key}.{ext}" if ext else key or "empty", data)
        check(lambda: load_dataset(shard), shard)
