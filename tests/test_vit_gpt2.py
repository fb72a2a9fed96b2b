"""The vit_gpt2 family on a tiny random ViT (2 blocks, width 24, 32 px images of 8 px patches)
and a tiny random GPT-2 (2 blocks, width 32: the widths differ, so the projection exists) with
a byte-level BPE tokenizer trained here on the synthetic shapes captions, all saved to temporary
folders: no network. Which tensors a training step changes under several freezing settings,
the KV-cached steps against the teacher-forced forward and against the VisionEncoderDecoderModel's
own forward on the pixels, a trainer run through the checkpoint, its reload, the transformers
export and the command line, and the one-line errors for models that are not there. (What
every family must do -- beam 1 against greedy, shared images, rescoring -- is asserted in
test_model_contract.py.)"""

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from helpers import shape_image, write_lm_config  # noqa: E402

from captionkit.cli.main import main  # noqa: E402
from captionkit.core.checkpoint import read_config, read_weights  # noqa: E402
from captionkit.core.errors import WeightsUnavailable  # noqa: E402
from captionkit.data.images import to_tensor  # noqa: E402
from captionkit.data.tokenizers import LMTokenizer  # noqa: E402
from captionkit.encoders import create_encoder  # noqa: E402
from captionkit.encoders.vit_pixels import DEFAULT_VIT  # noqa: E402
from captionkit.inference.captioner import Captioner  # noqa: E402
from captionkit.models import create_model  # noqa: E402
from captionkit.training.config import RunConfig  # noqa: E402
from captionkit.training.run import build_trainer  # noqa: E402

GRID, ROW = [4, 4], 3 * 8 * 8  # the tiny ViT's patch grid and pixels per patch


def model_of(vit: str, lm: str, **cfg):
    torch.manual_seed(0)
    vocab = len(LMTokenizer.build(lm))
    return create_model("vit_gpt2", {"vocab_size": vocab, "feat_dim": ROW, "grid": GRID, "vit": vit, "lm": lm,
                                       **cfg}).eval()


def caption_ids(tok: LMTokenizer) -> torch.Tensor:
    """(3, T+1): <start> words <end>, padded with <pad> to one length."""
    ids = [tok.encode(["a", "red", "circle"]), tok.encode(["one", "blue", "square", "in", "the", "middle"]),
           tok.encode(["the", "triangle"])]
    T = max(map(len, ids))
    return torch.tensor([i + [0] * (T - len(i)) for i in ids])


def test_the_encoder_rows_are_the_vits_pixels(tiny_vit, tiny_gpt2):
    enc = create_encoder("vit_pixels", weights=tiny_vit)
    assert enc.preprocess.size == 32 and enc.preprocess.resample == "bilinear"  # the processor's filter
    assert enc.grid() == tuple(GRID) and enc.dim == ROW
    x = to_tensor(shape_image(1, size=80), enc.preprocess)  # (3, 32, 32) in [0, 1]
    with torch.no_grad():
        rows = enc(x.unsqueeze(0))  # (1, 16, 192)
    model = model_of(tiny_vit, tiny_gpt2)
    torch.testing.assert_close(model.pixels(rows), (x.unsqueeze(0) - 0.5) / 0.5)  # the ViT's mean and std
    # another geometry than the ViT's is refused in one line, naming the encoder to use
    with pytest.raises(ValueError, match=r"takes 4x4 patches of 3x8x8 pixels: train on \[encoder\] name = "
                                         r"\"vit_pixels\""):
        create_model("vit_gpt2", {"vocab_size": model.cfg.vocab_size, "feat_dim": 768, "grid": [14, 14],
                                    "vit": tiny_vit, "lm": tiny_gpt2})


