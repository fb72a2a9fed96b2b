"""DDP under torchrun on the CPU (gloo): two processes train what one process trains with the
same global batch, and a checkpoint of one world size resumes under another.

The tiny config has dropout 0, so a step depends only on the weights and the global batch;
its length batches include batches of one caption, so the rank that gets no caption (and
takes part with weight 0) is exercised too."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import captionkit
from captionkit.core.checkpoint import read_config
from captionkit.training.distributed import SINGLE, World, shard
from captionkit.training.run import train
from ddpsteps import assert_same_steps, record_steps, tiny_trainer
from helpers import free_port

pytestmark = pytest.mark.slow  # each torchrun start costs several seconds of imports per process

STEPS = 4


def run_module(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """python -m ARGS in a child with this checkout's captionkit first on the path."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(captionkit.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=timeout,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "last" / "model.safetensors")


def assert_same_weights(a: Path, b: Path, tol: float = 1e-6) -> None:
    """Equal up to what float rounding grows to under Adam: a sum of two shards' gradients is
    not bitwise the whole batch's, and Adam's grad / (|grad| + eps) turns such differences of
    ~0 gradients into shares of the learning rate (tests/ddpsteps.py). Measured on the tiny
    run (lr 1e-2): up to 3e-5 after 4 steps."""
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=tol, atol=tol, msg=k)


@pytest.fixture(scope="module")
def two_process_run(tiny_config, tmp_path_factory) -> Path:
    """STEPS steps of the tiny model in 2 processes launched by torchrun itself."""
    out = tmp_path_factory.mktemp("ddp") / "two"
    run_module("torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "captionkit", "train",
               "--config", str(tiny_config), "--out", str(out), "--max-steps", str(STEPS))
    return out


def test_shards_are_disjoint_and_cover_the_batch():
    batch = [5, 3, 9, 1, 7]
    parts = [shard(batch, World(r, 2)) for r in range(2)]
    assert parts == [([5, 9, 7], True), ([3, 1], True)] and shard(batch, SINGLE) == (batch, True)
    # image batching: an image's captions stay together (key: each caption's image)
    image = {5: 0, 3: 0, 9: 1, 1: 2, 7: 2}
    key = [image.get(i, -1) for i in range(10)]
    assert [shard(batch, World(r, 2), key)[0] for r in range(2)] == [[5, 3, 1, 7], [9]]
    assert shard([4], World(1, 2)) == ([4], False)  # nothing left: the first item, weight 0


def _pinned_rank(rank: int, config: str, out: str, port: int) -> None:
    """One of 2 gloo processes: the trainer as run.train builds it, each step from the
    parameters one process had before it (out/pinned.pt); rank 0 saves what the steps computed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = tiny_trainer(Path(config), Path(out), world=World(rank, 2, rank))
        pinned = torch.load(Path(out) / "pinned.pt")
        seen = record_steps(trainer, pinned)
        trainer.fit(max_steps=len(pinned), progress=False)
        if rank == 0:
            torch.save(seen, Path(out) / "steps.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_processes_train_what_one_process_trains(two_process_run, tiny_config, tmp_path):
    """Each step in 2 processes computes one process's loss and gradients from the same
    parameters (tests/ddpsteps.py: not the weights after Adam, which turns float rounding of
    ~0 gradients into lr-sized differences); and torchrun's run counts, reports and saves as
    one process does."""
    single = tiny_trainer(tiny_config, tmp_path / "single")
    expected = record_steps(single)
    single.fit(max_steps=STEPS, progress=False)
    two = tmp_path / "two"
    two.mkdir()
    torch.save(expected, two / "pinned.pt")
    torch.multiprocessing.spawn(_pinned_rank, args=(str(tiny_config), str(two), free_port()), nprocs=2)
    assert_same_steps(expected, torch.load(two / "steps.pt"))
    one = tmp_path / "one"
    train(tiny_config, out=one, max_steps=STEPS, progress=False)
    a, b = read_config(one / "last")["state"], read_config(two_process_run / "last")["state"]
    assert (a["step"], a["batch_in_epoch"], a["epoch_progress"]["seen"]) == \
        (b["step"], b["batch_in_epoch"], b["epoch_progress"]["seen"]) == (STEPS, STEPS, a["epoch_progress"]["seen"])
    # the reported loss is the global batch's, not rank 0's shard's
    assert a["epoch_progress"]["sums"]["loss"] == pytest.approx(b["epoch_progress"]["sums"]["loss"], rel=1e-5)
    assert not list(two_process_run.glob("*rank*"))  # one set of files, written by rank 0


def test_a_two_process_checkpoint_resumes_in_one_process_and_continues_identically(two_process_run, tiny_config,
                                                                                    tmp_path):
    resumed = tmp_path / "resumed"
    shutil.copytree(two_process_run, resumed)
    st = train(tiny_config, out=resumed, resume=True, max_steps=2 * STEPS, progress=False)
    straight = tmp_path / "straight"
    train(tiny_config, out=straight, max_steps=2 * STEPS, progress=False)
    assert st.step == 2 * STEPS
    assert_same_weights(straight, resumed, tol=1e-4)


def test_nproc_resumes_a_one_process_checkpoint_in_two(tiny_config, tmp_path):
    """captionkit train --nproc 2 (torchrun's launcher started from the CLI) continues a run
    of one process and ends where one process would."""
    run = tmp_path / "run"
    train(tiny_config, out=run, max_steps=STEPS, progress=False)
    run_module("captionkit", "train", "--config", str(tiny_config), "--out", str(run), "--resume",
               "--max-steps", str(2 * STEPS), "--nproc", "2")
    straight = tmp_path / "straight"
    train(tiny_config, out=straight, max_steps=2 * STEPS, progress=False)
    assert read_config(run / "last")["state"]["step"] == 2 * STEPS
    assert_same_weights(straight, run, tol=1e-4)


def test_self_critical_training_with_a_tuned_encoder_block_under_ddp(tiny_run, tiny_config, tmp_path):
    """SCST (sampling, rewards, the REINFORCE loss) and encoder fine-tuning, in 2 processes:
    both train, and the processes stay in step (rank 0's checkpoint is what they share)."""
    cfg = tmp_path / "scst.toml"
    head, _, rest = tiny_config.read_text().partition("[model]")
    text = head + rest[rest.index("[train]"):]  # the model comes from train.init
    cfg.write_text(text.replace("[train]", f'[train]\ninit = "{tiny_run / "best"}"\nobjective = "scst"\n'
                                           f'samples = 2\nfinetune_blocks = 1\nencoder_lr = 1e-2'))
    out = tmp_path / "run"
    run_module("torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "captionkit", "train",
               "--config", str(cfg), "--out", str(out), "--max-steps", "2")
    saved = read_config(out / "last")
    assert saved["state"]["step"] == 2 and saved["encoder"]["finetuned_blocks"] == 1
    assert saved["state"]["history"][-1]["reward"] >= 0  # (2 steps: the 9 images' epoch, validated by rank 0)
    last, start = load_file(out / "last" / "model.safetensors"), load_file(tiny_run / "best" / "model.safetensors")
    assert any(not torch.equal(last[k], start[k]) for k in start)  # the decoder moved
    assert any(k.startswith("encoder.") for k in last)  # and the tuned block is saved
