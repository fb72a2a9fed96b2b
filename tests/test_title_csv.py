"""Title datasets from a CSV in the Epicurious layout: cleaning report, saved split, errors,
cased words for subword models, scores, and a training config that reads one."""

import json
import os
from pathlib import Path

import pytest
from helpers import TINY_CONFIG, shape_image

from captionkit.cli.main import main
from captionkit.core.cache import cache_dir
from captionkit.data import datasets as data
from captionkit.data.datasets import DatasetError, cased_words, load_dataset, read_title_csv
from captionkit.training.config import DataConfig, RunConfig

HEADER = ",Title,Ingredients,Instructions,Image_Name,Cleaned_Ingredients"
TITLES = ["Miso-Butter Roast Chicken With Acorn Squash Panzanella", "Crispy Salt and Pepper Potatoes",
          "Thanksgiving Mac and Cheese", "Italian Sausage and Bread Stuffing", "Newton's Law",
          "Warm Comfort", "Apples and Oranges", "Kale and Pumpkin Falafels", "Pickled Cranberry Sauce",
          "Blue-Cheese Dressing", "Roasted Carrots With Dukkah", "Mom's Sweet Potato Pie"]


def _row(i, title, image) -> str:
    # ingredients and instructions hold quoted newlines and commas, as in the real file
    return f'{i},"{title}","[\'1 lemon\',\n\'2 cups flour, sifted\']","Heat the oven.\nBake.",{image},"[\'lemon\']"'


def names(ds) -> dict[str, list[str]]:
    return {split: [it.name for it in items] for split, items in ds.splits.items()}


def write_recipes(root: Path, titles=TITLES, extra_rows=()) -> Path:
    """recipes.csv and Food Images/: one image per title (img-k.jpg), then ``extra_rows``."""
    images = root / "Food Images"
    images.mkdir(parents=True, exist_ok=True)
    rows = [HEADER]
    for k, title in enumerate(titles):
        name = f"img-{k}"
        if not (images / f"{name}.jpg").exists():
            shape_image(k, size=48).save(images / f"{name}.jpg")
        rows.append(_row(k, title, name))
    rows += [_row(len(titles) + j, t, im) for j, (t, im) in enumerate(extra_rows)]
    csv = root / "recipes.csv"
    csv.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return csv


# each row spans 3 lines; the header is line 1, so data row r starts on line 2 + 3r
PROBLEMS = [("", "img-3"),              # row 12, line 38: no title
            ("   ", "img-4"),           # row 13, line 41: a blank title
            ("Ghost Pie", "#NAME?"),    # row 14, line 44: a spreadsheet's error value, no such image
            ("Lost Cake", "img-99"),    # row 15, line 47: image not there
            ("Warm Comfort", "img-5"),  # row 16, line 50: img-5 again
            ("Other Title", "img-0"),   # row 17, line 53: img-0 again, another title
            ("No Image", "")]           # row 18, line 56: no image name


def test_cleaning_report_counts_and_shows_each_problem_on_one_line(tmp_path, capsys):
    csv = write_recipes(tmp_path, extra_rows=PROBLEMS)
    ds = read_title_csv(csv, tmp_path / "Food Images")
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"{csv}: 19 rows, 12 images with a title kept"
    assert err[1] == "  2 rows without a title: line 38 (img-3.jpg), line 41 (img-4.jpg)"
    assert err[2] == (f"  3 rows whose image does not exist under {tmp_path / 'Food Images'}: "
                      "line 44 (#NAME?.jpg), line 47 (img-99.jpg), line 56 (no image name)")
    assert err[3] == ("  2 rows repeating an image (the first row is kept): "
                      "line 50 (img-5.jpg, first on line 17), line 53 (img-0.jpg, first on line 2)")
    assert err[4] == f"  10 train, 1 dev, 1 test: new seeded split (seed 0), saved in {tmp_path / 'recipes.split.json'}"
    assert len(err) == 5
    items = {it.name: it for it in ds.all_items()}
    assert len(items) == 12 and items["img-0.jpg"].raw == [TITLES[0]]  # one reference, the first row's
    assert items["img-0.jpg"].path == tmp_path / "Food Images" / "img-0.jpg"


def test_many_problems_show_three_examples_then_dots(tmp_path, capsys):
    csv = write_recipes(tmp_path, extra_rows=[("", f"img-{k}") for k in range(5)])
    read_title_csv(csv, tmp_path / "Food Images")
    line = capsys.readouterr().err.splitlines()[1]
    assert line.startswith("  5 rows without a title: line 38 (img-0.jpg), line 41 (img-1.jpg), line 44") and \
        line.endswith(", ...")