# the installed transformers' own way of passing the cache (captionkit.core.hf.with_cache): a
# deprecated keyword warns (FutureWarning), and stops working in a later release
@pytest.mark.filterwarnings("error::FutureWarning")
def test_kv_cached_steps_give_the_teacher_forced_log_probs(tiny_vit, tiny_gpt2):
    tok = LMTokenizer.build(tiny_gpt2)
    model = model_of(tiny_vit, tiny_gpt2, freeze_encoder_blocks=0, freeze_decoder_blocks=0)
    feats = torch.rand(3, GRID[0] * GRID[1], ROW)
    ids = caption_ids(tok)  # (3, T+1)
    with torch.no_grad():
        full, _ = model(feats, ids[:, :-1])  # (B, T, V) log-probs
        # the same logits as the VisionEncoderDecoderModel's own forward on the pixels (no cache)
        own = model.ved(pixel_values=model.pixels(feats), decoder_input_ids=model.lm_ids(ids[:, :-1])).logits
        torch.testing.assert_close(model.lm_logits(feats, ids[:, :-1]), own, atol=1e-5, rtol=1e-5)
        mem = model.prepare(feats)
        state = model.init_state(mem)
        for t in range(ids.shape[1] - 1):
            logp, state, attention = model.step(ids[:, t], state, mem)
            torch.testing.assert_close(logp, full[:, t], atol=1e-5, rtol=1e-5)
            assert attention.shape == (3, GRID[0] * GRID[1])
            torch.testing.assert_close(attention.sum(1), torch.ones(3))
    assert state[0].shape[2] == ids.shape[1] - 1  # GPT-2's cache grew one position per step
    assert mem.keys[0].shape[2] == 1 + GRID[0] * GRID[1]  # cross-attention memory: class token + patches
    assert torch.isinf(full[..., [0, 1, 3, 4 + model.eos_id]]).all()  # <end> is the only way to stop
    assert math.isclose(float(full[0, 0].exp().sum()), 1.0, rel_tol=1e-5)


def test_the_trainer_takes_the_familys_default_lm_for_its_tokenizer():
    from captionkit.models import family_default, model_class
    assert model_class("vit_gpt2").tokenizer_source({}) == "gpt2" and family_default("vit_gpt2", "vit") == DEFAULT_VIT
    assert model_class("vit_gpt2").tokenizer_source({"lm": "distilgpt2"}) == "distilgpt2"
    assert model_class("prefix_lm").tokenizer_source({}) == "smollm2-135m"
    assert model_class("sat").tokenizer_source({"lm": "gpt2"}) is None
    assert family_default("sat", "lm") is None and family_default("vit_gpt2", "vocab_size") is None


def write_config(path: Path, dataset: Path, vit: str, lm: str, epochs: int = 1, model: str = "",
                 train: str = "") -> Path:
    return write_lm_config(path, dataset, f'name = "vit_pixels"\nweights = "{vit}"',
                           f'family = "vit_gpt2"\nvit = "{vit}"\nlm = "{lm}"\n{model}', epochs, train)


