"""GPU decisions checked on CPU-only CI with fake GPUs: torch.cuda's queries monkeypatched to
describe the hardware (captionkit.core.precision, captionkit.core.devices)."""

from __future__ import annotations

import pytest
import torch

from captionkit.core import devices, precision
from captionkit.core.devices import resolve_device

V100, T4, A100, H100 = (7, 0), (7, 5), (8, 0), (9, 0)


class FakeGPUs:
    """Visible CUDA GPUs of given compute capabilities, a current device, and a record of which
    GPU each capability query asked about."""

    def __init__(self, monkeypatch, *capabilities: tuple[int, int]):
        self.capabilities = list(capabilities)
        self.current = 0
        self.asked: list[int] = []
        self.set_calls: list[int] = []
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: len(self.capabilities))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "get_device_capability", self.capability)
        # what the old decision asked: True on any GPU from Volta on, emulated or not
        monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)

    def index(self, device) -> int:
        if device is None:
            return self.current
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        return self.current if device.index is None else device.index

    def set_device(self, device) -> None:
        self.set_calls.append(self.index(device))
        self.current = self.index(device)

    def capability(self, device=None) -> tuple[int, int]:
        self.asked.append(self.index(device))
        return self.capabilities[self.index(device)]


@pytest.mark.parametrize("gpu", [V100, T4])
def test_auto_precision_on_a_pre_ampere_gpu_is_fp16_with_a_scaler(monkeypatch, gpu):
    """bf16 is only emulated before compute capability 8.0 (is_bf16_supported says yes anyway):
    "auto" takes fp16 there, trained under an enabled gradient scaler."""
    FakeGPUs(monkeypatch, gpu)
    cuda = torch.device("cuda", 0)
    assert precision.resolve_precision("auto", cuda) == "fp16"
    assert precision.grad_scaler(cuda, "fp16").is_enabled()


@pytest.mark.parametrize("gpu", [A100, H100])
def test_auto_precision_on_an_ampere_or_newer_gpu_is_bf16_without_a_scaler(monkeypatch, gpu):
    FakeGPUs(monkeypatch, gpu)
    cuda = torch.device("cuda", 0)
    assert precision.resolve_precision("auto", cuda) == "bf16"
    assert not precision.grad_scaler(cuda, "bf16").is_enabled()


def test_auto_precision_asks_the_gpu_in_use_not_the_current_one(monkeypatch):
    gpus = FakeGPUs(monkeypatch, A100, V100)  # current: GPU 0, an A100
    assert precision.resolve_precision("auto", torch.device("cuda", 1)) == "fp16"
    assert gpus.asked == [1]
    gpus.current = 1
    assert precision.resolve_precision("auto", "cuda:0") == "bf16"
    assert gpus.asked == [1, 0]


def test_explicit_precisions_are_kept_on_a_gpu(monkeypatch):
    FakeGPUs(monkeypatch, V100)
    for p in ("bf16", "fp16", "fp32"):
        assert precision.resolve_precision(p, torch.device("cuda", 0)) == p


def test_a_gpu_named_by_index_becomes_the_current_device(monkeypatch):
    """--device cuda:1: whatever allocates on "the current GPU" (transformers, torch.cuda calls
    without a device) then agrees with where the model is."""
    gpus = FakeGPUs(monkeypatch, A100, A100)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    assert gpus.current == 1
    assert resolve_device("cuda") == torch.device("cuda", 0) and gpus.current == 0
    gpus.set_calls.clear()
    assert devices.use_device(torch.device("cuda", 1)) == torch.device("cuda", 1) and gpus.set_calls == [1]
    for other in (torch.device("cpu"), torch.device("meta"), torch.device("cuda")):  # cuda: no index to set
        devices.use_device(other)
    assert gpus.set_calls == [1]


def test_auto_device_keeps_the_current_gpu(monkeypatch):
    gpus = FakeGPUs(monkeypatch, A100, A100)
    gpus.current = 1
    assert resolve_device("auto") == torch.device("cuda", 1) and gpus.current == 1


def test_fp32_on_cuda_multiplies_in_tf32_inside_the_autocast_region_only():
    """fp32 on a GPU opts in to TF32 matmuls (CUDA's flag only: the CPU's float32 matmuls stay
    exact) for the region the model computes in, and restores the setting after."""
    cuda_flag = torch.backends.cuda.matmul
    before, cpu_before = cuda_flag.allow_tf32, torch.backends.mkldnn.matmul.fp32_precision
    assert not before  # PyTorch's default
    with precision.autocast(torch.device("cuda", 0), "fp32"):
        assert cuda_flag.allow_tf32
        assert torch.backends.mkldnn.matmul.fp32_precision == cpu_before
    assert cuda_flag.allow_tf32 == before
    with precision.autocast(torch.device("cpu"), "fp32"):
        assert cuda_flag.allow_tf32 == before
