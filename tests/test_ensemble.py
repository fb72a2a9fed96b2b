"""Ensembles at decode time (captionkit.inference.ensemble), n-best beam search, and consensus (MBR)
reranking (captionkit.inference.rerank), on tiny random-weight decoders."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import assert_beam_one_is_greedy, cli_captions, decoder_checkpoint, direct_captions

from captionkit.cli.main import main
from captionkit.core.checkpoint import CheckpointError
from captionkit.core.outputs import owner_kind
from captionkit.data.vocab import SPECIALS
from captionkit.inference.captioner import Captioner
from captionkit.inference.decoding import beam_nbest, beam_search, greedy
from captionkit.inference.ensemble import (
    ENSEMBLE_FILE,
    TTA,
    TTA_OFF,
    ZOOM,
    EnsembleDecoder,
    combine_logprobs,
    normalised_weights,
    read_ensemble,
    tta_pixels,
    with_flip_views,
    with_tta_views,
)
from captionkit.inference.rerank import consensus_utilities, mbr_choice, rerank_files
from captionkit.models import create_model

WORDS = list(SPECIALS) + ["a", "red", "blue", "circle", "square", "on", "white", "the"]
GRID, FEAT = [2, 3], 10


def sat(seed: int = 0):
    torch.manual_seed(seed)
    return create_model("sat", {"vocab_size": len(WORDS), "feat_dim": FEAT, "embed_dim": 8,
                                  "hidden_dim": 9, "attn_dim": 7, "dropout": 0.0}).eval()


def transformer(seed: int = 0):
    torch.manual_seed(seed)
    return create_model("transformer", {"vocab_size": len(WORDS), "feat_dim": FEAT, "grid": GRID, "width": 8,
                                          "heads": 2, "decoder_layers": 2, "dropout": 0.0,
                                          "max_positions": 16}).eval()


def feats(n: int = 5, seed: int = 1) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(n, GRID[0] * GRID[1], FEAT)


def same_captions(a, b) -> None:
    assert [c.ids for c in a] == [c.ids for c in b]
    for x, y in zip(a, b):
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        torch.testing.assert_close(x.attention, y.attention)


def checkpoint(folder: Path, decoder, words=WORDS, grid=GRID, lp: float = 0.0) -> Path:
    family = "transformer" if "grid" in decoder.cfg.__dataclass_fields__ else "sat"
    return decoder_checkpoint(folder, decoder, family, words, "efficientnet_lite0", grid, lp)


# ---- the ensemble decoder --------------------------------------------------------------------
@pytest.mark.parametrize("make", [sat, transformer])
def test_an_ensemble_of_one_is_the_model(make):
    m, x = make(), feats()
    ens = EnsembleDecoder([m])
    same_captions(greedy(ens, x, max_len=6), greedy(m, x, max_len=6))
    same_captions(beam_search(ens, x, beam=3, max_len=6), beam_search(m, x, beam=3, max_len=6))
    same_captions(beam_search(ens, x, beam=3, max_len=6, length_penalty=1.0),
                  beam_search(m, x, beam=3, max_len=6, length_penalty=1.0))


@pytest.mark.parametrize("combine", ["loglinear", "linear"])
def test_two_copies_of_a_model_give_its_captions(combine):
    m, x = transformer(), feats()
    ens = EnsembleDecoder([m, copy.deepcopy(m)], [0.3, 0.7], combine)
    same_captions(greedy(ens, x, max_len=6), greedy(m, x, max_len=6))
    same_captions(beam_search(ens, x, beam=3, max_len=6, length_penalty=1.0),
                  beam_search(m, x, beam=3, max_len=6, length_penalty=1.0))


def test_members_of_two_families_keep_their_own_states():
    """A sat and a transformer member (states of 2 and 5 tensors): each step is the combination
    of what each member alone computes, and beam search (which selects state rows) with one
    beam still gives greedy's captions."""
    a, b, x = sat(), transformer(), feats()
    ens = EnsembleDecoder([a, b], [1.0, 3.0])
    mem = ens.prepare(x)
    state = ens.init_state(mem)
    assert mem.state_sizes == (2, 5)
    tokens = torch.full((x.shape[0],), 1)
    logp, state, att = ens.step(tokens, state, mem)
    la, _, att_a = a.step(tokens, a.init_state(a.prepare(x)), a.prepare(x))
    lb, _, _ = b.step(tokens, b.init_state(b.prepare(x)), b.prepare(x))
    mixed = 0.25 * la + 0.75 * lb
    torch.testing.assert_close(logp, mixed - mixed.logsumexp(1, keepdim=True))
    torch.testing.assert_close(att, att_a)  # the first member's attention
    assert torch.allclose(logp.exp().sum(1), torch.ones(x.shape[0]))
    assert_beam_one_is_greedy(ens, x, max_len=6)


