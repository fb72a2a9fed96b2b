"""Host syncs per training step and per decoding step, per model family, with their call sites.

    python benchmarks/sync_counts.py [--quick]

Every registered family (a tiny model of each, as tests/meta_models.py builds them; the LM
families from tiny random pretrained folders written here) runs on the meta device, the CPU's
stand-in for a GPU, with tests/devicecheck.py counting host syncs: reads of device values on the
host (``item``, ``tolist``, ``bool(t)``, ``.cpu()``, ``nonzero``...), each of which makes a
CUDA host wait for the GPU. No GPU needed, no values computed.

Per family it prints:

- train: syncs per training step of the model's part (training_loss, backward, an Adam step);
  ``sat_hard`` is sat with hard attention (its REINFORCE baseline).
- greedy / beam-3: syncs per decoding step (the slope in max_len, so the one copy of the
  captions to the host per call is left out) and per extra image (the slope in the batch).

Then Trainer.train_step of the tests' tiny run config (sat, soft and hard attention, and SCST),
per step, the whole step as the trainer takes it. The budget (issue 28): at most 1 host sync
per training step and per decoding step, none per image. Exits 0 always: it reports.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

import torch  # noqa: E402
from devicecheck import MetaAnswers, count_syncs, strict_devices  # noqa: E402
from helpers import TINY_CONFIG, write_flickr8k, write_tiny_gpt2, write_tiny_lm, write_tiny_vit  # noqa: E402
from hf_tiny import write_tiny_hf_models  # noqa: E402
from meta_models import HF_FAMILIES, META, per_step_and_image, tiny_model, train_syncs  # noqa: E402

from captionkit.data.vocab import Vocab  # noqa: E402
from captionkit.models import list_models  # noqa: E402

WRITERS = {"tiny_lm": write_tiny_lm, "tiny_vit": write_tiny_vit, "tiny_gpt2": write_tiny_gpt2,
           "tiny_hf": write_tiny_hf_models}


def sites(counter, per: float, indent: str = "      ") -> str:
    lines = [f"{indent}{n / per:6.2f}  {site}  {op}" for (site, op), n in counter.sites.most_common()]
    return "\n".join(lines) if lines else f"{indent}(none)"


def family_counts(family: str, folder) -> None:
    model = tiny_model(family, folder).to(META)
    with strict_devices():  # the first step (optimizer state, a baseline's start) aside
        train_syncs(model, steps=1)
    run = train_syncs(model, steps=3)
    print(f"{family}\n  train: {run.syncs.total / run.steps:.2f} per step")
    print(sites(run.syncs, run.steps))
    for beam, label in ((1, "greedy"), (3, "beam-3")):
        per_step, per_image, big = per_step_and_image(model, beam)
        print(f"  {label}: {per_step:.2f} per step, {per_image:.2f} per image "
              f"(one call of {big.steps} steps: {big.syncs.total} in all)")
        print(sites(big.syncs, big.steps))


def trainer_counts(work: Path, steps: int) -> None:
    from captionkit.training.config import RunConfig
    from captionkit.training.run import build_trainer
    from captionkit.training.stages import prepare_data
    from captionkit.training.trainer import EpochProgress

    data_dir = write_flickr8k(work / "flickr")
    variants = {
        "sat (soft)": TINY_CONFIG,
        "sat (hard)": TINY_CONFIG.replace("dropout = 0.0", 'dropout = 0.0\nattention = "hard"'),
        "sat scst": TINY_CONFIG.replace("batch_size = 8", 'batch_size = 2\nobjective = "scst"\nsamples = 2'),
    }
    print(f"Trainer.train_step (tests' tiny run config, {steps} steps after the first)")
    for name, text in variants.items():
        path = work / f"{name.replace(' ', '_').replace('(', '').replace(')', '')}.toml"
        path.write_text(text.format(dataset=data_dir))
        cfg = RunConfig.load(path, None)
        trainer = build_trainer(cfg, work / "run", data=prepare_data(cfg), device=META)
        for group in trainer.opt.param_groups:  # meta has no fused kernels: the per-tensor loop
            group["fused"] = False
        trainer.state.epoch_progress = EpochProgress()
        trainer.model.train(cfg.train.objective == "xe")
        batches = trainer.epoch_batches(0)
        answers = MetaAnswers(fill=Vocab.end)  # a finite loss; scst: greedy word lists that end
        with strict_devices(answers):
            trainer.train_step(batches[0], 0, len(batches))
        with strict_devices(answers), count_syncs() as syncs:
            for bi in range(1, 1 + steps):
                trainer.train_step(batches[bi], bi, len(batches))
        print(f"  {name}: {syncs.total / steps:.2f} per step")
        print(sites(syncs, steps, "    "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the families without pretrained LMs only")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        os.environ.setdefault("CAPTIONKIT_CACHE", str(work / "cache"))
        folders: dict[str, str] = {}

        def folder(name: str) -> str:
            if name not in folders:
                path = work / name
                path.mkdir()
                folders[name] = WRITERS[name](path)
            return folders[name]

        families = [f for f in list_models() if not (args.quick and f in ("prefix_lm", "vit_gpt2", *HF_FAMILIES))]
        print(f"host syncs on the meta device (torch {torch.__version__}); budget: <= 1 per training step "
              "and per decoding step, 0 per image\n")
        for family in [*families, "sat_hard"]:
            family_counts(family, folder)
            print()
        trainer_counts(work, steps=3)


if __name__ == "__main__":
    main()
