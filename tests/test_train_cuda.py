"""Training on a CUDA GPU: a few steps match the CPU's, fp16 trains under its gradient scaler,
the checkpoints load on the CPU, SCST samples on the GPU. Skipped without a GPU (this
project's development machine has none: these tests have not run there)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from captionkit.core.checkpoint import read_config
from captionkit.inference.captioner import Captioner
from captionkit.training.run import train

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")]


def _config(tiny_config, tmp_path, name: str, extra: str = "", drop_model: bool = False):
    text = tiny_config.read_text()
    if drop_model:
        head, _, rest = text.partition("[model]")
        text = head + rest[rest.index("[train]"):]
    path = tmp_path / f"{name}.toml"
    path.write_text(text.replace("[train]", f"[train]\n{extra}"))
    return path


def test_training_steps_on_cuda_match_the_cpu(tiny_config, tmp_path):
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    train(tiny_config, out=cpu, max_steps=3, progress=False, device="cpu")
    train(tiny_config, out=gpu, max_steps=3, progress=False, device="cuda")  # precision fp32 in the tiny config
    a, b = load_file(cpu / "last" / "model.safetensors"), load_file(gpu / "last" / "model.safetensors")
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4, msg=k)
    assert read_config(gpu / "last")["train"]["train"]["device"] == "auto"  # --device is not the config's


def test_fp16_trains_under_a_gradient_scaler_and_loads_on_the_cpu(tiny_config, tmp_path):
    cfg = _config(tiny_config, tmp_path, "fp16", "")
    cfg.write_text(cfg.read_text().replace('precision = "fp32"', 'precision = "fp16"'))
    out = tmp_path / "fp16"
    st = train(cfg, out=out, progress=False, device="cuda")  # whole epochs: validation and decoding on the GPU
    assert st.epoch == 3 and all(torch.isfinite(v).all() for v in load_file(out / "last" / "model.safetensors").values())
    assert "grad_scaler" in read_config(out / "last")
    cap = Captioner.load(out / "best", with_encoder=False)  # written from CPU copies: loads anywhere
    assert cap.decode_features(torch.rand(1, 49, 1280), beam=2)[0].ids


def test_self_critical_steps_on_cuda(tiny_run, tiny_config, tmp_path):
    cfg = _config(tiny_config, tmp_path, "scst", f'init = "{tiny_run / "best"}"\nobjective = "scst"\nsamples = 2',
                  drop_model=True)
    out = tmp_path / "scst"
    train(cfg, out=out, max_steps=2, progress=False, device="cuda")
    assert read_config(out / "last")["state"]["history"][-1]["reward"] >= 0  # 2 steps: the 9 images' epoch
