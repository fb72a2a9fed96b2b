"""The training loop: :class:`Trainer` trains a model built by the stages
(:mod:`captionkit.training.stages`) into the run folder. Per epoch: length-bucketed batches
(every batch holds captions of one length, as in the paper; or whole images with their
captions), Adam, AdamW or RMSProp with gradient clipping and a plateau, cosine or inverse-sqrt
schedule, then validation by free-running beam search on the dev split scored with the
coco-caption scorers; the best checkpoint is kept and training stops early when the score stops
improving.

Two objectives: ``xe`` (cross-entropy under teacher forcing, or the model family's own
training loss, e.g. hard attention's lower bound) and ``scst`` (self-critical training, see
:mod:`captionkit.training.scst`; batches of images instead of captions). With encoder blocks
fine-tuned, they run in every step. What a run has done is a :class:`TrainState`, saved as JSON
in every checkpoint.
"""

from __future__ import annotations

import copy
import itertools
import json
import math
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from ..core.checkpoint import (
    ENCODER_PREFIX,
    epoch_names,
    kill_point,
    load_into,
    optimizer_tensors,
    prune_epochs,
    read_config,
    read_weights,
    remove_leftovers,
    restore_optimizer,
    save_checkpoint,
)
from ..core.collectives import process_sum, summed_over
from ..core.devices import forked_rng
from ..core.errors import TrainingDiverged
from ..core.outputs import append_whole, atomic_write_text
from ..core.precision import autocast, grad_scaler, resolve_precision
from ..core.progress import progress as progress_bar
from ..core.signals import Preempted, StopSignals
from ..data.tokenizers import Tokenizer
from ..data.vocab import Vocab
from ..encoders import load_finetuned
from ..inference.captioner import Captioner
from ..models.matcher import Matcher, load_matcher
from ..scoring.evaluation import coco_scores, format_scores
from .config import ConfigError, RunConfig
from .distributed import SINGLE, World, barrier, broadcast_json, mean_figures, shard, step_sum
from .prefetch import HostBatch, Prefetcher, Shard
from .schedule import image_batches, length_batches, lr_factor
from .scst import SelfCritical
from .state import EpochProgress, TrainState  # (defined here before: imported from here too)
from .stages import CPU, BuiltModel, BuiltOptimizer, TrainData, decoder_weights, encode_captions

_SCORER = {"METEOR": "meteor", "ROUGE_L": "rouge"}  # validation scores BLEU and CIDEr, and these when chosen
# Steps between host reads of the training figures: the progress bar's figures (and the check
# that the loss is finite) come every LOG_EVERY steps; between them a step never waits for the device.
LOG_EVERY = 20
PRECISION_NAMES = {"bf16": "bf16 mixed precision matmuls", "fp32": "float32 matmuls",
                   "fp16": "fp16 mixed precision matmuls with a gradient scaler"}


# ---- the trainer ---------------------------------------------------------------------------------

