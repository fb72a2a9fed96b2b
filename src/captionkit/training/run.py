"""Training a decoder on cached encoder features.

``captionkit train --config FILE [--max-steps N] [--out DIR] [--resume]``. The config is TOML
with [data], [encoder], [model] and [train] tables (see configs/). Per epoch: length-bucketed
batches (every batch holds captions of one length, as in the paper; or whole images with their
captions), Adam, AdamW or RMSProp with gradient clipping and a plateau, cosine or inverse-sqrt
schedule, then validation by free-running beam search on the dev split scored with the
coco-caption scorers; the best checkpoint is kept and training stops early when the score stops
improving.

Two objectives: ``xe`` (cross-entropy under teacher forcing, or the model family's own
training loss, e.g. hard attention's lower bound) and ``scst`` (self-critical training, see
:mod:`captionkit.training.scst`; batches of images instead of captions). A run can start from a trained
checkpoint (``train.init``) and can fine-tune the encoder's last blocks (``finetune_blocks``):
what stays frozen is cached, the rest runs in every step.

The stages, each a function whose result the next takes (:func:`build_trainer` runs them):
``prepare_data`` (splits, encoder, cached features) -> ``build_tokenizer`` -> ``build_model``
-> ``build_optimizer`` -> ``Trainer(...).fit()``. What a run has done is a :class:`TrainState`,
saved as JSON in every checkpoint. The config is checked in full when it is read
(:mod:`captionkit.training.config`), and the files it names by :func:`check_inputs`, before any stage.
"""

from __future__ import annotations

import itertools
import json
import math
import random
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel

from ..core.checkpoint import (
    ENCODER_PREFIX,
    CheckpointError,
    kill_point,
    load_into,
    optimizer_tensors,
    read_config,
    read_weights,
    remove_leftovers,
    resolve,
    restore_optimizer,
    save_checkpoint,
)
from ..core.devices import resolve_device
from ..core.errors import DatasetError, OutputError, UserError
from ..core.outputs import MARKER, atomic_write_text, check_folder_target, write_marker
from ..core.precision import autocast, grad_scaler, resolve_precision
from ..data.datasets import ImageItem, load_dataset
from ..data.tokenizers import Tokenizer, load_tokenizer
from ..data.tokenizers import build_tokenizer as new_tokenizer
from ..data.vocab import Vocab
from ..encoders import Encoder, create_encoder, load_finetuned
from ..encoders.features import ArrayStore, FeatureRows, build_features
from ..inference.captioner import Captioner
from ..models import (
    CaptionModel,
    create_model,
    family_config,
    family_fields,
    model_class,
)
from ..scoring.evaluation import coco_scores, format_scores

# the config classes are imported from here by tests and benchmarks
from .config import (  # noqa: F401
    TRAINER_SET,
    VAL_METRICS,
    ConfigError,
    DataConfig,
    EncoderConfig,
    RunConfig,
    TrainConfig,
)
from .distributed import (
    SINGLE,
    World,
    barrier,
    broadcast_json,
    device_for,
    main_first,
    mean_figures,
    shard,
    start,
    stop,
    world_from_env,
)
from .glove import Coverage, glove_embedding, vector_dim
from .scst import SelfCritical

_SCORER = {"METEOR": "meteor", "ROUGE_L": "rouge"}  # validation scores BLEU and CIDEr, and these when chosen
CPU = torch.device("cpu")
PRECISION_NAMES = {"bf16": "bf16 mixed precision matmuls", "fp32": "float32 matmuls",
                   "fp16": "fp16 mixed precision matmuls with a gradient scaler"}


def make_optimizer(groups: list[dict], tc: TrainConfig) -> torch.optim.Optimizer:
    """groups: [{"params": ..., "lr": ...}, ...] (the decoder's, then the encoder's if tuned).
    adamw splits each group in two, as nanoGPT does: parameters of two or more dimensions
    (weight matrices, embeddings, positions) decay, vectors (biases, norms) don't."""
    if tc.optimizer == "adam":  # the fused CPU kernel is ~4x faster than the per-tensor loop
        return torch.optim.Adam(groups, lr=tc.lr, weight_decay=tc.weight_decay, fused=True)
    if tc.optimizer == "adamw":
        split = []
        for g in groups:
            split.append({**g, "params": [p for p in g["params"] if p.dim() >= 2]})
            split.append({**g, "params": [p for p in g["params"] if p.dim() < 2], "weight_decay": 0.0})
        return torch.optim.AdamW(split, lr=tc.lr, weight_decay=tc.weight_decay, fused=True)
    return torch.optim.RMSprop(groups, lr=tc.lr, weight_decay=tc.weight_decay)


