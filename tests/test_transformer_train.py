"""The transformer family through the trainer, the checkpoint and the command line, on the
synthetic shapes corpus: patches from scratch and a CNN grid, word/char/BPE tokens, one random
caption per image per epoch, label smoothing, warm-up + cosine / inverse square root, AdamW,
GloVe vectors frozen or fine-tuned, exact resume."""

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import shape_image, word_trainer
from PIL import Image

from captionkit.cli.main import main
from captionkit.core.checkpoint import read_config, read_weights
from captionkit.inference.captioner import Captioner
from captionkit.training.config import RunConfig, TrainConfig
from captionkit.training.run import train
from captionkit.training.schedule import lr_factor

GLOVE = Path(__file__).parent / "data" / "glove_tiny.6d.txt"

CONFIG = """
[data]
dataset = "{dataset}"
min_count = 1
{data}

[encoder]
name = "{encoder}"
weights = "random"

[model]
family = "transformer"
width = 16
heads = 2
encoder_layers = {encoder_layers}
decoder_layers = 1
dropout = 0.0
max_positions = {max_positions}
{model}

[train]
epochs = {epochs}
batch_size = 8
lr = {lr}
precision = "fp32"
val_beam = 2
checkpoint_every = 0
max_len = {max_len}
alpha_c = 0.0
{train}
"""


def write_config(path: Path, dataset: Path, encoder="patches", encoder_layers=1, max_positions=24, max_len=12,
                 epochs=1, lr=3e-3, data="", model="", train="") -> Path:
    path.write_text(CONFIG.format(dataset=dataset, encoder=encoder, encoder_layers=encoder_layers,
                                  max_positions=max_positions, max_len=max_len, epochs=epochs, lr=lr, data=data,
                                  model=model, train=train))
    return path


@pytest.fixture(scope="module")
def word_run(flickr_dir, tmp_path_factory) -> Path:
    """Patches from scratch + words, AdamW, warm-up then cosine, label smoothing, one random
    caption per image per epoch: 3 epochs."""
    out = tmp_path_factory.mktemp("tr_word")
    cfg = write_config(out / "word.toml", flickr_dir, epochs=3, train="""
optimizer = "adamw"
weight_decay = 0.01
schedule = "cosine"
warmup_steps = 3
label_smoothing = 0.1
caption_sampling = "random_one"
length_penalties = [0.0, 1.0]
""")
    train(cfg, out=out / "run", progress=False)
    return out / "run"


@pytest.fixture(scope="module")
def char_run(flickr_dir, tmp_path_factory) -> Path:
    """Patches from scratch + characters, inverse square root schedule: 2 epochs."""
    out = tmp_path_factory.mktemp("tr_char")
    cfg = write_config(out / "char.toml", flickr_dir, epochs=2, max_positions=48, max_len=40,
                       lr=1e-2, data='tokenizer = "char"',
                       train='schedule = "inverse_sqrt"\nwarmup_steps = 4')
    train(cfg, out=out / "run", progress=False)
    return out / "run"


