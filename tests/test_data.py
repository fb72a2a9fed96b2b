import json
from pathlib import Path

import pytest
from helpers import shape_image

from captionkit.data.datasets import DatasetError, load_dataset, normalize, read_flickr8k
from captionkit.data.vocab import Vocab


def _images(folder: Path, names: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i, n in enumerate(names):
        shape_image(i).save(folder / n)


def test_normalize_is_karpathy_style():
    assert normalize("A dog, running!  In the PARK.") == ["a", "dog", "running", "in", "the", "park"]
    assert normalize("Man's hat") == ["mans", "hat"]


def test_flickr8k_reader_skips_missing_images_and_reports_malformed_lines(tmp_path, capsys):
    _images(tmp_path / "Flicker8k_Dataset", ["a.jpg", "b.jpg", "c.jpg"])
    (tmp_path / "Flickr8k.token.txt").write_text(
        "a.jpg#0\tA dog runs .\n"
        "a.jpg#1\tA brown dog .\n"
        "b.jpg#0\tTwo cats sleep .\n"
        "this line has no tab\n"
        "c.jpg#0\tA bird .\n"
        "gone.jpg#0\tAn image that is not there .\n"
        "gone.jpg#1\tStill not there .\n"
        "2258277193_586949ec62.jpg.1#0\tThe known bogus key .\n")
    (tmp_path / "Flickr_8k.trainImages.txt").write_text("a.jpg\nb.jpg\ngone.jpg\n")
    (tmp_path / "Flickr_8k.devImages.txt").write_text("c.jpg\n")
    (tmp_path / "Flickr_8k.testImages.txt").write_text("")
    ds = read_flickr8k(tmp_path)
    err = capsys.readouterr().err
    assert f"{tmp_path / 'Flickr8k.token.txt'}:4: malformed line" in err
    # gone.jpg is in the train split; the bogus key is in none, so it would be left out anyway
    assert err.count("missing") == 1 and "2258277193" not in err
    assert (f"flickr8k: skipped 2 captions of 1 image whose file is missing under {tmp_path / 'Flicker8k_Dataset'} "
            f"(train 1)\n") in err
    assert [it.name for it in ds.split("train")] == ["a.jpg", "b.jpg"]
    assert ds.split("val")[0].raw == ["A bird ."]  # 'val' is an alias of dev
    assert ds.split("train")[0].tokens == [["a", "dog", "runs"], ["a", "brown", "dog"]]
    assert ds.split("test") == []


def test_kaggle_reader_with_quoted_commas_and_malformed_rows(tmp_path, capsys):
    _images(tmp_path / "Images", [f"{i}.jpg" for i in range(12)])
    rows = ["image,caption", '0.jpg,"A dog, a cat and a bird ."', "1.jpg,A man rides a bike .", "2.jpg", ",empty name"]
    rows += [f"{i}.jpg,Caption number {i} ." for i in range(3, 12)] + ["missing.jpg,Nothing here ."]
    (tmp_path / "captions.txt").write_text("\n".join(rows) + "\n")
    ds = load_dataset(tmp_path)
    err = capsys.readouterr().err
    assert f"{tmp_path / 'captions.txt'}:4: malformed line" in err
    assert f"{tmp_path / 'captions.txt'}:5: malformed line" in err
    assert "skipped 1 caption of 1 image whose file is missing under" in err  # no split files: every image counts
    items = {it.name: it for split in ds.splits.values() for it in split}
    assert items["0.jpg"].raw == ["A dog, a cat and a bird ."]
    assert "2.jpg" not in items
    # no split files beside it: a seeded split, the same every time
    assert {k: [i.name for i in v] for k, v in ds.splits.items()} == \
        {k: [i.name for i in v] for k, v in load_dataset(tmp_path).splits.items()}
    assert sum(len(v) for v in ds.splits.values()) == 11


def test_kaggle_reader_rejects_a_wrong_header(tmp_path):
    (tmp_path / "Images").mkdir()
    (tmp_path / "captions.txt").write_text("file\ttext\n")
    with pytest.raises(DatasetError, match=r"captions.txt:1: expected the header"):
        load_dataset(tmp_path)


def test_karpathy_json_reader(tmp_path, capsys):
    _images(tmp_path / "imgs" / "val2014", ["x.jpg", "y.jpg"])
    doc = {"dataset": "coco", "images": [
        {"filepath": "val2014", "filename": "x.jpg", "split": "restval",
         "sentences": [{"raw": "A red bus.", "tokens": ["a", "red", "bus"]}]},
        {"filepath": "val2014", "filename": "y.jpg", "split": "test",
         "sentences": [{"raw": "Two dogs.", "tokens": ["two", "dogs"]}]},
        {"filepath": "val2014", "filename": "z.jpg", "split": "val", "sentences": [{"raw": "Gone."}]}]}
    path = tmp_path / "dataset_coco.json"
    path.write_text(json.dumps(doc))
    ds = load_dataset(path, tmp_path / "imgs")
    assert f"skipped 1 caption of 1 image whose file is missing under {tmp_path / 'imgs'} (dev 1)" in \
        capsys.readouterr().err
    assert [it.name for it in ds.split("train")] == ["x.jpg"]  # restval joins train
    assert ds.split("test")[0].raw == ["Two dogs."]


def test_coco_annotation_reader(tmp_path):
    _images(tmp_path / "train2014", ["p.jpg", "q.jpg"])
    doc = {"images": [{"id": 1, "file_name": "p.jpg"}, {"id": 2, "file_name": "q.jpg"}],
           "annotations": [{"image_id": 1, "caption": "A plane."}, {"image_id": 1, "caption": "A jet. "},
                           {"image_id": 2, "caption": "A boat."}]}
    path = tmp_path / "captions_train2014.json"
    path.write_text(json.dumps(doc))
    ds = load_dataset(path, tmp_path / "train2014")
    assert {it.name: it.raw for it in ds.split("train")} == {"p.jpg": ["A plane.", "A jet."], "q.jpg": ["A boat."]}
    doc["annotations"].append({"image_id": 99, "caption": "orphan"})
    path.write_text(json.dumps(doc))
    with pytest.raises(DatasetError, match=r"annotations\[3\]"):
        load_dataset(path, tmp_path / "train2014")


def test_invalid_json_names_the_line(tmp_path):
    path = tmp_path / "dataset_flickr8k.json"
    path.write_text('{"images": [\n  {oops}\n]}')
    with pytest.raises(DatasetError, match=r"dataset_flickr8k.json:2: invalid JSON"):
        load_dataset(path, tmp_path)


def test_vocab_min_count_top_k_and_round_trip():
    caps = [["a", "dog"], ["a", "cat"], ["a", "dog", "runs"], ["zebra"]]
    v = Vocab.build(caps, min_count=2)
    assert v.words == ["<pad>", "<start>", "<end>", "<unk>", "a", "dog"]
    assert Vocab.build(caps, min_count=1, top_k=2).words[4:] == ["a", "dog"]
    ids = v.encode(["a", "dog", "zebra"])
    assert ids == [v.start, 4, 5, v.unk, v.end]
    assert v.decode(ids + [4, 4]) == ["a", "dog", "<unk>"]
    again = Vocab.from_json(json.loads(json.dumps(v.to_json())))
    assert again.words == v.words and again.encode(["dog"]) == v.encode(["dog"])
    with pytest.raises(ValueError):
        Vocab(["a", "b"])