def lr_factor(tc: TrainConfig, step: int, progress: float) -> float:
    """The schedule's multiplier of the learning rate at optimizer step ``step`` (0-based) and
    ``progress`` = the fraction of the planned epochs done. A function of the saved training
    state only, so a resumed run continues on the same curve."""
    s = step + 1
    warm = min(1.0, s / tc.warmup_steps) if tc.warmup_steps else 1.0
    if tc.schedule == "cosine":
        return warm * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    if tc.schedule == "inverse_sqrt":
        return min(warm, math.sqrt(tc.warmup_steps / s))
    return warm


def image_batches(groups: list[list[int]], lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """Caption indices grouped by image (groups: each image's captions), whole images per
    batch, up to batch_size captions (at least one image). Images are ordered by their longest
    caption within seeded-random buckets, so a batch pads little; the batches are shuffled."""
    rng = random.Random(seed)
    order = [g for g in groups if g]
    rng.shuffle(order)
    order.sort(key=lambda g: max(lengths[i] for i in g))  # stable: random within a length
    batches, cur = [], []
    for g in order:
        if cur and len(cur) + len(g) > batch_size:
            batches.append(cur)
            cur = []
        cur = cur + g
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def length_batches(lengths: list[int], batch_size: int, seed: int) -> list[list[int]]:
    """Indices grouped so that every batch holds captions of one length, in a seeded order."""
    rng = random.Random(seed)
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        by_len.setdefault(n, []).append(i)
    batches = []
    for n in sorted(by_len):
        idx = by_len[n]
        rng.shuffle(idx)
        batches += [idx[i:i + batch_size] for i in range(0, len(idx), batch_size)]
    rng.shuffle(batches)
    return batches


# ---- the state a checkpoint carries -------------------------------------------------------------

@dataclass
class EpochProgress:
    """The current epoch's figures so far, saved with the state so that an epoch resumed from
    a checkpoint reports its whole time, count and mean figures."""

    seconds: float = 0.0
    seen: int = 0
    batches: int = 0
    sums: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainState:
    """Where a run stands; saved as JSON under "state" in every checkpoint's config.json.

    lr: the base learning rate after the plateau schedule's decays (the warm-up and cosine
    factors are functions of ``step`` and ``epoch``, see :func:`lr_factor`); every group's rate
    is this times its own scale. best_score is on the scorers' scale (CIDEr 0..10)."""

    lr: float
    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    best_score: float | None = None
    best_epoch: int = 0
    bad_epochs: int = 0
    lr_bad_epochs: int = 0
    history: list[dict] = field(default_factory=list)
    epoch_progress: EpochProgress | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict, where: str | Path) -> TrainState:
        """A checkpoint's "state" (runs written before this class hold the same keys; a key
        they lack takes its default)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown or "lr" not in d:
            raise CheckpointError(f"{where}: not a training state ({'unknown key ' + unknown[0] if unknown else 'no lr'})")
        progress = d.get("epoch_progress")
        return cls(**{**d, "epoch_progress": EpochProgress(**progress) if progress else None})


# ---- the stages: data, tokenizer, model, optimizer ----------------------------------------------

@dataclass
class InitCheckpoint:
    """``train.init``: the checkpoint a run starts from (its config and weights)."""

    folder: str
    config: dict
    weights: dict[str, torch.Tensor]

    @property
    def decoder_weights(self) -> dict[str, torch.Tensor]:
        return decoder_weights(self.weights)

    @property
    def encoder_weights(self) -> dict[str, torch.Tensor]:
        return {k[len(ENCODER_PREFIX):]: v for k, v in self.weights.items() if k.startswith(ENCODER_PREFIX)}


@dataclass
class TrainData:
    """What :func:`prepare_data` gives: the splits, the encoder and the cached features.

    Features are the cache's rows (N, L, C) float16, read lazily (:class:`FeatureRows`: a
    batch's rows when it asks for them; never the whole store). With encoder blocks tuned (now:
    ``tail_params`` trained; or by the init checkpoint, then frozen and run once here), the
    cached rows come from before ``tail`` (on ``source_grid``), and :meth:`Trainer.features`
    runs ``tail`` at every step; ``grid`` is the encoder's output grid."""

    train_items: list[ImageItem]
    val_items: list[ImageItem]
    encoder: Encoder
    train_feats: FeatureRows
    val_feats: FeatureRows
    grid: tuple[int, int]
    source_grid: tuple[int, int]
    tuned_blocks: int = 0
    tail: torch.nn.Module | None = None
    tail_params: list[torch.nn.Parameter] = field(default_factory=list)
    init: InitCheckpoint | None = None


def decoder_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights.items() if not k.startswith(ENCODER_PREFIX)}


def load_init(cfg: RunConfig) -> InitCheckpoint | None:
    tc = cfg.train
    if not tc.init:
        return None
    init = InitCheckpoint(tc.init, read_config(tc.init), read_weights(tc.init))
    trained_on = init.config["encoder"]["name"]
    if trained_on != cfg.encoder.name:
        raise ConfigError(f"train.init {tc.init} was trained on {trained_on}, the config names {cfg.encoder.name}")
    return init


