"""DDP's set-up, without starting processes: one GPU per process (issue 28, item 3), checked
on a hardware fake (torch.cuda answering as a machine with 2 GPUs), and what a rank prints when
its collective broke because another rank failed (item 2; the processes themselves are in
tests/test_ddp_faults.py)."""

from __future__ import annotations

import pytest
import torch

import captionkit.training.distributed as distributed
import captionkit.training.run as run
from captionkit.cli.main import main
from captionkit.core.errors import UserError
from captionkit.training.distributed import World, WaitTimeout, check_gpus, device_for, peer_failure

CUDA = torch.device("cuda", 0)


@pytest.fixture
def two_gpus(monkeypatch):
    """This machine as one with 2 CUDA GPUs, as far as the checks ask (nothing runs on them)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)


@pytest.fixture
def no_process_group(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the processes started: a GPU was missing and nobody said so")

    monkeypatch.setattr(run, "start", refuse)
    monkeypatch.setattr(distributed, "launch", refuse)


def test_each_rank_takes_the_gpu_of_its_local_rank(two_gpus):
    assert device_for(World(3, 4, 1, 2), CUDA) == torch.device("cuda", 1)
    assert device_for(World(0, 2, 0, 2), CUDA) == torch.device("cuda", 0)
    assert device_for(World(1, 2, 1, 2), torch.device("cpu")) == torch.device("cpu")  # shared
    check_gpus(2, CUDA)
    check_gpus(8, torch.device("cpu"))


@pytest.mark.parametrize("rank", [0, 2])
def test_more_ranks_on_a_machine_than_gpus_is_one_line_on_every_rank_before_anything_loads(
        rank, two_gpus, no_process_group, no_expensive_work, tiny_config, tmp_path, monkeypatch, capsys):
    """3 processes on 2 GPUs: not CUDA's "invalid device ordinal" in rank 2 while ranks 0 and 1
    wait for it in the process group, but the same line in every rank, rank 0 included."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for k, v in {"RANK": rank, "WORLD_SIZE": 3, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": 3}.items():
        monkeypatch.setenv(k, str(v))
    assert main(["train", "--config", str(tiny_config), "--out", str(tmp_path / "run"), "--device", "cuda"]) == 2
    assert capsys.readouterr().err == (
        "captionkit train: error: 3 processes on this machine train on CUDA, one GPU each, but 2 GPU(s) are "
        "visible: start at most 2 (--nproc, torchrun --nproc_per_node) or train on the CPU (--device cpu)\n")
    assert not (tmp_path / "run").exists()


def test_nproc_above_the_gpu_count_is_one_line_before_torchrun_starts(two_gpus, no_process_group, tiny_config,
                                                                      tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert main(["train", "--config", str(tiny_config), "--out", str(tmp_path / "run"), "--device", "cuda",
                 "--nproc", "3"]) == 2
    assert capsys.readouterr().err == (
        "captionkit train: error: 3 processes on this machine train on CUDA, one GPU each, but 2 GPU(s) are "
        "visible (CUDA_VISIBLE_DEVICES=0,1): start at most 2 (--nproc, torchrun --nproc_per_node) or train "
        "on the CPU (--device cpu)\n")


def test_a_collective_broken_by_another_rank_is_told_in_one_line():
    """How gloo ends a rank's collective when the other rank's process has gone (the text of
    torch 2.14's error), and a timeout: one line naming this rank; errors of the rank's own,
    and any error in one process, are not turned into it."""
    gone = RuntimeError("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed "
                        "by peer [127.0.0.1]:18093. This is typically caused by a remote worker crashing. Check the "
                        "logs of the remote worker before reporting an error. GLHF!")
    assert peer_failure(World(0, 2), gone) == ("rank 0 stopped: another rank failed or stopped answering (its own "
                                               "error says why); here: Connection closed by peer [127.0.0.1]:18093")
    late = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 900000ms for recv operation "
                        "to complete")
    assert peer_failure(World(1, 2), late).endswith("here: Timed out waiting 900000ms for recv operation to complete")
    assert peer_failure(World(1, 2), torch.distributed.DistBackendError("NCCL error: remote process exited"))
    assert peer_failure(World(1, 2), torch.OutOfMemoryError("CUDA out of memory")) is None
    assert peer_failure(World(1, 2), FloatingPointError("loss became nan at step 3")) is None
    assert peer_failure(World(1, 2), WaitTimeout("rank 1 waited 3 h for rank 0")) is None
    assert peer_failure(World(0, 1), gone) is None
    assert isinstance(WaitTimeout("x"), UserError)  # one line, from the command line


class _FakeDist:
    """torch.distributed as abort() sees it: an initialized group of ``backend``; what is called is recorded."""

    def __init__(self, backend: str):
        self.backend, self.calls = backend, []
        fake = self

        class group:
            class WORLD:
                @staticmethod
                def abort():
                    fake.calls.append("abort")

        self.group = group

    def is_initialized(self):
        return True

    def get_backend(self):
        return self.backend

    def __getattr__(self, name):  # barrier, destroy_process_group, ...: each would wait on the other ranks
        raise AssertionError(f"abort called dist.{name}")


@pytest.mark.parametrize("backend, calls", [("nccl", ["abort"]), ("gloo", [])])
def test_abort_waits_for_no_other_rank(monkeypatch, backend, calls):
    """The error path: nccl's communicators are aborted; gloo's group is left to the process's
    exit (destroying it would wait out its timeout on a pending collective); no barrier."""
    fake = _FakeDist(backend)
    monkeypatch.setattr(distributed, "dist", fake)
    distributed.abort(World(1, 2))
    assert fake.calls == calls


def test_a_wait_for_rank_0_that_times_out_is_one_line_naming_what_it_waited_for(monkeypatch):
    """gloo's timeout is a plain RuntimeError: a failure at the end of the wait's time is the
    timeout (one line: what the rank waited for, what to do); an earlier one is not."""
    import time
    from datetime import timedelta

    monkeypatch.setattr(distributed, "_waits", object())  # the group of the long waits
    monkeypatch.setattr(distributed, "WAIT_TIMEOUT", timedelta(seconds=0.05))

    def late(group):
        time.sleep(0.06)
        raise RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 50ms for recv operation")

    monkeypatch.setattr(distributed.dist, "barrier", lambda group: late(group))
    with pytest.raises(WaitTimeout, match=r"^rank 1 waited 0.05 s for rank 0 to finish the feature cache and "
                                          r"gave up; fill it first$"):
        distributed.barrier(World(1, 2), "rank 0 to finish the feature cache", "fill it first")

    def gone(group):
        raise RuntimeError("Connection closed by peer [127.0.0.1]:1234")

    monkeypatch.setattr(distributed.dist, "barrier", lambda group: gone(group))
    with pytest.raises(RuntimeError, match="Connection closed"):
        distributed.barrier(World(1, 2), "x")