def test_titles_keep_case_and_hyphens_for_subword_models():
    title = "Miso-Butter Roast Chicken, With \"Acorn\" Squash & Mom's Pie!"
    assert cased_words(title) == ["Miso-Butter", "Roast", "Chicken", "With", "Acorn", "Squash", "Mom's", "Pie"]
    item = data.ImageItem("a.jpg", Path("a.jpg"), [title])
    assert item.words("karpathy") == item.tokens == [["misobutter", "roast", "chicken", "with", "acorn", "squash",
                                                       "moms", "pie"]]
    assert item.words("cased") == [cased_words(title)]
    with pytest.raises(ValueError, match="data.words must be one of karpathy, cased, not 'upper'"):
        DataConfig(dataset="x.csv", words="upper")


def test_split_is_seeded_saved_and_reused_and_survives_csv_changes(tmp_path, capsys):
    csv = write_recipes(tmp_path)
    images = tmp_path / "Food Images"
    first = names(load_dataset(csv, images))
    saved = json.loads((tmp_path / "recipes.split.json").read_text())
    assert saved["seed"] == 0 and saved["splits"] == first
    assert [len(first[s]) for s in ("train", "dev", "test")] == [10, 1, 1]
    # another folder, the same CSV: the same split without the file
    other = write_recipes(tmp_path / "copy")
    assert names(load_dataset(other, tmp_path / "copy" / "Food Images")) == first
    capsys.readouterr()
    assert names(load_dataset(csv, images)) == first
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"split from {tmp_path / 'recipes.split.json'}")
    # the CSV changes: 8 recipes more, the first one gone; old images keep their split
    more = TITLES + [f"New Dish {k}" for k in range(8)]
    write_recipes(tmp_path, titles=more)
    rows = csv.read_text().split("\n")
    csv.write_text("\n".join(rows[:1] + rows[4:]))  # drop img-0's three lines
    second = names(load_dataset(csv, images))
    note = capsys.readouterr().err.splitlines()[-1]
    assert note.endswith(f"split from {tmp_path / 'recipes.split.json'}, 8 new images assigned, "
                         f"saved in {tmp_path / 'recipes.split.json'}")
    where = {n: s for s, ns in second.items() for n in ns}
    assert "img-0.jpg" not in where and all(where[n] == s for s, ns in first.items() for n in ns if n != "img-0.jpg")
    assert [len(second[s]) for s in ("train", "dev", "test")] == [15, 2, 2]  # 10% of 19, rounded
    was = next(s for s, ns in first.items() if "img-0.jpg" in ns)
    kept = json.loads((tmp_path / "recipes.split.json").read_text())["splits"]
    assert "img-0.jpg" in kept[was]  # gone from the CSV, still recorded: it keeps its split if it returns


def test_split_goes_to_the_cache_when_the_csv_folder_is_not_writable(tmp_path, monkeypatch, capsys):
    csv = write_recipes(tmp_path)
    real_replace = os.replace

    def refuse_beside_csv(src, dst):
        if Path(dst).parent == tmp_path:
            raise PermissionError(13, "Permission denied", str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", refuse_beside_csv)  # the os module data/datasets.py writes through
    first = names(load_dataset(csv, tmp_path / "Food Images"))
    note = capsys.readouterr().err.splitlines()[-1]
    cached = Path(note.rsplit("saved in ", 1)[1])
    assert cached.is_file() and cached.parent == cache_dir("splits") and cached.name.startswith("recipes-")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Food Images", "recipes.csv"]  # no temporary left
    assert names(load_dataset(csv, tmp_path / "Food Images")) == first
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"split from {cached}")


def test_bad_csvs_get_one_line_naming_the_file_and_column(tmp_path):
    csv = write_recipes(tmp_path)
    images = tmp_path / "Food Images"
    with pytest.raises(DatasetError, match=r"recipes.csv: no title column 'Name' \(its columns: '', 'Title', "):
        read_title_csv(csv, images, title_column="Name")
    with pytest.raises(DatasetError, match=r"recipes.csv: no image-name column 'image'"):
        load_dataset(csv, images, image_column="image")
    with pytest.raises(DatasetError, match=r"recipes.csv: a CSV dataset needs --images"):
        load_dataset(csv)
    with pytest.raises(DatasetError, match=r"recipes.csv: no usable row \(is .* the image folder, and '.png'"):
        read_title_csv(csv, images, image_suffix=".png")
    binary = tmp_path / "photo.csv"
    binary.write_bytes((images / "img-0.jpg").read_bytes())
    with pytest.raises(DatasetError, match=r"photo.csv: not a CSV file \(not UTF-8 text\)"):
        load_dataset(binary, images)
    empty = tmp_path / "empty.csv"
    empty.write_text("")
    with pytest.raises(DatasetError, match=r"empty.csv: empty file"):
        load_dataset(empty, images)
    (tmp_path / "recipes.split.json").write_text('{"seed": 0, "splits": {"holdout": []}}')
    with pytest.raises(DatasetError, match=r"recipes.split.json: not a split file"):
        load_dataset(csv, images)


