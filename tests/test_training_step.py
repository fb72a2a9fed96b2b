"""The training step: right under DDP and on a GPU, shown on the CPU.

What validation decodes with (the run's precision) and which random generators it forks; the
global statistics of a DDP step (SCST's word count, hard attention's REINFORCE baseline) through
captionkit.core.collectives, checked with ranks simulated by threads and with 2 gloo processes;
no host read inside a training step (a model on ``meta`` stands in for the GPU, see
tests/devicecheck.py), one every LOG_EVERY steps, where a non-finite loss is caught; and the
batches' host work prefetched on a thread without changing a result."""

from __future__ import annotations

import copy
import os
import random
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from ddpsteps import ThreadRanks, assert_same_steps, record_steps
from devicecheck import MetaAnswers, count_syncs, factory_sentinel, strict_devices
from helpers import free_port
from safetensors.torch import load_file, save_file

import captionkit.inference.captioner as captioner_module
import captionkit.training.scst as scst_module
import captionkit.training.trainer as trainer_module
from captionkit.core import precision
from captionkit.core.errors import UserError
from captionkit.data.vocab import Vocab
from captionkit.inference.captioner import Captioner
from captionkit.models import create_model
from captionkit.training.config import RunConfig
from captionkit.training.distributed import SINGLE, World
from captionkit.training.prefetch import Prefetcher
from captionkit.training.run import build_trainer
from captionkit.training.scst import SelfCritical, sample
from captionkit.training.stages import CPU, prepare_data
from captionkit.training.trainer import LOG_EVERY, EpochProgress, Trainer, forked_rng

META = torch.device("meta")


def variant(tiny_config: Path, folder: Path, model: str = "", train: str = "") -> Path:
    """The tiny config with lines added to [model] and [train] (a key given replaces its own)."""
    text = tiny_config.read_text()
    for line in (model + train).splitlines():
        key = line.split("=")[0].strip()
        text = "\n".join(l for l in text.splitlines() if l.split("=")[0].strip() != key)
    text = text.replace("[model]", f"[model]\n{model}").replace("[train]", f"[train]\n{train}")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "run.toml"
    path.write_text(text)
    return path


def tiny_trainer(config: Path, out: Path, device: torch.device = CPU, world: World = SINGLE) -> Trainer:
    cfg = RunConfig.load(config)
    trainer = build_trainer(cfg, out, data=prepare_data(cfg), device=device, world=world)
    trainer.state.epoch_progress = EpochProgress()
    return trainer


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


# ---- validation: the run's precision, the device's generator, the baseline untouched --------------
def test_validation_decodes_in_the_runs_precision(tiny_config, tmp_path, monkeypatch):
    """train.precision = "fp32" on a CPU that multiplies bf16 natively, where "auto" is bf16:
    the dev captions are decoded in fp32 too (they were decoded under "auto")."""
    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    trainer = tiny_trainer(tiny_config, tmp_path / "run")  # the tiny config says fp32
    assert trainer.precision == "fp32"
    placed, decoded = [], []
    place = Captioner.place

    def spy_place(self, *args, **kwargs):
        out = place(self, *args, **kwargs)
        placed.append(self.precision)
        return out

    autocast = captioner_module.autocast

    def spy_autocast(device, resolved):
        decoded.append(resolved)
        return autocast(device, resolved)

    monkeypatch.setattr(Captioner, "place", spy_place)
    monkeypatch.setattr(captioner_module, "autocast", spy_autocast)
    trainer.validate()
    assert placed == ["fp32"] and decoded and set(decoded) == {"fp32"}


def test_forked_rng_restores_the_training_devices_generator(monkeypatch):
    """A fake GPU generator per device index: what validation draws on the training GPU is
    undone, on the GPU the run uses ("cuda" alone: the current one); the CPU forks only its own."""
    states = {0: torch.tensor([10], dtype=torch.uint8), 1: torch.tensor([11], dtype=torch.uint8)}
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": states[device].clone())
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": states.__setitem__(device, state))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    for device, index in ((torch.device("cuda", 0), 0), (torch.device("cuda"), 1)):
        before = {k: v.clone() for k, v in states.items()}
        cpu_before = torch.get_rng_state()
        with forked_rng(device):
            states[index] = torch.tensor([99], dtype=torch.uint8)  # a draw on that GPU moves its generator
            torch.rand(3)
        assert states == before and torch.equal(torch.get_rng_state(), cpu_before)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": pytest.fail("the CPU forked a GPU"))
    with forked_rng(CPU):
        torch.rand(3)


