"""The trainer reads the feature store lazily: a run asks the store for a batch's rows at a
time, never for every image's, and its weights are bit for bit those of the eager trainer that
held every row in one tensor."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from captionkit.encoders.features import FeatureRows
from captionkit.training import stages as stages_module
from captionkit.training.config import RunConfig
from captionkit.training.run import build_trainer, train
from captionkit.training.stages import prepare_data


class CountingStore:
    """A store that records how many rows each read asks for."""

    def __init__(self, store):
        self.store, self.grid, self.reads = store, store.grid, []

    def __contains__(self, name: str) -> bool:
        return name in self.store

    def rows(self, names: list[str]) -> np.ndarray:
        self.reads.append(len(names))
        return self.store.rows(names)


class EagerRows:
    """The trainer's features before FeatureRows: every row in one (N, L, D) tensor."""

    def __init__(self, rows: FeatureRows):
        self.names = rows.names
        self.tensor = torch.from_numpy(np.ascontiguousarray(rows.store.rows(rows.names)))

    def __len__(self) -> int:
        return len(self.tensor)

    def select(self, rows: torch.Tensor) -> torch.Tensor:
        return self.tensor.index_select(0, rows)

    def __getitem__(self, span: slice) -> torch.Tensor:
        return self.tensor[span]


@pytest.fixture
def stores(monkeypatch) -> list[CountingStore]:
    """Every store the trainer opens from now on, counting its reads."""
    opened: list[CountingStore] = []
    real = stages_module.build_features

    def counting(*args, **kwargs):
        opened.append(CountingStore(real(*args, **kwargs)))
        return opened[-1]

    monkeypatch.setattr(stages_module, "build_features", counting)
    return opened


def test_feature_rows_read_only_the_rows_asked_for(tiny_config):
    data = prepare_data(RunConfig.load(tiny_config))
    store = CountingStore(data.train_feats.store)
    rows = FeatureRows(store, data.train_feats.names)
    eager = EagerRows(data.train_feats)
    index = torch.tensor([4, 0, 4, 7])
    assert torch.equal(rows.select(index), eager.select(index)) and rows.select(index).dtype == torch.float16
    assert torch.equal(rows[2:5], eager[2:5]) and len(rows) == len(eager) == 9
    assert store.reads == [4, 4, 3]
    assert torch.equal(rows.in_memory().select(index), eager.select(index)) and store.reads[-1] == 9


def _short(tiny_config, tmp_path, epochs: int) -> RunConfig:
    """The tiny config, shortened: ``epochs`` epochs, one length penalty to try, greedy dev scores."""
    path = tmp_path / "short.toml"
    path.write_text(tiny_config.read_text().replace("epochs = 3", f"epochs = {epochs}")
                    .replace("length_penalties = [0.0, 1.0]", "length_penalties = [0.0]")
                    .replace("val_beam = 2", "val_beam = 1"))
    return path


@pytest.mark.slow  # a training run
def test_a_training_run_never_reads_the_whole_store(tiny_config, tmp_path, stores):
    config = _short(tiny_config, tmp_path, epochs=2)
    cfg = RunConfig.load(config)
    state = train(config, out=tmp_path / "run", progress=False)
    assert state.epoch == cfg.train.epochs  # validated, decoding tuned: every reader ran
    (store,) = stores
    images = len(store.store.index)  # 9 training, 3 dev and 3 test images
    assert store.reads and max(store.reads) <= cfg.train.batch_size < images
    assert sum(store.reads) > 2 * images  # read again each epoch, not kept


def _fit(cfg: RunConfig, out, eager: bool) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """-> the trained weights and the history without its times."""
    data = prepare_data(cfg)  # seeds torch: both runs start from the same draws
    if eager:
        data.train_feats, data.val_feats = EagerRows(data.train_feats), EagerRows(data.val_feats)
    trainer = build_trainer(cfg, out, data)
    state = trainer.fit(progress=False)
    return trainer.model.state_dict(), [{k: v for k, v in h.items() if k != "seconds"} for h in state.history]


@pytest.mark.slow  # two training runs
@pytest.mark.parametrize("objective", ["xe", "scst"])
def test_lazy_reads_train_the_same_weights_as_the_eager_tensor(tiny_config, tmp_path, objective):
    """Every reader: training batches (caption rows, or scst's image rows), dev decoding in
    spans, the dev loss's batches; the weights and every figure of the history are the same."""
    cfg = RunConfig.load(_short(tiny_config, tmp_path, epochs=2))
    if objective == "scst":
        cfg.train.objective, cfg.train.samples = "scst", 2
    (lazy, lazy_history), (eager, eager_history) = (_fit(cfg, tmp_path / "lazy", eager=False),
                                                    _fit(cfg, tmp_path / "eager", eager=True))
    assert lazy.keys() == eager.keys()
    for k in lazy:
        assert torch.equal(lazy[k], eager[k]), k
    assert lazy_history == eager_history and "CIDEr" in lazy_history[-1]


def _from(tiny_config, tmp_path, name: str, train_lines: str):
    """The tiny config with its model taken from train.init, and ``train_lines`` added."""
    head, _, rest = tiny_config.read_text().partition("[model]")
    path = tmp_path / f"{name}.toml"
    path.write_text((head + rest[rest.index("[train]"):]).replace("[train]", "[train]\n" + train_lines))
    return path


@pytest.mark.slow  # a training run
def test_frozen_tuned_blocks_give_the_rows_the_eager_tensor_gave(tiny_run, tiny_config, tmp_path, stores):
    """A run from a checkpoint whose last encoder block was tuned, with the block frozen now:
    its output is computed once from the store's rows (read 256 at a time), bit for bit what it
    was from the eager tensor of every row."""
    tuned = tmp_path / "tuned"
    train(_from(tiny_config, tmp_path, "tune", f'init = "{tiny_run / "best"}"\n'
          'finetune_blocks = 1\nencoder_lr = 1e-2'), out=tuned, max_steps=1, progress=False)
    stores.clear()
    data = prepare_data(RunConfig.load(_from(tiny_config, tmp_path, "frozen", f'init = "{tuned / "last"}"')))
    assert data.tuned_blocks == 1 and data.source_grid == data.grid and data.tail is not None
    (store,) = stores  # the rows before the tuned block
    for rows in (data.train_feats, data.val_feats):
        eager = torch.from_numpy(np.ascontiguousarray(store.rows(rows.names)))
        with torch.no_grad():  # the trainer's computation before FeatureRows, on the eager tensor
            expected = torch.cat([data.tail(eager[i:i + 256].float(), store.grid).half()
                                  for i in range(0, len(eager), 256)])
        assert torch.equal(rows[:], expected) and rows[:].dtype == torch.float16