class Trainer:
    """Trains a built model on prepared data into the run folder ``out``: :meth:`fit` runs the
    epochs (:meth:`train_step` per batch, :meth:`end_epoch` after each: validation, early
    stopping, checkpoints), then picks the decoding settings."""

    def __init__(self, cfg: RunConfig, out: Path, data: TrainData, vocab: Tokenizer, built: BuiltModel,
                 optim: BuiltOptimizer, state: TrainState | None = None, device: torch.device = CPU,
                 world: World = SINGLE):
        tc = cfg.train
        self.cfg, self.out, self.data, self.vocab = cfg, out, data, vocab
        self.family, self.model_cfg, self.model = built.family, built.config, built.model
        self.length_penalty, self.glove_coverage = built.length_penalty, built.glove_coverage
        self.opt, self.lr_scales = optim.opt, optim.lr_scales
        self.trained_parameters, self.params = optim.trained_parameters, optim.params
        self.state = state or TrainState(lr=tc.lr)
        self.device, self.world = device, world
        self.unread: list[tuple] = []  # (step, share, loss, figures) of the steps since read_figures
        self.stop = StopSignals(())  # fit's: the signals that ask the loop to stop (none by default)
        self.saved_step = -1  # the step of the newest ``last`` written by this process (or resumed from)
        self.bars = False  # progress bars (captionkit.core.progress): fit's progress=True, on rank 0
        self.precision = resolve_precision(tc.precision, device)  # "bf16", "fp16" or "fp32"
        self.scaler = grad_scaler(device, self.precision)  # enabled for fp16 only
        if world.main:
            where = "" if device == CPU else f" on {device}"
            where += f", {world.size} processes (DDP)" if world.distributed else ""
            print(f"precision {tc.precision}: {PRECISION_NAMES[self.precision]}{where}", file=sys.stderr)
        # the module whose forward is a batch's loss: DistributedDataParallel wraps it (and
        # averages the gradients of its parameters across processes in backward)
        self.loss_module: torch.nn.Module = _BatchLoss(self)
        if world.distributed:
            self.loss_module = DistributedDataParallel(self.loss_module,
                                                       device_ids=[device] if device.type == "cuda" else None)
            torch.manual_seed(tc.seed + 1000003 * world.rank)  # each rank its own draws (rank 0 keeps the seed's)
        self.examples, self.image_examples = encode_captions(data.train_items, vocab, cfg.data)
        # train.flip: the token ids of each caption that names a side, as it reads mirrored
        self.mirrored_ids: dict[int, list[int]] = {}
        if tc.flip:
            mirrored, _ = encode_captions(data.train_items, vocab, cfg.data, mirrored=True)
            self.mirrored_ids = {i: m for i, ((_, ids), (_, m)) in enumerate(zip(self.examples, mirrored)) if m != ids}
        self.epoch_mirrored = torch.zeros(len(data.train_items), dtype=torch.bool)  # epoch_batches' draw
        longest = max((len(ids) - 1 for _, ids in [*self.examples, *self.mirrored_ids.items()]), default=0)
        limit = self.model.max_positions
        if limit is not None and max(longest, tc.max_len + 1) > limit:  # (a new model's max_len: at load too)
            raise ConfigError(f"model.max_positions is {limit}, but training captions need {longest} positions "
                              f"and decoding (train.max_len + 1) {tc.max_len + 1}")
        self.scst: SelfCritical | None = None
        if tc.objective == "scst":  # CIDEr-D document frequencies from the training references
            refs = {row: [t for t in it.words(cfg.data.words) if t] for row, it in enumerate(data.train_items)}
            self.scst = SelfCritical(refs, vocab, tc.samples, tc.max_len, tc.scst_baseline,
                                     tc.scst_repeat_penalty, _scst_matcher(tc.scst_matcher, data, device),
                                     tc.scst_match_weight, tc.scst_bleu_weight, tc.scst_meteor_weight)

    # ---- features and batches ----
    def features(self, feats: torch.Tensor) -> torch.Tensor:
        """Cached rows (B, L, C) -> annotation vectors (B, L, D), through the tuned blocks if
        they are being trained. Call under the training autocast."""
        if self.cfg.train.finetune_blocks:
            return self.data.tail(feats.float(), self.data.source_grid)
        return feats.to(torch.bfloat16) if self.precision == "bf16" else feats.float()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A batch's tensor built on the CPU -> the training device (through pinned memory,
        without waiting for the copy, on CUDA; the prefetch thread has pinned it already)."""
        if self.device.type == "cuda":
            return (t if t.is_pinned() else t.pin_memory()).to(self.device, non_blocking=True)
        return t.to(self.device)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """xe: caption indices, one length per batch; scst: image rows. Also draws, with
        train.flip, which images the epoch sees mirrored (``epoch_mirrored``, (N,) bool), from
        the seed and the epoch alone: every DDP rank and a resumed run draw the same."""
        tc = self.cfg.train
        seed = tc.seed * 1000 + epoch
        if tc.flip:
            draw = torch.rand(len(self.data.train_items), generator=torch.Generator().manual_seed(seed + 7919))
            self.epoch_mirrored = draw < tc.flip  # (N,)
        if tc.objective == "scst":
            rows = list(range(len(self.data.train_items)))
            random.Random(seed).shuffle(rows)
            return [rows[i:i + tc.batch_size] for i in range(0, len(rows), tc.batch_size)]
        groups = self.image_examples
        if tc.caption_sampling == "random_one":  # this epoch's caption of each image
            rng = random.Random(seed)
            groups = [[rng.choice(idx)] for idx in self.image_examples if idx]
        if tc.batching == "image":
            return image_batches(groups, [len(ids) for _, ids in self.examples], tc.batch_size, seed)
        pick = [i for g in groups for i in g]
        batches = length_batches([len(self.examples[i][1]) for i in pick], tc.batch_size, seed)
        return [[pick[j] for j in b] for b in batches]

    def host_batch(self, batch: list[int]) -> HostBatch:
        """A global batch's host side for this process: its shard and the shard's tensors.
        Runs on the prefetch thread: reads and builds on the CPU only, draws nothing."""
        sh = self.shard(batch)
        return HostBatch(sh, len(batch), self.host_tensors(sh.part))

    def host_tensors(self, idx: list[int]) -> dict[str, torch.Tensor]:
        """The CPU tensors of the items ``idx`` (pinned when training on CUDA): xe: "feats"
        (B or U, L, C) cached rows, "ids" (B, T+1) and with image batching "image_index" (B,);
        scst: "feats" (B, L, C) of the images, and with train.scst_xe_weight "ids" (R, T+1) of
        every caption of theirs and "image_index" (R,), each caption's image."""
        if self.scst is not None:
            out = {"feats": self.select_feats(torch.tensor(idx))}  # (B, L, C)
            if self.cfg.train.scst_xe_weight:  # the mixed objective: every caption of the B images
                pos = [(p, i) for p, row in enumerate(idx) for i in self.image_examples[row]]
                out["ids"] = self.caption_ids([i for _, i in pos])  # (R, T+1)
                out["image_index"] = torch.tensor([p for p, _ in pos])  # (R,) each caption's image in feats
        else:
            rows = torch.tensor([self.examples[i][0] for i in idx])
            out = {"ids": self.caption_ids(idx)}  # (B, T+1)
            if self.cfg.train.batching == "image":  # each image once, indexed per caption
                rows, out["image_index"] = torch.unique(rows, return_inverse=True)  # (U,), (B,)
            out["feats"] = self.select_feats(rows)  # (B or U, L, C)
        if self.device.type == "cuda":
            out = {k: v.pin_memory() for k, v in out.items()}
        return out

    def caption_ids(self, idx: list[int]) -> torch.Tensor:
        """The token ids of the captions ``idx`` (as the epoch sees them: mirrored with their
        image under train.flip) -> (B, T+1), <pad> after <end> (ignored by the loss). A
        "length" batch is all one length, except where a mirrored caption's tokenizer spells
        "left" and "right" in different numbers of tokens (characters, subwords)."""
        captions = [self.mirrored_ids.get(i, self.examples[i][1])
                    if self.mirrored_ids and self.epoch_mirrored[self.examples[i][0]]
                    else self.examples[i][1] for i in idx]
        longest = max(len(c) for c in captions)
        return torch.tensor([c + [Vocab.pad] * (longest - len(c)) for c in captions])

    def select_feats(self, rows: torch.Tensor) -> torch.Tensor:
        """The cached rows of the train images ``rows`` (R,) -> (R, L, C): the mirror image's for
        those the epoch sees mirrored (``epoch_mirrored``)."""
        if self.data.train_feats_mirrored is None:  # no train.flip: nothing to choose per row
            return self.data.train_feats.select(rows)
        flip = self.epoch_mirrored[rows]  # (R,)
        if not flip.any():
            return self.data.train_feats.select(rows)
        out = self.data.train_feats_mirrored.select(rows[flip])  # (F, L, C)
        if flip.all():
            return out
        feats = torch.empty((len(rows), *out.shape[1:]), dtype=out.dtype)
        feats[flip] = out
        feats[~flip] = self.data.train_feats.select(rows[~flip])
        return feats

    def batch_loss(self, batch: HostBatch | list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """-> (loss to minimise, figures to report: the cross-entropy, or scst's mean rewards).
        ``batch``: a prepared :class:`HostBatch`, or items to read here. The figures are 0-dim
        tensors on the device, left there: reading them is :meth:`read_figures`'s job."""
        tc = self.cfg.train
        idx, host = (batch.shard.part, batch.tensors) if isinstance(batch, HostBatch) else (batch, self.host_tensors(batch))
        t = {k: self.to_device(v) for k, v in host.items()}
        with autocast(self.device, self.precision):
            feats = self.features(t["feats"])  # (B or U, L, D)
            if self.scst is not None:
                mirrored = self.epoch_mirrored[idx].tolist() if tc.flip else None
                loss, stats = self.scst.loss(self.model, feats, idx, mirrored=mirrored)
                figures = {"reward": stats.sample_reward}
                if stats.greedy_reward is not None:
                    figures["greedy_reward"] = stats.greedy_reward
                if "ids" in t:  # train.scst_xe_weight
                    xe, figures["loss"] = self.reference_loss(feats, t["ids"], t["image_index"])
                    loss = loss + tc.scst_xe_weight * xe
                return loss, figures
            ids = t["ids"]
            loss, ce = self.model.training_loss(feats, ids[:, :-1], ids[:, 1:], alpha_c=tc.alpha_c,
                                                label_smoothing=tc.label_smoothing, image_index=t.get("image_index"))
            return loss, {"loss": ce.detach()}

    def reference_loss(self, feats: torch.Tensor, ids: torch.Tensor, image_index: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """The mixed objective's cross-entropy term: the family's training loss on the captions
        ``ids`` (R, T+1) of the images ``feats`` (B, L, D) (``image_index`` (R,): each caption's
        image) -> (the term, weighted like the self-critical loss: by this process's share of
        the global batch's target tokens, so that under DDP the processes' terms add up to the
        one-process term; the plain cross-entropy, detached, to report)."""
        tc = self.cfg.train
        if not self.model.image_batching:  # (the family takes one image row per caption)
            feats, image_index = feats.index_select(0, image_index), None  # (R, L, D)
        loss, ce = self.model.training_loss(feats, ids[:, :-1], ids[:, 1:], alpha_c=tc.alpha_c,
                                            label_smoothing=tc.label_smoothing, image_index=image_index)
        tokens = (ids[:, 1:] != Vocab.pad).sum()
        return loss * tokens / process_sum(tokens), ce.detach()

    # ---- the loop ----
    def fit(self, max_steps: int | None = None, progress: bool = True,
            on_epoch: Callable[[dict], None] | None = None, stop: StopSignals | None = None) -> TrainState:
        """Train to the end (or ``max_steps``). ``on_epoch`` is called with each epoch's history
        entry once it is logged and saved. ``stop`` (core.signals): on its signal, the current step
        ends, ``last`` is saved and Preempted raised: one process after that step; DDP at the next
        figures read (the flag rides its all-reduce: every rank stops at the same step), at most
        LOG_EVERY steps on. During an epoch's validation, before its next chunk of 100 images:
        the state before it is saved, and the resumed run validates the epoch again."""
        tc = self.cfg.train
        self.stop = stop or self.stop
        self.stop.immediate = False  # from here a signal is a flag the loop polls
        self.bars = progress and self.world.main
        on_epoch = on_epoch if self.world.main else None
        self.set_lr(self.state.lr)
        if self.data.init and self.state.best_score is None:  # the starting point is the score to beat
            self.score_start(on_epoch)
        while self.state.epoch < tc.epochs and self.state.bad_epochs < tc.patience:  # (a resumed early stop stays stopped)
            st = self.state
            batches = self.epoch_batches(st.epoch)
            self.model.train(tc.objective == "xe")  # self-critical training samples without dropout (see scst)
            if not st.batch_in_epoch or st.epoch_progress is None:
                st.epoch_progress = EpochProgress()
            clock = _Clock(st.epoch_progress)
            if self.stop.requested and not self.world.distributed:  # (came during validation or set-up)
                self.preempt()
            # counted in captions (images for scst); leave=None: kept, unless under a sweep's bar
            bar = progress_bar(total=sum(map(len, batches)), initial=sum(map(len, batches[:st.batch_in_epoch])),
                               desc=f"epoch {st.epoch + 1}/{tc.epochs}", unit=self.unit[:-1], leave=None,
                               show=self.bars)
            # the coming batches' reads on a background thread (training.prefetch)
            with bar, Prefetcher(self.host_batch, batches[st.batch_in_epoch:]) as coming:
                for bi, batch in enumerate(coming, start=st.batch_in_epoch):
                    if max_steps is not None and st.step >= max_steps:
                        self.read_figures()
                        self.save("last", with_optimizer=True)
                        return st
                    self.train_step(batch, bi, len(batches))
                    clock.tick()
                    bar.update(batch.size)
                    shown = bi % LOG_EVERY == 0 or bi == len(batches) - 1  # (an epoch's last: always)
                    saved = tc.checkpoint_every and st.step % tc.checkpoint_every == 0
                    stopping = self.stop.requested is not None and not self.world.distributed
                    if shown or saved:  # on every process: under DDP the read is a collective
                        stopping = self.read_figures()
                    if shown:  # the epoch's mean figures so far, as read
                        prog = st.epoch_progress
                        bar.set_postfix_str(" ".join(f"{k} {v / prog.batches:.3f}" for k, v in prog.sums.items()))
                    if saved:
                        self.save("last", with_optimizer=True)
                    if stopping:
                        self.preempt()
            before = copy.deepcopy(self.state)  # the state to save if a signal stops the validation
            try:
                self.end_epoch(clock, on_epoch)
            except _StopInValidation:  # (rank 0) validation has changed nothing: stop as after the last step
                self.state = before
                self.receive_state(stopped=True)
            if self.state.bad_epochs >= tc.patience and self.world.main:
                gain = f" above {100 * tc.min_delta:g} (x100)" if tc.min_delta else ""
                span = "epochs" if tc.val_every == 1 else f"validations (every {tc.val_every} epochs)"
                print(f"early stop: no {tc.val_metric} gain{gain} for {tc.patience} {span}", file=sys.stderr)
        if self.world.main:
            self.tune_decoding()
        barrier(self.world)
        return self.state

    def train_step(self, batch: HostBatch | list[int], bi: int, n_batches: int) -> None:
        """One optimizer step on one global batch, at the schedule's learning rate for this step.
        Under DDP each process takes its shard of the batch; its loss is weighted (see
        :meth:`shard`) so that the gradients DDP averages are those of the whole batch. No
        host read: the step's figures and loss wait on the device for :meth:`read_figures`."""
        tc, st = self.cfg.train, self.state
        if not isinstance(batch, HostBatch):
            batch = self.host_batch(batch)
        self.set_lr(st.lr * lr_factor(tc, st.step, (st.epoch + bi / n_batches) / tc.epochs))
        with summed_over(step_sum(self.world, batch.shard.real)):  # the step's global sums (core.collectives)
            loss, figures = self.loss_module(batch)
        self.unread.append((st.step, batch.shard.share, loss.detach(), figures))
        if self.world.distributed:  # DDP averages over the processes: weight * world size each
            loss = loss * (batch.shard.loss_weight * self.world.size)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if tc.grad_clip:
            self.scaler.unscale_(self.opt)  # (fp16: clip the true gradients)
            torch.nn.utils.clip_grad_norm_(self.params, tc.grad_clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        st.step += 1
        st.batch_in_epoch = bi + 1
        prog = st.epoch_progress
        prog.seen += batch.size
        prog.batches += 1

    def read_figures(self) -> bool:
        """The figures of the steps since the last read, read on the host at once (one sync;
        under DDP one all-reduce, so every process calls it at the same steps) and added to
        the epoch's sums, in step order. The losses are checked here too: a loss that was
        not finite stops training, naming its step, at most LOG_EVERY steps after it (no
        checkpoint is written in between: every save reads first). -> whether a stop signal
        came (under DDP: to any process, summed in the same all-reduce)."""
        unread, self.unread, stop = self.unread, [], float(self.stop.requested is not None)
        if not unread:
            return bool(stop)
        keys = sorted(unread[0][3])
        # (N, K + 1): each step's figures weighted by this process's share, and its loss
        rows = torch.stack([torch.stack([f[k].to(torch.float64) * share for k in keys] + [loss.to(torch.float64)])
                            for _, share, loss, f in unread])
        if self.world.distributed:  # (N + 1, K + 1): a last row carries the stop flag
            rows = torch.cat([rows, torch.full((1, len(keys) + 1), stop, dtype=torch.float64, device=rows.device)])
        read = mean_figures(self.world, rows)
        stop = read.pop()[0] if self.world.distributed else stop
        prog = self.state.epoch_progress
        for (step, *_), values in zip(unread, read):
            if not math.isfinite(values[-1]):  # (summed over the processes: any one's)
                raise TrainingDiverged(f"loss became {values[-1]} at step {step}: training diverged (lower train.lr, "
                                       "keep train.grad_clip on, or use train.precision fp32); the checkpoints "
                                       "saved before it are kept")
            for k, v in zip(keys, values):  # means over this epoch so far
                prog.sums[k] = prog.sums.get(k, 0.0) + v
        return stop > 0

    def preempt(self) -> None:
        """Stop on the signal: ``last`` saved at this step (unless it just was), every rank
        past the save, then Preempted (the command exits core.signals.EXIT_PREEMPTED)."""
        st = self.state
        self.read_figures()
        if self.saved_step != st.step:
            self.save("last", with_optimizer=True)
        barrier(self.world, "rank 0 to save the checkpoint")
        why = self.stop.requested or "another rank's signal"
        raise Preempted(f"stopped on {why} after step {st.step} "
                        f"(epoch {st.epoch + 1}), {self.stop.seconds():.1f} s after it; {self.out / 'last'} "
                        f"holds the run: run the same command with --resume auto to continue", why)

    def shard(self, batch: list[int]) -> Shard:
        """This process's part of a global batch and its weights (see :class:`Shard`): by
        target tokens for cross-entropy (the loss is a mean over them); for SCST the figures
        by images, the loss by 1 (it is normalised by the global batch's sampled words).
        Image batching keeps each image's captions on one process."""
        if not self.world.distributed:
            return Shard(batch)
        if self.scst is not None:
            part, real = shard(batch, self.world)
            return Shard(part, real, len(part) / len(batch) if real else 0.0, 1.0 if real else 0.0)
        key = [row for row, _ in self.examples] if self.cfg.train.batching == "image" else None
        part, real = shard(batch, self.world, key)
        tokens = [len(self.examples[i][1]) - 1 for i in batch]  # targets: the words and <end>
        share = sum(len(self.examples[i][1]) - 1 for i in part) / sum(tokens) if real else 0.0
        return Shard(part, real, share, share)

    @property
    def unit(self) -> str:
        return "images" if self.scst is not None else "captions"

    def end_epoch(self, clock: _Clock, on_epoch: Callable[[dict], None] | None) -> None:
        """Close an epoch: its history entry (with dev scores when it is validated), the
        early-stopping and plateau bookkeeping, history.jsonl and the ``last`` checkpoint.
        Under DDP, rank 0 does it and the others take its state."""
        tc, st = self.cfg.train, self.state
        self.read_figures()  # (nothing left unread: an epoch's last step is a read point)
        prog = st.epoch_progress
        st.epoch += 1
        st.batch_in_epoch = 0
        st.epoch_progress = None
        if not self.world.main:
            self.receive_state()
            return
        entry = {"epoch": st.epoch, "step": st.step, **{k: v / max(prog.batches, 1) for k, v in prog.sums.items()},
                 "lr": self.opt.param_groups[0]["lr"], "seconds": clock.seconds(), self.unit: prog.seen}
        if st.epoch % tc.val_every and st.epoch < tc.epochs:  # no dev scoring after this epoch
            st.history.append(entry)
            print(f"epoch {st.epoch}: not validated (train.val_every = {tc.val_every})", file=sys.stderr)
        else:
            scores = self.validate(stoppable=True)
            val_loss = self.validation_loss()
            st.history.append({**entry, **scores, "val_loss": val_loss})
            self.judge(scores[tc.val_metric])
            print(f"epoch {st.epoch}: dev {format_scores(scores)} loss {val_loss:.3f} ({tc.val_metric} "
                  f"{'best' if st.best_epoch == st.epoch else 'no gain'}; "
                  f"lr {self.opt.param_groups[0]['lr']:.2e})", file=sys.stderr)
        self.log_history()
        self.save("last", with_optimizer=True)
        if tc.keep_epochs:  # this epoch's weights too (after last: a kill between loses nothing)
            self.save(f"epoch-{st.epoch}", with_optimizer=False)
            if self.world.main:
                prune_epochs(self.out, keep_from=st.epoch - tc.keep_epochs + 1)
        self.receive_state()
        if on_epoch:
            on_epoch(st.history[-1])

    def receive_state(self, stopped: bool = False) -> None:
        """Under DDP: every process takes rank 0's state (its dev scores decide early stopping
        and the plateau schedule for all), and whether a signal stopped its validation
        (``stopped``: then every process saves and stops, see :meth:`preempt`)."""
        if self.world.distributed:
            got = broadcast_json(self.world, {"state": self.state.to_json(), "stopped": stopped}, self.device)
            self.state, stopped = TrainState.from_json(got["state"], "rank 0"), got["stopped"]
            self.set_lr(self.state.lr)
        if stopped:
            self.preempt()

    def score_start(self, on_epoch: Callable[[dict], None] | None) -> None:
        """A run from train.init: the starting checkpoint's dev score is the one to beat."""
        tc, st = self.cfg.train, self.state
        if self.world.main:
            scores, val_loss = self.validate(), self.validation_loss()
            st.best_score, st.best_epoch = scores[tc.val_metric], 0
            st.history.append({"epoch": 0, "step": 0, **scores, "val_loss": val_loss})
            print(f"epoch 0 ({tc.init}): dev {format_scores(scores)} loss {val_loss:.3f}", file=sys.stderr)
            self.log_history()
            self.save("best", with_optimizer=False)
        self.receive_state()
        if on_epoch:
            on_epoch(self.state.history[-1])

    def set_lr(self, lr: float) -> None:
        for pg, scale in zip(self.opt.param_groups, self.lr_scales):
            pg["lr"] = lr * scale

    def judge(self, score: float) -> None:
        """A validated epoch's dev score: a new best (by more than min_delta) is saved as
        ``best``; otherwise the counters of early stopping and of the plateau schedule grow."""
        tc, st = self.cfg.train, self.state
        if st.best_score is None or score > st.best_score + tc.min_delta:
            st.best_score, st.best_epoch, st.bad_epochs, st.lr_bad_epochs = score, st.epoch, 0, 0
            self.save("best", with_optimizer=False)
            return
        st.bad_epochs += 1
        st.lr_bad_epochs += 1
        if tc.schedule == "plateau" and st.lr_bad_epochs >= tc.lr_patience:
            st.lr *= tc.lr_decay
            st.lr_bad_epochs = 0
            self.set_lr(st.lr)

    # ---- validation ----
    @torch.no_grad()
    def validate(self, length_penalty: float | None = None, stoppable: bool = False) -> dict[str, float]:
        """Decode the dev split and score it. ``stoppable`` (an epoch's validation): a stop
        signal ends it between chunks of 100 images (_StopInValidation: fit saves and stops)."""
        tc, data = self.cfg.train, self.data
        length_penalty = self.length_penalty if length_penalty is None else length_penalty
        self.model.eval()
        # decoded where the model trains (place() moves nothing that is already there), in the
        # run's precision (the captioner's own default, "auto", would ignore train.precision)
        cap = Captioner(self.model, self.vocab, self.checkpoint_config()).place(self.device, self.precision)
        captions = {}
        bar = progress_bar(total=len(data.val_items), desc="validating", unit="image", leave=False, show=self.bars)
        for i in range(0, len(data.val_items), 100):
            if stoppable and self.stop.requested:
                raise _StopInValidation
            feats = self.to_device(data.val_feats[i:i + 100]).float()
            feats = data.tail(feats, data.source_grid) if tc.finetune_blocks else feats
            for it, c in zip(data.val_items[i:i + 100],
                             cap.decode_features(feats, beam=tc.val_beam, length_penalty=length_penalty)):
                captions[it.name] = " ".join(self.vocab.decode(c.ids))
            bar.update(len(feats))
        bar.close()
        kill_point("validate")  # test-only: the kill-anywhere test stops a run here
        refs = {it.name: it.raw for it in data.val_items}
        return coco_scores(captions, refs, metrics=("bleu", "cider", _SCORER.get(tc.val_metric, "cider")), quiet=True)

    @torch.no_grad()
    def validation_loss(self) -> float:
        """The teacher-forced cross-entropy of the dev captions (the model's training_loss, without
        dropout), per token: the dev counterpart of the training ``loss``, to see over-fitting.
        Under a forked RNG (the CPU's and the device's), so that a family whose loss samples
        leaves training's draws unchanged; in eval mode, so that it leaves a family's running
        statistics (hard attention's baseline) as training left them."""
        tc = self.cfg.train
        examples, _ = encode_captions(self.data.val_items, self.vocab, self.cfg.data)
        self.model.eval()
        total, tokens = 0.0, 0
        with forked_rng(self.device):
            for idx in length_batches([len(ids) for _, ids in examples], tc.batch_size, seed=0):
                rows = torch.tensor([examples[i][0] for i in idx])
                ids = self.to_device(torch.tensor([examples[i][1] for i in idx]))  # (B, T+1), one length per batch
                with autocast(self.device, self.precision):
                    feats = self.features(self.to_device(self.data.val_feats.select(rows)))
                    _, ce = self.model.training_loss(feats, ids[:, :-1], ids[:, 1:], alpha_c=tc.alpha_c)
                total += float(ce) * ids[:, 1:].numel()
                tokens += ids[:, 1:].numel()
        return total / max(tokens, 1)

    def tune_decoding(self) -> None:
        """Pick the best checkpoint's length normalisation on the dev split, together with the
        model's declared decode options (hard attention: whether to decode with the expected
        context or the most probable location), and save the choice in its config."""
        tc = self.cfg.train
        best = self.out / "best"
        cfg = read_config(best)
        weights = self.load_weights(best)
        declared = self.model.decode_options()  # option -> values to try; saved in [model]
        variants = [tuple(zip(declared, values)) for values in itertools.product(*declared.values())]
        tried: dict[tuple, float] = {}
        for options in variants:
            self.model.set_decode_options(**dict(options))
            for lp in tc.length_penalties:
                tried[(options, lp)] = self.validate(lp)[tc.val_metric]
        options, lp = max(tried, key=lambda k: (tried[k], -abs(k[1])))
        self.model.set_decode_options(**dict(options))
        cfg["model"] = dict(cfg["model"], **dict(options))
        cfg["decoding"] = dict(cfg["decoding"], length_penalty=lp)

        def label(opts: tuple, k: float, sep: str, fmt: str) -> str:
            return "".join(f"{v}{sep}" for _, v in opts) + format(k, fmt)

        cfg["length_penalty_search"] = {"metric": tc.val_metric, "split": self.cfg.data.val_split, "beam": tc.val_beam,
                                        "scores": {label(o, k, ", ", ""): v for (o, k), v in tried.items()}}
        save_checkpoint(best, weights, cfg)
        shown = ", ".join(f"{label(o, k, ' ', 'g')}: {100 * v:.2f}" for (o, k), v in tried.items())
        chosen = "".join(f"{name} {value}, " for name, value in options)
        print(f"{chosen}length penalty {lp:g} chosen on {self.cfg.data.val_split} ({shown} {tc.val_metric})",
              file=sys.stderr)

    # ---- checkpoints ----
    def log_history(self) -> None:
        """Append the newest epoch's figures and dev scores to history.jsonl."""
        self.out.mkdir(parents=True, exist_ok=True)  # an unscored first epoch comes before any save
        # a full disk: one line naming it, the earlier epochs' lines whole (captionkit.core.outputs)
        append_whole(self.out / "history.jsonl", (json.dumps(self.state.history[-1]) + "\n").encode())

    def checkpoint_config(self) -> dict:
        data = self.data
        encoder = {"name": self.cfg.encoder.name, "weights": self.cfg.encoder.weights or None,
                   "grid": list(data.grid), "cache_key": data.encoder.cache_key()}
        if data.tuned_blocks:
            encoder["finetuned_blocks"] = data.tuned_blocks
        return {"family": self.family, "model": self.model_cfg, "encoder": encoder,
                "vocab": self.vocab.to_json(),
                "decoding": {"max_len": self.cfg.train.max_len, "length_penalty": self.length_penalty},
                "trained_parameters": self.trained_parameters, "train": self.cfg.to_dict(),
                "state": self.state.to_json()}

    def weights(self) -> dict[str, torch.Tensor]:
        """The decoder's weights, and the tuned encoder blocks' under ``encoder.``."""
        out = dict(self.model.state_dict())
        if self.data.tail is not None:
            tail = {id(p) for p in self.data.tail.parameters()}
            out.update({ENCODER_PREFIX + k: p.detach() for k, p in self.data.encoder.named_parameters() if id(p) in tail})
        return out

    def save(self, name: str, with_optimizer: bool) -> None:
        """Write the checkpoint ``name`` (rank 0 only: the processes hold the same weights);
        save_checkpoint copies every tensor to the CPU, so it loads on any device."""
        if not self.world.main:
            return
        optim = None
        cfg = self.checkpoint_config()
        if with_optimizer:
            optim, groups = optimizer_tensors(self.opt)
            optim["rng.torch"] = torch.get_rng_state()
            if self.device.type == "cuda":  # SCST's sampling draws from the GPU's generator
                optim["rng.cuda"] = torch.cuda.get_rng_state(self.device)
            cfg["optimizer_groups"] = groups
            if self.scaler.is_enabled():
                cfg["grad_scaler"] = self.scaler.state_dict()
        save_checkpoint(self.out / name, self.weights(), cfg, optim)
        if name == "last":
            self.saved_step = self.state.step

    def load_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        weights = read_weights(folder)
        load_into(self.model, decoder_weights(weights), folder)
        if self.cfg.train.finetune_blocks:
            load_finetuned(self.data.encoder, {k[len(ENCODER_PREFIX):]: v for k, v in weights.items()
                                               if k.startswith(ENCODER_PREFIX)}, str(folder))
        return weights

    def restore(self, folder: Path, saved: dict) -> None:
        """Continue from the checkpoint ``folder`` (its config ``saved``): weights, optimizer,
        random state and training state."""
        self.load_weights(folder)
        optim = read_weights(folder, "optimizer.safetensors")  # on the CPU; restored onto the parameters' device
        rng, rng_cuda = optim.pop("rng.torch"), optim.pop("rng.cuda", None)
        if self.world.main:  # (the other ranks keep their own draws, seeded by rank)
            torch.set_rng_state(rng)
            if rng_cuda is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(rng_cuda, self.device)
        restore_optimizer(self.opt, optim, saved["optimizer_groups"])
        if self.scaler.is_enabled() and "grad_scaler" in saved:
            self.scaler.load_state_dict(saved["grad_scaler"])
        self.state = TrainState.from_json(saved["state"], folder / "config.json")
        self.saved_step = self.state.step
        if not self.world.main:
            return
        # the checkpoint's history is the run's: epochs logged after it (by a run killed before
        # its next save) are run again, so their lines go rather than appear twice
        atomic_write_text(self.out / "history.jsonl", "".join(json.dumps(h) + "\n" for h in self.state.history))
        print(f"resuming from {folder} (epoch {self.state.epoch}, step {self.state.step})", file=sys.stderr)
        for name in ("last", "best", *epoch_names(self.out)):  # what killed saves left
            remove_leftovers(self.out / name)


class _StopInValidation(Exception):
    """A stop signal came during an epoch's validation (rank 0): the epoch's state from before
    it is saved (resumed, it validates again) instead of waiting for the validation to end."""


def _scst_matcher(folder: str, data: TrainData, device: torch.device) -> Matcher | None:
    """train.scst_matcher's matcher on ``device`` (where the features are), or None; one line
    naming the folder when it reads another encoder's rows than the run's."""
    if not folder:
        return None
    m = load_matcher(folder)
    if m.cfg.encoder != data.encoder.cache_key():
        raise ConfigError(f"train.scst_matcher: {folder} is a matcher of {m.cfg.encoder} rows, but this run's "
                          f"encoder is {data.encoder.cache_key()} (captionkit matcher --encoder trains one for it)")
    return m.to(device)


class _BatchLoss(torch.nn.Module):
    """The trained modules (the model, and the tuned encoder blocks) behind one forward that
    returns a batch's (loss, figures): what DistributedDataParallel wraps, so that its
    gradient averaging sees every step, whatever the objective."""

    def __init__(self, trainer: Trainer):
        super().__init__()
        self.model = trainer.model
        self.tail = trainer.data.tail if trainer.cfg.train.finetune_blocks else None
        self.batch_loss = trainer.batch_loss

    def forward(self, batch: HostBatch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.batch_loss(batch)


class _Clock:
    """An epoch's time so far (carried across a resume by its EpochProgress)."""

    def __init__(self, progress: EpochProgress):
        self.progress = progress
        self.t0 = time.time() - progress.seconds

    def tick(self) -> None:
        self.progress.seconds = round(time.time() - self.t0, 1)

    def seconds(self) -> float:
        return round(time.time() - self.t0, 1)

