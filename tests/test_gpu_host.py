"""The suite passes on a GPU host: tests not marked ``cuda`` run on the CPU whatever the host
has (conftest's ``_cpu_unless_marked_cuda``, helpers.hide_gpus), in this process and in its
child processes (commands, torchrun's ranks); tests marked ``cuda`` see torch's own view. A GPU
host is faked here, so these run on CPU-only CI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from helpers import hide_gpus, show_gpus

from captionkit.core.devices import resolve_device
from captionkit.training.distributed import World, device_for
from captionkit.training.run import check_run

CPU = torch.device("cpu")


@pytest.fixture
def gpu_host(monkeypatch):
    """torch as it answers on a host with one visible GPU (no CUDA call is made)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)  # resolve_device makes cuda:N current
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert resolve_device("auto") == torch.device("cuda", 0)  # the fake is a GPU host to captionkit


def test_tests_not_marked_cuda_see_no_gpu():
    assert not torch.cuda.is_available() and torch.cuda.device_count() == 0
    assert resolve_device("auto") == CPU
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
    child = subprocess.run([sys.executable, "-c", "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "''"  # torchrun's ranks and commands in child processes: no GPU either


def test_on_a_gpu_host_the_pin_makes_auto_the_cpu(gpu_host, tiny_config, tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        real = hide_gpus(mp)
        assert resolve_device("auto") == CPU
        _, _, device = check_run(tiny_config, tmp_path / "run")  # the tiny config's train.device: auto
        assert device == CPU
        assert device_for(World(1, 2, 1), device) == CPU  # torchrun's rank 1 of 2 asks for no cuda:1
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""
        show_gpus(mp, real)  # what a test marked cuda gets
        assert resolve_device("auto") == torch.device("cuda", 0)
        assert "CUDA_VISIBLE_DEVICES" not in os.environ
    assert resolve_device("auto") == torch.device("cuda", 0)


@pytest.mark.cuda  # (no skip: this checks the marker's effect, not a GPU)
def test_tests_marked_cuda_get_torchs_own_view(_cpu_unless_marked_cuda):
    real = _cpu_unless_marked_cuda
    assert torch.cuda.is_available is real.is_available and torch.cuda.device_count is real.device_count
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == real.visible
