"""DDP's steps compared with one process's, from the same weights (shared by tests/test_ddp.py
and tests/test_training_step.py).

Two processes train what one process trains when every step, taken from the same parameters
on the same global batch, has the same loss and the same (DDP-averaged) gradients. Comparing
the weights after several Adam steps is not that check: Adam's update grad / (|grad| + eps)
turns float-rounding differences of gradients near 0 (two shards' gradients summed are not
bitwise the whole batch's) into differences of a share of the learning rate, and it hides a
gradient that is wrong by a scale (its first steps are about lr * sign(grad)). Measured on the
tiny SAT run once its random encoder saw the photo: after 4 steps at lr 1e-2 gates_ctx.weight
differed by 3e-5 between one and two processes, while each step's gradients agreed to float
rounding (see assert_same_steps). So :func:`record_steps` pins each step of the DDP run to the
parameters one process had before that step and records what the step computed.
:class:`ThreadRanks` simulates a step's ranks on threads of one process, for the parts of a step
whose global sums (``process_sum``) can be checked without starting processes.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from captionkit.core.collectives import summed_over
from captionkit.training.config import RunConfig
from captionkit.training.distributed import SINGLE, World
from captionkit.training.run import build_trainer
from captionkit.training.stages import CPU, prepare_data
from captionkit.training.trainer import EpochProgress, Trainer

# A tensor's gradient from two processes is one's to GRAD_RTOL of its size plus GRAD_ATOL of the
# whole gradient's size: a tensor whose gradient is ~0 is float noise of sums at the whole's
# scale. Measured on the tiny SAT runs: tensors with real gradients < 3e-7 relative; the hard
# attention's att_w, whose gradient is ~1e-6 once its softmax saturates (the whole's: 5, after
# clipping), 2.5e-6 apart, i.e. 5e-7 of the whole. Without DDP's averaging a rank was 0.49 off.
GRAD_RTOL = 1e-4
GRAD_ATOL = 1e-5


def tiny_trainer(config: Path, out: Path, device: torch.device = CPU, world: World = SINGLE) -> Trainer:
    cfg = RunConfig.load(config)
    trainer = build_trainer(cfg, out, data=prepare_data(cfg), device=device, world=world)
    trainer.state.epoch_progress = EpochProgress()
    return trainer


def record_steps(trainer: Trainer, pinned: list[dict] | None = None) -> list[dict]:
    """Wraps ``trainer.train_step``: from now on each step is recorded as {"params": the
    parameters before it, "grads": its gradients (under DDP the averaged ones every rank
    applies), "loss": the global batch's loss (summed over the processes)}. With ``pinned`` (one
    process's records), step i first loads pinned[i]'s parameters (buffers are left to run their
    own course: a hard-attention baseline stays the run's own)."""
    steps: list[dict] = []
    step = trainer.train_step
    named = dict(trainer.model.named_parameters())

    def train_step(*args):
        if pinned is not None:
            with torch.no_grad():
                for n, p in named.items():
                    p.copy_(pinned[len(steps)]["params"][n])
        before = {n: p.detach().clone() for n, p in named.items()}
        step(*args)
        _, share, loss, _ = trainer.unread[-1]  # (this process's loss; share: its part of the batch)
        loss = (loss.detach() * share).double()
        if trainer.world.distributed:
            torch.distributed.all_reduce(loss)
        grads = {n: p.grad.detach().clone() for n, p in named.items() if p.grad is not None}
        steps.append({"params": before, "grads": grads, "loss": loss})

    trainer.train_step = train_step
    return steps


def assert_same_steps(one: list[dict], two: list[dict]) -> None:
    """Each step of ``two`` (a pinned DDP run's records) computed one process's loss and gradients."""
    assert len(one) == len(two) and one
    for i, (a, b) in enumerate(zip(one, two)):
        assert a["params"].keys() == b["params"].keys()
        assert all(torch.equal(a["params"][n], b["params"][n]) for n in a["params"])  # (pinned: the same start)
        torch.testing.assert_close(b["loss"], a["loss"], rtol=1e-6, atol=0, msg=f"loss at step {i}")
        assert a["grads"].keys() == b["grads"].keys() and a["grads"]
        total = float(torch.stack([g.norm() for g in a["grads"].values()]).norm())
        for n, g in a["grads"].items():
            gap = float((b["grads"][n] - g).norm())
            assert gap < GRAD_RTOL * float(g.norm()) + GRAD_ATOL * total, \
                f"step {i}: {n}'s gradient from two processes is {gap:.1e} from one's (its size {float(g.norm()):.1e})"


class ThreadRanks:
    """``fn(rank)`` for each of ``n`` ranks, each on its own thread, with
    :func:`~captionkit.core.collectives.process_sum` an all-reduce over them (what the trainer
    gets from ``distributed.step_sum``, simulated in one process)."""

    def __init__(self, n: int):
        self.n, self.barrier, self.parts = n, threading.Barrier(n, timeout=60), [None] * n

    def _sum(self, rank: int):
        def total(t: torch.Tensor) -> torch.Tensor:
            self.parts[rank] = t.clone()
            self.barrier.wait()
            out = sum(self.parts[r] for r in range(self.n))
            self.barrier.wait()
            return out
        return total

    def run(self, fn) -> list:
        results, errors = [None] * self.n, []

        def one(rank):
            try:
                with summed_over(self._sum(rank)):
                    results[rank] = fn(rank)
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)
                self.barrier.abort()

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return results
