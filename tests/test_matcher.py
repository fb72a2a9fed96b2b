"""The image-caption matcher (captionkit.models.matcher, captionkit.training.matcher) and
``--rerank match`` (issue 32: more distinct captions): it learns, its score prefers the caption
that says what is in the photo, its checkpoint reloads to the same numbers, and the reranker
changes the captions the way its weight says (0: the beam's own choice)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import cli_captions, direct_captions, write_picky_decoder

from captionkit.cli.main import main
from captionkit.core.errors import CheckpointError, UserError
from captionkit.inference.captioner import Captioner
from captionkit.inference.rerank import match_choice, rare_word_gains
from captionkit.models.matcher import Matcher, MatcherConfig, load_matcher
from captionkit.training.matcher import build_words, fit

CONCEPTS = ["dog", "cat", "bike", "boat", "tree", "ball", "snow", "beach", "horse", "car", "girl", "man"]


def concept_photos(n: int, seed: int, dim: int = 24):
    """n photos, each two distinct concepts: its pooled rows are the sum of the concepts' vectors
    plus noise, its captions name both (and only them) among filler words."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(len(CONCEPTS), dim, generator=torch.Generator().manual_seed(99))
    pooled, captions = [], []
    for _ in range(n):
        a, b = torch.randperm(len(CONCEPTS), generator=g)[:2].tolist()
        pooled.append(centres[a] + centres[b] + 0.2 * torch.randn(dim, generator=g))
        captions.append([f"a {CONCEPTS[a]} and a {CONCEPTS[b]}", f"the {CONCEPTS[b]} near the {CONCEPTS[a]}"])
    return torch.stack(pooled), captions


@pytest.fixture(scope="module")
def trained():
    train_x, train_caps = concept_photos(240, seed=0)
    dev_x, dev_caps = concept_photos(40, seed=1)
    cfg = MatcherConfig(words=build_words(train_caps, 1), feat_dim=24, embed_dim=32, word_dim=16, dropout=0.0,
                        bank_size=100)
    m, history = fit(cfg, train_x, train_caps, dev_x, dev_caps, epochs=12, batch_size=32, lr=3e-3, seed=0)
    return m, history, dev_x, dev_caps


def test_the_matcher_learns_what_the_captions_say(trained):
    m, history, _, _ = trained
    # 40 dev photos: chance is 1/40 at R@1; two concepts of twelve also tie some photos
    assert history[0]["t2i_r1"] < 0.2
    assert max(h["t2i_r1"] for h in history) > 0.4
    assert max(h["t2i_r5"] for h in history) > 0.8
    assert not m.training and bool(m.bank.any())


def test_discriminability_prefers_the_photo_s_own_caption_over_generic_and_wrong_ones(trained):
    m, _, dev_x, dev_caps = trained
    images = m.pooled_image(dev_x)
    own = m.discriminability(images, m.text([caps[0] for caps in dev_caps]))
    generic = m.discriminability(images, m.text(["a photo of something"] * len(dev_caps)))
    wrong = m.discriminability(images, m.text([dev_caps[(i + 1) % len(dev_caps)][0] for i in range(len(dev_caps))]))
    assert (own > generic).float().mean() > 0.9
    assert (own > wrong).float().mean() > 0.8
    # a caption that fits this photo as well as any other scores near 0: the bank is the contrast
    assert generic.abs().mean() < own.abs().mean()


def test_a_matcher_refuses_what_does_not_fit():
    with pytest.raises(UserError, match="embed_dim must be even"):
        MatcherConfig(embed_dim=7)
    with pytest.raises(UserError, match="words must start with"):
        MatcherConfig(words=["a", "b"])
    with pytest.raises(RuntimeError, match="never trained"):
        m = Matcher(MatcherConfig(feat_dim=4, embed_dim=4, word_dim=2, bank_size=2))
        m.discriminability(torch.ones(1, 4), torch.ones(1, 4))


