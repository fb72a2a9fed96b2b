"""Training a decoder on cached encoder features.

``captionkit train --config FILE [--max-steps N] [--out DIR] [--resume]``. The config is TOML
with [data], [encoder], [model] and [train] tables (see configs/). Per epoch: length-bucketed
batches (every batch holds captions of one length, as in the paper), Adam/RMSProp with
gradient clipping, then validation by free-running beam search on the dev split scored with
the coco-caption scorers; the best checkpoint is kept, the learning rate decays on plateaus and
training stops early when the score stops improving.

Two objectives: ``xe`` (cross-entropy under teacher forcing, or the model family's own
training loss, e.g. hard attention's lower bound) and ``scst`` (self-critical training, see
:mod:`captionkit.scst`; batches of images instead of captions). A run can start from a trained
checkpoint (``train.init``) and can fine-tune the encoder's last blocks (``finetune_blocks``):
what stays frozen is cached, the rest runs in every step.
"""

from __future__ import annotations

import inspect
import json
import math
import random
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from .captioner import Captioner
from .checkpoint import (ENCODER_PREFIX, CheckpointError, kill_point, load_into, optimizer_tensors,
                         read_config, read_weights, remove_leftovers, resolve, restore_optimizer,
                         save_checkpoint)
from .data import WORD_STYLES, ImageItem, load_dataset
from .encoders import create_encoder, load_finetuned
from .evaluation import METRICS, coco_scores, format_scores
from .features import build_features
from .glove import glove_embedding
from .models import create_decoder, family_config, family_default, family_fields
from .outputs import atomic_write_text
from .precision import PRECISIONS, resolve_precision
from .scst import BASELINES, SelfCritical
from .tokenizers import KINDS, PRETRAINED_KINDS, Tokenizer, build_tokenizer, load_tokenizer


@dataclass
class DataConfig:
    """dataset: a Flickr8k/Kaggle folder, a Karpathy/COCO JSON file or a title CSV (one title
        per image, see captionkit.data.read_title_csv).
    images: the image folder of a JSON or CSV dataset.
    image_column / title_column / image_suffix: a CSV's columns of image names and titles, and
        what turns an image name into its file name (Epicurious' layout by default).
    words: how reference captions become training words: "karpathy" (lower case, punctuation
        dropped) or "cased" (case and in-word hyphens and apostrophes kept: for subword
        tokenizers on titles). Scores do not depend on it: the scorers' PTB tokenisation
        lower-cases both sides and keeps hyphenated words whole.
    tokenizer: how captions become tokens: "word", "char", "bpe" or "lm" (the language model's
        own tokenizer, that of model.lm: the prefix_lm family; see captionkit.tokenizers).
    min_count / top_k: vocabulary from the training captions (top_k 0 = no cap); for char,
        characters seen fewer than min_count times become <unk>; for bpe, pairs seen fewer
        than min_count times are not merged.
    bpe_vocab_size: the BPE vocabulary size, specials included; every character of the
        training captions is kept, so a very small size can come out a little larger.
    max_words: longer training captions are truncated (in words, before tokenising)."""

    dataset: str
    images: str = ""
    tokenizer: str = "word"
    min_count: int = 5
    top_k: int = 10000
    bpe_vocab_size: int = 2000
    max_words: int = 30
    train_split: str = "train"
    val_split: str = "dev"
    words: str = "karpathy"
    image_column: str = "Image_Name"
    title_column: str = "Title"
    image_suffix: str = ".jpg"

    def __post_init__(self):
        if self.words not in WORD_STYLES:
            raise ValueError(f"data.words must be one of {', '.join(WORD_STYLES)}, not {self.words!r}")
        if not self.image_column or not self.title_column:
            raise ValueError("data.image_column and data.title_column must name CSV columns")
        if self.tokenizer not in KINDS + PRETRAINED_KINDS:
            raise ValueError(f"data.tokenizer must be one of {', '.join(KINDS + PRETRAINED_KINDS)}, "
                             f"not {self.tokenizer!r}")
        if self.bpe_vocab_size < 5 or self.min_count < 1:
            raise ValueError("data.bpe_vocab_size must be at least 5 and data.min_count at least 1")


@dataclass
class EncoderConfig:
    name: str = "efficientnet_lite2"
    weights: str = ""  # empty: the encoder's pretrained weights


VAL_METRICS = tuple(m for m in METRICS if m != "SPICE")  # SPICE is too slow for every epoch
_SCORER = {"METEOR": "meteor", "ROUGE_L": "rouge"}  # validation scores BLEU and CIDEr, and these when chosen


