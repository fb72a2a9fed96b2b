"""Each option of the command line changes what its command does: the outputs of a run with it
are compared with those of a run without it (or with another value), and with what the library
computes when asked for the same thing directly. A test that only checked the exit status or the
keys of an output would pass with the option silently dropped (as --tta once was).

The models are the picky decoders (helpers.write_picky_decoder): their captions follow the pixels,
so a beam width, a length penalty, an ensemble's weights or MBR each change some of the picky
photos' captions; each test first checks that its two settings do differ there."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from helpers import cli_captions, direct_captions

import captionkit.inference.captioner as captioner_module
from captionkit.cli.main import main
from captionkit.data.datasets import load_dataset
from captionkit.inference.captioner import Captioner
from captionkit.inference.rerank import mbr_choice


def _photos(picky_data: Path) -> tuple[Path, list[Path]]:
    folder = picky_data / "Flicker8k_Dataset"
    return folder, sorted(folder.iterdir())


# ---- caption -------------------------------------------------------------------------------------
@pytest.mark.parametrize("option, values, to_kwargs", [
    ("--beam", ("1", "3"), lambda v: {"beam": int(v)}),
    ("--length-penalty", ("0", "2"), lambda v: {"length_penalty": float(v)}),
], ids=["beam", "length-penalty"])
def test_caption_decoding_options_change_the_captions(picky_models, picky_data, tmp_path, option, values, to_kwargs):
    a, _ = picky_models
    folder, paths = _photos(picky_data)
    cap = Captioner.load(a)
    want = [direct_captions(cap, paths, **to_kwargs(v)) for v in values]
    assert want[0] != want[1]  # the two values caption some of these photos differently
    for value, captions in zip(values, want):
        assert cli_captions(tmp_path, ["caption", str(folder), "--model", str(a), option, value]) == captions


def test_caption_weights_weigh_the_ensembles_members(picky_models, picky_data, tmp_path):
    a, b = picky_models
    folder, paths = _photos(picky_data)
    want = {w: direct_captions(Captioner.load_ensemble([a, b], [float(x) for x in w.split(",")]), paths)
            for w in ("4,1", "1,4")}
    assert want["4,1"] != want["1,4"]
    for w, captions in want.items():
        assert cli_captions(tmp_path, ["caption", str(folder), "--model", str(a), "--model", str(b),
                                       "--weights", w]) == captions


def test_caption_nbest_and_rerank_mbr(picky_models, picky_data, tmp_path):
    """--nbest N --candidates: each image's N best beams, the caption first; --rerank mbr: the
    consensus candidate of those N, which is not always the best beam."""
    a, _ = picky_models
    folder, paths = _photos(picky_data)
    top = cli_captions(tmp_path, ["caption", str(folder), "--model", str(a), "--nbest", "2",
                                  "--candidates", str(tmp_path / "two.json")])
    lists = json.loads((tmp_path / "two.json").read_text())
    assert top == direct_captions(Captioner.load(a), paths)  # the n-best lists begin with the beam's caption
    assert sorted(lists) == sorted(top) and all(len(v) == 2 and v[0] == top[k] for k, v in lists.items())
    want = {n: direct_captions(Captioner.load(a), paths, nbest=n, rerank="mbr") for n in (2, 5)}
    assert want[2] != want[5] and want[2] != top
    choice = mbr_choice(lists)  # one batch: the consensus among the lists written
    assert want[2] == {k: lists[k][i] for k, i in choice.items()}
    assert cli_captions(tmp_path, ["caption", str(folder), "--model", str(a), "--rerank", "mbr", "--nbest", "2"]) \
        == want[2]
    assert cli_captions(tmp_path, ["caption", str(folder), "--model", str(a), "--rerank", "mbr"]) == want[5]


def test_caption_batch_size_is_the_images_encoded_together(picky_models, picky_data, tmp_path, monkeypatch):
    a, _ = picky_models
    folder, paths = _photos(picky_data)
    sizes = []
    encode = Captioner.encode
    monkeypatch.setattr(Captioner, "encode", lambda self, pixels: sizes.append(len(pixels)) or encode(self, pixels))
    five = cli_captions(tmp_path, ["caption", str(folder), "--model", str(a), "--batch-size", "5"])
    assert sizes == [5, 5, 2]
    sizes.clear()
    assert cli_captions(tmp_path, ["caption", str(folder), "--model", str(a), "--batch-size", "12"]) == five
    assert sizes == [12]
    sizes.clear()
    _evaluate(picky_data, tmp_path, "--model", str(a), "--batch-size", "3")  # the 4 dev images
    assert sizes == [3, 1]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_caption_precision_is_the_decoding_precision(picky_models, picky_data, tmp_path, monkeypatch, precision):
    """--precision reaches the autocast of every encoder and decoder call (bf16 is accepted on any
    CPU: emulated where it is not native), and gives the library's captions at that precision."""
    a, _ = picky_models
    folder, paths = _photos(picky_data)
    want = direct_captions(Captioner.load(a, precision=precision), paths)
    used = []
    autocast = captioner_module.autocast
    monkeypatch.setattr(captioner_module, "autocast", lambda device, p: used.append(p) or autocast(device, p))
    assert cli_captions(tmp_path, ["caption", str(folder), "--model", str(a), "--device", "cpu",
                                   "--precision", precision]) == want
    assert used and set(used) == {precision}
    used.clear()
    dev = [it.path for it in load_dataset(str(picky_data)).split("dev")]
    doc = _evaluate(picky_data, tmp_path, "--model", str(a), "--device", "cpu", "--precision", precision)
    assert doc["captions"] == {k: v for k, v in want.items() if k in {p.name for p in dev}}
    assert used and set(used) == {precision}