def test_match_choice_weight_zero_is_the_beam_s_ranking_and_a_weight_moves_it():
    logprobs, lengths, disc = [[-3.0, -3.2, -6.0]], [[4, 5, 9]], [[0.0, 1.0, 9.0]]
    # by logprob / (n + 1) ** 1: -0.6, -0.533, -0.6 -> the second
    assert match_choice(logprobs, lengths, disc, 0.0, 1.0) == [1]
    assert match_choice(logprobs, lengths, disc, 0.0, 0.0) == [0]  # the plain sum
    assert match_choice(logprobs, lengths, disc, 1.0, 1.0) == [2]
    assert match_choice([[-1.0, -1.0]], [[3, 3]], [[0.5, 0.5]], 1.0, 1.0) == [0]  # a tie: the earlier
    with pytest.raises(ValueError, match="for one list"):
        match_choice([[-1.0]], [[3, 4]], [[0.0]], 1.0, 1.0)


def test_the_rare_word_gain_adds_its_weight_times_the_words_gains():
    logprobs, lengths, disc = [[-3.0, -3.2, -6.0]], [[4, 5, 9]], [[0.0, 1.0, 9.0]]
    gains = [[0.0, 0.5, 0.1]]
    assert match_choice(logprobs, lengths, disc, 0.0, 1.0, gains, 0.0) == [1]  # weight 0: as without
    assert match_choice(logprobs, lengths, disc, 0.0, 0.0, gains, 0.5) == [1]  # -3.2 + 0.25 > -3.0
    assert match_choice(logprobs, lengths, disc, 0.0, 0.0, gains, 0.3) == [0]  # -3.2 + 0.15 < -3.0
    assert match_choice(logprobs, lengths, disc, 1.0, 1.0, [[0.0, 0.0, -10.0]], 1.0) == [1]  # the terms add
    with pytest.raises(ValueError, match="needs the candidates' gains"):
        match_choice(logprobs, lengths, disc, 0.0, 1.0, None, 0.5)
    with pytest.raises(ValueError, match="2 gains for one list"):
        match_choice(logprobs, lengths, disc, 0.0, 1.0, [[0.0, 1.0]], 0.5)
    # a caption's gain: the sum of what --rare-word-bonus 1 gives each of its words
    from captionkit.inference.shaping import rare_word_bonus
    bonus = rare_word_bonus(1.0, 200, torch.device("cpu"))
    got = rare_word_gains([[[4, 150, 190], [], [5]], [[190]]], 200)  # two lists
    assert got[0] == pytest.approx([float(bonus[150] + bonus[190]), 0.0, 0.0])
    assert got[1] == pytest.approx([float(bonus[190])])
    assert float(bonus[150]) > 0 and float(bonus[5]) == 0