def test_linear_combination_is_the_mean_of_probabilities():
    la, lb = torch.log_softmax(torch.randn(3, 9), 1), torch.log_softmax(torch.randn(3, 9), 1)
    got = combine_logprobs([la, lb], [0.25, 0.75], "linear").exp()
    torch.testing.assert_close(got, 0.25 * la.exp() + 0.75 * lb.exp())


def test_weights_are_validated():
    assert normalised_weights([2, 6], 2) == [0.25, 0.75]
    assert normalised_weights(None, 4) == [0.25] * 4
    for bad, why in [([1.0], "1 weights for 2 members"), ([1.0, 0.0], "weight 2 is 0.0"),
                     ([1.0, -1.0], "weight 2"), ([float("nan"), 1.0], "weight 1"),
                     ([float("inf"), 1.0], "weight 1"), ([True, 1.0], "weight 1"), (["1", 1.0], "weight 1")]:
        with pytest.raises(ValueError, match=why):
            normalised_weights(bad, 2)
    with pytest.raises(ValueError, match="weight 2"):
        EnsembleDecoder([sat(), sat(1)], [1.0, -2.0])


# ---- n-best beam search ----------------------------------------------------------------------
@pytest.mark.parametrize("lp", [0.0, 1.0])
def test_nbest_lists_are_ranked_and_begin_with_the_beam_result(lp):
    m, x = sat(), feats(6)
    plain = beam_search(m, x, beam=4, max_len=6, length_penalty=lp)
    same_captions([n[0] for n in beam_nbest(m, x, 1, beam=4, max_len=6, length_penalty=lp)], plain)
    lists = beam_nbest(m, x, 4, beam=4, max_len=6, length_penalty=lp)
    same_captions([n[0] for n in lists], plain)
    for caps in lists:
        assert len(caps) == 4 and len({tuple(c.ids) for c in caps}) == 4
        scores = [c.logprob / (len(c.ids) + 1) ** lp for c in caps]
        assert scores == sorted(scores, reverse=True)
    with pytest.raises(ValueError, match="n_best"):
        beam_nbest(m, x, 5, beam=4)


# ---- checkpoints and ensemble folders --------------------------------------------------------
def test_ensemble_folder_round_trips_through_captioner_load(tmp_path, capsys):
    a = checkpoint(tmp_path / "runs" / "a", sat(), lp=0.5)
    b = checkpoint(tmp_path / "runs" / "b", transformer())
    out = tmp_path / "ens"
    argv = ["ensemble", "--model", str(a), "--model", str(b), "--weights", "1,3", "--length-penalty", "1.5",
            "--out", str(out)]
    assert main(argv) == 0
    assert owner_kind(out) == "ensemble"
    doc = json.loads((out / ENSEMBLE_FILE).read_text())
    assert [m["path"] for m in doc["members"]] == ["../runs/a", "../runs/b"]
    assert [m["weight"] for m in doc["members"]] == [0.25, 0.75]
    assert doc["decoding"] == {"length_penalty": 1.5, "max_len": 6}
    loaded = Captioner.load(out, with_encoder=False)
    direct = Captioner.load_ensemble([a, b], [1, 3], length_penalty=1.5, with_encoder=False)
    assert isinstance(loaded.decoder, EnsembleDecoder) and loaded.decoder.weights == [0.25, 0.75]
    assert loaded.length_penalty == 1.5 and loaded.config["family"] == "ensemble"
    x = feats()
    same_captions(loaded.decode_features(x, beam=3), direct.decode_features(x, beam=3))
    assert main(argv) == 2  # an existing ensemble is replaced only with --overwrite
    assert "--overwrite" in capsys.readouterr().err
    (out / "notes.txt").write_text("mine")
    assert main(argv[:-2] + ["--weights", "1,1", "--out", str(out), "--overwrite"]) == 0
    assert read_ensemble(out).weights == [0.5, 0.5]
    assert (out / "notes.txt").read_text() == "mine"  # only ensemble.json is replaced


