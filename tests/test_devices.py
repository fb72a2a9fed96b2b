"""Device names are checked by spelling before any work, and resolved only to devices that exist."""

import pytest
import torch

from captionkit.core.devices import check_device_name, resolve_device


@pytest.mark.parametrize("name", ["auto", "cpu", "cuda", "cuda:1", "mps"])
def test_device_names_accepted(name):
    assert check_device_name(name) == name


@pytest.mark.parametrize("name", ["gpu", "cuda:", "CPU", "cuda:x", ""])
def test_device_typos_are_one_line_errors(name):
    with pytest.raises(ValueError, match="device must be auto .* cpu, cuda, cuda:N or mps"):
        check_device_name(name)


def test_auto_is_cpu_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("captionkit.core.devices._mps_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="device 'cuda:0': no CUDA GPU is visible"):
        resolve_device("cuda:0")
    with pytest.raises(ValueError, match="device 'mps': MPS is not available"):
        resolve_device("mps")