@dataclass
class TrainConfig:
    """optimizer: adam, adamw (decoupled weight decay on matrices, embeddings and positions,
        not on biases and norms) or rmsprop.
    precision: bf16 (mixed precision matmuls), fp32, or auto: bf16 where the CPU multiplies
        bf16 natively, else fp32 (see captionkit.precision).
    schedule: "plateau" (lr *= lr_decay after lr_patience epochs without dev gain), "cosine"
        (from lr down to 0 over the epochs) or "inverse_sqrt" (lr * sqrt(warmup_steps / step));
        each after a linear warm-up over warmup_steps steps (inverse_sqrt needs one).
    label_smoothing: spread this much of each target's probability over the vocabulary.
    caption_sampling: "all" (every caption of every image, each epoch) or "random_one" (one
        caption per image per epoch, drawn anew each epoch: augmentation, 1/5 of the steps).
    batching: "length" (each batch holds captions of one length, in a seeded order: no padding,
        which the LSTM's attention penalty needs) or "image" (each batch holds whole images with
        all their captions of the epoch, padded; the image side runs once per image instead of
        once per caption: the transformer's encoder is then 5x cheaper with caption_sampling
        "all"). Images are bucketed by their longest caption, so padding stays small.
    glove: a GloVe-format word-vector file to initialise the word embedding (word tokenizer
        only); the vocabulary's coverage is printed and saved as glove_coverage.json. When
        [model] sets no embed_dim, the file's dimension is used. freeze_embeddings: keep them.
    alpha_c: weight of the doubly stochastic attention penalty (LSTM only).
    val_metric: the dev score that selects the best checkpoint and drives early stopping and
        lr decay: Bleu_1..Bleu_4, METEOR, ROUGE_L or CIDEr (CIDEr-D).
    min_delta: an epoch improves only if its val_metric beats the best so far by more than
        this, on the scorers' own scale (BLEU, METEOR, ROUGE-L 0..1, CIDEr 0..10: the printed
        x100 scores divided by 100; 0.001 = 0.1 printed points). Smaller gains count as epochs
        without improvement and do not replace the best checkpoint.
    patience: validations without improvement before stopping; lr_patience: before lr *= lr_decay.
    val_every: score the dev split after every N-th epoch (and the last); the best checkpoint
        is chosen among those epochs. For runs of many short epochs (caption_sampling
        "random_one"), where a dev pass would cost as much as the epoch.
    checkpoint_every: also save the resumable checkpoint every N steps.
    length_penalties: after training, the best checkpoint's beam-search length normalisation
        is chosen among these on the dev split (by val_metric) and saved in its config.
    objective: "xe" (cross-entropy / the family's training loss) or "scst" (self-critical).
    init: a checkpoint folder to start from; its vocabulary, model and encoder are used (the
        config's [model] table must then be left out). Its dev score is the one to beat.
    samples: scst only, captions sampled per image.
    scst_baseline: scst only, "greedy" (the greedy caption's CIDEr-D, Rennie et al.) or "mean"
        (the image's other samples' mean CIDEr-D, Luo 2020; needs samples >= 2).
    finetune_blocks: train the encoder's last N blocks too (0: frozen encoder).
    encoder_lr: their learning rate (decayed together with lr).
    lr_groups: learning rates of the model's named parameter groups, for families that name
        them (prefix_lm: projector, lora, lm_blocks), e.g. {projector = 1e-3, lora = 2e-4};
        a group not listed trains at lr. All follow lr's schedule and decay in proportion."""

    epochs: int = 20
    batch_size: int = 32
    optimizer: str = "adam"
    lr: float = 4e-4
    weight_decay: float = 0.0
    grad_clip: float = 5.0
    alpha_c: float = 1.0
    precision: str = "auto"
    seed: int = 0
    val_beam: int = 3
    val_metric: str = "CIDEr"
    val_max_images: int = 0
    val_every: int = 1
    patience: int = 5
    min_delta: float = 0.0
    lr_patience: int = 2
    lr_decay: float = 0.5
    max_len: int = 20
    checkpoint_every: int = 1000
    length_penalties: list[float] = field(default_factory=lambda: [0.0])
    objective: str = "xe"
    init: str = ""
    samples: int = 5
    scst_baseline: str = "greedy"
    finetune_blocks: int = 0
    encoder_lr: float = 1e-4
    schedule: str = "plateau"
    warmup_steps: int = 0
    label_smoothing: float = 0.0
    caption_sampling: str = "all"
    batching: str = "length"
    glove: str = ""
    freeze_embeddings: bool = False
    lr_groups: dict[str, float] = field(default_factory=dict)

    def __post_init__(self):
        if self.schedule not in ("plateau", "cosine", "inverse_sqrt"):
            raise ValueError(f"train.schedule must be plateau, cosine or inverse_sqrt, not {self.schedule!r}")
        if self.warmup_steps < 0 or (self.schedule == "inverse_sqrt" and self.warmup_steps < 1):
            raise ValueError("train.warmup_steps must be >= 0, and >= 1 for the inverse_sqrt schedule")
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"train.label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.caption_sampling not in ("all", "random_one"):
            raise ValueError(f"train.caption_sampling must be all or random_one, not {self.caption_sampling!r}")
        if self.batching not in ("length", "image"):
            raise ValueError(f"train.batching must be length or image, not {self.batching!r}")
        if self.freeze_embeddings and not self.glove:
            raise ValueError("train.freeze_embeddings needs train.glove (frozen random embeddings learn nothing)")
        if self.objective not in ("xe", "scst"):
            raise ValueError(f"train.objective must be xe or scst, not {self.objective!r}")
        if self.samples < 1 or self.finetune_blocks < 0 or self.encoder_lr <= 0:
            raise ValueError("train.samples and train.encoder_lr must be positive, train.finetune_blocks >= 0")
        if self.scst_baseline not in BASELINES:
            raise ValueError(f"train.scst_baseline must be one of {', '.join(BASELINES)}, not {self.scst_baseline!r}")
        if self.scst_baseline == "mean" and self.samples < 2:
            raise ValueError("train.scst_baseline = \"mean\" needs train.samples >= 2")
        if self.optimizer not in ("adam", "adamw", "rmsprop"):
            raise ValueError(f"train.optimizer must be adam, adamw or rmsprop, not {self.optimizer!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"train.precision must be one of {', '.join(PRECISIONS)}, not {self.precision!r}")
        if self.batch_size < 1 or self.epochs < 1 or self.lr <= 0 or self.val_every < 1:
            raise ValueError("train.batch_size, train.epochs, train.lr and train.val_every must be positive")
        if self.val_metric not in VAL_METRICS:
            raise ValueError(f"train.val_metric must be one of {', '.join(VAL_METRICS)}, not {self.val_metric!r}")
        if self.min_delta < 0 or self.patience < 1:
            raise ValueError("train.min_delta must be >= 0 and train.patience at least 1")
        bad = [k for k, v in self.lr_groups.items() if not isinstance(v, (int, float)) or v <= 0]
        if bad:
            raise ValueError(f"train.lr_groups: the learning rate of {bad[0]!r} must be a positive number")


@dataclass
class RunConfig:
    data: DataConfig
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    model: dict = field(default_factory=lambda: {"family": "sat"})
    train: TrainConfig = field(default_factory=TrainConfig)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "RunConfig":
        def build(kind, table, name):
            known = {f.name for f in fields(kind)}
            unknown = sorted(set(table) - known)
            if unknown:
                raise ValueError(f"{where}: unknown field(s) in [{name}]: {', '.join(unknown)}")
            return kind(**table)

        if "data" not in d or "dataset" not in d["data"]:
            raise ValueError(f"{where}: [data] needs 'dataset'")
        unknown = sorted(set(d) - {"data", "encoder", "model", "train"})
        if unknown:
            raise ValueError(f"{where}: unknown table(s): {', '.join(unknown)}")
        train = build(TrainConfig, d.get("train", {}), "train")
        if train.init and "model" in d:
            raise ValueError(f"{where}: with train.init the model comes from that checkpoint; leave out [model]")
        model = dict(d.get("model", {}))
        if not train.init:
            model.setdefault("family", "sat")
        return cls(build(DataConfig, d["data"], "data"), build(EncoderConfig, d.get("encoder", {}), "encoder"),
                   model, train)

    @classmethod
    def load(cls, path: str | Path, init: str | None = None) -> "RunConfig":
        """Read a TOML config; ``init`` (a checkpoint folder) replaces its train.init."""
        path = Path(path)
        try:
            d = tomllib.loads(path.read_text())
            if init:
                d.setdefault("train", {})["init"] = init
            return cls.from_dict(d, str(path))
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path}: invalid TOML ({e})") from None
        except FileNotFoundError:
            raise ValueError(f"{path}: no such config file") from None

    def to_dict(self) -> dict:
        return {"data": asdict(self.data), "encoder": asdict(self.encoder), "model": dict(self.model),
                "train": asdict(self.train)}


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