# ---- evaluate ------------------------------------------------------------------------------------
def _evaluate(picky_data: Path, tmp_path: Path, *argv: str, split: str = "dev",
              metrics: str = "bleu,cider") -> dict:
    out = tmp_path / f"eval{len(list(tmp_path.glob('eval*.json')))}.json"
    assert main(["evaluate", *argv, "--dataset", str(picky_data), "--split", split, "--metrics", metrics,
                 "--tokenizer", "python", "--meteor", "none", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def test_evaluate_decoding_options_change_the_captions(picky_models, picky_data, tmp_path):
    """--beam, --length-penalty, --rerank mbr and --nbest: the dev captions evaluate scores are
    the library's under the same options, and each differs from the default's."""
    a, _ = picky_models
    dev = [it.path for it in load_dataset(str(picky_data)).split("dev")]
    cap = Captioner.load(a)
    default = direct_captions(cap, dev)
    assert _evaluate(picky_data, tmp_path, "--model", str(a))["captions"] == default
    for argv, options in ((["--beam", "1"], {"beam": 1}), (["--length-penalty", "2"], {"length_penalty": 2.0}),
                          (["--rerank", "mbr", "--nbest", "2"], {"nbest": 2, "rerank": "mbr"}),
                          (["--rerank", "mbr"], {"nbest": 5, "rerank": "mbr"})):
        want = direct_captions(cap, dev, **options)
        assert want != default, argv
        doc = _evaluate(picky_data, tmp_path, "--model", str(a), *argv)
        assert doc["captions"] == want, argv
    assert doc["mbr_nbest"] == 5 and doc["beam"] == 3


def test_evaluate_weights_weigh_the_ensembles_members(picky_models, picky_data, tmp_path):
    a, b = picky_models
    dev = [it.path for it in load_dataset(str(picky_data)).split("dev")]
    want = {w: direct_captions(Captioner.load_ensemble([a, b], [float(x) for x in w.split(",")]), dev)
            for w in ("4,1", "1,4")}
    assert want["4,1"] != want["1,4"]
    for w, captions in want.items():
        doc = _evaluate(picky_data, tmp_path, "--model", str(a), "--model", str(b), "--weights", w)
        assert doc["captions"] == captions


def test_evaluate_split_metrics_and_brevity_penalty(picky_models, picky_data, tmp_path):
    """--split chooses the images captioned and the references; --metrics the scores computed;
    --no-brevity-penalty raises BLEU for captions shorter than their references."""
    from captionkit.scoring.evaluation import score_captions
    a, _ = picky_models
    ds = load_dataset(str(picky_data))
    dev = _evaluate(picky_data, tmp_path, "--model", str(a))
    test = _evaluate(picky_data, tmp_path, "--model", str(a), split="test", metrics="rouge")
    assert sorted(dev["captions"]) == sorted(it.name for it in ds.split("dev"))
    assert sorted(test["captions"]) == sorted(it.name for it in ds.split("test")) and test["split"] == "test"
    assert set(dev["scores"]) == {"Bleu_1", "Bleu_2", "Bleu_3", "Bleu_4", "CIDEr"} and set(test["scores"]) == {"ROUGE_L"}
    refs = {it.name: it.raw for it in ds.split("test")}
    want = score_captions(test["captions"], refs, metrics=["rouge"], tokenizer="python", quiet=True).scores
    assert test["scores"]["ROUGE_L"] == pytest.approx(100 * want["ROUGE_L"], abs=1e-4)
    plain = _evaluate(picky_data, tmp_path, "--model", str(a), "--no-brevity-penalty")
    assert plain["captions"] == dev["captions"]
    assert plain["scores"]["Bleu_1"] > dev["scores"]["Bleu_1"]  # the captions are shorter than their references
    assert plain["scores"]["CIDEr"] == dev["scores"]["CIDEr"]


# ---- score ---------------------------------------------------------------------------------------
REFS = {f"i{k}.jpg": ["a brown dog runs on the green grass in the park", "a dog is running on grass",
                      "the dog runs fast across a field"] for k in range(20)}
CAPS = {k: ("a dog runs" if i % 2 else "a dog runs on the grass in a park") for i, k in enumerate(REFS)}


def _score(tmp_path: Path, *argv: str) -> dict:
    (tmp_path / "caps.json").write_text(json.dumps(CAPS))
    (tmp_path / "refs.json").write_text(json.dumps(REFS))
    out = tmp_path / f"score{len(list(tmp_path.glob('score*.json')))}.json"
    assert main(["score", "--captions", str(tmp_path / "caps.json"), "--refs", str(tmp_path / "refs.json"),
                 "--tokenizer", "python", "--metrics", "bleu,cider", "--json", str(out), *argv]) == 0
    return json.loads(out.read_text())


def test_score_no_brevity_penalty_and_seed(tmp_path):
    with_bp, without = _score(tmp_path), _score(tmp_path, "--no-brevity-penalty")
    assert without["Bleu_4"] > with_bp["Bleu_4"] and without["CIDEr"] == with_bp["CIDEr"]
    seeded = [_score(tmp_path, "--bootstrap", "50", "--seed", s)["ci95"] for s in ("0", "1", "1")]
    assert seeded[1] == seeded[2] and seeded[0] != seeded[1]  # the resamples follow --seed


def test_score_split_chooses_the_references(picky_data, tmp_path, capsys):
    """score --dataset D --split S scores against S's references: each split's own first
    references score 100; the dev captions against the test split are refused (other images)."""
    ds = load_dataset(str(picky_data))
    for split in ("dev", "test"):
        (tmp_path / f"{split}.json").write_text(json.dumps({it.name: it.raw[0] for it in ds.split(split)}))
        assert main(["score", "--captions", str(tmp_path / f"{split}.json"), "--dataset", str(picky_data),
                     "--split", split, "--metrics", "bleu", "--tokenizer", "python",
                     "--json", str(tmp_path / f"{split}.scores.json")]) == 0
        assert json.loads((tmp_path / f"{split}.scores.json").read_text())["Bleu_4"] == pytest.approx(100.0)
    capsys.readouterr()
    assert main(["score", "--captions", str(tmp_path / "dev.json"), "--dataset", str(picky_data), "--split", "test",
                 "--metrics", "bleu", "--tokenizer", "python"]) == 2
    assert "only in" in capsys.readouterr().err


def test_score_tokenizer_chooses_the_ptb_tokenizer(tmp_path):
    from captionkit.scoring.ptb_tokenize import java_available
    if not java_available():
        pytest.skip("Java is not installed: the PTB jar cannot run")
    python = _score(tmp_path)  # (--tokenizer python)
    java = _score(tmp_path, "--tokenizer", "java")
    assert "Python" in python["tokenizer"] and "Python" not in java["tokenizer"]
    assert java["tokenizer"] != python["tokenizer"]


# ---- features, ensemble, pack --------------------------------------------------------------------
def test_features_flip_caches_the_mirror_images_rows(picky_data, tmp_path, monkeypatch):
    from captionkit.data.images import load_rgb, to_tensor
    from captionkit.encoders import create_encoder

    def cached(name: str, *extra: str) -> np.ndarray:
        monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / name))
        assert main(["features", "--dataset", str(picky_data), "--encoder", "patches", "--workers", "0", *extra]) == 0
        feats, = (tmp_path / name).rglob("feats.npy")
        return np.load(feats)

    enc = create_encoder("patches")
    pixels = [to_tensor(load_rgb(it.path), enc.preprocess) for it in load_dataset(str(picky_data)).all_items()]
    mirrored = enc.encode_batch([x.flip(-1) for x in pixels]).numpy().astype(np.float16)
    assert not np.array_equal(mirrored, enc.encode_batch(pixels).numpy().astype(np.float16))
    assert np.array_equal(cached("flip", "--flip"), mirrored)
    assert np.array_equal(cached("plain"), enc.encode_batch(pixels).numpy().astype(np.float16))