def test_patches_and_words_run_writes_a_transformer_checkpoint(word_run):
    cfg = read_config(word_run / "best")
    assert cfg["family"] == "transformer" and cfg["encoder"]["name"] == "patches"
    assert cfg["model"]["grid"] == [16, 16] == cfg["encoder"]["grid"] and cfg["model"]["feat_dim"] == 192
    hist = [json.loads(line) for line in (word_run / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == [1, 2, 3]
    assert hist[-1]["loss"] < hist[0]["loss"]
    # random_one: 9 captions per epoch (one per training image), at most one batch each
    steps = [0] + [h["step"] for h in hist]
    assert all(0 < b - a <= 9 for a, b in zip(steps, steps[1:]))
    # cosine: the last epoch ends near lr 0
    assert hist[-1]["lr"] < 0.2 * 3e-3
    cap = Captioner.load(word_run / "best")
    assert type(cap.decoder).__name__ == "TransformerCaptioner"
    res = cap.result(cap.decode_features(torch.randn(1, 256, 192), beam=2)[0])
    assert res.attention.shape == (len(res.words), 256)


def test_caption_command_with_attention_works_for_a_transformer(word_run, char_run, tmp_path, capsys):
    shape_image(1, size=80).save(tmp_path / "photo.jpg")
    for run in (word_run, char_run):
        figs = tmp_path / f"att_{run.parent.name}"
        rc = main(["caption", "--model", str(run / "best"), "--attention", str(figs), "--beam", "2",
                   str(tmp_path / "photo.jpg")])
        out, err = capsys.readouterr()
        assert rc == 0, err
        name, caption = out.strip().split("\t")
        assert name == "photo.jpg" and caption
        im = Image.open(figs / "photo.jpg.png")  # figures are named after the whole file name
        assert im.format == "PNG" and im.width > 200


def test_character_model_gives_one_attention_panel_per_word(char_run):
    cap = Captioner.load(char_run / "best", with_encoder=False)
    assert read_config(char_run / "best")["vocab"]["kind"] == "char"
    c = cap.decode_features(torch.randn(1, 256, 192), beam=2)[0]
    res = cap.result(c)
    spans = cap.vocab.spans(c.ids)
    assert res.words == [w for w, _ in spans] and res.attention.shape == (len(res.words), 256)
    for row, (_, pos) in zip(res.attention, spans):  # each word: the mean of its characters' rows
        torch.testing.assert_close(row, c.attention[pos].mean(0))


@pytest.mark.slow  # a training run
def test_pretrained_grid_with_bpe_tokens(flickr_dir, tmp_path):
    cfg = write_config(tmp_path / "bpe.toml", flickr_dir, encoder="efficientnet_lite0", encoder_layers=0,
                       max_positions=40, max_len=20, data='tokenizer = "bpe"\nbpe_vocab_size = 40',
                       model="tie_embeddings = false")
    train(cfg, out=tmp_path / "run", progress=False)
    saved = read_config(tmp_path / "run" / "best")
    assert saved["vocab"]["kind"] == "bpe" and saved["model"]["grid"] == [7, 7]
    cap = Captioner.load(tmp_path / "run" / "best", with_encoder=False)
    assert len(cap.vocab) == saved["model"]["vocab_size"]
    for c in cap.decode_features(torch.randn(2, 49, 1280).abs(), beam=2):
        words = cap.vocab.decode(c.ids)
        assert cap.result(c).words == words and all(" " not in w and not w.startswith("##") for w in words)


def test_one_random_caption_per_image_per_epoch(flickr_dir, tmp_path):
    cfg = write_config(tmp_path / "r1.toml", flickr_dir, train='caption_sampling = "random_one"')
    run_cfg = RunConfig.load(cfg)
    trainer = word_trainer(run_cfg, tmp_path)
    picks = []
    for epoch in range(3):
        chosen = [i for b in trainer.epoch_batches(epoch) for i in b]
        rows = [trainer.examples[i][0] for i in chosen]
        assert sorted(rows) == list(range(len(trainer.data.train_items)))  # every image, once
        assert all(len({len(trainer.examples[i][1]) for i in b}) == 1 for b in trainer.epoch_batches(epoch))
        picks.append(sorted(chosen))
        assert trainer.epoch_batches(epoch) == trainer.epoch_batches(epoch)  # seeded: resumable
    assert picks[0] != picks[1] or picks[1] != picks[2]  # a new draw each epoch


def test_image_batches_hold_whole_images_and_every_caption_once(flickr_dir, tmp_path):
    cfg = write_config(tmp_path / "ib.toml", flickr_dir, train='batching = "image"')
    cfg.write_text(cfg.read_text().replace("batch_size = 8", "batch_size = 12"))  # room for two images
    run_cfg = RunConfig.load(cfg)
    trainer = word_trainer(run_cfg, tmp_path)
    for epoch in range(2):
        batches = trainer.epoch_batches(epoch)
        assert sorted(i for b in batches for i in b) == list(range(len(trainer.examples)))
        for b in batches:
            rows = {trainer.examples[i][0] for i in b}
            assert all(set(trainer.image_examples[r]) <= set(b) for r in rows)  # whole images
            assert len(b) <= 12 or len(rows) == 1
        assert any(len({trainer.examples[i][0] for i in b}) > 1 for b in batches)
        assert batches == trainer.epoch_batches(epoch)  # seeded: resumable
    loss, figures = trainer.batch_loss(batches[0])  # padded captions, one encoder pass per image
    assert math.isfinite(float(loss.detach())) and figures["loss"] > 0


def test_image_batching_needs_a_family_that_shares_the_image_side(flickr_dir, tmp_path):
    cfg = write_config(tmp_path / "lstm.toml", flickr_dir, train='batching = "image"')
    text = cfg.read_text().replace('family = "transformer"', 'family = "sat"')
    for key in ("width", "heads", "encoder_layers", "decoder_layers", "max_positions"):
        text = "\n".join(line for line in text.splitlines() if not line.startswith(key + " ="))
    cfg.write_text(text)
    with pytest.raises(ValueError, match='train.batching = "image" needs a family that shares the image side'):
        train(cfg, out=tmp_path / "lstm", progress=False)


@pytest.mark.slow  # a training run
def test_dev_scoring_every_n_epochs_and_after_the_last(flickr_dir, tmp_path):
    cfg = write_config(tmp_path / "ve.toml", flickr_dir, epochs=3, train="val_every = 2")
    train(cfg, out=tmp_path / "run", progress=False)
    hist = [json.loads(line) for line in (tmp_path / "run" / "history.jsonl").read_text().splitlines()]
    assert [h["epoch"] for h in hist] == [1, 2, 3]
    assert ["CIDEr" in h for h in hist] == [False, True, True]
    assert read_config(tmp_path / "run" / "best")["state"]["best_epoch"] in (2, 3)


def test_learning_rate_schedules():
    cos = TrainConfig(schedule="cosine", warmup_steps=10)
    assert lr_factor(cos, 0, 0.0) == pytest.approx(0.1)  # warm-up: step 1 of 10
    assert lr_factor(cos, 9, 0.0) == pytest.approx(1.0)
    assert lr_factor(cos, 50, 0.5) == pytest.approx(0.5)
    assert lr_factor(cos, 99, 1.0) == pytest.approx(0.0, abs=1e-12)
    inv = TrainConfig(schedule="inverse_sqrt", warmup_steps=4)
    assert [lr_factor(inv, s, 0.0) for s in range(4)] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lr_factor(inv, 15, 0.0) == pytest.approx(math.sqrt(4 / 16))
    assert lr_factor(TrainConfig(), 123, 0.7) == 1.0  # plateau without warm-up: the old behaviour
    with pytest.raises(ValueError, match="inverse_sqrt"):
        TrainConfig(schedule="inverse_sqrt")
    with pytest.raises(ValueError, match="train.schedule must be one of plateau, cosine, inverse_sqrt"):
        TrainConfig(schedule="linear")
    with pytest.raises(ValueError, match="train.caption_sampling must be one of all, random_one"):
        TrainConfig(caption_sampling="one")


def test_adamw_decays_matrices_not_biases_or_norms(flickr_dir, tmp_path):
    cfg = write_config(tmp_path / "aw.toml", flickr_dir, train='optimizer = "adamw"\nweight_decay = 0.1')
    run_cfg = RunConfig.load(cfg)
    trainer = word_trainer(run_cfg, tmp_path)
    assert isinstance(trainer.opt, torch.optim.AdamW)
    decay, no_decay = trainer.opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(trainer.model.parameters()))


@pytest.mark.slow  # training runs
def test_resume_with_a_schedule_matches_an_unbroken_run(flickr_dir, tmp_path):
    cfg = write_config(tmp_path / "res.toml", flickr_dir, epochs=2, train="""
optimizer = "adamw"
weight_decay = 0.01
schedule = "cosine"
warmup_steps = 2
caption_sampling = "random_one"
label_smoothing = 0.1
""")
    broken, whole = tmp_path / "broken", tmp_path / "whole"
    train(cfg, out=broken, max_steps=2, progress=False)
    train(cfg, out=broken, max_steps=4, resume=True, progress=False)
    train(cfg, out=whole, max_steps=4, progress=False)
    assert read_config(broken / "last")["state"]["step"] == 4
    a, b = read_weights(broken / "last"), read_weights(whole / "last")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)
    oa = read_weights(broken / "last", "optimizer.safetensors")
    ob = read_weights(whole / "last", "optimizer.safetensors")
    assert read_config(broken / "last")["optimizer_groups"] == read_config(whole / "last")["optimizer_groups"]
    for k in oa:
        torch.testing.assert_close(oa[k], ob[k], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("freeze", [True, False])
@pytest.mark.slow  # a training run
def test_glove_vectors_frozen_or_fine_tuned(flickr_dir, tmp_path, freeze):
    cfg = write_config(tmp_path / "g.toml", flickr_dir,
                       train=f'glove = "{GLOVE}"\nfreeze_embeddings = {str(freeze).lower()}')
    train(cfg, out=tmp_path / "run", progress=False)
    cov = json.loads((tmp_path / "run" / "glove_coverage.json").read_text())
    assert cov["dim"] == 6 and cov["missing"] == ["green", "triangle"] and cov["found"] == cov["total"] - 2
    saved = read_config(tmp_path / "run" / "last")
    assert saved["model"]["embed_dim"] == 6  # the file's dimension, projected to width 16
    w = read_weights(tmp_path / "run" / "last")
    assert w["embed.weight"].shape[1] == 6 and w["embed_proj.weight"].shape == (16, 6)
    vocab = saved["vocab"]
    rows = {line.split()[0]: [float(x) for x in line.split()[1:]] for line in GLOVE.read_text().splitlines()}
    red = w["embed.weight"][vocab.index("red")]
    if freeze:
        torch.testing.assert_close(red, torch.tensor(rows["red"]))
    else:
        assert not torch.allclose(red, torch.tensor(rows["red"]))


def test_configuration_errors_name_the_field(flickr_dir, tmp_path):
    cases = [
        (dict(data='tokenizer = "char"', train=f'glove = "{GLOVE}"'), "word vectors need a word tokenizer"),
        (dict(train="freeze_embeddings = true"), "train.freeze_embeddings needs train.glove"),
        (dict(max_positions=7, max_len=5), "model.max_positions is 7, but training captions need 8"),
        (dict(max_positions=8), "train.max_len is 12, but decoding needs max_len \\+ 1 = 13 positions"),
        (dict(train=f'glove = "{GLOVE}"', model="embed_dim = 5"), "model.embed_dim is 5 but .* holds 6-d vectors"),
        (dict(data='tokenizer = "wordpiece"'), "data.tokenizer must be one of word, char, bpe"),
    ]
    for i, (kw, msg) in enumerate(cases):
        cfg = write_config(tmp_path / f"bad{i}.toml", flickr_dir, **kw)
        with pytest.raises(ValueError, match=msg):
            train(cfg, out=tmp_path / f"bad{i}", progress=False)


@pytest.mark.slow  # a training run and an ONNX export
def test_onnx_export_gives_the_same_captions(word_run, char_run, flickr_dir, tmp_path):
    pytest.importorskip("onnxruntime")
    from captionkit.data.images import find_images
    from captionkit.export.exporters import export_onnx
    from captionkit.export.onnx_runtime import parity_check
    files = find_images([flickr_dir / "Flicker8k_Dataset"])
    for run in (word_run, char_run):
        cap = Captioner.load(run / "best")
        out = tmp_path / run.parent.name
        export_onnx(cap, out, log=lambda s: None)
        for beam in (1, 3):
            rep = parity_check(cap, out, files, beam=beam)
            assert rep["identical"] == rep["images"] == len(files), rep["differ"]
            assert rep["numeric"]["logprobs"] < 1e-3