def prepare_data(cfg: RunConfig, device: torch.device = CPU) -> TrainData:
    """Stage 1: the dataset's splits, the encoder (with the init checkpoint's tuned blocks) and
    the cached features of every image (computed once per encoder, see captionkit.encoders.features).
    The features stay in the store, read a batch at a time on the CPU (encoder blocks tuned
    before and frozen now: their output is computed here and held in memory); tuned encoder
    blocks go to ``device``."""
    tc = cfg.train
    torch.manual_seed(tc.seed)  # the encoder's random weights (tests) and everything after
    init = load_init(cfg)  # before the dataset: a bad folder costs nothing
    ds = load_dataset(cfg.data.dataset, cfg.data.images or None, cfg.data.image_column,
                      cfg.data.title_column, cfg.data.image_suffix)
    train_items, val_items = ds.split(cfg.data.train_split), ds.split(cfg.data.val_split)
    if tc.val_max_images:
        val_items = val_items[:tc.val_max_images]
    if tc.train_max_images:
        train_items = train_items[:tc.train_max_images]
    if not train_items:
        raise DatasetError(f"{cfg.data.dataset}: the {cfg.data.train_split} split is empty")
    encoder = create_encoder(cfg.encoder.name, weights=cfg.encoder.weights or None)
    if init and init.encoder_weights:
        load_finetuned(encoder, init.encoder_weights, tc.init)
    # Blocks run at every step: those fine-tuned now, or earlier (then frozen; their output is
    # computed once below). Everything before them comes from the cache.
    inherited = int(init.config["encoder"].get("finetuned_blocks", 0)) if init else 0
    if tc.finetune_blocks and tc.finetune_blocks < inherited:
        raise ConfigError(f"train.finetune_blocks must be 0 or at least the {inherited} blocks {tc.init} tuned")
    tuned_blocks = max(tc.finetune_blocks, inherited)
    source, tail = (encoder.split(tuned_blocks) if tuned_blocks else (encoder, None))
    store = build_features(source, [it.path for it in ds.all_items()])
    data = TrainData(train_items, val_items, encoder, _load_feats(store, train_items), _load_feats(store, val_items),
                     grid=tuple(encoder.grid()), source_grid=store.grid, tuned_blocks=tuned_blocks, tail=tail, init=init)
    if tail is not None and not tc.finetune_blocks:  # tuned before, frozen now
        data.train_feats = _run_tail(tail, data.train_feats, store.grid)
        data.val_feats = _run_tail(tail, data.val_feats, store.grid)
        data.source_grid = data.grid
    elif tail is not None:
        tail.to(device)
        data.tail_params = list(tail.parameters())
        for p in data.tail_params:
            p.requires_grad_(True)
    return data


def _load_feats(store, items: list[ImageItem]) -> FeatureRows:
    missing = [it.name for it in items if it.name not in store]
    if missing:
        raise DatasetError(f"{len(missing)} images have no features (unreadable?), e.g. {missing[0]}")
    return FeatureRows(store, [it.name for it in items])


@torch.no_grad()
def _run_tail(tail: torch.nn.Module, feats: FeatureRows, grid: tuple[int, int]) -> FeatureRows:
    """The frozen tuned blocks' output for every row, computed once, 256 rows at a time: held
    in memory (N, L, D) float16, as the blocks' output is in no store."""
    out = torch.cat([tail(feats[i:i + 256].float(), grid).half() for i in range(0, len(feats), 256)])
    return FeatureRows(ArrayStore(feats.names, out.numpy()), feats.names)


def build_tokenizer(cfg: RunConfig, data: TrainData) -> Tokenizer:
    """Stage 2: the init checkpoint's tokenizer, or one built from the training captions."""
    if data.init:
        return load_tokenizer(data.init.config["vocab"])
    words = [toks for it in data.train_items for toks in it.words(cfg.data.words)]
    lm = model_class(cfg.model["family"]).tokenizer_source(cfg.model)  # an LM family's LM
    return new_tokenizer(cfg.data.tokenizer, words, cfg.data.min_count, cfg.data.top_k or None,
                         cfg.data.bpe_vocab_size, lm=lm)


@dataclass
class BuiltModel:
    """What :func:`build_model` gives. length_penalty: the decoding setting dev scores are
    taken with (a run from a tuned checkpoint keeps its own: compared at 0, a self-critical
    model that writes longer captions would look worse than it is). glove_coverage: what
    train.glove covered of the vocabulary (saved as glove_coverage.json)."""

    family: str
    config: dict
    model: CaptionModel
    length_penalty: float = 0.0
    glove_coverage: Coverage | None = None