# ---- the command, the checkpoint and --rerank match on the picky photos --------------------------------
@pytest.fixture(scope="module")
def picky_matcher(picky_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("matcher") / "m"
    assert main(["matcher", "--dataset", str(picky_data), "--encoder", "patches", "--out", str(out),
                 "--epochs", "3", "--embed-dim", "8", "--word-dim", "4", "--batch-size", "4", "--bank-size", "4",
                 "--min-count", "1"]) == 0
    return out


def test_the_matcher_command_writes_a_checkpoint_that_reloads_to_the_same_numbers(picky_matcher):
    config = json.loads((picky_matcher / "config.json").read_text())
    assert config["kind"] == "matcher" and config["matcher"]["encoder"].startswith("patches-")
    assert [h["epoch"] for h in config["training"]["history"]] == [1, 2, 3]
    a, b = load_matcher(picky_matcher), load_matcher(picky_matcher)
    rows = torch.randn(3, 256, 192)
    caps = ["a red circle", "the square is blue", "zebra"]  # (an unknown word: <unk>)
    assert torch.equal(a.image(rows), b.image(rows)) and torch.equal(a.text(caps), b.text(caps))
    assert a.bank.shape == (4, 8) and bool(a.bank.any())


def test_the_matcher_command_refuses_an_existing_folder_before_any_work(picky_matcher, picky_data, capsys,
                                                                       monkeypatch):
    import captionkit.training.matcher

    def expensive(*a, **k):
        raise AssertionError("the dataset was read before the output folder was checked")

    monkeypatch.setattr(captionkit.training.matcher, "load_dataset", expensive)
    before = (picky_matcher / "config.json").read_bytes()
    assert main(["matcher", "--dataset", str(picky_data), "--encoder", "patches", "--out", str(picky_matcher)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (picky_matcher / "config.json").read_bytes() == before


@pytest.mark.parametrize("argv, message", [(["--embed-dim", "7"], "MatcherConfig.embed_dim must be even"),
                                           (["--dropout", "1"], "MatcherConfig.dropout must be")])
def test_the_matcher_command_refuses_sizes_that_do_not_fit_before_any_work(argv, message, picky_data, tmp_path,
                                                                           capsys, monkeypatch):
    import captionkit.training.matcher

    def expensive(*a, **k):
        raise AssertionError("the dataset was read before the sizes were checked")

    monkeypatch.setattr(captionkit.training.matcher, "load_dataset", expensive)
    assert main(["matcher", "--dataset", str(picky_data), "--out", str(tmp_path / "m"), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_load_matcher_refuses_a_captioner(picky_models):
    with pytest.raises(CheckpointError, match="not a matcher checkpoint"):
        load_matcher(picky_models[0])


def test_rerank_match_weight_zero_is_the_beam_and_a_large_weight_takes_the_matcher_s_best(
        picky_models, picky_data, picky_matcher, tmp_path):
    a, _ = picky_models
    photos = sorted((picky_data / "Flicker8k_Dataset").iterdir())
    args = ["caption", *map(str, photos), "--model", str(a), "--beam", "3"]
    plain = cli_captions(tmp_path, args)
    zero = cli_captions(tmp_path, [*args, "--rerank", "match", "--matcher", str(picky_matcher),
                                   "--match-weight", "0", "--nbest", "3"])
    assert zero == plain  # no rules shape this model's beam: the beam's own choice
    cands = tmp_path / "cands.json"
    heavy = cli_captions(tmp_path, [*args, "--rerank", "match", "--matcher", str(picky_matcher),
                                    "--match-weight", "1000", "--nbest", "3", "--candidates", str(cands)])
    lists = json.loads(cands.read_text())
    # what the heavy weight must choose, computed here from the matcher and the encoder's rows
    cap, m = Captioner.load(a), load_matcher(picky_matcher)
    rows = cap.encode_batch([cap_pixels(cap, p) for p in photos])
    for p, feats in zip(photos, rows):
        texts = lists[p.name]
        disc = m.discriminability(m.image(feats[None]).expand(len(texts), -1), m.text(texts))
        assert heavy[p.name] == texts[int(disc.argmax())]
    assert heavy != plain  # what makes the test mean something: the matcher changes some captions
    # the Python API: the same choice
    cap.use_matcher(picky_matcher, 1000)
    assert direct_captions(cap, photos, nbest=3, rerank="match", beam=3) == heavy


def cap_pixels(cap, path):
    from captionkit.data.images import load_rgb, to_tensor
    return to_tensor(load_rgb(path), cap.encoder.preprocess)


@pytest.mark.parametrize("argv, message", [
    (["--rerank", "match"], "--rerank match needs --matcher"),
    (["--matcher", "M"], "--matcher is for --rerank match"),
    (["--match-weight", "0.1"], "--match-weight is for --rerank match"),
    (["--match-rare-weight", "0.1"], "--match-rare-weight is for --rerank match"),
    (["--rerank", "match", "--matcher", "nowhere"], "--matcher nowhere: not a checkpoint folder"),
])
def test_rerank_match_options_that_do_not_fit_are_one_line_before_loading(argv, message, picky_data, capsys,
                                                                            no_expensive_work):
    """(A model without a reranker of its own: the default's flags replace its folder's values.)"""
    photo = next((picky_data / "Flicker8k_Dataset").iterdir())
    assert main(["caption", str(photo), "--model", "transformer-lite2-flickr8k", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_a_matcher_of_another_encoder_is_refused_naming_it(picky_matcher):
    cap = Captioner.load("sat-lite2-flickr8k", with_encoder=True, encoder_weights="random")
    with pytest.raises(UserError, match=f"{picky_matcher}: a matcher of patches-"):
        cap.use_matcher(picky_matcher, 0.1)


def test_a_resumed_file_keeps_its_matcher_and_weight(picky_models, picky_data, picky_matcher, tmp_path, capsys):
    a, _ = picky_models
    photos = sorted((picky_data / "Flicker8k_Dataset").iterdir())
    out = tmp_path / "caps.jsonl"
    args = ["caption", *map(str, photos[:4]), "--model", str(a), "--rerank", "match", "--matcher", str(picky_matcher),
            "--jsonl", str(out)]
    assert main(args) == 0
    capsys.readouterr()
    assert main([*args[:-2], "--match-weight", "0.5", "--jsonl", str(out)]) == 2
    assert "with --match-weight 0.03, this run has --match-weight 0.5" in capsys.readouterr().err


def test_evaluate_reranks_by_the_matcher_and_records_it(picky_models, picky_data, picky_matcher, tmp_path):
    from captionkit.data.datasets import load_dataset

    a, _ = picky_models
    out = tmp_path / "eval.json"
    assert main(["evaluate", "--model", str(a), "--dataset", str(picky_data), "--split", "dev", "--metrics", "bleu",
                 "--tokenizer", "python", "--meteor", "none", "--rerank", "match", "--matcher", str(picky_matcher),
                 "--match-weight", "1000", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert (doc["rerank"], doc["nbest"], doc["match_weight"]) == ("match", 3, 1000.0)
    assert doc["matcher"] == str(picky_matcher.resolve()) and doc["mbr_nbest"] is None
    dev = [it.path for it in load_dataset(str(picky_data)).split("dev")]
    cap = Captioner.load(a).use_matcher(picky_matcher, 1000)
    assert doc["captions"] == direct_captions(cap, dev, nbest=3, rerank="match")
    assert doc["captions"] != direct_captions(Captioner.load(a), dev)  # (on these photos the matcher moves some)


# ---- the rare-word gain beside the matcher (--match-rare-weight) --------------------------------------
RARE_WORDS = tuple(f"rare{i}" for i in range(40))  # ranks 9..48 after the picky words: gains past rank 30


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory):
    """A picky checkpoint (captions that follow the pixels) whose vocabulary ends in 40 rarer words."""
    return write_picky_decoder(tmp_path_factory.mktemp("wide") / "m", 0, RARE_WORDS)


def test_match_rare_weight_chooses_each_list_s_rarest_caption(wide_model, picky_data, picky_matcher, tmp_path):
    from captionkit.data.items import normalize
    photos = sorted((picky_data / "Flicker8k_Dataset").iterdir())
    args = ["caption", *map(str, photos), "--model", str(wide_model), "--beam", "3", "--rerank", "match",
            "--matcher", str(picky_matcher), "--nbest", "3", "--match-weight", "0"]
    plain = cli_captions(tmp_path, args)
    cands = tmp_path / "cands.json"
    rare = cli_captions(tmp_path, [*args, "--match-rare-weight", "1000", "--candidates", str(cands)])
    lists = json.loads(cands.read_text())
    cap = Captioner.load(wide_model)

    def gain(text: str) -> float:
        return rare_word_gains([[cap.vocab.encode(normalize(text))]], len(cap.vocab))[0][0]

    for p in photos:  # at this weight the gain decides: the chosen caption is its list's rarest
        assert gain(rare[p.name]) == max(gain(t) for t in lists[p.name])
    assert rare != plain  # what makes the test mean something: the gain changes some captions
    # the Python API: the same choice; evaluate: the same captions, and the weight recorded
    cap.use_matcher(picky_matcher, 0.0, 1000)
    assert direct_captions(cap, photos, nbest=3, rerank="match", beam=3) == rare
    out = tmp_path / "eval.json"
    assert main(["evaluate", "--model", str(wide_model), "--dataset", str(picky_data), "--split", "dev",
                 "--metrics", "bleu", "--tokenizer", "python", "--meteor", "none", "--rerank", "match",
                 "--matcher", str(picky_matcher), "--match-weight", "0", "--match-rare-weight", "1000",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["match_rare_weight"] == 1000.0
    assert doc["captions"] == {k: rare[k] for k in doc["captions"]}


def test_match_rare_weight_is_refused_for_tokens_in_no_frequency_order(wide_model, picky_matcher):
    from captionkit.data.tokenizers import build_tokenizer
    cap = Captioner.load(wide_model)
    char = Captioner(cap.decoder, build_tokenizer("char", [["a", "b"]]), cap.config, encoder=cap.encoder)
    with pytest.raises(UserError, match="--match-rare-weight .* this model's tokens are 'char' tokens"):
        char.use_matcher(picky_matcher, 0.1, 0.5)
    char.use_matcher(picky_matcher, 0.1)  # without the gain: nothing to refuse
    with pytest.raises(UserError, match="rare-word gain's weight must be a finite number >= 0"):
        cap.use_matcher(picky_matcher, 0.1, float("nan"))


# ---- an ensemble folder's own reranker ------------------------------------------------------------------
@pytest.fixture(scope="module")
def reranked_folder(picky_models, picky_matcher, tmp_path_factory):
    """The two picky models as an ensemble folder that reranks by the picky matcher at weight
    1000 (so that its choices differ from the beam's on these photos)."""
    a, b = picky_models
    out = tmp_path_factory.mktemp("own") / "ens"
    assert main(["ensemble", "--model", str(a), "--model", str(b), "--rerank", "match", "--matcher",
                 str(picky_matcher), "--match-weight", "1000", "--match-rare-weight", "0", "--out", str(out)]) == 0
    return out


def test_an_ensemble_folder_keeps_its_reranker_and_a_copy_of_the_matcher(reranked_folder, picky_matcher):
    from captionkit.inference.ensemble import read_ensemble
    doc = json.loads((reranked_folder / "ensemble.json").read_text())
    assert doc["rerank"] == {"method": "match", "matcher": "matcher", "nbest": 3, "weight": 1000.0, "rare_weight": 0.0}
    # a copy (the folder stands alone), of the words the members can write: the same scores
    kept, source = load_matcher(reranked_folder / "matcher"), load_matcher(picky_matcher)
    vocab = Captioner.load(reranked_folder, with_encoder=False).vocab
    assert set(kept.cfg.words) <= set(vocab.words) | {"<pad>", "<unk>"} and kept.cfg.words[:2] == ["<pad>", "<unk>"]
    texts = ["a red circle on the white", "the blue square", ""]
    x = torch.randn(3, source.cfg.feat_dim, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(kept.discriminability(kept.pooled_image(x), kept.text(texts)),
                               source.discriminability(source.pooled_image(x), source.text(texts)))
    own = read_ensemble(reranked_folder).rerank
    assert own.matcher == reranked_folder / "matcher" and (own.nbest, own.weight) == (3, 1000.0)


def test_a_folder_s_reranker_chooses_its_captions_unless_told_otherwise(reranked_folder, picky_models, picky_data,
                                                                       picky_matcher, tmp_path, capsys):
    a, b = picky_models
    photos = sorted((picky_data / "Flicker8k_Dataset").iterdir())
    paths = list(map(str, photos))
    own = cli_captions(tmp_path, ["caption", *paths, "--model", str(reranked_folder)])
    explicit = cli_captions(tmp_path, ["caption", *paths, "--model", str(a), "--model", str(b), "--rerank", "match",
                                       "--matcher", str(picky_matcher), "--match-weight", "1000", "--nbest", "3"])
    off = cli_captions(tmp_path, ["caption", *paths, "--model", str(reranked_folder), "--rerank", "none"])
    assert own == explicit
    assert off == direct_captions(Captioner.load_ensemble([a, b]), photos) != own  # the reranker moves some
    # a flag replaces the folder's value: weight 0 is the beam's own choice (no rules shape it)
    assert cli_captions(tmp_path, ["caption", *paths, "--model", str(reranked_folder), "--match-weight", "0"]) == off
    # greedy asks for one caption: the reranker steps aside
    assert cli_captions(tmp_path, ["caption", *paths, "--model", str(reranked_folder), "--beam", "1"]) == \
        cli_captions(tmp_path, ["caption", *paths, "--model", str(reranked_folder), "--rerank", "none", "--beam", "1"])
    # the Python API: the same captions, and rerank="none" the beam's
    cap = Captioner.load(reranked_folder)
    assert {p.name: r.text for p, r in zip(photos, cap(paths))} == own
    assert {p.name: r.text for p, r in zip(photos, cap(paths, rerank="none"))} == off
    assert direct_captions(cap, photos) == own
    # evaluate: the folder's reranker, recorded
    out = tmp_path / "eval.json"
    assert main(["evaluate", "--model", str(reranked_folder), "--dataset", str(picky_data), "--split", "dev",
                 "--metrics", "bleu", "--tokenizer", "python", "--meteor", "none", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert (doc["rerank"], doc["nbest"], doc["match_weight"]) == ("match", 3, 1000.0)
    assert doc["matcher"] == str((reranked_folder / "matcher").resolve())
    assert doc["captions"] == {k: own[k] for k in doc["captions"]}
    assert "matcher over the 3 best beams (weight 1000)" in capsys.readouterr().out


@pytest.mark.parametrize("table, message", [
    ({"method": "mbr", "matcher": "matcher", "nbest": 3, "weight": 0.1}, "rerank.method must be 'match'"),
    ({"method": "match", "matcher": "matcher", "nbest": 1, "weight": 0.1}, "rerank.nbest must be a whole number"),
    ({"method": "match", "matcher": "matcher", "nbest": 3, "weight": -1}, "rerank.weight must be a number >= 0"),
    ({"method": "match", "matcher": "../m", "nbest": 3, "weight": 0.1}, "rerank.matcher must be a folder inside"),
    ({"method": "match", "matcher": "nowhere", "nbest": 3, "weight": 0.1}, "is not a checkpoint folder"),
    ({"method": "match", "nbest": 3, "weight": 0.1}, "'rerank' must be a table of"),
])
def test_a_wrong_rerank_table_is_one_line_naming_the_file(reranked_folder, tmp_path, table, message):
    import shutil

    from captionkit.inference.ensemble import read_ensemble
    from captionkit.inference.rerank import read_folder_rerank
    folder = tmp_path / "ens"
    shutil.copytree(reranked_folder, folder)
    doc = json.loads((folder / "ensemble.json").read_text())
    (folder / "ensemble.json").write_text(json.dumps({**doc, "rerank": table}))
    for read in (read_ensemble, read_folder_rerank):
        with pytest.raises(CheckpointError, match=f"{folder / 'ensemble.json'}: .*{message}"):
            read(folder)


def test_the_ensemble_command_s_reranker_options_are_checked_before_loading(picky_models, tmp_path, capsys,
                                                                           no_expensive_work):
    a, b = picky_models
    for argv, message in ((["--matcher", "m"], "--matcher is for --rerank match"),
                          (["--rerank", "match"], "--rerank match needs --matcher")):
        assert main(["ensemble", "--model", str(a), "--model", str(b), *argv, "--out", str(tmp_path / "e")]) == 2
        assert message in capsys.readouterr().err


def test_a_folder_with_its_reranker_is_pushed_with_its_matcher(reranked_folder, picky_data, tmp_path):
    from helpers import place_in_cache
    repo, commit = "captionkit-tests/reranked", "c" * 40
    photos = sorted((picky_data / "Flicker8k_Dataset").iterdir())
    out = tmp_path / "upload"
    assert main(["push", str(reranked_folder), repo, "--dry-run", str(out), "--samples", str(photos[0])]) == 0
    assert (out / "matcher" / "model.safetensors").read_bytes() == \
        (reranked_folder / "matcher" / "model.safetensors").read_bytes()  # the folder's, as it is
    assert "chosen among the 3 best by its matcher (weight 1000" in (out / "README.md").read_text()
    place_in_cache(out, tmp_path / "cache", repo, commit)
    hub = Captioner.from_pretrained(f"hub:{repo}", cache_dir=tmp_path / "cache", local_files_only=True)
    assert hub.own_rerank is not None
    assert direct_captions(hub, photos) == direct_captions(Captioner.load(reranked_folder), photos)


def test_a_matcher_narrowed_to_some_words_scores_their_captions_as_before(picky_matcher, tmp_path):
    from captionkit.core.checkpoint import save_checkpoint
    from captionkit.models.matcher import matcher_of_words
    source = load_matcher(picky_matcher)
    words = set(source.cfg.words[2:]) - {"red"}
    assert "red" in source.cfg.words  # (what makes the test mean something: a word goes)
    save_checkpoint(tmp_path / "narrow", *matcher_of_words(picky_matcher, words))
    narrow = load_matcher(tmp_path / "narrow")
    assert narrow.cfg.words == [w for w in source.cfg.words if w != "red"]
    assert narrow.embed.weight.shape[0] == source.embed.weight.shape[0] - 1
    x = torch.randn(2, source.cfg.feat_dim, generator=torch.Generator().manual_seed(0))
    without, withred = ["a blue circle on the white", "the square"], ["a red circle", "red red"]
    torch.testing.assert_close(narrow.discriminability(narrow.pooled_image(x), narrow.text(without)),
                               source.discriminability(source.pooled_image(x), source.text(without)))
    unk = ["a <unk> circle", "<unk> <unk>"]  # "red" is now a word it does not know
    torch.testing.assert_close(narrow.discriminability(narrow.pooled_image(x), narrow.text(withred)),
                               source.discriminability(source.pooled_image(x), source.text(unk)))

def test_an_int8_matcher_narrowed_stays_int8_bit_for_bit(tmp_path):
    """``captionkit pack --int8`` of a matcher (matrices of >= 4096 entries as int8), narrowed:
    the kept embedding rows and every other tensor as they were."""
    from dataclasses import asdict

    from safetensors.torch import load_file

    from captionkit.core.checkpoint import save_checkpoint
    from captionkit.models.matcher import KIND, matcher_of_words
    words = ["<pad>", "<unk>", *(f"w{i}" for i in range(80))]
    torch.manual_seed(0)
    m = Matcher(MatcherConfig(words=words, feat_dim=64, embed_dim=64, word_dim=64, bank_size=8))
    m.bank.copy_(torch.nn.functional.normalize(torch.randn(8, 64), dim=1))
    save_checkpoint(tmp_path / "m", m.state_dict(), {"kind": KIND, "matcher": asdict(m.cfg)})
    assert main(["pack", str(tmp_path / "m"), str(tmp_path / "m8"), "--int8"]) == 0
    save_checkpoint(tmp_path / "narrow8", *matcher_of_words(tmp_path / "m8", {"w3", "w50", "other"}))
    a, b = load_file(tmp_path / "m8" / "model.safetensors"), load_file(tmp_path / "narrow8" / "model.safetensors")
    assert a.keys() == b.keys() and b["embed.weight"].dtype == torch.int8
    for k in a:
        assert torch.equal(b[k], a[k][[0, 1, 5, 52]] if k.startswith("embed.weight") else a[k]), k
    assert load_matcher(tmp_path / "narrow8").cfg.words == ["<pad>", "<unk>", "w3", "w50"]