def test_score_reads_a_title_csv_and_reports_the_references_metrics(tmp_path, capsys):
    csv = write_recipes(tmp_path)
    test = load_dataset(csv, tmp_path / "Food Images").split("test")
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps({it.name: it.raw[0].lower() for it in test}))
    capsys.readouterr()
    assert main(["score", "--captions", str(caps), "--dataset", str(csv), "--images", str(tmp_path / "Food Images"),
                 "--split", "test", "--json", str(tmp_path / "scores.json"), "--tokenizer", "python",
                 "--meteor", "none"]) == 0  # the METEOR jar's start-up takes a minute on a busy machine
    scores = json.loads((tmp_path / "scores.json").read_text())
    assert {"Bleu_1", "Bleu_2", "ROUGE_L", "CIDEr"} <= set(scores)
    assert scores["Bleu_1"] == pytest.approx(100.0) and scores["ROUGE_L"] == pytest.approx(100.0)  # case-blind
    # other column names and suffixes, from the command line
    (tmp_path / "renamed.csv").write_text(csv.read_text().replace(",Title,", ",name,", 1))
    renamed = ["score", "--captions", str(caps), "--dataset", str(tmp_path / "renamed.csv"),
               "--images", str(tmp_path / "Food Images"), "--metrics", "bleu", "--tokenizer", "python"]
    assert main(renamed + ["--title-column", "name"]) == 0
    assert main(renamed) == 2
    assert "renamed.csv: no title column 'Title'" in capsys.readouterr().err


@pytest.mark.slow  # a training run
def test_a_training_config_reads_a_title_csv_with_cased_words(tmp_path):
    from captionkit.core.checkpoint import read_config
    from captionkit.training.run import train
    csv = write_recipes(tmp_path)
    cfg = TINY_CONFIG.format(dataset=csv).replace(
        'min_count = 1', f'min_count = 1\nimages = "{tmp_path / "Food Images"}"\nwords = "cased"')
    path = tmp_path / "titles.toml"
    path.write_text(cfg)
    assert RunConfig.load(path).data.words == "cased"
    train(path, out=tmp_path / "run", max_steps=2, progress=False)
    words = read_config(tmp_path / "run" / "last")["vocab"]
    assert "Miso-Butter" in words and "Mom's" in words and "misobutter" not in words


def test_score_image_column_and_suffix_name_the_images(tmp_path, capsys):
    """--image-column and --image-suffix: which column names the images and how their files end;
    the references are found through them, and not without them."""
    from PIL import Image
    csv = write_recipes(tmp_path)
    test = load_dataset(csv, tmp_path / "Food Images").split("test")
    pngs = tmp_path / "pngs"
    pngs.mkdir()
    for p in (tmp_path / "Food Images").iterdir():
        Image.open(p).save(pngs / f"{p.stem}.png")
    (tmp_path / "photos.csv").write_text(csv.read_text().replace(",Image_Name,", ",photo,", 1))
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps({f"{Path(it.name).stem}.png": it.raw[0] for it in test}))
    argv = ["score", "--captions", str(caps), "--dataset", str(tmp_path / "photos.csv"), "--images", str(pngs),
            "--split", "test", "--metrics", "bleu", "--tokenizer", "python", "--json", str(tmp_path / "s.json")]
    assert main(argv + ["--image-column", "photo", "--image-suffix", ".png"]) == 0
    assert json.loads((tmp_path / "s.json").read_text())["Bleu_1"] == pytest.approx(100.0)
    capsys.readouterr()
    assert main(argv + ["--image-suffix", ".png", "--overwrite"]) == 2
    assert "no image-name column 'Image_Name'" in capsys.readouterr().err
    assert main(argv + ["--image-column", "photo", "--overwrite"]) == 2  # img-k.jpg: not in pngs/
    assert "pngs" in capsys.readouterr().err