class Trainer:
    def __init__(self, cfg: RunConfig, out: Path):
        self.cfg, self.out = cfg, out
        tc = cfg.train
        torch.manual_seed(tc.seed)
        ds = load_dataset(cfg.data.dataset, cfg.data.images or None, cfg.data.image_column,
                          cfg.data.title_column, cfg.data.image_suffix)
        self.train_items = ds.split(cfg.data.train_split)
        self.val_items = ds.split(cfg.data.val_split)
        if tc.val_max_images:
            self.val_items = self.val_items[:tc.val_max_images]
        if not self.train_items:
            raise ValueError(f"{cfg.data.dataset}: the {cfg.data.train_split} split is empty")
        self.bf16 = resolve_precision(tc.precision) == "bf16"
        print(f"precision {tc.precision}: {'bf16 mixed precision' if self.bf16 else 'float32'} matmuls", file=sys.stderr)
        self.init_cfg = read_config(tc.init) if tc.init else None
        self.init_weights = read_weights(tc.init) if tc.init else {}
        # dev scores are taken with the model's own length normalisation: a run from a tuned
        # checkpoint keeps its setting (compared at 0, a self-critical model that writes
        # longer captions would look worse than it is); length_penalties retunes it at the end
        self.length_penalty = float(self.init_cfg["decoding"].get("length_penalty", 0.0)) if tc.init else 0.0
        enc_cfg = self.init_cfg["encoder"] if self.init_cfg else {}
        if enc_cfg and enc_cfg["name"] != cfg.encoder.name:
            raise ValueError(f"train.init {tc.init} was trained on {enc_cfg['name']}, the config names {cfg.encoder.name}")
        self.encoder = create_encoder(cfg.encoder.name, weights=cfg.encoder.weights or None)
        tuned = {k[len(ENCODER_PREFIX):]: v for k, v in self.init_weights.items() if k.startswith(ENCODER_PREFIX)}
        if tuned:
            load_finetuned(self.encoder, tuned, tc.init)
        # Blocks run at every step: those fine-tuned now, or earlier (then frozen; their
        # output is computed once below). Everything before them comes from the cache.
        inherited = int(enc_cfg.get("finetuned_blocks", 0))
        if tc.finetune_blocks and tc.finetune_blocks < inherited:
            raise ValueError(f"train.finetune_blocks must be 0 or at least the {inherited} blocks {tc.init} tuned")
        self.tuned_blocks = max(tc.finetune_blocks, inherited)
        self.tail = None
        source = self.encoder
        if self.tuned_blocks:
            source, self.tail = self.encoder.split(self.tuned_blocks)
        paths = [it.path for it in ds.all_items()]
        store = build_features(source, paths)
        self.source_grid = store.grid
        self.grid = tuple(self.encoder.grid())
        self.train_feats = self._load_feats(store, self.train_items)  # (N, L, C) float16
        self.val_feats = self._load_feats(store, self.val_items)
        if self.tail is not None and not tc.finetune_blocks:  # tuned before, frozen now
            self.train_feats, self.val_feats = self._run_tail(self.train_feats), self._run_tail(self.val_feats)
            self.source_grid = self.grid
            self.tail_params: list[torch.nn.Parameter] = []
        elif self.tail is not None:
            self.tail_params = list(self.tail.parameters())
            for p in self.tail_params:
                p.requires_grad_(True)
        self.vocab: Tokenizer | None = None

    @staticmethod
    def _load_feats(store, items: list[ImageItem]) -> torch.Tensor:
        missing = [it.name for it in items if it.name not in store]
        if missing:
            raise ValueError(f"{len(missing)} images have no features (unreadable?), e.g. {missing[0]}")
        return torch.from_numpy(np.ascontiguousarray(store.rows([it.name for it in items])))

    @torch.no_grad()
    def _run_tail(self, feats: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.tail(feats[i:i + 256].float(), self.source_grid).half()
                          for i in range(0, len(feats), 256)])

    def features(self, feats: torch.Tensor) -> torch.Tensor:
        """Cached rows (B, L, C) -> annotation vectors (B, L, D), through the tuned blocks if
        they are being trained. Call under the training autocast."""
        if self.cfg.train.finetune_blocks:
            return self.tail(feats.float(), self.source_grid)
        return feats.to(torch.bfloat16) if self.bf16 else feats.float()

    def setup(self, vocab: Tokenizer) -> None:
        cfg, tc = self.cfg, self.cfg.train
        self.vocab = vocab
        vectors = None
        if self.init_cfg:
            self.family, model_cfg = self.init_cfg["family"], dict(self.init_cfg["model"])
            if tc.glove:
                raise ValueError("train.glove initialises a new model's embedding; with train.init the "
                                 "embedding comes from that checkpoint")
        else:
            self.family = cfg.model["family"]
            model_cfg = {k: v for k, v in cfg.model.items() if k != "family"}
            model_cfg.update(vocab_size=len(vocab), feat_dim=self.encoder.dim)
            if "grid" in family_fields(self.family):  # families with image positions need the grid
                model_cfg["grid"] = list(self.grid)
            if tc.glove:
                vectors, coverage = glove_embedding(vocab, tc.glove, seed=tc.seed)
                print(coverage.summary(), file=sys.stderr)
                (self.out / "glove_coverage.json").write_text(json.dumps(coverage.to_json(), indent=1))
                model_cfg.setdefault("embed_dim", coverage.dim)
        family_config(self.family, model_cfg)  # validates before building
        self.model_cfg = model_cfg
        self.model = create_decoder(self.family, model_cfg)
        if self.init_cfg:
            load_into(self.model, self.decoder_weights(self.init_weights), tc.init)
        if vectors is not None:
            if self.model.embed.embedding_dim != vectors.shape[1]:
                raise ValueError(f"model.embed_dim is {self.model.embed.embedding_dim} but {tc.glove} holds "
                                 f"{vectors.shape[1]}-d vectors (leave embed_dim out to use the file's)")
            with torch.no_grad():
                self.model.embed.weight.copy_(vectors)
            self.model.embed.weight.requires_grad_(not tc.freeze_embeddings)
        if tc.batching == "image" and "image_index" not in inspect.signature(self.model.training_loss).parameters:
            raise ValueError(f"train.batching = \"image\" needs a family that shares the image side between "
                             f"captions; {self.family} trains on batches of one caption length (\"length\")")
        named = self.model.param_groups() if hasattr(self.model, "param_groups") else {}
        unknown = sorted(set(tc.lr_groups) - set(named))
        if unknown:
            raise ValueError(f"train.lr_groups: {self.family} trains no group {unknown[0]!r} here "
                             f"(its groups: {', '.join(named) or 'none'})")
        if named:  # each named group at its own learning rate
            groups = [{"params": ps, "lr": tc.lr_groups.get(name, tc.lr)} for name, ps in named.items()]
        else:
            groups = [{"params": [p for p in self.model.parameters() if p.requires_grad], "lr": tc.lr}]
        if tc.finetune_blocks:
            groups.append({"params": self.tail_params, "lr": tc.encoder_lr})
        self.opt = make_optimizer(groups, tc)
        # what this run trains, counted once per tensor: the model card's "trainable parameters"
        names = (list(named) if named else ["decoder"]) + (["encoder"] if tc.finetune_blocks else [])
        self.trained_parameters = {name: sum(p.numel() for p in g["params"] if p.requires_grad)
                                   for name, g in zip(names, groups)}
        self.trained_parameters["total"] = sum(self.trained_parameters.values())
        print("trained parameters: " + ", ".join(f"{k} {v:,}" for k, v in self.trained_parameters.items()),
              file=sys.stderr)
        self.lr_scales = [g["lr"] / tc.lr for g in self.opt.param_groups]
        # (image row, token ids) for every training caption; each image's captions' indices
        self.examples: list[tuple[int, list[int]]] = []
        self.image_examples: list[list[int]] = []
        for row, it in enumerate(self.train_items):
            self.image_examples.append([])
            for toks in it.words(cfg.data.words):
                if toks:
                    self.image_examples[-1].append(len(self.examples))
                    self.examples.append((row, vocab.encode(toks[:cfg.data.max_words])))
        longest = max((len(ids) - 1 for _, ids in self.examples), default=0)
        limit = getattr(self.model.cfg, "max_positions", None)
        if limit is not None and max(longest, tc.max_len + 1) > limit:
            raise ValueError(f"model.max_positions is {limit}, but training captions need {longest} positions "
                             f"and decoding (train.max_len + 1) {tc.max_len + 1}")
        self.scst = None
        if tc.objective == "scst":  # CIDEr-D document frequencies from the training references
            refs = {row: [t for t in it.words(cfg.data.words) if t] for row, it in enumerate(self.train_items)}
            self.scst = SelfCritical(refs, vocab, tc.samples, tc.max_len, tc.scst_baseline)
        self.state = {"epoch": 0, "step": 0, "batch_in_epoch": 0, "best_score": None, "best_epoch": 0,
                      "bad_epochs": 0, "lr_bad_epochs": 0, "lr": tc.lr, "history": []}

    @staticmethod
    def decoder_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v for k, v in weights.items() if not k.startswith(ENCODER_PREFIX)}

    def checkpoint_config(self) -> dict:
        encoder = {"name": self.cfg.encoder.name, "weights": self.cfg.encoder.weights or None,
                   "grid": list(self.grid), "cache_key": self.encoder.cache_key()}
        if self.tuned_blocks:
            encoder["finetuned_blocks"] = self.tuned_blocks
        return {"family": self.family, "model": self.model_cfg, "encoder": encoder,
                "vocab": self.vocab.to_json(),
                "decoding": {"max_len": self.cfg.train.max_len, "length_penalty": self.length_penalty},
                "trained_parameters": self.trained_parameters, "train": self.cfg.to_dict(), "state": self.state}

    def weights(self) -> dict[str, torch.Tensor]:
        """The decoder's weights, and the tuned encoder blocks' under ``encoder.``."""
        out = dict(self.model.state_dict())
        if self.tail is not None:
            tail = {id(p) for p in self.tail.parameters()}
            out.update({ENCODER_PREFIX + k: p.detach() for k, p in self.encoder.named_parameters() if id(p) in tail})
        return out

    def save(self, name: str, with_optimizer: bool) -> None:
        optim = None
        cfg = self.checkpoint_config()
        if with_optimizer:
            optim, groups = optimizer_tensors(self.opt)
            optim["rng.torch"] = torch.get_rng_state()
            cfg["optimizer_groups"] = groups
        save_checkpoint(self.out / name, self.weights(), cfg, optim)

    def load_weights(self, folder: Path) -> dict[str, torch.Tensor]:
        weights = read_weights(folder)
        load_into(self.model, self.decoder_weights(weights), folder)
        if self.cfg.train.finetune_blocks:
            load_finetuned(self.encoder, {k[len(ENCODER_PREFIX):]: v for k, v in weights.items()
                                          if k.startswith(ENCODER_PREFIX)}, str(folder))
        return weights

    def resume(self) -> None:
        folder = resolve(self.out / "last")
        cfg = read_config(folder)
        self.setup(load_tokenizer(cfg["vocab"]))
        if cfg["model"] != self.model_cfg or cfg["family"] != self.family:
            raise CheckpointError(f"{folder}: saved with a different model config than {self.cfg.model}")
        self.load_weights(folder)
        optim = read_weights(folder, "optimizer.safetensors")
        torch.set_rng_state(optim.pop("rng.torch"))
        restore_optimizer(self.opt, optim, cfg["optimizer_groups"])
        self.state = cfg["state"]
        # the checkpoint's history is the run's: epochs logged after it (by a run killed before
        # its next save) are run again, so their lines go rather than appear twice
        atomic_write_text(self.out / "history.jsonl", "".join(json.dumps(h) + "\n" for h in self.state["history"]))
        print(f"resuming from {folder} (epoch {self.state['epoch']}, step {self.state['step']})", file=sys.stderr)
        for name in ("last", "best"):  # what killed saves left
            remove_leftovers(self.out / name)

    @torch.no_grad()
    def validate(self, length_penalty: float | None = None) -> dict[str, float]:
        tc = self.cfg.train
        length_penalty = self.length_penalty if length_penalty is None else length_penalty
        self.model.eval()
        cap = Captioner(self.model, self.vocab, self.checkpoint_config())
        captions = {}
        for i in range(0, len(self.val_items), 100):
            feats = self.val_feats[i:i + 100]
            feats = self.tail(feats.float(), self.source_grid) if tc.finetune_blocks else feats.float()
            for it, c in zip(self.val_items[i:i + 100],
                             cap.decode_features(feats, beam=tc.val_beam, length_penalty=length_penalty)):
                captions[it.name] = " ".join(self.vocab.decode(c.ids))
        kill_point("validate")  # test-only: the kill-anywhere test stops a run here
        refs = {it.name: it.raw for it in self.val_items}
        return coco_scores(captions, refs, metrics=("bleu", "cider", _SCORER.get(tc.val_metric, "cider")), quiet=True)

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        """xe: caption indices, one length per batch; scst: image rows."""
        tc = self.cfg.train
        seed = tc.seed * 1000 + epoch
        if tc.objective == "scst":
            rows = list(range(len(self.train_items)))
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
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            if tc.objective == "scst":
                feats = self.features(self.train_feats.index_select(0, torch.tensor(idx)))  # (B, L, D)
                loss, stats = self.scst.loss(self.model, feats, idx)
                figures = {"reward": stats.sample_reward}
                if stats.greedy_reward is not None:
                    figures["greedy_reward"] = stats.greedy_reward
                return loss, figures
            rows = torch.tensor([self.examples[i][0] for i in idx])
            longest = max(len(self.examples[i][1]) for i in idx)  # "length" batches: all this long
            ids = torch.tensor([self.examples[i][1] + [0] * (longest - len(self.examples[i][1]))
                                for i in idx])  # (B, T+1), <pad> = 0 after <end> (ignored by the loss)
            extra = {}
            if tc.batching == "image":  # each image once, indexed per caption
                rows, image_index = torch.unique(rows, return_inverse=True)  # (U,), (B,)
                extra = {"image_index": image_index}
            feats = self.features(self.train_feats.index_select(0, rows))  # (B or U, L, D)
            loss, ce = self.model.training_loss(feats, ids[:, :-1], ids[:, 1:], tc.alpha_c,
                                                label_smoothing=tc.label_smoothing, **extra)
            return loss, {"loss": float(ce.detach())}

    def log_history(self) -> None:
        """Append the newest epoch's figures and dev scores to history.jsonl."""
        self.out.mkdir(parents=True, exist_ok=True)  # an unscored first epoch comes before any save
        with open(self.out / "history.jsonl", "a") as fh:
            fh.write(json.dumps(self.state["history"][-1]) + "\n")

    def set_lr(self, lr: float) -> None:
        for pg, scale in zip(self.opt.param_groups, self.lr_scales):
            pg["lr"] = lr * scale

    def run(self, max_steps: int | None = None, progress: bool = True) -> dict:
        tc, st = self.cfg.train, self.state
        self.set_lr(st["lr"])
        if self.init_cfg and st["best_score"] is None:  # the starting point is the score to beat
            scores = self.validate()
            st.update(best_score=scores[tc.val_metric], best_epoch=0)
            st["history"].append({"epoch": 0, "step": 0, **scores})
            print(f"epoch 0 ({tc.init}): dev {format_scores(scores)}", file=sys.stderr)
            self.log_history()
            self.save("best", with_optimizer=False)
        params = list(self.model.parameters()) + (self.tail_params if tc.finetune_blocks else [])
        while st["epoch"] < tc.epochs and st["bad_epochs"] < tc.patience:  # (a resumed early stop stays stopped)
            batches = self.epoch_batches(st["epoch"])
            # self-critical training samples without dropout (see captionkit.scst)
            self.model.train(tc.objective == "xe")
            unit = "images" if tc.objective == "scst" else "captions"
            # this epoch's figures so far live in the state the checkpoints carry, so an epoch
            # resumed from one reports its whole time, count and mean loss
            if not st["batch_in_epoch"] or not st.get("epoch_progress"):
                st["epoch_progress"] = {"seconds": 0.0, "seen": 0, "batches": 0, "sums": {}}
            prog = st["epoch_progress"]
            t0 = time.time() - prog["seconds"]
            since, seen_before = time.time(), prog["seen"]  # the rate shown is this process's
            for bi in range(st["batch_in_epoch"], len(batches)):
                if max_steps is not None and st["step"] >= max_steps:
                    self.save("last", with_optimizer=True)
                    return st
                self.set_lr(st["lr"] * lr_factor(tc, st["step"], (st["epoch"] + bi / len(batches)) / tc.epochs))
                loss, figures = self.batch_loss(batches[bi])
                if not math.isfinite(float(loss.detach())):
                    raise FloatingPointError(f"loss became {float(loss.detach())} at step {st['step']}")
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                if tc.grad_clip:
                    torch.nn.utils.clip_grad_norm_(params, tc.grad_clip)
                self.opt.step()
                st["step"] += 1
                st["batch_in_epoch"] = bi + 1
                prog["seen"] += len(batches[bi])
                prog["batches"] += 1
                for k, v in figures.items():  # means over this epoch so far
                    prog["sums"][k] = prog["sums"].get(k, 0.0) + v
                prog["seconds"] = round(time.time() - t0, 1)
                if progress and (bi % 20 == 0 or bi == len(batches) - 1):
                    rate = (prog["seen"] - seen_before) / max(time.time() - since, 1e-9)
                    shown = " ".join(f"{k} {v / prog['batches']:.3f}" for k, v in prog["sums"].items())
                    print(f"\repoch {st['epoch'] + 1}/{tc.epochs} {bi + 1}/{len(batches)} "
                          f"{shown} {rate:.0f} {unit}/s", end="", file=sys.stderr, flush=True)  # a log file sees it too
                if tc.checkpoint_every and st["step"] % tc.checkpoint_every == 0:
                    self.save("last", with_optimizer=True)
            if progress:
                print(file=sys.stderr)
            st["epoch"] += 1
            st["batch_in_epoch"] = 0
            st["epoch_progress"] = None
            entry = {"epoch": st["epoch"], "step": st["step"],
                     **{k: v / max(prog["batches"], 1) for k, v in prog["sums"].items()},
                     "lr": self.opt.param_groups[0]["lr"], "seconds": round(time.time() - t0, 1), unit: prog["seen"]}
            if st["epoch"] % tc.val_every and st["epoch"] < tc.epochs:  # no dev scoring after this epoch
                st["history"].append(entry)
                print(f"epoch {st['epoch']}: not validated (train.val_every = {tc.val_every})", file=sys.stderr)
            else:
                scores = self.validate()
                st["history"].append({**entry, **scores})
                self.judge(scores[tc.val_metric])
                print(f"epoch {st['epoch']}: dev {format_scores(scores)} ({tc.val_metric} "
                      f"{'best' if st['best_epoch'] == st['epoch'] else 'no gain'}; "
                      f"lr {self.opt.param_groups[0]['lr']:.2e})", file=sys.stderr)
            self.log_history()
            self.save("last", with_optimizer=True)
            if st["bad_epochs"] >= tc.patience:
                gain = f" above {100 * tc.min_delta:g} (x100)" if tc.min_delta else ""
                span = "epochs" if tc.val_every == 1 else f"validations (every {tc.val_every} epochs)"
                print(f"early stop: no {tc.val_metric} gain{gain} for {tc.patience} {span}", file=sys.stderr)
                break
        self.tune_decoding()
        return st

    def judge(self, score: float) -> None:
        """A validated epoch's dev score: a new best (by more than min_delta) is saved as
        ``best``; otherwise the counters of early stopping and of the plateau schedule grow."""
        tc, st = self.cfg.train, self.state
        if st["best_score"] is None or score > st["best_score"] + tc.min_delta:
            st.update(best_score=score, best_epoch=st["epoch"], bad_epochs=0, lr_bad_epochs=0)
            self.save("best", with_optimizer=False)
            return
        st["bad_epochs"] += 1
        st["lr_bad_epochs"] += 1
        if tc.schedule == "plateau" and st["lr_bad_epochs"] >= tc.lr_patience:
            st["lr"] *= tc.lr_decay
            st["lr_bad_epochs"] = 0
            self.set_lr(st["lr"])

    def tune_decoding(self) -> None:
        """Pick the best checkpoint's length normalisation on the dev split (and, for hard
        attention, whether to decode with the expected context or the most probable location)
        and save the choice in its config."""
        tc = self.cfg.train
        best = self.out / "best"
        cfg = read_config(best)
        weights = self.load_weights(best)
        contexts = ["expected", "argmax"] if self.model_cfg.get("attention") == "hard" else [None]
        tried: dict[tuple, float] = {}
        for ctx in contexts:
            if ctx:
                self.model.cfg.decode_context = ctx
            for lp in tc.length_penalties:
                tried[(ctx, lp)] = self.validate(lp)[tc.val_metric]
        ctx, lp = max(tried, key=lambda k: (tried[k], -abs(k[1])))
        if ctx:
            self.model.cfg.decode_context = ctx
            cfg["model"] = dict(cfg["model"], decode_context=ctx)
        cfg["decoding"] = dict(cfg["decoding"], length_penalty=lp)
        cfg["length_penalty_search"] = {"metric": tc.val_metric, "split": self.cfg.data.val_split, "beam": tc.val_beam,
                                        "scores": {f"{c}, {k}" if c else str(k): v for (c, k), v in tried.items()}}
        save_checkpoint(best, weights, cfg)
        shown = ", ".join(f"{c + ' ' if c else ''}{k:g}: {100 * v:.2f}" for (c, k), v in tried.items())
        print(f"{ctx + ' context, ' if ctx else ''}length penalty {lp:g} chosen on {self.cfg.data.val_split} "
              f"({shown} {tc.val_metric})", file=sys.stderr)


def train(config: str | Path, out: str | Path | None = None, max_steps: int | None = None,
          resume: bool = False, progress: bool = True, init: str | None = None) -> dict:
    cfg = RunConfig.load(config, init)
    out = Path(out) if out else Path("runs") / Path(config).stem
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(cfg, out)
    if resume and resolve(out / "last").exists():
        trainer.resume()
    else:
        if resume:
            print(f"--resume: no checkpoint in {out}, starting fresh", file=sys.stderr)
        if trainer.init_cfg:
            vocab = load_tokenizer(trainer.init_cfg["vocab"])
        else:
            words = [toks for it in trainer.train_items for toks in it.words(cfg.data.words)]
            lm = cfg.model.get("lm", family_default(cfg.model["family"], "lm"))  # the family's default LM, if any
            vocab = build_tokenizer(cfg.data.tokenizer, words, cfg.data.min_count, cfg.data.top_k or None,
                                    cfg.data.bpe_vocab_size, lm=lm)
        trainer.setup(vocab)
    return trainer.run(max_steps=max_steps, progress=progress)