# name: ([model] lines, [train] lines, patterns of exactly the tensors that must change, the
# optimizer's learning rates in the order encoder, decoder, cross_attention, projection)
CROSS = [r"\.crossattention\.", r"\.ln_cross_attn\.", r"^ved\.enc_to_dec_proj\."]
MODES = {
    "decoder_top": ('freeze_encoder_blocks = "all"\nfreeze_decoder_blocks = 1',
                    "lr_groups = { cross_attention = 1e-2, decoder = 1e-3 }",
                    CROSS + [r"^ved\.decoder\.transformer\.h\.1\.", r"^ved\.decoder\.transformer\.ln_f\."],
                    [1e-3, 1e-2, 3e-3]),
    "encoder_top": ("freeze_encoder_blocks = 1\nfreeze_decoder_blocks = \"all\"",
                    "lr_groups = { encoder = 1e-4, projection = 5e-3 }",
                    CROSS + [r"^ved\.encoder\.(encoder\.)?layers?\.1\.", r"^ved\.encoder\.layernorm\."],
                    [1e-4, 3e-3, 5e-3]),
    "nothing_frozen": ("freeze_encoder_blocks = 0\nfreeze_decoder_blocks = 0", "batching = \"image\"",
                       [r"^ved\.(?!encoder\.pooler\.)"],  # the pooler is never used, so never trained
                       [3e-3, 3e-3, 3e-3, 3e-3]),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_a_training_step_changes_exactly_the_unfrozen_tensors(mode, tiny_vit, tiny_gpt2, flickr_dir, tmp_path):
    model_lines, train_lines, patterns, lrs = MODES[mode]
    cfg = RunConfig.load(write_config(tmp_path / "c.toml", flickr_dir, tiny_vit, tiny_gpt2, model=model_lines,
                                      train=train_lines))
    trainer = build_trainer(cfg, tmp_path / "run", vocab=LMTokenizer.build(tiny_gpt2))
    loss, figures = trainer.batch_loss(trainer.epoch_batches(0)[0])
    assert math.isfinite(float(loss.detach())) and math.isfinite(figures["loss"])

    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit(max_steps=2, progress=False)
    after = dict(trainer.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    expected = {n for n in before if any(re.search(p, n) for p in patterns)}
    assert changed == expected
    assert changed == {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert not trainer.data.encoder.state_dict()  # vit_pixels holds no weights: the ViT is the model's
    assert [g["lr"] for g in trainer.opt.param_groups] == pytest.approx(lrs)  # schedule factor 1 here
    # the checkpoint holds what was trained and nothing else
    assert set(read_weights(tmp_path / "run" / "last")) == expected


def test_freezing_settings_are_checked_in_one_line(tiny_vit, tiny_gpt2):
    with pytest.raises(ValueError, match=r"freeze_encoder_blocks must be a number of blocks >= 0 or \"all\", "
                                         r"got 'some'"):
        model_of(tiny_vit, tiny_gpt2, freeze_encoder_blocks="some")
    with pytest.raises(ValueError, match=r"freeze_decoder_blocks must be .* got -1"):
        model_of(tiny_vit, tiny_gpt2, freeze_decoder_blocks=-1)
    with pytest.raises(ValueError, match=r"freeze_decoder_blocks is 3, but .*tiny_gpt2.* has 2 blocks"):
        model_of(tiny_vit, tiny_gpt2, freeze_decoder_blocks=3)
    with pytest.raises(ValueError, match="unknown fields: freeze_blocks"):
        model_of(tiny_vit, tiny_gpt2, freeze_blocks=1)


@pytest.fixture(scope="module")
def trained(tiny_vit, tiny_gpt2, flickr_dir, tmp_path_factory):
    """A few epochs on the shapes: ViT's last block, all of GPT-2, per-group learning rates."""
    out = tmp_path_factory.mktemp("vit_gpt2_run")
    cfg = RunConfig.load(write_config(out / "run.toml", flickr_dir, tiny_vit, tiny_gpt2, epochs=8,
                                      model="freeze_encoder_blocks = 1\nfreeze_decoder_blocks = 0",
                                      train="lr_groups = { encoder = 1e-3, decoder = 1e-2, cross_attention = 2e-2 }"))
    trainer = build_trainer(cfg, out / "run", vocab=LMTokenizer.build(tiny_gpt2))
    trainer.fit(progress=False)  # ends with the best checkpoint's weights loaded into trainer.model
    return trainer, out / "run" / "best"


@pytest.mark.slow  # the trained fixture: a ViT-GPT-2 training run
def test_the_checkpoint_reloads_to_identical_captions(trained, tiny_vit, tiny_gpt2):
    trainer, best = trained
    cfg = read_config(best)
    assert cfg["family"] == "vit_gpt2" and cfg["model"]["vit"] == tiny_vit and cfg["model"]["lm"] == tiny_gpt2
    assert cfg["encoder"]["name"] == "vit_pixels" and cfg["vocab"]["kind"] == "lm"
    saved = read_weights(best)
    assert saved and set(saved) == trainer.model.trained
    assert not any(".embeddings." in k or ".layers.0." in k or "pooler" in k for k in saved)  # frozen: not saved
    cap = Captioner.load(best)
    feats = trainer.data.val_feats[:].float()
    ours = cap.decode_features(feats, beam=2)
    trainer.model.eval()
    theirs = Captioner(trainer.model, trainer.vocab, cfg).decode_features(feats, beam=2)
    assert [c.ids for c in ours] == [c.ids for c in theirs]
    assert [c.logprob for c in ours] == pytest.approx([c.logprob for c in theirs], abs=1e-5)
    assert all(c.ids for c in ours)  # it learnt to say something


@pytest.mark.slow  # the trained fixture: a ViT-GPT-2 training run
def test_captionkit_caption_prints_the_caption(trained, tmp_path, capsys):
    _, best = trained
    shape_image(0, size=80).save(tmp_path / "photo.jpg")
    rc = main(["caption", "--model", str(best), "--beam", "2", "--attention", str(tmp_path / "figs"),
               str(tmp_path / "photo.jpg")])
    out, err = capsys.readouterr()
    assert rc == 0, err
    name, caption = out.strip("\n").split("\t")
    assert name == "photo.jpg" and caption.split()
    assert len(list((tmp_path / "figs").glob("*.png"))) == 1  # the cross-attention over the patch grid, per word
    (_, result), = Captioner.load(best).caption_files([tmp_path / "photo.jpg"], beam=2)
    assert result.text == caption


@pytest.mark.slow  # the trained fixture: a ViT-GPT-2 training run
def test_the_transformers_export_gives_the_same_logits(trained, tmp_path):
    from transformers import VisionEncoderDecoderModel

    from captionkit.export.exporters import export_transformers
    trainer, best = trained
    out = export_transformers(best, tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "preprocessor_config.json"} <= {
        p.name for p in out.iterdir()}
    ved = VisionEncoderDecoderModel.from_pretrained(out).eval()
    model = trainer.model.eval()
    feats = trainer.data.val_feats[:2].float()
    ids = model.lm_ids(caption_ids(trainer.vocab)[:2, :-1])
    with torch.no_grad():
        ours = model.ved(pixel_values=model.pixels(feats), decoder_input_ids=ids).logits
        exported = ved(pixel_values=model.pixels(feats), decoder_input_ids=ids).logits
    torch.testing.assert_close(exported, ours, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # the trained fixture: a ViT-GPT-2 training run
def test_models_that_are_not_there_are_one_line_errors(trained, tiny_vit, tiny_gpt2, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    vocab = len(LMTokenizer.build(tiny_gpt2))

    def build(**cfg):
        return create_model("vit_gpt2", {"vocab_size": vocab, "feat_dim": ROW, "grid": GRID, "lm": tiny_gpt2,
                                           "vit": tiny_vit, **cfg})

    with pytest.raises(WeightsUnavailable, match=r"vision model '.*no_such_vit': no such folder"):
        build(vit=str(tmp_path / "no_such_vit"))
    with pytest.raises(WeightsUnavailable, match=r"language model '.*no_such_lm': no such folder"):
        build(lm=str(tmp_path / "no_such_lm"))
    with pytest.raises(WeightsUnavailable, match="vision model 'captionkit-tests/no-such-vit' is neither a folder "
                                                 "nor in the local Hugging Face cache"):
        build(vit="captionkit-tests/no-such-vit")
    not_gpt2 = shutil.copytree(tiny_gpt2, tmp_path / "not_gpt2")  # GPT-2's tokenizer, a ViT's config
    shutil.copy(Path(tiny_vit) / "config.json", not_gpt2 / "config.json")
    with pytest.raises(ValueError, match=r"language model '.*not_gpt2' is a vit model; the vit_gpt2 family "
                                         r"needs a GPT-2"):
        build(lm=str(not_gpt2))
    # a checkpoint short of a tensor: never random weights in its place
    broken = shutil.copytree(tiny_gpt2, tmp_path / "broken_gpt2")
    weights = load_file(broken / "model.safetensors")
    del weights["transformer.h.1.mlp.c_fc.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(WeightsUnavailable, match=r"broken_gpt2.*lacks 1 tensors.*c_fc"):
        build(lm=str(broken))
    # the real-weights default: offline, the error names it (skipped where it is cached)
    from huggingface_hub import try_to_load_from_cache
    if isinstance(try_to_load_from_cache("google/vit-base-patch16-224-in21k", "config.json"), str):
        pytest.skip("google/vit-base-patch16-224-in21k is in the local Hugging Face cache")
    with pytest.raises(WeightsUnavailable, match="vision model 'google/vit-base-patch16-224-in21k' is neither"):
        create_model("vit_gpt2", {"vocab_size": vocab, "lm": tiny_gpt2})
    # and from the command line: a checkpoint whose ViT is gone fails in one line naming it
    _, best = trained
    ckpt = shutil.copytree(best, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model"]["vit"] = cfg["encoder"]["weights"] = str(tmp_path / "deleted_vit")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    shape_image(0, size=80).save(tmp_path / "photo.jpg")
    rc = main(["caption", "--model", str(ckpt), str(tmp_path / "photo.jpg")])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "deleted_vit" in err and "no such folder" in err