def test_ensemble_combine_is_how_the_folder_combines(picky_models, picky_data, tmp_path):
    a, b = picky_models
    folder, paths = _photos(picky_data)
    want = {c: direct_captions(Captioner.load_ensemble([a, b], combine=c), paths) for c in ("linear", "loglinear")}
    assert want["linear"] != want["loglinear"]
    for combine, captions in want.items():
        out = tmp_path / combine
        assert main(["ensemble", "--model", str(a), "--model", str(b), "--combine", combine, "--out", str(out)]) == 0
        assert cli_captions(tmp_path, ["caption", str(folder), "--model", str(out)]) == captions


@pytest.mark.parametrize("option, dtype", [("--int8", "I8"), ("--fp16", "F16")])
def test_pack_stores_the_decoders_matrices_as_asked(picky_models, tmp_path, option, dtype):
    """pack --int8 / --fp16 store the decoder's matrices as int8 (with row scales) / float16:
    a smaller file than a plain pack's, and still the model (read back as float)."""
    import torch
    from safetensors import safe_open

    from captionkit.core.checkpoint import read_weights
    a, _ = picky_models

    def stored(folder: Path) -> dict[str, str]:
        with safe_open(folder / "model.safetensors", "pt") as f:
            return {k: f.get_slice(k).get_dtype() for k in f.keys()}

    assert main(["pack", str(a), str(tmp_path / "plain")]) == 0
    assert main(["pack", str(a), str(tmp_path / "packed"), option]) == 0
    assert set(stored(tmp_path / "plain").values()) == {"F32"} and dtype in stored(tmp_path / "packed").values()
    assert (tmp_path / "packed" / "model.safetensors").stat().st_size < \
        (tmp_path / "plain" / "model.safetensors").stat().st_size
    plain, packed = read_weights(tmp_path / "plain"), read_weights(tmp_path / "packed")
    assert plain.keys() == packed.keys()
    for k in plain:
        torch.testing.assert_close(packed[k].float(), plain[k], atol=0.02 * plain[k].abs().max().item() + 1e-6,
                                   rtol=0)


