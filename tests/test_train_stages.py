"""The trainer in stages: TrainState as JSON (old run folders' states included), the checks
a config gets at load that used to fail only once the model was built, and the stages run one
by one."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import TINY_CONFIG

from captionkit.cli.main import main
from captionkit.core.checkpoint import CheckpointError, read_config
from captionkit.training.config import ConfigError, RunConfig
from captionkit.training.run import train
from captionkit.training.stages import build_model, build_optimizer, build_tokenizer, prepare_data
from captionkit.training.trainer import EpochProgress, TrainState

# the "state" of a checkpoint written before TrainState (a run in /work/runs, mid-epoch)
OLD_STATE = {"epoch": 2, "step": 1234, "batch_in_epoch": 17, "best_score": 0.61, "best_epoch": 2, "bad_epochs": 0,
             "lr_bad_epochs": 0, "lr": 0.0004, "history": [{"epoch": 1, "step": 600, "CIDEr": 0.5}],
             "epoch_progress": {"seconds": 12.5, "seen": 544, "batches": 17, "sums": {"loss": 40.1}}}


def test_train_state_reads_an_old_state_and_writes_it_back_unchanged():
    st = TrainState.from_json(json.loads(json.dumps(OLD_STATE)), "run/last/config.json")
    assert (st.epoch, st.step, st.best_score, st.lr) == (2, 1234, 0.61, 0.0004)
    assert st.epoch_progress == EpochProgress(12.5, 544, 17, {"loss": 40.1})
    assert st.to_json() == OLD_STATE
    # a state saved between epochs has no progress; one lacking a newer key takes its default
    assert TrainState.from_json({"lr": 1e-3, "epoch": 1}, "x").epoch_progress is None
    with pytest.raises(CheckpointError, match="x: not a training state \\(unknown key epochs\\)"):
        TrainState.from_json({"lr": 1e-3, "epochs": 1}, "x")


def _write(tmp_path, text: str, flickr_dir) -> str:
    path = tmp_path / "run.toml"
    path.write_text(TINY_CONFIG.format(dataset=flickr_dir).replace("[train]\n", "[train]\n" + text + "\n"))
    return str(path)


@pytest.mark.parametrize("model,train_lines,message", [
    ("", "lr_groups = { lora = 1e-3 }",
     "train.lr_groups: the sat family has no parameter group 'lora' \\(its groups: decoder\\)"),
    ('family = "transformer"\nmax_positions = 16', "max_len = 20",
     "train.max_len is 20, but decoding needs max_len \\+ 1 = 21 positions and model.max_positions is 16"),
])
def test_model_and_train_tables_are_checked_together_at_load(tmp_path, flickr_dir, model, train_lines, message):
    text = TINY_CONFIG.format(dataset=flickr_dir).replace("max_len = 12", train_lines if "max_len" in train_lines
                                                          else "max_len = 12\n" + train_lines)
    if model:
        text = text.replace('family = "sat"\nembed_dim = 16\nhidden_dim = 24\nattn_dim = 12\ndropout = 0.0',
                            model + "\nwidth = 16\nheads = 2")
    path = tmp_path / "c.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"^{path}: {message}$"):
        RunConfig.load(path)


def test_a_glove_file_of_another_dimension_is_one_line_before_any_data(tmp_path, flickr_dir, no_expensive_work,
                                                                         capsys):
    vectors = tmp_path / "vectors.txt"
    vectors.write_text("red 0.1 0.2 0.3\nblue 0.3 0.2 0.1\n")
    cfg = _write(tmp_path, f'glove = "{vectors}"', flickr_dir)  # the tiny config's embed_dim is 16
    assert main(["train", "--config", cfg, "--out", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == (f"captionkit train: error: {cfg}: model.embed_dim is 16 but train.glove "
                                       f"{vectors} holds 3-d vectors (leave embed_dim out to use the file's)\n")


def test_the_stages_one_by_one(tiny_config, tmp_path):
    """prepare_data -> build_tokenizer -> build_model -> build_optimizer: each a value the next
    takes; nothing is written before the Trainer runs."""
    cfg = RunConfig.load(tiny_config)
    data = prepare_data(cfg)
    assert len(data.train_feats) == len(data.train_items) == 9 and data.tail is None
    vocab = build_tokenizer(cfg, data)
    built = build_model(cfg, data, vocab)
    assert built.family == "sat" and built.config["vocab_size"] == len(vocab)
    optim = build_optimizer(cfg, data, built.model)
    assert optim.trained_parameters["total"] == sum(p.numel() for p in built.model.parameters())
    assert not any(tmp_path.iterdir())


def test_train_and_val_max_images_take_the_first_images_of_each_split(tiny_config, tmp_path):
    full = prepare_data(RunConfig.load(tiny_config))
    cut = tiny_config.parent / "cut.toml"
    cut.write_text(tiny_config.read_text().replace("[train]", "[train]\ntrain_max_images = 4\nval_max_images = 2"))
    data = prepare_data(RunConfig.load(cut))
    assert [it.name for it in data.train_items] == [it.name for it in full.train_items[:4]]
    assert [it.name for it in data.val_items] == [it.name for it in full.val_items[:2]]
    assert len(data.train_feats) == 4 and len(data.val_feats) == 2


def test_a_run_resumes_from_a_checkpoint_of_the_old_state_format(tiny_config, tmp_path):
    """A run folder whose last checkpoint holds the state as the old trainer wrote it resumes."""
    out = tmp_path / "run"
    train(tiny_config, out=out, max_steps=5, progress=False)
    saved = read_config(out / "last")
    assert set(saved["state"]) == set(OLD_STATE)  # the JSON keys did not change
    st = train(tiny_config, out=out, resume=True, max_steps=7, progress=False)
    assert st.step == 7


def test_the_training_device_is_checked_before_any_data(tmp_path, flickr_dir, tiny_config, no_expensive_work,
                                                       monkeypatch, capsys):
    cfg = _write(tmp_path, 'device = "gpu"', flickr_dir)
    with pytest.raises(ConfigError, match=f"^{cfg}: train.device must be auto .*, not 'gpu'$"):
        RunConfig.load(cfg)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", "--config", str(tiny_config), "--out", str(tmp_path / "a"), "--device", "cuda"]) == 2
    assert capsys.readouterr().err == ("captionkit train: error: --device: device 'cuda': no CUDA GPU is visible "
                                       "here (torch.cuda.is_available() is False)\n")
    cuda = _write(tmp_path, 'device = "cuda:1"', flickr_dir)
    assert main(["train", "--config", cuda, "--out", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err.startswith(f"captionkit train: error: {cuda}: train.device: device 'cuda:1': ")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


class _Stop(Exception):
    """Ends prepare_data once its features are built (a meta encoder cannot go back to the CPU)."""


def test_the_feature_cache_is_computed_on_the_training_device(tiny_config, tmp_path, monkeypatch):
    """train --device cuda: the encoder that fills the cache runs on the training device, not
    the CPU (issue 28, item 13). The meta device stands in for the GPU: the encoder's calls are
    recorded there and answered with zero rows (float32, as the real encoder gives), in a cache
    of this test's own."""
    import captionkit.training.stages as stages
    from captionkit.encoders.base import Encoder, module_device

    monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / "cache"))  # new features; fake ones stay here
    seen: list[torch.device] = []

    def encode(self, pixels):
        seen.append(module_device(self))
        rows = self.grid()[0] * self.grid()[1]
        return torch.zeros(pixels.shape[0], rows, self.dim)  # (B, L, D)

    def build_then_stop(*args, **kwargs):
        store = real_build(*args, **kwargs)
        assert len(store.index) == 12  # every photo the run uses (train and dev; not test) encoded
        raise _Stop

    real_build = stages.build_features
    monkeypatch.setattr(Encoder, "encode", encode)
    monkeypatch.setattr(stages, "build_features", build_then_stop)
    with pytest.raises(_Stop):
        prepare_data(RunConfig.load(tiny_config), device=torch.device("meta"))
    assert seen and set(seen) == {torch.device("meta")}