def test_validation_loss_forks_the_training_devices_generator(tiny_config, tmp_path, monkeypatch):
    trainer = tiny_trainer(tiny_config, tmp_path / "run")
    forked = []

    def spy(device):
        forked.append(device)
        return forked_rng(device)

    monkeypatch.setattr(trainer_module, "forked_rng", spy)
    trainer.validation_loss()
    assert forked == [trainer.device]


def test_the_dev_loss_leaves_the_hard_attention_baseline_alone(tiny_config, tmp_path):
    trainer = tiny_trainer(variant(tiny_config, tmp_path, model='attention = "hard"\n'), tmp_path / "run")
    batches = trainer.epoch_batches(0)
    trainer.model.train()
    for bi in range(3):
        trainer.train_step(batches[bi], bi, len(batches))
    before = trainer.model.baseline.clone()
    assert before[1] == 3  # three training batches
    trainer.validation_loss()
    assert torch.equal(trainer.model.baseline, before)


# ---- DDP: the global statistics of a step ----------------------------------------------------------
def tiny_sat(**kw):
    torch.manual_seed(0)
    return create_model("sat", dict(vocab_size=12, feat_dim=10, embed_dim=8, hidden_dim=9, attn_dim=7, dropout=0.0,
                                    **kw))


def test_self_critical_gradient_under_ddp_is_the_one_process_gradient(monkeypatch):
    """Two ranks take Trainer.shard's parts of a batch of 5 images (3 and 2: unequal shares,
    and unequal sampled-word counts); the average DDP takes of their weighted gradients is the
    whole batch's gradient. Each image's samples are the whole batch's draws, so the shards see
    what one process saw."""
    m = tiny_sat().eval()
    vocab = Vocab(["<pad>", "<start>", "<end>", "<unk>"] + [f"w{i}" for i in range(8)])
    refs = {k: [[f"w{(k + j) % 8}", f"w{(k * 3 + j) % 8}", "w1"] for j in range(3)] for k in range(5)}
    sc = SelfCritical(refs, vocab, samples=3, max_len=6)
    torch.manual_seed(3)
    feats, keys = torch.randn(5, 6, 10), list(range(5))
    seqs = sample(m, feats, 3, 6)  # (15, T), the whole batch's draws
    assert len({int((seqs[3 * k:3 * k + 3] != Vocab.pad).sum()) for k in keys}) > 1  # images differ in words

    def drawn(model, f, n, max_len=20, generator=None):  # each image's own draws, whatever the batch
        images = [next(k for k in keys if torch.equal(row, feats[k])) for row in f]
        return torch.cat([seqs[n * k:n * k + n] for k in images])

    monkeypatch.setattr(scst_module, "sample", drawn)
    params = [p for p in m.parameters() if p.requires_grad]
    whole = torch.autograd.grad(sc.loss(m, feats, keys)[0], params, allow_unused=True)
    shards = [Trainer.shard(SimpleNamespace(world=World(r, 2), scst=sc), keys) for r in range(2)]
    assert [s.part for s in shards] == [[0, 2, 4], [1, 3]]

    def rank(r):
        part = shards[r].part
        loss, _ = sc.loss(m, feats[part], part)
        return torch.autograd.grad(loss * (shards[r].loss_weight * 2), params, allow_unused=True)  # as train_step

    grads = ThreadRanks(2).run(rank)
    for g, a, b in zip(whole, *grads):
        if g is not None:
            torch.testing.assert_close((a + b) / 2, g, rtol=1e-5, atol=1e-7)  # DDP averages


def first_location(probs, num_samples=1, **kwargs):
    """torch.multinomial's stand-in for hard attention's draws: location 0, whatever the batch
    (a most probable location would do too, but an untrained model's weights are near ties
    that a batch of another size breaks differently)."""
    return torch.zeros(probs.shape[0], 1, dtype=torch.long, device=probs.device)