def build_model(cfg: RunConfig, data: TrainData, vocab: Tokenizer, device: torch.device = CPU) -> BuiltModel:
    """Stage 3: the model the config (or the init checkpoint) describes, its word embedding
    filled from train.glove, checked against what training needs of it, on ``device``."""
    tc = cfg.train
    vectors, coverage = None, None
    if data.init:
        family, model_cfg = data.init.config["family"], dict(data.init.config["model"])
    else:
        family = cfg.model["family"]
        model_cfg = {k: v for k, v in cfg.model.items() if k != "family"}
        model_cfg.update(vocab_size=len(vocab), feat_dim=data.encoder.dim)
        if "grid" in family_fields(family):  # families with image positions need the grid
            model_cfg["grid"] = list(data.grid)
        if tc.glove:
            vectors, coverage = glove_embedding(vocab, tc.glove, seed=tc.seed)
            print(coverage.summary(), file=sys.stderr)
            model_cfg.setdefault("embed_dim", coverage.dim)
    family_config(family, model_cfg)  # validates before building
    model = create_model(family, model_cfg)
    if data.init:
        load_into(model, data.init.decoder_weights, tc.init)
    if vectors is not None:
        _fill_embedding(model, vectors, tc)
    if tc.batching == "image" and not model.image_batching:
        raise ConfigError(f"train.batching = \"image\" needs a family that shares the image side between "
                          f"captions; {family} trains on batches of one caption length (\"length\")")
    length_penalty = float(data.init.config["decoding"].get("length_penalty", 0.0)) if data.init else 0.0
    return BuiltModel(family, model_cfg, model.to(device), length_penalty, coverage)


def _fill_embedding(model: CaptionModel, vectors: torch.Tensor, tc: TrainConfig) -> None:
    embedding = model.word_embedding()
    if embedding is None:
        raise ConfigError(f"train.glove: the {model.family} family has no word embedding of its own to fill")
    if embedding.embedding_dim != vectors.shape[1]:
        raise ConfigError(f"model.embed_dim is {embedding.embedding_dim} but {tc.glove} holds "
                          f"{vectors.shape[1]}-d vectors (leave embed_dim out to use the file's)")
    with torch.no_grad():
        embedding.weight.copy_(vectors)
    embedding.weight.requires_grad_(not tc.freeze_embeddings)


@dataclass
class BuiltOptimizer:
    """What :func:`build_optimizer` gives. lr_scales: each optimizer group's rate over train.lr
    (the schedule moves them together); trained_parameters: the model card's counts per group;
    params: everything trained (gradient clipping's set)."""

    opt: torch.optim.Optimizer
    lr_scales: list[float]
    trained_parameters: dict[str, int]
    params: list[torch.nn.Parameter]


def build_optimizer(cfg: RunConfig, data: TrainData, model: CaptionModel) -> BuiltOptimizer:
    """Stage 4: the optimizer over the model's named parameter groups (each at its
    train.lr_groups rate) and the tuned encoder blocks (at train.encoder_lr)."""
    tc = cfg.train
    named = model.param_groups()
    unknown = sorted(set(tc.lr_groups) - set(named))
    if unknown:  # declared but empty in this configuration (checked against the declaration at load)
        raise ConfigError(f"train.lr_groups: {model.family} trains no group {unknown[0]!r} here "
                          f"(its groups: {', '.join(named) or 'none'})")
    groups = [{"params": ps, "lr": tc.lr_groups.get(name, tc.lr)} for name, ps in named.items()]
    if tc.finetune_blocks:
        groups.append({"params": data.tail_params, "lr": tc.encoder_lr})
    opt = make_optimizer(groups, tc)
    # what this run trains, counted once per tensor: the model card's "trainable parameters"
    names = list(named) + (["encoder"] if tc.finetune_blocks else [])
    counts = {name: sum(p.numel() for p in g["params"] if p.requires_grad) for name, g in zip(names, groups)}
    counts["total"] = sum(counts.values())
    print("trained parameters: " + ", ".join(f"{k} {v:,}" for k, v in counts.items()), file=sys.stderr)
    params = list(model.parameters()) + (data.tail_params if tc.finetune_blocks else [])
    return BuiltOptimizer(opt, [g["lr"] / tc.lr for g in opt.param_groups], counts, params)


