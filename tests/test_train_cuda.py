"""Training on a CUDA GPU: a few steps match the CPU's, fp16 trains under its gradient scaler,
the checkpoints load on the CPU, SCST samples on the GPU. Skipped without a GPU (CI has none;
they ran on two H200s and an H100 on 2026-11-26: docs/devices.md, "What ran on a GPU")."""

from __future__ import annotations

import math

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


def _trainer(config, out, device: str):
    from captionkit.training.config import RunConfig
    from captionkit.training.run import build_trainer
    from captionkit.training.stages import prepare_data
    from captionkit.training.trainer import EpochProgress

    cfg = RunConfig.load(config)
    trainer = build_trainer(cfg, out, data=prepare_data(cfg), device=torch.device(device))
    trainer.state.epoch_progress = EpochProgress()
    return trainer


def test_training_steps_on_cuda_match_the_cpu(tiny_config, tmp_path):
    """Three steps from the same weights on the same batches: each step's loss and gradients
    on CUDA are the CPU's. Gradients, not the weights after Adam: Adam's first steps move a
    weight by about lr * sign(grad) (its update is grad / (|grad| + eps)), so a weight whose
    gradient is ~1e-8 on both devices moves by a device-dependent fraction of lr either way.
    Measured on an H200 with TF32 off: the weights after 3 steps differed by up to 8% of lr,
    at lr 1e-2 and 1e-4 alike, while the gradients agreed to float32 rounding. The tolerance
    here is TF32's (fp32 on CUDA computes matmuls in TF32: docs/devices.md); a device bug (a
    mask, a state or a term lost on the way) changes them by far more."""
    cpu, gpu = _trainer(tiny_config, tmp_path / "cpu", "cpu"), _trainer(tiny_config, tmp_path / "gpu", "cuda")
    wc, wg = cpu.model.state_dict(), gpu.model.state_dict()
    assert all(torch.equal(wc[k], wg[k].cpu()) for k in wc)  # the same initial weights
    batches = cpu.epoch_batches(0)[:3]
    for bi, batch in enumerate(batches):
        for t in (cpu, gpu):
            t.train_step(batch, bi, len(batches))
        (_, _, loss_c, _), (_, _, loss_g, _) = cpu.unread[-1], gpu.unread[-1]
        torch.testing.assert_close(loss_g.cpu(), loss_c, rtol=1e-3, atol=0, msg=f"loss at step {bi}")
        gc = {n: p.grad for n, p in cpu.model.named_parameters() if p.grad is not None}
        gg = {n: p.grad for n, p in gpu.model.named_parameters() if p.grad is not None}
        assert gc.keys() == gg.keys() and gc
        total = float(torch.stack([g.norm() for g in gc.values()]).norm())
        for n in gc:  # (a tensor whose gradient is ~0 on the CPU is held to the whole gradient's scale)
            assert gg[n].is_cuda
            gap = float((gg[n].cpu() - gc[n]).norm()) / max(float(gc[n].norm()), 1e-3 * total)
            assert gap < 1e-2, f"step {bi}: {n}'s gradient on CUDA is {gap:.1e} (relative) from the CPU's"
        gpu.model.load_state_dict(cpu.model.state_dict())  # the next step from the same weights again
    out = tmp_path / "run"
    train(tiny_config, out=out, max_steps=1, progress=False, device="cuda")
    assert read_config(out / "last")["train"]["train"]["device"] == "auto"  # --device is not the config's


def test_fp16_trains_under_a_gradient_scaler_and_loads_on_the_cpu(tiny_config, tmp_path):
    cfg = _config(tiny_config, tmp_path, "fp16", "")
    cfg.write_text(cfg.read_text().replace('precision = "fp32"', 'precision = "fp16"'))
    out = tmp_path / "fp16"
    st = train(cfg, out=out, progress=False, device="cuda")  # whole epochs: validation and decoding on the GPU
    assert st.epoch == 3 and all(torch.isfinite(v).all() for v in load_file(out / "last" / "model.safetensors").values())
    assert "grad_scaler" in read_config(out / "last")
    cap = Captioner.load(out / "best", with_encoder=False)  # written from CPU copies: loads anywhere
    assert cap.decode_features(torch.rand(1, 49, 1280), beam=2)[0].ids


@pytest.mark.parametrize("variant", ["", 'scst_baseline = "mean"\nscst_repeat_penalty = 0.3',
                                     'scst_matcher = "MATCHER"\nscst_match_weight = 0.5'],
                         ids=["greedy-baseline", "mean-baseline-repeat-penalty", "greedy-baseline-matcher"])
def test_self_critical_steps_on_cuda(tiny_run, tiny_config, tmp_path, variant, request):
    if "MATCHER" in variant:  # the discriminability term: the matcher runs on the GPU beside the model
        variant = variant.replace("MATCHER", str(request.getfixturevalue("tiny_matcher")))
    cfg = _config(tiny_config, tmp_path, "scst",
                  f'init = "{tiny_run / "best"}"\nobjective = "scst"\nsamples = 2\n{variant}', drop_model=True)
    out = tmp_path / "scst"
    train(cfg, out=out, max_steps=2, progress=False, device="cuda")
    reward = read_config(out / "last")["state"]["history"][-1]["reward"]  # 2 steps: the 9 images' epoch
    assert reward >= 0 if "matcher" not in variant else math.isfinite(reward)