def test_caption_paths_from_captions_the_listed_images(picky_models, picky_data, tmp_path):
    a, _ = picky_models
    _, paths = _photos(picky_data)
    listing = tmp_path / "list.txt"
    listing.write_text("# two of them\n" + "\n".join(str(p) for p in paths[3:5]) + "\n")
    want = direct_captions(Captioner.load(a), [paths[0], *paths[3:5]])
    assert cli_captions(tmp_path, ["caption", str(paths[0]), "--paths-from", str(listing), "--model", str(a)]) == want


# ---- report --------------------------------------------------------------------------------------
def test_report_split_beam_and_images(picky_models, picky_data, tmp_path):
    """report --split chooses the images captioned and scored, --beam their beam width, --images
    how many the page shows: compared with the library's captions at each width."""
    from html.parser import HTMLParser

    from captionkit.core.checkpoint import read_config, read_weights, save_checkpoint
    a, _ = picky_models
    run = tmp_path / "run"  # a run folder of the picky model, trained (as it were) on the picky data
    save_checkpoint(run / "best", read_weights(a), {**read_config(a), "train": {"data": {"dataset": str(picky_data)}}})
    test = load_dataset(str(picky_data)).split("test")
    cap = Captioner.load(a)
    want = {beam: direct_captions(cap, [it.path for it in test], beam=beam) for beam in (1, 3)}
    assert want[1] != want[3]

    class Rows(HTMLParser):
        def __init__(self):
            super().__init__()
            self.rows = []

        def handle_starttag(self, tag, attrs):
            if tag == "tr" and "data-image" in dict(attrs):
                self.rows.append(dict(attrs)["data-image"])

    def report(name: str, *argv: str) -> tuple[dict, list[str]]:
        assert main(["report", str(run), "--out", str(tmp_path / f"{name}.html"), "--data", str(tmp_path / f"{name}.json"),
                     "--metrics", "bleu", "--tokenizer", "python", "--bootstrap", "0", *argv]) == 0
        page = Rows()
        page.feed((tmp_path / f"{name}.html").read_text())
        return json.loads((tmp_path / f"{name}.json").read_text()), page.rows

    saved, rows = report("greedy", "--split", "test", "--beam", "1", "--images", "1")
    assert saved["split"] == "test"
    assert saved["runs"][0]["captions"] == want[1]
    assert rows == [test[0].name]
    saved, rows = report("beam3", "--split", "test", "--images", "3")
    assert saved["runs"][0]["captions"] == want[3] and rows == [it.name for it in test[:3]]
    saved, _ = report("dev")
    assert saved["split"] == "dev" and sorted(saved["runs"][0]["captions"]) == \
        sorted(it.name for it in load_dataset(str(picky_data)).split("dev"))


