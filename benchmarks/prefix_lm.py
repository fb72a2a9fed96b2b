"""Speed and memory of the prefix-LM captioner at a recipe's sizes, on the cached Lite2 features.

    python benchmarks/prefix_lm.py [--config configs/prefix_smollm2_lora_flickr8k.toml]
                                   [--threads 1 2] [--steps 20] [--images 32]

Prints, per thread count: training captions/s (the trainer's own step: forward, backward,
clipping, AdamW; after --warmup steps), and decoding ms per image for greedy and beam 3 on
dev images in batches of 16 (the decoder only: the features are cached; the encoder adds its
own ~15 ms/image), with the mean caption length; then the process's peak resident memory.
Each figure is given per wall-clock second and per CPU second of this process: on a machine
busy with other work the wall figure only says how much CPU this process got, while with one
thread the CPU figure is what a quiet core gives.
The model is the recipe's, freshly initialised (an untrained projector: its captions tend
to run longer than a trained model's, so the decoding figures are on the slow side).
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch

from captionkit.cli.main import tune_allocator
from captionkit.inference.captioner import Captioner
from captionkit.training.config import RunConfig
from captionkit.training.run import build_trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="configs/prefix_smollm2_lora_flickr8k.toml")
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--images", type=int, default=32)
    args = ap.parse_args()
    tune_allocator()
    cfg = RunConfig.load(args.config)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as out:
        trainer = build_trainer(cfg, Path(out))  # the training stages: data, tokenizer, model, optimizer
        print(f"{args.config}: set-up {time.time() - t0:.0f} s; prefix {trainer.model.cfg.prefix_len} tokens; "
              f"trained parameters {sum(p.numel() for g in trainer.opt.param_groups for p in g['params']):,}",
              file=sys.stderr)
        batches = trainer.epoch_batches(0)
        for threads in args.threads:
            torch.set_num_threads(threads)
            start = trainer.state.step
            trainer.fit(max_steps=start + args.warmup, progress=False)
            first = trainer.state.batch_in_epoch
            t, cpu = time.time(), time.process_time()
            trainer.fit(max_steps=start + args.warmup + args.steps, progress=False)
            seconds, cpu = time.time() - t, time.process_time() - cpu
            done = batches[first:trainer.state.batch_in_epoch]
            captions = sum(len(b) for b in done)
            tokens = sum(len(trainer.examples[i][1]) - 1 for b in done for i in b)
            print(f"threads {threads}: training {captions / seconds:.2f} captions/s wall, {captions / cpu:.2f} per "
                  f"CPU second ({len(done)} batches of {cfg.train.batch_size}, {tokens / captions:.1f} tokens + "
                  f"{trainer.model.cfg.prefix_len} prefix per caption, {seconds:.1f} s wall, {cpu:.1f} s CPU)")
            trainer.model.eval()
            cap = Captioner(trainer.model, trainer.vocab, trainer.checkpoint_config()).place(trainer.device)
            feats = trainer.data.val_feats[:args.images].float()
            for beam in (1, 3):
                t, cpu = time.time(), time.process_time()
                caps = [c for i in range(0, len(feats), 16) for c in cap.decode_features(feats[i:i + 16], beam=beam)]
                ms, cpu_ms = (1000 * (x / len(feats)) for x in (time.time() - t, time.process_time() - cpu))
                mean_len = sum(len(c.ids) for c in caps) / len(caps)
                print(f"threads {threads}: {'greedy' if beam == 1 else f'beam {beam}'} {ms:.0f} ms/image wall, "
                      f"{cpu_ms:.0f} ms CPU "
                      f"({len(feats)} images, batches of 16, {mean_len:.1f} tokens per caption, "
                      f"max_len {cap.max_len})")
    print(f"peak resident memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
