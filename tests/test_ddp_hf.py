"""DDP with the Hugging Face families (models/hf_captioner.py, hf_families.py): two gloo processes
fine-tune a tiny random VisionEncoderDecoder and Idefics3 model (hf_tiny.py), with LoRA
(the vision tower and the language side's weights frozen, adapters trained) and fully, and each
step computes one process's loss and gradients on the same global batch (the pinned comparison of
tests/ddpsteps.py, as tests/test_ddp.py does for the SAT family); and ``captionkit train --nproc 2``
of an hf model checkpoints a run that one process resumes to the unbroken run's adapters.

The models are the tiny ones with their dropout set to 0 (GIT's and GPT-2's configs have 0.1): a
step then depends only on the weights and the global batch. With dropout each process draws its
own masks, as under any DDP run, and no two runs are equal.

Two of the four families run here: an encoder-decoder (VED, with the unread ViT pooler that once
stopped DDP) and the decoder-only LM behind a connector (Idefics3); what DDP adds is the same for
each. What differs by family, DDP's condition that every trained parameter gets a gradient at
every step, is checked for all four (BLIP and GIT too) in one process by
tests/test_hf_models.py::test_a_training_step_trains_exactly_the_chosen_side."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

from ddpsteps import assert_same_steps, record_steps, tiny_trainer  # noqa: E402
from helpers import free_port, write_lm_config  # noqa: E402
from meta_models import HF_FAMILIES, HF_PROMPT  # noqa: E402

import captionkit  # noqa: E402
from captionkit.core.checkpoint import read_config, read_weights  # noqa: E402
from captionkit.training.distributed import World  # noqa: E402
from captionkit.training.run import train  # noqa: E402

pytestmark = pytest.mark.slow  # each process imports transformers and builds its trainers

FAMILY = {arch: family for family, arch in HF_FAMILIES.items()}
TRAININGS = ("lora", "full")
STEPS = 3  # the tiny run's epoch: 6 images x 5 captions in batches of 8 -> 4 batches


def without_dropout(source: str, folder: Path) -> str:
    """A copy of the saved model ``source`` whose config sets every dropout probability to 0."""
    shutil.copytree(source, folder)

    def zero(d: dict) -> None:
        for k, v in d.items():
            if isinstance(v, dict):
                zero(v)
            elif ("dropout" in k or "pdrop" in k) and isinstance(v, float):
                d[k] = 0.0

    config = json.loads((folder / "config.json").read_text())
    zero(config)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def run_config(path: Path, arch: str, source: str, flickr_dir: Path, training: str) -> Path:
    prompt = f'prompt = "{HF_PROMPT}"\n' if arch == "idefics3" else ""
    return write_lm_config(path, flickr_dir, f'name = "hf_pixels"\nweights = "{source}"',
                           f'family = "{FAMILY[arch]}"\nsource = "{source}"\ntraining = "{training}"\n{prompt}'
                           f'lora_rank = 2\nlora_dropout = 0.0', epochs=1,
                           train="train_max_images = 6\nval_max_images = 2")


def _pinned_rank(rank: int, folder: str, port: int) -> None:
    """One of 2 gloo processes: for each training, the trainer as run.train builds it, each step
    from the parameters one process had before it (folder/TRAINING/pinned.pt); rank 0 saves what
    the steps computed."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for training in TRAININGS:
            out = Path(folder) / training
            trainer = tiny_trainer(out / "run.toml", out / "two", world=World(rank, 2, rank))
            pinned = torch.load(out / "pinned.pt")
            seen = record_steps(trainer, pinned)
            trainer.fit(max_steps=len(pinned), progress=False)
            if rank == 0:
                torch.save(seen, out / "steps.pt")
            dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("arch", ["ved", "idefics3"])
def test_two_processes_fine_tune_what_one_process_fine_tunes(arch, tiny_hf, flickr_dir, tmp_path):
    """LoRA and full fine-tuning, STEPS steps each. Full fine-tuning under DDP needs every trained parameter to get a gradient
    at every step: a VisionEncoderDecoderModel's ViT pooler, which the caption never reads, is
    frozen (before, DDP stopped at the second step naming two parameters without a gradient)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        source = without_dropout(tiny_hf[arch], tmp_path / "model")
        expected = {}
        for training in TRAININGS:
            out = tmp_path / training
            out.mkdir()
            cfg = run_config(out / "run.toml", arch, source, flickr_dir, training)
            single = tiny_trainer(cfg, out / "one")  # (and it fills the feature cache the ranks read)
            expected[training] = record_steps(single)
            single.fit(max_steps=STEPS, progress=False)
            torch.save(expected[training], out / "pinned.pt")
        torch.multiprocessing.spawn(_pinned_rank, args=(str(tmp_path), free_port()), nprocs=2)
    finally:
        torch.set_num_threads(threads)
    for training in TRAININGS:
        steps = torch.load(tmp_path / training / "steps.pt")
        assert_same_steps(expected[training], steps)
        trained = set(steps[0]["grads"])
        if training == "lora":  # the adapters alone: the vision tower and the language weights stay frozen
            assert trained and all("lora_" in n for n in trained)
        else:  # both sides
            assert any(".vision_model." in n or n.startswith(("hf.encoder.", "hf.git.image_encoder.")) for n in trained)
            assert any(".text_" in n or n.startswith(("hf.decoder.", "hf.git.encoder.")) for n in trained)


def test_nproc_2_checkpoints_a_lora_run_that_one_process_resumes(tiny_hf, flickr_dir, tmp_path):
    """captionkit train --nproc 2 (torchrun's launcher) fine-tunes Idefics3 (SmolVLM's
    architecture) with LoRA; the checkpoint holds the adapters alone, and one process resumes
    it to the weights of one process's unbroken run (to Adam's rounding, tests/test_ddp.py)."""
    cfg = run_config(tmp_path / "run.toml", "idefics3", tiny_hf["idefics3"], flickr_dir, "lora")
    run, straight = tmp_path / "run", tmp_path / "straight"
    train(cfg, out=straight, max_steps=4, progress=False)  # (and the feature cache is filled first)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(captionkit.__file__).parents[1]),
                                                       os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "captionkit", "train", "--config", str(cfg), "--out", str(run),
                           "--max-steps", "2", "--nproc", "2"], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = read_config(run / "last")
    assert saved["state"]["step"] == 2 and saved["family"] == "hf_idefics3"
    assert not list(run.glob("*rank*"))  # one set of files, written by rank 0
    train(cfg, out=run, resume=True, max_steps=4, progress=False)
    a, b = read_weights(run / "last"), read_weights(straight / "last")
    assert set(a) == set(b) and a and all("lora_" in k for k in a)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-4, msg=k)
