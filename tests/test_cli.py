import json
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from helpers import shape_image
from PIL import Image

from captionkit.cli.main import main
from captionkit.data.images import ImageError, load_rgb


def _png_header_only(path: Path, w: int, h: int) -> None:
    """A PNG that claims w x h pixels: enough for a decompression-bomb check, 60 bytes on disk."""
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


@pytest.fixture(scope="module")
def photo_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("photos")
    base = shape_image(0, size=64)
    base.save(d / "good.jpg")
    base.convert("L").save(d / "gray.png")
    base.convert("RGBA").save(d / "rgba.png")
    base.convert("CMYK").save(d / "cmyk.jpg")
    Image.fromarray((np.asarray(base.convert("L"), dtype=np.uint16) * 257)).save(d / "deep16.png")
    Image.new("RGB", (1, 1)).save(d / "tiny.png")
    (d / "empty.jpg").write_bytes(b"")
    (d / "notes.jpg").write_text("this is not an image")
    full = (d / "good.jpg").read_bytes()
    (d / "truncated.jpg").write_bytes(full[: len(full) // 2])
    _png_header_only(d / "bomb.png", 30000, 30000)
    return d


GOOD = ["cmyk.jpg", "deep16.png", "good.jpg", "gray.png", "rgba.png"]
BAD = ["bomb.png", "empty.jpg", "notes.jpg", "tiny.png", "truncated.jpg"]


@pytest.mark.parametrize("name", GOOD)
def test_colour_modes_become_rgb(photo_dir, name):
    im = load_rgb(photo_dir / name)
    assert im.mode == "RGB" and im.size == (64, 64)


@pytest.mark.parametrize("name,why", [("bomb.png", "decompression bomb"), ("empty.jpg", "empty file"),
                                      ("notes.jpg", "cannot read image"), ("tiny.png", "too small"),
                                      ("truncated.jpg", "cannot read image"), ("absent.jpg", "no such file")])
def test_bad_images_get_one_line_naming_the_file(photo_dir, name, why):
    with pytest.raises(ImageError) as e:
        load_rgb(photo_dir / name)
    msg = str(e.value)
    assert msg.startswith(str(photo_dir / name)) and why in msg and "\n" not in msg


def test_caption_cli_captions_the_good_and_reports_the_bad(tiny_run, photo_dir, tmp_path, capsys):
    out_json, figs = tmp_path / "caps.json", tmp_path / "att"
    rc = main(["caption", str(photo_dir), "--model", str(tiny_run / "best"), "--beam", "2",
               "--json", str(out_json), "--attention", str(figs), "--batch-size", "3"])
    out, err = capsys.readouterr()
    assert rc == 1
    printed = dict(line.split("\t") for line in out.strip().splitlines())
    assert sorted(printed) == GOOD
    assert all(printed.values())
    assert json.loads(out_json.read_text()) == printed
    assert sorted(p.name for p in figs.iterdir() if p.suffix == ".png") == [n + ".png" for n in GOOD]
    err_lines = err.strip().splitlines()
    for name in BAD:
        assert sum(str(photo_dir / name) in l for l in err_lines) == 1
    assert err_lines[-1] == f"{len(BAD)} of {len(BAD) + len(GOOD)} images could not be captioned"
    assert "Traceback" not in err


def test_attention_figure_is_a_real_png(tiny_run, photo_dir, tmp_path):
    assert main(["caption", str(photo_dir / "good.jpg"), "--model", str(tiny_run / "best"),
                 "--attention", str(tmp_path)]) == 0
    im = Image.open(tmp_path / "good.jpg.png")
    assert im.format == "PNG" and im.width > 200 and im.height > 150


def test_cli_errors_are_one_line(tiny_run, tmp_path, capsys):
    assert main(["caption", str(tmp_path), "--model", str(tiny_run / "best")]) == 2
    assert "no image files found" in capsys.readouterr().err
    assert main(["caption", str(tmp_path), "--model", str(tmp_path / "nope")]) == 2
    bad_cfg = tmp_path / "x.toml"
    bad_cfg.write_text("[data\n")
    assert main(["train", "--config", str(bad_cfg)]) == 2
    err = capsys.readouterr().err
    assert "x.toml: invalid TOML" in err and "Traceback" not in err


@pytest.mark.slow  # evaluates a model and starts the scoring jars
def test_evaluate_and_score_end_to_end(tiny_run, flickr_dir, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["evaluate", "--model", str(tiny_run / "best"), "--dataset", str(flickr_dir),
                 "--split", "test", "--beam", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["split"] == "test" and doc["scale"] == "x100" and len(doc["captions"]) == 3
    assert {"Bleu_1", "Bleu_4", "ROUGE_L", "CIDEr"} <= set(doc["scores"])
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps(doc["captions"]))
    assert main(["score", "--captions", str(caps), "--dataset", str(flickr_dir), "--split", "test",
                 "--json", str(tmp_path / "s.json")]) == 0
    scored = json.loads((tmp_path / "s.json").read_text())
    assert {k: scored[k] for k in doc["scores"]} == doc["scores"]
    assert "coco-caption" in scored["implementation"]["CIDEr"]
    caps.write_text(json.dumps({**doc["captions"], "stray.jpg": "a cat"}))
    assert main(["score", "--captions", str(caps), "--dataset", str(flickr_dir)]) == 2
    assert "stray.jpg" in capsys.readouterr().err


@pytest.mark.slow  # a child process
def test_console_script_runs(tiny_run, photo_dir):
    r = subprocess.run([sys.executable, "-m", "captionkit.cli.main", "caption", str(photo_dir / "good.jpg"),
                        "--model", str(tiny_run / "best")], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("good.jpg\t")


def test_score_bootstrap_per_image_and_compare(tmp_path, capsys):
    refs = {f"i{k}.jpg": [f"a dog runs on the grass number {k}", "a dog is running", "the dog runs fast"]
            for k in range(30)}
    good = {k: v[0] for k, v in refs.items()}
    bad = {k: "a cat sleeps on a sofa" for k in refs}
    for name, caps in (("good", good), ("bad", bad)):
        (tmp_path / f"{name}.json").write_text(json.dumps(caps))
    (tmp_path / "refs.json").write_text(json.dumps(refs))
    assert main(["score", "--captions", str(tmp_path / "bad.json"), "--refs", str(tmp_path / "refs.json"),
                 "--bootstrap", "200", "--per-image", str(tmp_path / "pi.csv"), "--json", str(tmp_path / "s.json"),
                 "--metrics", "bleu,rouge,cider", "--tokenizer", "python"]) == 0
    out = capsys.readouterr().out
    assert "95% CI" in out and "PTB tokenizer (Python re-implementation)" in out
    doc = json.loads((tmp_path / "s.json").read_text())
    lo, hi = doc["ci95"]["CIDEr"]
    assert lo <= doc["CIDEr"] <= hi
    rows = (tmp_path / "pi.csv").read_text().splitlines()
    assert rows[0] == "image,caption,Bleu_4,ROUGE_L,CIDEr" and len(rows) == 31
    assert main(["score", "--compare", str(tmp_path / "good.json"), str(tmp_path / "bad.json"),
                 "--refs", str(tmp_path / "refs.json"), "--bootstrap", "200", "--metrics", "bleu,rouge,cider",
                 "--tokenizer", "python"]) == 0
    out = capsys.readouterr().out
    assert out.count("A beats B") == 6  # BLEU-1..4, ROUGE-L, CIDEr


# --- issue 17: caption's and zero-shot's options and outputs ------------------------------------

@pytest.mark.parametrize("argv,named", [
    (["caption", "x.jpg", "--batch-size", "-1"], "argument --batch-size: must be at least 1, got -1"),
    (["caption", "x.jpg", "--batch-size", "0"], "argument --batch-size: must be at least 1, got 0"),
    (["caption", "x.jpg", "--beam", "0"], "argument --beam: must be at least 1"),
    (["caption", "x.jpg", "--beam", "2.5"], "argument --beam: expected a whole number, got '2.5'"),
    (["caption", "x.jpg", "--workers", "-1"], "argument --workers: must be at least 0"),
    (["caption", "x.jpg", "--device", "gpu"], "argument --device: device must be auto"),
    (["features", "--dataset", "d", "--device", "cuda:x"], "argument --device: device must be auto"),
    (["caption", "x.jpg", "--length-penalty", "nan"], "argument --length-penalty: must be a finite number"),
    (["caption", "x.jpg", "--length-penalty", "-1"], "argument --length-penalty: must be at least 0"),
    (["zero-shot", "x.jpg", "--batch-size", "0"], "argument --batch-size: must be at least 1"),
    (["zero-shot", "x.jpg", "--max-new-tokens", "-5"], "argument --max-new-tokens: must be at least 1"),
])
def test_numeric_options_are_checked_by_the_parser(argv, named, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and named in err and "Traceback" not in err


def test_output_targets_are_checked_before_the_model_loads(photo_dir, tmp_path, capsys):
    """The model named does not exist: each run must fail on its output target first."""
    no_model = str(tmp_path / "no-such-model")
    folder = tmp_path / "some_folder"
    folder.mkdir()
    mine = tmp_path / "mine.json"
    mine.write_text("my notes")
    for argv, named in (
            (["--json", f"{folder}/"], "some_folder/: is a folder; give a file name to write"),
            (["--json", str(mine)], "mine.json: exists; pass --overwrite to replace it"),
            (["--jsonl", str(folder)], "some_folder: is a folder"),
            (["--csv", str(mine)], "mine.json: not a captionkit CSV"),
            (["--jsonl", str(mine)], "mine.json: not a captionkit JSONL file"),
            (["--json", str(tmp_path / "a.json"), "--jsonl", str(tmp_path / "a.json")], "given as more than one output"),
            (["--attention", str(photo_dir)], f"{photo_dir.name}: exists and is not empty; pass --overwrite")):
        assert main(["caption", str(photo_dir), "--model", no_model, *argv]) == 2
        err = capsys.readouterr().err
        assert named in err and err.count("\n") == 1, (argv, err)
    assert main(["zero-shot", str(photo_dir), "--model", no_model, "--json", str(mine)]) == 2
    assert "mine.json: exists; pass --overwrite" in capsys.readouterr().err
    assert mine.read_text() == "my notes" and sorted(p.name for p in tmp_path.iterdir()) == ["mine.json", "some_folder"]


def test_json_is_replaced_only_with_overwrite(tiny_run, photo_dir, tmp_path, capsys):
    out = tmp_path / "caps.json"
    out.write_text("{}")
    args = ["caption", str(photo_dir / "good.jpg"), "--model", str(tiny_run / "best"), "--json", str(out)]
    assert main(args) == 2 and out.read_text() == "{}"
    assert main(args + ["--overwrite"]) == 0
    assert list(json.loads(out.read_text())) == ["good.jpg"] and [p.name for p in tmp_path.iterdir()] == ["caps.json"]


@pytest.mark.slow  # a child process: Python, torch and the model start again (about 5 s)
def test_a_closed_stdout_ends_the_command_quietly(tiny_run, photo_dir):
    """`captionkit caption DIR | head -1`: here the reader has gone before the first line."""
    import os

    r, w = os.pipe()
    os.close(r)
    p = subprocess.run([sys.executable, "-m", "captionkit", "caption", str(photo_dir), "--model", str(tiny_run / "best")],
                       stdout=w, stderr=subprocess.PIPE, text=True, timeout=300)
    os.close(w)
    assert p.returncode == 141  # 128 + SIGPIPE, what a shell shows for a command ended by its pipe
    assert "Traceback" not in p.stderr and "BrokenPipe" not in p.stderr and "Exception ignored" not in p.stderr


def test_evaluate_max_images_and_score_subset_say_how_many_were_scored(tiny_run, flickr_dir, tmp_path, capsys):
    """Issue 29, item 9: evaluate --max-images N scores the split's first N images; score
    --subset scores captions that cover part of a split, and both say how many."""
    fast = ["--tokenizer", "python", "--meteor", "none", "--metrics", "bleu,cider"]
    out = tmp_path / "eval.json"
    assert main(["evaluate", "--model", str(tiny_run / "best"), "--dataset", str(flickr_dir), "--beam", "1",
                 "--max-images", "2", "--out", str(out), *fast]) == 0
    assert capsys.readouterr().out.startswith("test split, 2 of its 3 images (--max-images), beam 1")
    doc = json.loads(out.read_text())
    assert list(doc["captions"]) == ["img012.jpg", "img013.jpg"]  # the split's first two, in its order
    assert (doc["max_images"], doc["images"], doc["split_images"]) == (2, 2, 3)
    caps = tmp_path / "caps.json"
    caps.write_text(json.dumps(doc["captions"]))
    score = ["score", "--captions", str(caps), "--dataset", str(flickr_dir), "--split", "test", *fast]
    assert main(score) == 2
    assert capsys.readouterr().err == (f"captionkit score: error: {caps}: captions 2 of the 3 images of {flickr_dir} "
                                       f"(test split); give --subset to score those 2\n")
    assert main([*score, "--subset", "--json", str(tmp_path / "s.json")]) == 0
    assert capsys.readouterr().out.startswith(f"2 of the 3 images of {flickr_dir} (test split) (--subset)\n")
    scored = json.loads((tmp_path / "s.json").read_text())
    assert {k: scored[k] for k in doc["scores"]} == doc["scores"] and scored["subset"] == {"images": 2, "of": 3}