def test_hard_attention_baseline_under_ddp_is_the_one_process_baseline(monkeypatch):
    """Two ranks with their own copies of the model, on unequal shards of each batch: after
    each step every rank holds the baseline one process gets from the whole batch."""
    monkeypatch.setattr(torch, "multinomial", first_location)
    whole = tiny_sat(attention="hard", expected_prob=0.0, baseline_decay=0.5).train()
    ranks = [copy.deepcopy(whole) for _ in range(2)]
    parts = [[0, 1, 2, 3], [4, 5]]
    for step in range(3):
        torch.manual_seed(step)
        feats, ids = torch.randn(6, 6, 10), torch.randint(4, 12, (6, 8))
        ids[:, 0] = Vocab.start
        for b, n in enumerate((7, 7, 5, 3, 4, 6)):  # captions of several lengths: the baseline is per word
            ids[b, n], ids[b, n + 1:] = Vocab.end, Vocab.pad
        whole.training_loss(feats, ids[:, :-1], ids[:, 1:])

        def rank(r):
            p = parts[r]
            ranks[r].training_loss(feats[p], ids[p, :-1], ids[p, 1:])

        ThreadRanks(2).run(rank)
        assert torch.equal(ranks[0].baseline, ranks[1].baseline)
        torch.testing.assert_close(ranks[0].baseline, whole.baseline, rtol=1e-6, atol=0)
    assert whole.baseline[1] == 3


def baselines_per_step(trainer: Trainer) -> list[torch.Tensor]:
    """The model's baseline after each of the trainer's steps, from now on."""
    seen, step = [], trainer.train_step

    def train_step(*args):
        step(*args)
        seen.append(trainer.model.baseline.clone())

    trainer.train_step = train_step
    return seen