def test_shipped_members_are_named_by_name(tmp_path):
    out = tmp_path / "shipped"
    assert main(["ensemble", "--model", "transformer-lite2-flickr8k", "--model", "sat-lite2-flickr8k",
                 "--out", str(out)]) == 0
    doc = json.loads((out / ENSEMBLE_FILE).read_text())
    assert [m["shipped"] for m in doc["members"]] == ["transformer-lite2-flickr8k", "sat-lite2-flickr8k"]
    assert doc["decoding"]["length_penalty"] == 2.0  # the first member's


def test_members_must_share_tokenizer_and_encoder(tmp_path):
    a = checkpoint(tmp_path / "a", sat())
    other_words = checkpoint(tmp_path / "b", sat(1), words=WORDS[:-1] + ["green"])
    other_grid = checkpoint(tmp_path / "c", sat(1), grid=[3, 2])
    for bad, why in [(other_words, "vocabulary differs"), (other_grid, "encoder")]:
        with pytest.raises(CheckpointError) as e:
            Captioner.load_ensemble([a, bad], with_encoder=False)
        assert str(e.value).startswith(str(bad)) and why in str(e.value) and "\n" not in str(e.value)


def test_ensemble_mistakes_are_one_line(tmp_path, capsys):
    a = checkpoint(tmp_path / "a", sat())
    b = checkpoint(tmp_path / "b", sat(1), words=WORDS[:-1] + ["green"])
    cases = [(["caption", "x.jpg", "--model", str(a), "--model", str(a), "--weights", "1"], "--weights gives 1"),
             (["ensemble", "--model", str(a), "--model", str(b), "--out", str(tmp_path / "e")], "vocabulary"),
             (["caption", "x.jpg", "--model", str(a), "--nbest", "3"], "--rerank mbr")]
    for argv, why in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert why in err and "\n" not in err
    assert not (tmp_path / "e").exists()
    with pytest.raises(SystemExit):  # refused by the parser
        main(["caption", "x.jpg", "--model", str(a), "--model", str(a), "--weights", "1,-1"])
    assert "--weights" in capsys.readouterr().err
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / ENSEMBLE_FILE).write_text(json.dumps(
        {"format": "captionkit-ensemble", "members": [{"path": "../a", "weight": 0}]}))
    with pytest.raises(CheckpointError, match=r"ensemble.json: members' weights: weight 1 is 0"):
        Captioner.load(tmp_path / "bad", with_encoder=False)


# ---- consensus reranking ---------------------------------------------------------------------
def test_mbr_picks_the_consensus_candidate():
    cands = {"dog.jpg": ["a cat sleeps on a red sofa",  # the model's best, but an outlier
                         "a brown dog runs on the grass",
                         "a dog runs on the green grass",
                         "a dog is running on grass"],
             "bike.jpg": ["a woman swims in a pool", "a man rides a bike on a road", "a man rides a bike"]}
    assert mbr_choice(cands) == {"dog.jpg": 2, "bike.jpg": 1}
    assert consensus_utilities(cands)["dog.jpg"][0] == 0.0  # shares no informative n-gram
    assert mbr_choice({"one.jpg": ["a dog"]}) == {"one.jpg": 0}


def test_mbr_weights_are_the_other_candidates_probabilities():
    cands = {"x.jpg": ["a man rides a bike", "a man rides a red bike",
                       "a woman swims in a pool", "a woman swims in a blue pool"],
             "y.jpg": ["two dogs play in the snow", "a dog in the snow"]}
    n = len(cands["x.jpg"])
    # one-hot weights give each candidate's CIDEr-D against one other: the similarity matrix
    sim = [[consensus_utilities(cands, {"x.jpg": [float(j == k) for k in range(n)], "y.jpg": [1, 1]})["x.jpg"][i]
            for j in range(n)] for i in range(n)]
    uniform = consensus_utilities(cands)["x.jpg"]
    for i in range(n):
        assert uniform[i] == pytest.approx(sum(sim[i][j] for j in range(n) if j != i) / (n - 1))
    assert sim[0][1] > 0 and sim[0][2] == 0
    riders = {"x.jpg": [1.0, 1.0, 0.1, 0.1], "y.jpg": [1, 1]}
    swimmers = {"x.jpg": [0.1, 0.1, 1.0, 1.0], "y.jpg": [1, 1]}
    assert mbr_choice(cands, riders)["x.jpg"] in (0, 1)
    assert mbr_choice(cands, swimmers)["x.jpg"] in (2, 3)