def encode_captions(items: list[ImageItem], vocab: Tokenizer, cfg: DataConfig
                    ) -> tuple[list[tuple[int, list[int]]], list[list[int]]]:
    """(image row, token ids) for every caption of ``items``, and each image's captions' indices."""
    examples: list[tuple[int, list[int]]] = []
    image_examples: list[list[int]] = []
    for row, it in enumerate(items):
        image_examples.append([])
        for toks in it.words(cfg.words):
            if toks:
                image_examples[-1].append(len(examples))
                examples.append((row, vocab.encode(toks[:cfg.max_words])))
    return examples, image_examples


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
        longest = max((len(ids) - 1 for _, ids in self.examples), default=0)
        limit = self.model.max_positions
        if limit is not None and max(longest, tc.max_len + 1) > limit:  # (a new model's max_len: at load too)
            raise ConfigError(f"model.max_positions is {limit}, but training captions need {longest} positions "
                              f"and decoding (train.max_len + 1) {tc.max_len + 1}")
        self.scst: SelfCritical | None = None
        if tc.objective == "scst":  # CIDEr-D document frequencies from the training references
            refs = {row: [t for t in it.words(cfg.data.words) if t] for row, it in enumerate(data.train_items)}
            self.scst = SelfCritical(refs, vocab, tc.samples, tc.max_len, tc.scst_baseline)

    # ---- features and batches ----
    def features(self, feats: torch.Tensor) -> torch.Tensor:
        """Cached rows (B, L, C) -> annotation vectors (B, L, D), through the tuned blocks if
        they are being trained. Call under the training autocast."""
        if self.cfg.train.finetune_blocks:
            return self.data.tail(feats.float(), self.data.source_grid)
        return feats.to(torch.bfloat16) if self.precision == "bf16" else feats.float()

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A batch's tensor built on the CPU -> the training device (through pinned memory,
        without waiting for the copy, on CUDA)."""
        if self.device.type == "cuda":
            return t.pin_memory().to(self.device, non_blocking=True)
        return t.to(self.device)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """xe: caption indices, one length per batch; scst: image rows."""
        tc = self.cfg.train
        seed = tc.seed * 1000 + epoch
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

    def batch_loss(self, idx: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        """-> (loss to minimise, figures to report: the cross-entropy, or scst's rewards)."""
        tc = self.cfg.train
        with autocast(self.device, self.precision):
            if self.scst is not None:
                rows = self.data.train_feats.select(torch.tensor(idx))
                feats = self.features(self.to_device(rows))  # (B, L, D)
                loss, stats = self.scst.loss(self.model, feats, idx)
                figures = {"reward": stats.sample_reward}
                if stats.greedy_reward is not None:
                    figures["greedy_reward"] = stats.greedy_reward
                return loss, figures
            rows = torch.tensor([self.examples[i][0] for i in idx])
            longest = max(len(self.examples[i][1]) for i in idx)  # "length" batches: all this long
            ids = torch.tensor([self.examples[i][1] + [Vocab.pad] * (longest - len(self.examples[i][1]))
                                for i in idx])  # (B, T+1), <pad> after <end> (ignored by the loss)
            image_index = None
            if tc.batching == "image":  # each image once, indexed per caption
                rows, image_index = torch.unique(rows, return_inverse=True)  # (U,), (B,)
                image_index = self.to_device(image_index)
            feats = self.features(self.to_device(self.data.train_feats.select(rows)))  # (B or U, L, D)
            ids = self.to_device(ids)
            loss, ce = self.model.training_loss(feats, ids[:, :-1], ids[:, 1:], alpha_c=tc.alpha_c,
                                                label_smoothing=tc.label_smoothing, image_index=image_index)
            return loss, {"loss": float(ce.detach())}

    # ---- the loop ----
    def fit(self, max_steps: int | None = None, progress: bool = True,
            on_epoch: Callable[[dict], None] | None = None) -> TrainState:
        """Train to the end (or ``max_steps``). ``on_epoch`` is called with each epoch's history
        entry (dev scores and ``val_loss`` when validated) once it is logged and saved."""
        tc = self.cfg.train
        progress = progress and self.world.main
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
            for bi in range(st.batch_in_epoch, len(batches)):
                if max_steps is not None and st.step >= max_steps:
                    self.save("last", with_optimizer=True)
                    return st
                self.train_step(batches[bi], bi, len(batches))
                clock.tick()
                if progress and (bi % 20 == 0 or bi == len(batches) - 1):
                    self.log(bi, len(batches), clock)
                if tc.checkpoint_every and st.step % tc.checkpoint_every == 0:
                    self.save("last", with_optimizer=True)
            if progress:
                print(file=sys.stderr)
            self.end_epoch(clock, on_epoch)
            if self.state.bad_epochs >= tc.patience and self.world.main:
                gain = f" above {100 * tc.min_delta:g} (x100)" if tc.min_delta else ""
                span = "epochs" if tc.val_every == 1 else f"validations (every {tc.val_every} epochs)"
                print(f"early stop: no {tc.val_metric} gain{gain} for {tc.patience} {span}", file=sys.stderr)
        if self.world.main:
            self.tune_decoding()
        barrier(self.world)
        return self.state

    def train_step(self, batch: list[int], bi: int, n_batches: int) -> None:
        """One optimizer step on one global batch, at the schedule's learning rate for this step.
        Under DDP each process takes its shard of the batch; its loss is weighted by its share
        so that the gradients DDP averages are those of the whole batch."""
        tc, st = self.cfg.train, self.state
        self.set_lr(st.lr * lr_factor(tc, st.step, (st.epoch + bi / n_batches) / tc.epochs))
        part, weight = self.shard(batch)
        loss, figures = self.loss_module(part)
        if not math.isfinite(float(loss.detach())):
            raise FloatingPointError(f"loss became {float(loss.detach())} at step {st.step}")
        if self.world.distributed:  # DDP averages over the processes: weight * world size each
            loss = loss * (weight * self.world.size)
        self.opt.zero_grad(set_to_none=True)
        self.scaler.scale(loss).backward()
        if tc.grad_clip:
            self.scaler.unscale_(self.opt)  # (fp16: clip the true gradients)
            torch.nn.utils.clip_grad_norm_(self.params, tc.grad_clip)
        self.scaler.step(self.opt)
        self.scaler.update()
        figures = mean_figures(self.world, figures, weight, self.device)
        st.step += 1
        st.batch_in_epoch = bi + 1
        prog = st.epoch_progress
        prog.seen += len(batch)
        prog.batches += 1
        for k, v in figures.items():  # means over this epoch so far
            prog.sums[k] = prog.sums.get(k, 0.0) + v

    def shard(self, batch: list[int]) -> tuple[list[int], float]:
        """This process's part of a global batch and its share of it (1 for one process): by
        target tokens for cross-entropy (the loss is a mean over them), by images for SCST.
        Image batching keeps each image's captions on one process."""
        if not self.world.distributed:
            return batch, 1.0
        if self.scst is not None:
            part, real = shard(batch, self.world)
            return part, (len(part) / len(batch) if real else 0.0)
        key = [row for row, _ in self.examples] if self.cfg.train.batching == "image" else None
        part, real = shard(batch, self.world, key)
        tokens = [len(self.examples[i][1]) - 1 for i in batch]  # targets: the words and <end>
        return part, (sum(len(self.examples[i][1]) - 1 for i in part) / sum(tokens) if real else 0.0)

    def log(self, bi: int, n_batches: int, clock: _Clock) -> None:
        """The progress line: epoch, batch, the epoch's mean figures, this process's rate."""
        prog = self.state.epoch_progress
        shown = " ".join(f"{k} {v / prog.batches:.3f}" for k, v in prog.sums.items())
        print(f"\repoch {self.state.epoch + 1}/{self.cfg.train.epochs} {bi + 1}/{n_batches} "
              f"{shown} {clock.rate():.0f} {self.unit}/s", end="", file=sys.stderr, flush=True)  # a log file sees it too

    @property
    def unit(self) -> str:
        return "images" if self.scst is not None else "captions"

    def end_epoch(self, clock: _Clock, on_epoch: Callable[[dict], None] | None) -> None:
        """Close an epoch: its history entry (with dev scores when it is validated), the
        early-stopping and plateau bookkeeping, history.jsonl and the ``last`` checkpoint.
        Under DDP, rank 0 does it and the others take its state."""
        tc, st = self.cfg.train, self.state
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
            scores = self.validate()
            val_loss = self.validation_loss()
            st.history.append({**entry, **scores, "val_loss": val_loss})
            self.judge(scores[tc.val_metric])
            print(f"epoch {st.epoch}: dev {format_scores(scores)} loss {val_loss:.3f} ({tc.val_metric} "
                  f"{'best' if st.best_epoch == st.epoch else 'no gain'}; "
                  f"lr {self.opt.param_groups[0]['lr']:.2e})", file=sys.stderr)
        self.log_history()
        self.save("last", with_optimizer=True)
        self.receive_state()
        if on_epoch:
            on_epoch(st.history[-1])

    def receive_state(self) -> None:
        """Under DDP: every process takes rank 0's state (its dev scores decide early stopping
        and the plateau schedule for all); nothing for one process."""
        if self.world.distributed:
            self.state = TrainState.from_json(broadcast_json(self.world, self.state.to_json(), self.device), "rank 0")
            self.set_lr(self.state.lr)

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
    def validate(self, length_penalty: float | None = None) -> dict[str, float]:
        tc, data = self.cfg.train, self.data
        length_penalty = self.length_penalty if length_penalty is None else length_penalty
        self.model.eval()
        # decoded where the model trains (place() moves nothing that is already there)
        cap = Captioner(self.model, self.vocab, self.checkpoint_config()).place(self.device)
        captions = {}
        for i in range(0, len(data.val_items), 100):
            feats = self.to_device(data.val_feats[i:i + 100]).float()
            feats = data.tail(feats, data.source_grid) if tc.finetune_blocks else feats
            for it, c in zip(data.val_items[i:i + 100],
                             cap.decode_features(feats, beam=tc.val_beam, length_penalty=length_penalty)):
                captions[it.name] = " ".join(self.vocab.decode(c.ids))
        kill_point("validate")  # test-only: the kill-anywhere test stops a run here
        refs = {it.name: it.raw for it in data.val_items}
        return coco_scores(captions, refs, metrics=("bleu", "cider", _SCORER.get(tc.val_metric, "cider")), quiet=True)

    @torch.no_grad()
    def validation_loss(self) -> float:
        """The teacher-forced cross-entropy of the dev captions (the model's training_loss, without
        dropout), per token: the dev counterpart of the training ``loss``, to see over-fitting.
        Under a forked RNG, so that a family whose loss samples leaves training's draws unchanged."""
        tc = self.cfg.train
        examples, _ = encode_captions(self.data.val_items, self.vocab, self.cfg.data)
        self.model.eval()
        total, tokens = 0.0, 0
        with torch.random.fork_rng(devices=[]):
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
        with open(self.out / "history.jsonl", "a") as fh:
            fh.write(json.dumps(self.state.history[-1]) + "\n")

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
        if not self.world.main:
            return
        # the checkpoint's history is the run's: epochs logged after it (by a run killed before
        # its next save) are run again, so their lines go rather than appear twice
        atomic_write_text(self.out / "history.jsonl", "".join(json.dumps(h) + "\n" for h in self.state.history))
        print(f"resuming from {folder} (epoch {self.state.epoch}, step {self.state.step})", file=sys.stderr)
        for name in ("last", "best"):  # what killed saves left
            remove_leftovers(self.out / name)


class _BatchLoss(torch.nn.Module):
    """The trained modules (the model, and the tuned encoder blocks) behind one forward that
    returns a batch's (loss, figures): what DistributedDataParallel wraps, so that its
    gradient averaging sees every step, whatever the objective."""

    def __init__(self, trainer: Trainer):
        super().__init__()
        self.model = trainer.model
        self.tail = trainer.data.tail if trainer.cfg.train.finetune_blocks else None
        self.batch_loss = trainer.batch_loss

    def forward(self, batch: list[int]) -> tuple[torch.Tensor, dict[str, float]]:
        return self.batch_loss(batch)


class _Clock:
    """An epoch's time so far (carried across a resume by its EpochProgress) and this
    process's rate (what a resumed process shows is its own)."""

    def __init__(self, progress: EpochProgress):
        self.progress = progress
        self.t0 = time.time() - progress.seconds
        self.since, self.seen_before = time.time(), progress.seen

    def tick(self) -> None:
        self.progress.seconds = round(time.time() - self.t0, 1)

    def seconds(self) -> float:
        return round(time.time() - self.t0, 1)

    def rate(self) -> float:
        return (self.progress.seen - self.seen_before) / max(time.time() - self.since, 1e-9)


def build_trainer(cfg: RunConfig, out: Path, data: TrainData | None = None, vocab: Tokenizer | None = None,
                  saved: dict | None = None, device: torch.device = CPU, world: World = SINGLE) -> Trainer:
    """The stages in order: data, tokenizer, model, optimizer, then the Trainer. ``vocab``
    replaces the built tokenizer; ``saved``: the config of a checkpoint to resume (its
    tokenizer, and its model config checked against the one built). Under DDP rank 0 fills the
    feature cache before the others read it, and its tokenizer is every rank's."""
    if data is None:
        with main_first(world):
            data = prepare_data(cfg, device)
    if saved is not None:
        vocab = load_tokenizer(saved["vocab"])
    if vocab is None:
        vocab = build_tokenizer(cfg, data) if world.main else None
        if world.distributed:
            shared = broadcast_json(world, vocab.to_json() if world.main else None, device)
            vocab = vocab or load_tokenizer(shared)
    built = build_model(cfg, data, vocab, device)
    if saved is not None and (saved["model"] != built.config or saved["family"] != built.family):
        raise CheckpointError(f"{out / 'last'}: saved with a different model config than {cfg.model}")
    return Trainer(cfg, out, data, vocab, built, build_optimizer(cfg, data, built.model), device=device, world=world)


def check_run_folder(out: Path, resume: bool, overwrite: bool) -> None:
    """Refuse a run folder this run must not write, before any expensive work: ``--resume``
    needs a checkpoint to continue; a new run needs a missing or empty folder, or ``overwrite``
    and a folder holding a captionkit run (never a folder captionkit did not write)."""
    if resume and overwrite:
        raise OutputError("give --resume (continue the run in OUT) or --overwrite (start it again), not both")
    has_run = (resolve(out / "last") / "config.json").is_file()
    if resume:
        if not has_run:
            raise OutputError(f"{out}: no checkpoint to resume ({out / 'last'} is missing); "
                              f"leave out --resume to start a new run there")
        return
    if has_run and not overwrite:
        raise OutputError(f"{out}: holds a training run; pass --resume to continue it, --overwrite to start "
                          f"it again (its checkpoints are replaced), or choose another --out")
    check_folder_target(out, overwrite=overwrite, kinds=("run",))


def check_resumable(cfg: RunConfig, out: Path) -> None:
    """The config's family and [model] fields are those the checkpoint to resume was trained
    with (checked again, in full, once the model is built)."""
    folder = resolve(out / "last")
    saved = read_config(folder)
    if cfg.train.init:
        return  # the model comes from the init checkpoint, as it did for the saved run
    if saved.get("family") != cfg.model["family"]:
        raise ConfigError(f"{folder}: trained as family {saved.get('family')!r}, the config names "
                          f"model.family = {cfg.model['family']!r}; resume with the run's own config")
    for k, v in cfg.model.items():
        if k != "family" and saved["model"].get(k) != v:
            raise ConfigError(f"{folder}: trained with model.{k} = {saved['model'].get(k)!r}, the config says "
                              f"{v!r}; resume with the run's own config")


def check_inputs(cfg: RunConfig, config: str | Path) -> None:
    """The files the config names that are cheap to check: the checkpoint to start from and
    the word-vector file (and its dimension against model.embed_dim)."""
    if cfg.train.init:
        read_config(cfg.train.init)  # one line naming the folder when it is not a checkpoint
    glove = cfg.train.glove
    if glove and not Path(glove).is_file():
        raise ConfigError(f"{config}: train.glove: {glove}: no such word-vector file")
    if glove and "embed_dim" in cfg.model:
        dim = vector_dim(glove)
        if dim != cfg.model["embed_dim"]:
            raise ConfigError(f"{config}: model.embed_dim is {cfg.model['embed_dim']} but train.glove {glove} holds "
                              f"{dim}-d vectors (leave embed_dim out to use the file's)")


def start_run_folder(out: Path, replace: bool) -> None:
    """Make ``out`` the folder of a new run, marked as captionkit's; with ``replace``, first
    empty it of the previous run that :func:`check_run_folder` found there."""
    if replace and out.is_dir():
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    out.mkdir(parents=True, exist_ok=True)
    write_marker(out, "run")


def train(config: str | Path, out: str | Path | None = None, max_steps: int | None = None,
          resume: bool = False, progress: bool = True, init: str | None = None, overwrite: bool = False,
          on_epoch: Callable[[dict], None] | None = None, tensorboard: str | None = None,
          device: str | None = None) -> TrainState:
    """Train from a TOML config into the run folder ``out`` (default runs/<config name>).
    Everything the user gave is checked first (the config, the folder, the files it names);
    ``resume`` continues the run in ``out``, ``overwrite`` replaces a run there. ``on_epoch``:
    see Trainer.fit; ``tensorboard``: a folder for event files (replaces train.tensorboard);
    ``device`` replaces train.device. Under torchrun (RANK/WORLD_SIZE in the environment) this
    process is one rank of a DDP run (see captionkit.training.distributed)."""
    world = world_from_env()
    cfg, out, run_device = check_run(config, out, max_steps, resume, init, overwrite, device)
    run_device = device_for(world, run_device)
    tensorboard = tensorboard or cfg.train.tensorboard
    if tensorboard and world.main:  # its package is checked before the expensive work
        from .tblog import TensorBoardLog
        tb = TensorBoardLog(tensorboard)
        on_epoch = tb.chain(on_epoch)
    start(world, run_device)
    try:
        barrier(world)  # every rank has checked the folder before rank 0 writes into it
        if resume:
            saved = read_config(resolve(out / "last"))
            trainer = build_trainer(cfg, out, saved=saved, device=run_device, world=world)
            if world.main and not (out / MARKER).is_file():  # a run written before folders were marked
                write_marker(out, "run")
            trainer.restore(resolve(out / "last"), saved)
        else:
            trainer = build_trainer(cfg, out, device=run_device, world=world)
            if world.main:
                start_run_folder(out, replace=overwrite)
        if trainer.glove_coverage is not None and world.main:
            atomic_write_text(out / "glove_coverage.json", json.dumps(trainer.glove_coverage.to_json(), indent=1))
        barrier(world)  # the run folder exists before any rank goes on
        return trainer.fit(max_steps=max_steps, progress=progress, on_epoch=on_epoch)
    finally:
        if tensorboard and world.main:
            tb.close()
        stop(world)


def check_run(config: str | Path, out: str | Path | None = None, max_steps: int | None = None,
              resume: bool = False, init: str | None = None, overwrite: bool = False,
              device: str | None = None) -> tuple[RunConfig, Path, torch.device]:
    """Everything the user gave, checked before any expensive work (also by ``--nproc`` before
    it starts the processes): -> (the config, the run folder, the training device)."""
    if max_steps is not None and (isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1):
        raise UserError(f"max_steps must be a positive integer, got {max_steps!r}")
    cfg = RunConfig.load(config, init)
    run_device = _training_device(cfg, config, device)
    out = Path(out) if out else Path("runs") / Path(config).stem
    check_run_folder(out, resume, overwrite)
    if resume:
        check_resumable(cfg, out)
    check_inputs(cfg, config)
    return cfg, out, run_device


def _training_device(cfg: RunConfig, config: str | Path, device: str | None) -> torch.device:
    """``--device`` or train.device as a device this machine has (one line naming the field if not)."""
    try:
        return resolve_device(device or cfg.train.device)
    except ValueError as e:
        raise ConfigError(f"--device: {e}" if device else f"{config}: train.device: {e}") from None