def test_frozen_tuned_blocks_run_on_the_training_device(tmp_path):
    """Encoder blocks tuned by train.init and frozen now run once over the cached rows, on the
    training device (meta here), and their output is held in CPU memory as float16."""
    from captionkit.encoders.features import ArrayStore, FeatureRows
    from captionkit.training.stages import _run_tail

    class Tail(torch.nn.Module):
        def forward(self, x, grid):
            self.seen = x.device
            return torch.ones(x.shape[0], 2, 3)  # (B, L, D)

    names = [f"{i}.jpg" for i in range(300)]
    rows = FeatureRows(ArrayStore(names, torch.zeros(300, 4, 5, dtype=torch.float16).numpy()), names)
    tail = Tail()
    out = _run_tail(tail, rows, (2, 2), torch.device("meta"))
    assert tail.seen == torch.device("meta")
    assert out[0:300].shape == (300, 2, 3) and out[0:1].dtype == torch.float16


def test_max_images_limit_the_feature_extraction_and_a_full_run_extends_the_cache(tiny_config, tmp_path,
                                                                                  monkeypatch):
    """Issue 29, item 4: a run on train_max_images/val_max_images images encoded every image of
    the dataset first (all 8,000 of Flickr8k for a 20-step check). Now it encodes only its own;
    the cache stays the dataset's, so a later full run fills in the rest of the same folder (and
    a partial cache never passes for a full one: its unwritten rows are not in the store)."""
    from captionkit.encoders.base import Encoder

    monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / "cache"))  # an empty cache of this test's own
    encoded: list[int] = []
    real_encode = Encoder.encode

    def counting(self, pixels):
        encoded.append(pixels.shape[0])
        return real_encode(self, pixels)

    monkeypatch.setattr(Encoder, "encode", counting)
    cut = tmp_path / "cut.toml"
    cut.write_text(tiny_config.read_text().replace("[train]", "[train]\ntrain_max_images = 4\nval_max_images = 2"))
    part = prepare_data(RunConfig.load(cut))
    assert sum(encoded) == 6 and len(part.train_feats.store.index) == 6  # 4 train + 2 dev, of 15 photos
    encoded.clear()
    full = prepare_data(RunConfig.load(tiny_config))
    assert sum(encoded) == 12 - 6  # the other train and dev photos, in the same cache folder
    assert full.train_feats.store.folder == part.train_feats.store.folder
    assert len(full.train_feats) == 9 and len(full.val_feats) == 3
    assert torch.allclose(full.train_feats[0:4].float(), part.train_feats[0:4].float(), atol=1e-3)
    assert torch.allclose(full.val_feats[0:2].float(), part.val_feats[0:2].float(), atol=1e-3)
    encoded.clear()
    prepare_data(RunConfig.load(cut))  # everything it needs is cached now
    assert encoded == []