def test_rerank_files_takes_lists_and_single_captions(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"x.jpg": ["a dog runs on the grass", "a cat on a sofa"],
                                                 "y.jpg": ["a man rides a bike", "a red bus"]}))
    (tmp_path / "b.json").write_text(json.dumps({"x.jpg": "a dog runs on grass", "y.jpg": "a man on a bike"}))
    out = tmp_path / "c.json"
    assert main(["rerank", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json", str(out)]) == 0
    assert json.loads(out.read_text()) == {"x.jpg": "a dog runs on the grass", "y.jpg": "a man rides a bike"}
    (tmp_path / "d.json").write_text(json.dumps({"x.jpg": "a dog"}))
    with pytest.raises(ValueError, match="d.json: covers other images"):
        rerank_files([str(tmp_path / "a.json"), str(tmp_path / "d.json")], None, False)


# ---- end to end: the caption command and the server -----------------------------------------
@pytest.fixture(scope="module")
def lite0_members(tmp_path_factory) -> tuple[Path, Path]:
    """Two tiny decoders of one vocabulary on the random-weight EfficientNet-Lite0 grid."""
    root = tmp_path_factory.mktemp("members")
    grid = [7, 7]
    torch.manual_seed(0)
    a = create_model("sat", {"vocab_size": len(WORDS), "feat_dim": 1280, "embed_dim": 8, "hidden_dim": 9,
                               "attn_dim": 7, "dropout": 0.0})
    b = create_model("transformer", {"vocab_size": len(WORDS), "feat_dim": 1280, "grid": grid, "width": 8,
                                       "heads": 2, "decoder_layers": 1, "dropout": 0.0, "max_positions": 16})
    return checkpoint(root / "a", a, grid=grid), checkpoint(root / "b", b, grid=grid)


@pytest.mark.slow  # two models through the caption command
def test_caption_command_decodes_an_ensemble(lite0_members, tmp_path):
    from helpers import shape_image
    a, b = lite0_members
    for k in range(3):
        shape_image(k, size=64).save(tmp_path / f"img{k}.jpg")

    def run(*models: str, extra=()) -> dict:
        out = tmp_path / f"{len(list(tmp_path.glob('*.json')))}.json"
        argv = ["caption", str(tmp_path / "img0.jpg"), str(tmp_path / "img1.jpg"), str(tmp_path / "img2.jpg"),
                "--json", str(out), *[x for m in models for x in ("--model", str(m))], *extra]
        assert main(argv) == 0
        return json.loads(out.read_text())

    alone = run(a)
    assert run(a, a, extra=["--weights", "1,2"]) == alone  # two copies of a model: its captions
    # the n-best lists begin with the beam's caption
    assert run(a, extra=["--nbest", "3", "--candidates", str(tmp_path / "a.nbest")]) == alone
    lists = json.loads((tmp_path / "a.nbest").read_text())
    assert set(lists) == set(alone) and all(len(v) == 3 and v[0] == alone[k] for k, v in lists.items())
    mixed = run(a, b, extra=["--rerank", "mbr", "--nbest", "3", "--candidates", str(tmp_path / "ab.nbest")])
    lists = json.loads((tmp_path / "ab.nbest").read_text())
    assert set(mixed) == set(alone) and all(mixed[k] in lists[k] for k in mixed)


def test_the_server_serves_an_ensemble_folder(lite0_members, tmp_path):
    pytest.importorskip("fastapi")
    from captionkit.serve.app import load_models
    a, b = lite0_members
    assert main(["ensemble", "--model", str(a), "--model", str(b), "--out", str(tmp_path / "ens")]) == 0
    models = load_models([str(tmp_path / "ens")])
    assert list(models) == ["ens"] and isinstance(models["ens"].decoder, EnsembleDecoder)
    assert models["ens"].config["family"] == "ensemble"


def test_evaluate_scores_an_ensemble_with_mbr(lite0_members, flickr_dir, tmp_path, capsys):
    a, b = lite0_members
    out = tmp_path / "eval.json"
    assert main(["evaluate", "--model", str(a), "--model", str(b), "--weights", "2,1", "--dataset", str(flickr_dir),
                 "--split", "dev", "--rerank", "mbr", "--nbest", "2", "--tokenizer", "python", "--meteor", "none",
                 "--metrics", "bleu,cider", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["model"] == {"members": [str(a.resolve()), str(b.resolve())], "weights": [2.0, 1.0]}
    assert doc["mbr_nbest"] == 2 and len(doc["captions"]) == 3 and "CIDEr" in doc["scores"]
    assert "MBR over the 2 best beams" in capsys.readouterr().out


# ---- test-time flip averaging ------------------------------------------------------------------
def two_views(x: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
    return torch.stack([x, x if y is None else y], 1)  # (B, 2, L, D)


@pytest.mark.parametrize("make", [sat, transformer, lambda: EnsembleDecoder([sat(), transformer(1)], [1, 3])])
def test_flip_views_of_identical_views_are_the_model(make):
    m, x = make(), feats()
    tta = with_flip_views(m)
    assert tta.views == [0] * (len(tta.members) // 2) + [1] * (len(tta.members) // 2)
    same_captions(greedy(tta, two_views(x), max_len=6), greedy(m, x, max_len=6))
    same_captions(beam_search(tta, two_views(x), beam=3, max_len=6, length_penalty=1.0),
                  beam_search(m, x, beam=3, max_len=6, length_penalty=1.0))


def test_flip_views_average_the_two_views_log_probabilities():
    m, x, y = transformer(), feats(seed=1), feats(seed=2)
    tta = with_flip_views(m)
    mem = tta.prepare(two_views(x, y))
    tokens = torch.full((x.shape[0],), 1)
    logp, _, att = tta.step(tokens, tta.init_state(mem), mem)
    lx, _, att_x = m.step(tokens, m.init_state(m.prepare(x)), m.prepare(x))
    ly, _, _ = m.step(tokens, m.init_state(m.prepare(y)), m.prepare(y))
    mixed = 0.5 * lx + 0.5 * ly
    torch.testing.assert_close(logp, mixed - mixed.logsumexp(1, keepdim=True))
    torch.testing.assert_close(att, att_x)  # the photo's attention, not the mirror image's
    with pytest.raises(ValueError, match="2 views"):
        tta.prepare(x)  # one view where two are read: refused, not silently misread
    with pytest.raises(ValueError, match="already reads"):
        with_flip_views(tta)


def test_flip_tta_encodes_the_mirror_image_and_ships_in_an_ensemble_folder(lite0_members, tmp_path):
    from helpers import shape_image

    from captionkit.core.precision import autocast
    from captionkit.data.images import to_tensor
    a, b = lite0_members
    assert main(["ensemble", "--model", str(a), "--model", str(b), "--tta", "flip", "--out", str(tmp_path / "ens")]) == 0
    assert read_ensemble(tmp_path / "ens").tta == "flip"
    cap = Captioner.load(tmp_path / "ens")
    assert cap.tta == "flip" and cap.config["tta"] == "flip"
    assert Captioner.load(tmp_path / "ens", with_encoder=False).decoder.views == [0, 0, 1, 1]
    images = [to_tensor(shape_image(k, size=64), cap.encoder.preprocess) for k in range(2)]
    got = cap.encode_batch(images)
    assert got.shape[:2] == (2, 2)
    # the encoder's own output under the captioner's precision (bf16 autocast on a CPU with bf16)
    with autocast(cap.device, cap.precision):
        torch.testing.assert_close(got[:, 0], cap.encoder.encode_batch(images).float())
        torch.testing.assert_close(got[:, 1], cap.encoder.encode_batch([x.flip(-1) for x in images]).float())
    assert got.dtype == torch.float32
    assert len(cap.decode_features(got, beam=2)) == 2
    plain = Captioner.load(a, tta="flip")  # one model with --tta flip
    assert plain.tta == "flip" and plain.decoder.views == [0, 1]
    off = Captioner.load(tmp_path / "ens", tta="none")  # --tta none over the folder's flip
    assert off.tta is None and "tta" not in off.config
    assert off.encode_batch(images).shape[:2] == (2, cap.grid[0] * cap.grid[1])  # one view: (B, L, D)
    doc = json.loads((tmp_path / "ens" / ENSEMBLE_FILE).read_text())
    (tmp_path / "ens" / ENSEMBLE_FILE).write_text(json.dumps({**doc, "decoding": {"tta": "rotate"}}))
    with pytest.raises(CheckpointError, match="decoding.tta"):
        read_ensemble(tmp_path / "ens")


def test_caption_command_takes_tta_flip(picky_models, picky_data, tmp_path):
    """--tta flip captions as Captioner.load(..., tta="flip") does -- on these photos, not as the
    model alone does -- and --tta none as the model alone."""
    a, _ = picky_models
    photos = picky_data / "Flicker8k_Dataset"
    flip = direct_captions(Captioner.load(a, tta="flip"), sorted(photos.iterdir()))
    plain = direct_captions(Captioner.load(a), sorted(photos.iterdir()))
    assert flip != plain  # what makes the test mean something: flips change some captions
    assert cli_captions(tmp_path, ["caption", str(photos), "--model", str(a), "--tta", "flip"]) == flip
    assert cli_captions(tmp_path, ["caption", str(photos), "--model", str(a), "--tta", "none"]) == plain
    assert cli_captions(tmp_path, ["caption", str(photos), "--model", str(a)]) == plain


def test_tta_none_switches_off_an_ensemble_folders_flip(picky_models, picky_data, tmp_path):
    """An ensemble folder written with --tta flip averages flips when used; --tta none switches
    that off; --tta flip adds it to an ensemble given as several --model."""
    a, b = picky_models
    photos = picky_data / "Flicker8k_Dataset"
    ens = tmp_path / "ens"
    assert main(["ensemble", "--model", str(a), "--model", str(b), "--tta", "flip", "--out", str(ens)]) == 0
    flip = direct_captions(Captioner.load_ensemble([a, b], tta="flip"), sorted(photos.iterdir()))
    plain = direct_captions(Captioner.load_ensemble([a, b]), sorted(photos.iterdir()))
    assert flip != plain
    assert cli_captions(tmp_path, ["caption", str(photos), "--model", str(ens)]) == flip
    assert cli_captions(tmp_path, ["caption", str(photos), "--model", str(ens), "--tta", "none"]) == plain
    assert cli_captions(tmp_path, ["caption", str(photos), "--model", str(a), "--model", str(b), "--tta",
                                   "flip"]) == flip


def test_evaluate_takes_tta(picky_models, picky_data, tmp_path, capsys):
    """evaluate --tta flip scores the flip-averaged captions, and records it; --tta none over an
    ensemble folder's flip scores the plain ensemble's."""
    from captionkit.data.datasets import load_dataset
    a, b = picky_models
    dev = [it.path for it in load_dataset(str(picky_data)).split("dev")]

    def evaluate(*argv: str) -> dict:
        out = tmp_path / f"eval{len(list(tmp_path.glob('eval*.json')))}.json"
        assert main(["evaluate", *argv, "--dataset", str(picky_data), "--split", "dev", "--metrics", "bleu,cider",
                     "--tokenizer", "python", "--meteor", "none", "--out", str(out)]) == 0
        return json.loads(out.read_text())

    flip, plain = direct_captions(Captioner.load(a, tta="flip"), dev), direct_captions(Captioner.load(a), dev)
    assert flip != plain
    doc = evaluate("--model", str(a), "--tta", "flip")
    assert doc["captions"] == flip and doc["tta"] == "flip"
    assert "test-time flip" in capsys.readouterr().out
    doc = evaluate("--model", str(a))
    assert doc["captions"] == plain and doc["tta"] is None
    assert main(["ensemble", "--model", str(a), "--model", str(b), "--tta", "flip", "--out", str(tmp_path / "ens")]) == 0
    flip, plain = (direct_captions(Captioner.load_ensemble([a, b], tta=t), dev) for t in ("flip", None))
    assert flip != plain
    assert evaluate("--model", str(tmp_path / "ens"))["captions"] == flip
    doc = evaluate("--model", str(tmp_path / "ens"), "--tta", "none")
    assert doc["captions"] == plain and doc["tta"] is None


# ---- four views: the photo, its mirror image, a centre crop and the crop's mirror image ------------
def test_tta_pixels_are_the_photo_its_mirror_and_the_centre_crop_of_zoom():
    S = 40
    ramp = torch.arange(S, dtype=torch.float32).expand(2, 3, S, S).clone()  # (B, 3, S, S): x across
    ramp[1] *= -1  # a second photo, its own numbers
    views = tta_pixels(ramp, "flip-zoom")
    assert views.shape == (2, 4, 3, S, S)
    torch.testing.assert_close(views[:, 0], ramp)
    torch.testing.assert_close(views[:, 1], ramp.flip(-1))
    torch.testing.assert_close(views[:, 3], views[:, 2].flip(-1))
    # the crop: columns o .. o + side - 1 of the photo spread over S columns (bilinear, pixel
    # centres), so a ramp stays a ramp from about o to o + side - 1; exact away from the borders
    side = round(S * ZOOM)
    o = (S - side) // 2
    j = torch.arange(2, S - 2, dtype=torch.float32)
    want = o - 0.5 + (j + 0.5) * side / S
    torch.testing.assert_close(views[0, 2, :, 5, 2:S - 2], want.expand(3, -1))
    torch.testing.assert_close(views[1, 2, :, 5, 2:S - 2], -want.expand(3, -1))
    assert torch.equal(tta_pixels(ramp, "flip"), views[:, :2])
    with pytest.raises(ValueError, match="unknown test-time augmentation 'rotate'"):
        tta_pixels(ramp, "rotate")


def test_four_views_of_identical_views_are_the_model_and_each_holds_a_quarter():
    m, x, y = transformer(), feats(seed=1), feats(seed=2)
    four = with_tta_views(m, "flip-zoom")
    assert four.views == [0, 1, 2, 3] and four.weights == [0.25] * 4
    same_captions(beam_search(four, torch.stack([x] * 4, 1), beam=3, max_len=6, length_penalty=1.0),
                  beam_search(m, x, beam=3, max_len=6, length_penalty=1.0))
    mem = four.prepare(torch.stack([x, y, y, x], 1))
    tokens = torch.full((x.shape[0],), 1)
    logp, _, _ = four.step(tokens, four.init_state(mem), mem)
    lx, _, _ = m.step(tokens, m.init_state(m.prepare(x)), m.prepare(x))
    ly, _, _ = m.step(tokens, m.init_state(m.prepare(y)), m.prepare(y))
    mixed = 0.5 * lx + 0.5 * ly  # two views of each: a quarter each
    torch.testing.assert_close(logp, mixed - mixed.logsumexp(1, keepdim=True))
    with pytest.raises(ValueError, match="4 views"):
        four.prepare(torch.stack([x, y], 1))  # two views where four are read


def test_flip_zoom_encodes_four_views_and_changes_captions(picky_models, picky_data, tmp_path, capsys):
    """--tta flip-zoom: the encoder's rows of the four views, in order; captions as the API's,
    not flip's; an ensemble folder records it; evaluate records it."""
    from captionkit.data.images import load_rgb, to_tensor
    a, b = picky_models
    photos = sorted((picky_data / "Flicker8k_Dataset").iterdir())
    cap = Captioner.load(a, tta="flip-zoom", device="cpu", precision="fp32")
    assert cap.tta == "flip-zoom" and cap.decoder.views == [0, 1, 2, 3]
    images = [to_tensor(load_rgb(p), cap.encoder.preprocess) for p in photos[:3]]
    got = cap.encode_batch(images)  # (B, 4, L, D)
    assert got.shape[:2] == (3, 4) and got.dtype == torch.float32
    want = cap.encoder.encode(tta_pixels(torch.stack(images), "flip-zoom").flatten(0, 1)).unflatten(0, (3, 4))
    torch.testing.assert_close(got, want.float())
    torch.testing.assert_close(got[:, 0], cap.encoder.encode_batch(images).float())
    zoom = direct_captions(cap, photos)
    flip = direct_captions(Captioner.load(a, tta="flip"), photos)
    assert zoom != flip  # what makes the test mean something: the crop's views change some captions
    assert cli_captions(tmp_path, ["caption", *map(str, photos), "--model", str(a), "--tta", "flip-zoom"]) == zoom
    ens = tmp_path / "ens"
    assert main(["ensemble", "--model", str(a), "--model", str(b), "--tta", "flip-zoom", "--out", str(ens)]) == 0
    assert read_ensemble(ens).tta == "flip-zoom"
    assert Captioner.load(ens, with_encoder=False).decoder.views == [0, 0, 1, 1, 2, 2, 3, 3]
    assert cli_captions(tmp_path, ["caption", *map(str, photos), "--model", str(ens)]) == \
        direct_captions(Captioner.load_ensemble([a, b], tta="flip-zoom"), photos)
    out = tmp_path / "eval.json"
    assert main(["evaluate", "--model", str(a), "--tta", "flip-zoom", "--dataset", str(picky_data), "--split", "dev",
                 "--metrics", "bleu", "--tokenizer", "python", "--meteor", "none", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["tta"] == "flip-zoom" and "test-time flip-zoom" in capsys.readouterr().out


@pytest.mark.parametrize("command", [["caption"], ["evaluate", "--dataset", "d"], ["ensemble", "--out", "e", "--model", "m"]])
def test_the_command_line_offers_every_test_time_augmentation(command):
    from captionkit.cli.main import build_parser
    for tta in (*TTA, TTA_OFF):  # (the command line names them without importing torch)
        assert build_parser().parse_args([*command, "--tta", tta]).tta == tta


def test_mirror_image_features_are_cached_apart(tmp_path):
    from helpers import shape_image

    from captionkit.data.images import load_rgb, to_tensor
    from captionkit.encoders import create_encoder
    from captionkit.encoders.features import build_features
    paths = []
    for k in range(2):
        shape_image(k, size=64).save(tmp_path / f"img{k}.jpg")
        paths.append(tmp_path / f"img{k}.jpg")
    enc = create_encoder("efficientnet_lite0", weights="random")
    plain = build_features(enc, paths, root=tmp_path / "cache", progress=False)
    flipped = build_features(enc, paths, root=tmp_path / "cache", progress=False, flip=True)
    assert plain.folder != flipped.folder
    want = enc.encode_batch([to_tensor(load_rgb(p), enc.preprocess).flip(-1) for p in paths])
    torch.testing.assert_close(torch.from_numpy(flipped.rows(["img0.jpg", "img1.jpg"]).astype("float32")),
                               want, atol=2e-3, rtol=2e-3)  # the cache holds float16


# ---- int8 storage of shipped members -----------------------------------------------------------
def test_int8_pack_is_a_quarter_of_the_size_and_decodes_like_float32(tmp_path):
    from captionkit.core.checkpoint import INT8_SCALE, dequantize_int8, quantize_int8, read_weights
    m = transformer()
    w = {k: v.repeat(8, 1) if k == "embed.weight" else v for k, v in m.state_dict().items()}  # one big matrix
    q = quantize_int8(w, min_size=64)
    big = [k for k, v in w.items() if v.dim() == 2 and v.numel() >= 64]
    assert big and all(q[k].dtype == torch.int8 and q[k + INT8_SCALE].shape == (w[k].shape[0], 1) for k in big)
    assert all(torch.equal(q[k], w[k]) for k in w if k not in big)  # vectors and small tensors kept
    back = dequantize_int8(q)
    assert back.keys() == w.keys()
    for k in big:  # at most half a quantisation step per entry
        step = w[k].abs().amax(1, keepdim=True) / 127
        assert ((back[k] - w[k]).abs() <= step / 2 + 1e-7).all()
    src = checkpoint(tmp_path / "src", m)
    assert main(["pack", str(src), str(tmp_path / "q"), "--int8"]) == 0
    assert main(["pack", str(src), str(tmp_path / "x"), "--int8", "--fp16"]) == 2
    assert not any(v.dtype == torch.int8 for v in read_weights(tmp_path / "q").values())  # read as float
    x = feats()
    plain, packed = Captioner.load(src, with_encoder=False), Captioner.load(tmp_path / "q", with_encoder=False)
    assert [c.ids for c in packed.decode_features(x)] == [c.ids for c in plain.decode_features(x)]