# ---- train ---------------------------------------------------------------------------------------
@pytest.mark.slow  # two short training runs
def test_train_max_steps_and_init(tiny_config, tiny_run, tmp_path):
    """--max-steps stops the run after that many steps; --init starts it from that checkpoint
    (here at a learning rate too small to move it: the run's weights are the checkpoint's)."""
    import torch

    from captionkit.core.checkpoint import read_config, read_weights
    assert main(["train", "--config", str(tiny_config), "--out", str(tmp_path / "short"), "--max-steps", "2"]) == 0
    assert read_config(tmp_path / "short" / "last")["state"]["step"] == 2
    head, _, rest = tiny_config.read_text().partition("[model]")
    cfg = tmp_path / "init.toml"  # the model comes from --init
    cfg.write_text((head + rest[rest.index("[train]"):]).replace("lr = 1e-2", "lr = 1e-9"))
    assert main(["train", "--config", str(cfg), "--out", str(tmp_path / "tuned"), "--init", str(tiny_run / "best"),
                 "--max-steps", "1"]) == 0
    start, tuned = read_weights(tiny_run / "best"), read_weights(tmp_path / "tuned" / "last")
    assert read_config(tmp_path / "tuned" / "last")["vocab"] == read_config(tiny_run / "best")["vocab"]
    assert start.keys() == tuned.keys()
    for k in start:
        torch.testing.assert_close(tuned[k], start[k], atol=1e-6, rtol=0)


# ---- sweep ---------------------------------------------------------------------------------------
def test_sweep_random_seed_and_metric_define_the_trials(tiny_config, tmp_path, monkeypatch):
    """--random N --seed S: N trials of the grid, drawn as sweep.trial_overrides draws them for
    that seed; --metric: what the trials are ranked by (and validate on). Nothing is trained
    here: the local engine is stubbed, the sweep's definition is what is compared."""
    from captionkit.experiments import sweep as sw
    ran = []
    monkeypatch.setattr(sw, "run_local", lambda sweep: ran.append(sweep) or [])
    sets = ["train.lr=1e-2,1e-3,1e-4", "model.hidden_dim=8,16"]

    def define(name: str, *argv: str):
        assert main(["sweep", "--config", str(tiny_config), *[x for s in sets for x in ("--set", s)],
                     "--out", str(tmp_path / name), *argv]) == 0
        return ran[-1]

    axes = [sw.parse_set(s) for s in sets]
    grid = define("grid")
    assert [t["overrides"] for t in grid.trials] == sw.trial_overrides(axes) and grid.metric == "CIDEr"
    drawn = {seed: [t["overrides"] for t in define(f"r{seed}", "--random", "3", "--seed", str(seed)).trials]
             for seed in (0, 1)}
    assert drawn[0] != drawn[1]
    for seed, trials in drawn.items():
        assert trials == sw.trial_overrides(axes, random_count=3, seed=seed)
    bleu = define("bleu", "--metric", "Bleu_4")
    assert bleu.metric == "Bleu_4" and all(t["config"]["train"]["val_metric"] == "Bleu_4" for t in bleu.trials)
