"""The stages a trainer is built from, each a function whose result the next takes
(:func:`captionkit.training.run.build_trainer` runs them): ``prepare_data`` (splits, encoder,
cached features) -> ``build_tokenizer`` -> ``build_model`` -> ``build_optimizer``, and what
they hand on (:class:`TrainData`, :class:`BuiltModel`, :class:`BuiltOptimizer`); the trainer
(:mod:`captionkit.training.trainer`) takes their results.

A run can start from a trained checkpoint (``train.init``, :class:`InitCheckpoint`) and can
fine-tune the encoder's last blocks (``finetune_blocks``): what stays frozen is cached, the rest
runs in every step.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import torch

from ..core.checkpoint import ENCODER_PREFIX, load_into, read_config, read_weights
from ..core.errors import DatasetError
from ..data.datasets import ImageItem, load_dataset
from ..data.items import mirror_words
from ..data.tokenizers import Tokenizer, load_tokenizer
from ..data.tokenizers import build_tokenizer as new_tokenizer
from ..encoders import Encoder, create_encoder, load_finetuned
from ..encoders.features import ArrayStore, FeatureRows, build_features
from ..models import (
    CaptionModel,
    create_model,
    family_config,
    family_fields,
    model_class,
)
from .config import ConfigError, DataConfig, RunConfig, TrainConfig
from .glove import Coverage, glove_embedding

CPU = torch.device("cpu")


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
    cached rows come from before ``tail`` (on ``source_grid``), and :meth:`~captionkit.training.trainer.Trainer.features`
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
    train_feats_mirrored: FeatureRows | None = None  # train.flip: the train images' mirror images


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
    the cached features of the images the run uses (train.train_max_images and val_max_images
    limit them; each image's computed once per encoder, see captionkit.encoders.features).
    The features stay in the store, read a batch at a time on the CPU (encoder blocks tuned
    before and frozen now: their output is computed here and held in memory). The encoder
    computes on ``device`` (a GPU's minutes, not a CPU's hours, for a new dataset), in float32
    as on the CPU, then goes back to the CPU: only the blocks tuned now stay on ``device``."""
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
    # the whole encoder: a trunk (source) computes with its encoder's weights
    encoder.to(device)
    source.to(device)
    # The store is the whole dataset's (one cache folder per image set, whatever part a run
    # uses), but only this run's images are encoded: a run on train_max_images/val_max_images
    # images waits for those alone, and a later run on more of the dataset fills in the rest.
    store = build_features(source, [it.path for it in ds.all_items()],  # (where the encoder is)
                           only=[it.path for it in train_items + val_items])
    data = TrainData(train_items, val_items, encoder, _load_feats(store, train_items), _load_feats(store, val_items),
                     grid=tuple(encoder.grid()), source_grid=store.grid, tuned_blocks=tuned_blocks, tail=tail, init=init)
    if tc.flip:  # the mirror images of the train split, cached apart (as --tta flip's are)
        mirrored = build_features(source, [it.path for it in ds.all_items()], flip=True,
                                  only=[it.path for it in train_items])
        data.train_feats_mirrored = _load_feats(mirrored, train_items)
    if tail is not None and not tc.finetune_blocks:  # tuned before, frozen now
        data.train_feats = _run_tail(tail, data.train_feats, store.grid, device)
        data.val_feats = _run_tail(tail, data.val_feats, store.grid, device)
        if data.train_feats_mirrored is not None:
            data.train_feats_mirrored = _run_tail(tail, data.train_feats_mirrored, store.grid, device)
        data.source_grid = data.grid
    # what does not train leaves the device's memory to the model (the trainer never runs it)
    encoder.to(CPU)
    source.to(CPU)
    if tail is not None and tc.finetune_blocks:
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
def _run_tail(tail: torch.nn.Module, feats: FeatureRows, grid: tuple[int, int], device: torch.device = CPU
              ) -> FeatureRows:
    """The frozen tuned blocks' output for every row, computed once on ``device`` (where the
    blocks are), 256 rows at a time: held in CPU memory (N, L, D) float16, as the blocks'
    output is in no store."""
    out = torch.cat([tail(feats[i:i + 256].to(device).float(), grid).half().cpu()  # (<=256, L, D) each
                     for i in range(0, len(feats), 256)])
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


def encode_captions(items: list[ImageItem], vocab: Tokenizer, cfg: DataConfig, mirrored: bool = False
                    ) -> tuple[list[tuple[int, list[int]]], list[list[int]]]:
    """(image row, token ids) for every caption of ``items``, and each image's captions' indices.
    ``mirrored``: each caption as it describes the mirror image (:func:`mirror_words`), in the
    same order."""
    examples: list[tuple[int, list[int]]] = []
    image_examples: list[list[int]] = []
    for row, it in enumerate(items):
        image_examples.append([])
        for toks in it.words(cfg.words):
            if toks:
                image_examples[-1].append(len(examples))
                examples.append((row, vocab.encode((mirror_words(toks) if mirrored else toks)[:cfg.max_words])))
    return examples, image_examples