def _ddp_rank(rank: int, config: str, out: str, port: int, steps: int) -> None:
    """One of 2 gloo processes: the trainer as run.train builds it, ``steps`` steps, each from
    the parameters one process had before it (out/pinned.pt, tests/ddpsteps.py)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.multinomial = first_location
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        trainer = tiny_trainer(Path(config), Path(out), world=World(rank, 2, rank))
        seen = baselines_per_step(trainer)
        computed = record_steps(trainer, torch.load(Path(out) / "pinned.pt"))
        trainer.fit(max_steps=steps, progress=False)
        save_file({"baselines": torch.stack(seen)}, str(Path(out) / f"rank{rank}.safetensors"))
        if rank == 0:
            torch.save(computed, Path(out) / "steps.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # two processes start and build their trainers
def test_hard_attention_under_two_gloo_processes_trains_what_one_process_trains(tiny_config, tmp_path, monkeypatch):
    """Real DDP (buffers broadcast from rank 0 at every forward): 10 steps of the tiny hard-
    attention model (the first epoch, which has batches of one caption, so a rank stands in
    with weight 0; then rank 0 validates alone; then a step more) in 2 processes: after every
    step each rank holds one process's baseline, and each step, from the parameters one process
    had before it, computes one process's loss and gradients, the attention's included (not the
    weights after Adam, which turns float rounding of ~0 gradients into lr-sized differences:
    tests/ddpsteps.py)."""
    config = variant(tiny_config, tmp_path, model='attention = "hard"\nexpected_prob = 0.0\n')
    steps = 10
    monkeypatch.setattr(torch, "multinomial", first_location)
    one = tiny_trainer(config, tmp_path / "one")
    expected = baselines_per_step(one)
    one_steps = record_steps(one)
    one.fit(max_steps=steps, progress=False)
    two = tmp_path / "two"
    two.mkdir()
    torch.save(one_steps, two / "pinned.pt")
    torch.multiprocessing.spawn(_ddp_rank, args=(str(config), str(two), free_port(), steps), nprocs=2)
    ranks = [load_file(two / f"rank{r}.safetensors")["baselines"] for r in range(2)]  # (steps, 2) each
    assert torch.equal(ranks[0], ranks[1])
    assert ranks[0][:, 1].tolist() == list(range(1, steps + 1))  # one update a step; validation added none
    torch.testing.assert_close(ranks[0], torch.stack(expected), rtol=1e-5, atol=0)
    assert_same_steps(one_steps, torch.load(two / "steps.pt"))


# ---- host syncs: none in a step, one per LOG_EVERY steps ----------------------------------------
def meta_trainer(config: Path, out: Path) -> Trainer:
    """The trainer with its model on meta, the tests' stand-in GPU. Fused Adam has no meta
    kernel: the same rule runs per tensor here (its step count is a CPU tensor, made at its
    first step; on CUDA the fused kernel keeps it on the GPU and reads nothing on the host)."""
    trainer = tiny_trainer(config, out, device=META)
    trainer.opt = torch.optim.Adam([{"params": g["params"], "lr": g["lr"]} for g in trainer.opt.param_groups],
                                   foreach=False)
    trainer.model.train()
    return trainer


@pytest.mark.parametrize("model", ["", 'attention = "hard"\n'], ids=["soft", "hard"])
def test_a_training_step_reads_nothing_on_the_host(model, tiny_config, tmp_path):
    """Before: 2 host reads per step (the finite check, the loss figure), 7 with hard attention
    (its baseline's), 1 more under DDP. Now the figures and losses wait on the device and are
    read together, once, when the progress line is due. (And the step builds every tensor on
    its device: the factory sentinel.)"""
    trainer = meta_trainer(variant(tiny_config, tmp_path, model=model), tmp_path / "run")
    batches = [trainer.host_batch(b) for b in trainer.epoch_batches(0)]  # the prefetch thread's work
    answers = MetaAnswers(fill=0)
    with strict_devices(answers):  # a first step: the optimizer makes its state (the stand-in's on the CPU)
        trainer.train_step(batches[-1], 0, len(batches))
        trainer.read_figures()
    with strict_devices(answers), count_syncs(answers=answers) as syncs, factory_sentinel(META, host_copies=True):
        for bi in range(LOG_EVERY):
            trainer.train_step(batches[bi % len(batches)], bi, len(batches))
    assert syncs.total == 0, syncs.report(per=LOG_EVERY, unit=" per step")
    with strict_devices(answers), count_syncs(answers=answers) as syncs:
        trainer.read_figures()
    assert syncs.total == 1, syncs.report()
    assert trainer.state.epoch_progress.sums == {"loss": 0.0}  # (meta reads are made-up zeros)


@pytest.mark.parametrize("mixed", ["", "scst_xe_weight = 0.5\n"], ids=["plain", "mixed"])
def test_a_self_critical_step_reads_only_what_scoring_needs(mixed, tiny_config, tmp_path):
    """SCST scores its samples with CIDEr-D on the CPU: the samples and the greedy captions
    come to the host, and sampling and greedy decoding read once per word (to stop when every
    caption has ended). Nothing else is read: not the rewards, not the loss, not the mixed
    objective's cross-entropy term (whose captions and image index go to the device with the
    batch)."""
    trainer = meta_trainer(variant(tiny_config, tmp_path, train=f'objective = "scst"\nsamples = 2\n{mixed}'),
                           tmp_path / "run")
    trainer.model.eval()
    batch = trainer.host_batch(trainer.epoch_batches(0)[0])
    answers = MetaAnswers(fill=Vocab.end)
    with strict_devices(answers), count_syncs(answers=answers):  # a first step: the optimizer's state
        trainer.train_step(batch, 0, 2)
    with strict_devices(answers), count_syncs(answers=answers) as syncs, factory_sentinel(META, host_copies=True):
        trainer.train_step(batch, 0, 2)
    sites = {(site.split(":")[0], op) for site, op in syncs.sites}
    assert sites <= {("captionkit/training/scst.py", "tolist"), ("captionkit/training/scst.py", "__bool__"),
                     ("captionkit/inference/decoding.py", "__bool__"), ("captionkit/inference/decoding.py", "cpu")}, \
        syncs.report()
    steps = trainer.cfg.train.max_len + 1  # (meta answers "not all ended" to the end)
    assert syncs.sites[next(s for s in syncs.sites if s[0].startswith("captionkit/training/scst.py")
                            and s[1] == "tolist")] == 1
    assert sum(n for (site, op), n in syncs.sites.items() if op == "__bool__" and "scst.py" in site) == steps


def test_a_non_finite_loss_stops_training_naming_its_step(tiny_config, tmp_path, monkeypatch):
    """The loss is read every LOG_EVERY steps and at an epoch's end: a NaN at step 2 stops the
    run at the next read with the step it happened at, before any checkpoint is written."""
    trainer = tiny_trainer(tiny_config, tmp_path / "run")
    trainer.state.epoch_progress = None
    loss_of = trainer.model.training_loss
    calls = []

    def poisoned(*args, **kwargs):
        loss, ce = loss_of(*args, **kwargs)
        calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), ce

    monkeypatch.setattr(trainer.model, "training_loss", poisoned)
    with pytest.raises(FloatingPointError, match=r"^loss became nan at step 2: training diverged") as caught:
        trainer.fit(progress=False)
    assert 2 < trainer.state.step <= 2 + LOG_EVERY
    assert not (tmp_path / "run" / "last").exists()
    assert isinstance(caught.value, UserError)  # the command prints it as one line, no traceback


# ---- prefetching the host work ------------------------------------------------------------------
def test_the_next_batch_is_read_while_a_step_runs(tiny_config, tmp_path, monkeypatch):
    """Each step waits (up to 10 s) for the next batch's read to start: without a prefetch
    thread the read would come only after the step, and the wait would time out."""
    trainer = tiny_trainer(tiny_config, tmp_path / "run")
    trainer.state.epoch_progress = None
    started: list[int] = []
    read, step = trainer.host_batch, trainer.train_step
    overlapped = []

    def host_batch(batch):
        started.append(len(started))
        return read(batch)

    def train_step(batch, bi, n):
        deadline = time.monotonic() + 10
        while len(started) <= bi + 1 and bi + 1 < n and time.monotonic() < deadline:
            time.sleep(0.001)
        overlapped.append(len(started) > bi + 1 or bi + 1 == n)
        step(batch, bi, n)

    monkeypatch.setattr(trainer, "host_batch", host_batch)
    monkeypatch.setattr(trainer, "train_step", train_step)
    trainer.fit(max_steps=4, progress=False)
    assert overlapped == [True] * 4


class InlineReads:
    """Prefetcher's stand-in that reads each batch when it is asked for, on the training thread
    (as the trainer did before it prefetched)."""

    def __init__(self, make, items, depth=2):
        self.make, self.items = make, items

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def __iter__(self):
        return (self.make(i) for i in self.items)


@pytest.mark.parametrize("model,train", [('attention = "hard"\n', ""), ("", 'objective = "scst"\nsamples = 2\n')],
                         ids=["hard", "scst"])
def test_prefetching_changes_no_result(model, train, tiny_config, tmp_path, monkeypatch):
    """Hard attention and SCST draw random numbers inside the step: with the reads on the
    prefetch thread they draw the same, and the weights and figures are bit for bit those of
    reading inline. The reads themselves draw nothing."""
    config = variant(tiny_config, tmp_path, model=model, train=train)
    runs = []
    for prefetcher in (Prefetcher, InlineReads):
        monkeypatch.setattr(trainer_module, "Prefetcher", prefetcher)
        torch.manual_seed(0)
        trainer = tiny_trainer(config, tmp_path / prefetcher.__name__)
        trainer.state.epoch_progress = None
        trainer.fit(max_steps=6, progress=False)
        runs.append((weights(trainer), trainer.state.to_json()))
    (wa, sa), (wb, sb) = runs
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    for state in (sa, sb):  # (SCST: 2 steps an epoch, so 3 epochs: history entries hold seconds too)
        for figures in [state["epoch_progress"] or {}, *state["history"]]:
            figures.pop("seconds", None)
    assert sa == sb and sa["step"] == 6
    rng, py = torch.get_rng_state(), random.getstate()
    for b in trainer.epoch_batches(1):
        trainer.host_batch(b)
    assert torch.equal(torch.get_rng_state(), rng) and random.getstate() == py


def test_the_prefetcher_keeps_order_raises_where_it_failed_and_stops_when_left():
    def make(i):
        if i == 3:
            raise KeyError("row 3")
        return i * 10

    got = []
    with pytest.raises(KeyError, match="row 3"), Prefetcher(make, range(6)) as coming:
        for x in coming:
            got.append(x)
    assert got == [0, 10, 20]
    made = []
    with Prefetcher(lambda i: made.append(i) or i, range(1000), depth=2) as coming:
        assert next(iter(coming)) == 0
        thread = coming._thread
    assert not thread.is_alive() and len(made) <= 5  # left early: the thread stopped a few ahead
