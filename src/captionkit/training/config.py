"""The run config of ``captionkit train``: a TOML file with [data], [encoder], [model] and
[train] tables (see configs/), read into typed dataclasses and checked as it is read.

Every field is checked when the file is read -- its type (an integer field refuses 1.5), its
range or choices, unknown keys (with the nearest known name) -- and so is each model family's
[model] table, against the family's own config dataclass (``SATConfig``, ``TransformerConfig``,
...): all before a dataset, a feature or a model loads. A mistake is one :class:`ConfigError`
line naming the file and the field, e.g. ``run.toml: train.lr must be a number, got 'fast'``.
The checks themselves are declared on the dataclasses (:mod:`captionkit.core.fields`), so a config
built in code or read back from a checkpoint is checked the same way.
"""

from __future__ import annotations

import copy
import difflib
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from ..core.devices import DEVICE_HELP, check_device_name
from ..core.errors import ConfigError, UserError
from ..core.fields import FieldError, check_fields, field_error, field_names, required_fields, show, spec
from ..core.precision import PRECISIONS
from ..data.datasets import WORD_STYLES
from ..data.tokenizers import KINDS, PRETRAINED_KINDS
from ..models import DEFAULT_FAMILY
from ..scoring.evaluation import METRICS
from ..scoring.ptb_tokenize import java_available
from .scst import BASELINES

VAL_METRICS = tuple(m for m in METRICS if m != "SPICE")  # SPICE is too slow for every epoch


@dataclass
class DataConfig:
    """dataset: a Flickr8k/Kaggle folder, a Karpathy/COCO JSON file, a title CSV (one title
        per image, see captionkit.data.datasets.read_title_csv), an imagefolder, WebDataset
        shards or a saved Hugging Face dataset (docs/datasets.md).
    images: the image folder of a JSON or CSV dataset.
    image_column / title_column / image_suffix: a CSV's columns of image names and titles, and
        what turns an image name into its file name (Epicurious' layout by default).
    words: how reference captions become training words: "karpathy" (lower case, punctuation
        dropped) or "cased" (case and in-word hyphens and apostrophes kept: for subword
        tokenizers on titles). Scores do not depend on it: the scorers' PTB tokenisation
        lower-cases both sides and keeps hyphenated words whole.
    tokenizer: how captions become tokens: "word", "char", "bpe" or "lm" (the language model's
        own tokenizer, that of model.lm: the prefix_lm family; see captionkit.data.tokenizers).
    min_count / top_k: vocabulary from the training captions (top_k 0 = no cap); for char,
        characters seen fewer than min_count times become <unk>; for bpe, pairs seen fewer
        than min_count times are not merged.
    bpe_vocab_size: the BPE vocabulary size, specials included; every character of the
        training captions is kept, so a very small size can come out a little larger.
    max_words: longer training captions are truncated (in words, before tokenising)."""

    SECTION: ClassVar[str] = "data"

    dataset: str = spec(min_len=1)
    images: str = ""
    tokenizer: str = spec("word", choices=KINDS + PRETRAINED_KINDS)
    min_count: int = spec(5, ge=1)
    top_k: int = spec(10000, ge=0)
    bpe_vocab_size: int = spec(2000, ge=5)
    max_words: int = spec(30, ge=1)
    train_split: str = spec("train", min_len=1)
    val_split: str = spec("dev", min_len=1)
    words: str = spec("karpathy", choices=WORD_STYLES)
    image_column: str = spec("Image_Name", min_len=1)
    title_column: str = spec("Title", min_len=1)
    image_suffix: str = ".jpg"

    def __post_init__(self):
        check_fields(self)


@dataclass
class EncoderConfig:
    """name: a registered encoder (captionkit.encoders.list_encoders()).
    weights: empty for the encoder's pretrained weights, "random" (tests), a weights file, or
        what the encoder takes (a hub name for vit_pixels)."""

    SECTION: ClassVar[str] = "encoder"

    name: str = spec("efficientnet_lite2", min_len=1)
    weights: str = ""

    def __post_init__(self):
        check_fields(self)
        from ..encoders import list_encoders  # the registry; torch is loaded by then anyway
        if self.name not in list_encoders():
            raise field_error(self, "name", f"must be one of {', '.join(list_encoders())}, not {show(self.name)}")


@dataclass
class TrainConfig:
    """optimizer: adam, adamw (decoupled weight decay on matrices, embeddings and positions,
        not on biases and norms) or rmsprop.
    device: where training runs: auto (a GPU when there is one), cpu, cuda, cuda:N or mps;
        under torchrun each process takes the GPU of its local rank (see captionkit.core.devices,
        docs/distributed-training.md). ``captionkit train --device`` replaces it.
    precision: bf16 (mixed precision matmuls), fp16 (CUDA only, with a gradient scaler), fp32,
        or auto: on CUDA bf16 where the GPU has it, else fp16; on the CPU bf16 where it
        multiplies bf16 natively, else fp32 (see captionkit.core.precision).
    schedule: "plateau" (lr *= lr_decay after lr_patience epochs without dev gain), "cosine"
        (from lr down to 0 over the epochs) or "inverse_sqrt" (lr * sqrt(warmup_steps / step));
        each after a linear warm-up over warmup_steps steps (inverse_sqrt needs one).
    label_smoothing: spread this much of each target's probability over the vocabulary.
    caption_sampling: "all" (every caption of every image, each epoch) or "random_one" (one
        caption per image per epoch, drawn anew each epoch: augmentation, 1/5 of the steps).
    flip: the share of the training images seen mirrored each epoch (drawn anew each epoch
        from the seed): their features come from the encoder's mirror-image cache (built on
        the first run, as ``--tta flip`` builds it for evaluation) and their captions and
        self-critical rewards have "left" and "right" swapped. 0: never (augmentation, issue 32).
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
    train_max_images: train on the first N images of the train split only (0: all of them): a
        smaller budget, the same for every trial of a study, or a quick check.
    checkpoint_every: also save the resumable checkpoint every N steps.
    keep_epochs: also keep the weights of the last N epochs, each as the checkpoint folder
        ``epoch-K`` beside ``last`` and ``best`` (no optimizer state; older ones removed as new
        ones come), to average them afterwards (``captionkit average run/epoch-8 run/epoch-9
        run/epoch-10``, a "soup"). 0: none. Each costs one model's size on disk.
    length_penalties: after training, the best checkpoint's beam-search length normalisation
        is chosen among these on the dev split (by val_metric) and saved in its config.
    objective: "xe" (cross-entropy / the family's training loss) or "scst" (self-critical).
    init: a checkpoint folder to start from; its vocabulary, model and encoder are used (the
        config's [model] table must then be left out). Its dev score is the one to beat.
    samples: scst only, captions sampled per image.
    scst_baseline: scst only, "greedy" (the greedy caption's CIDEr-D, Rennie et al.) or "mean"
        (the image's other samples' mean CIDEr-D, Luo 2020; needs samples >= 2).
    scst_repeat_penalty: scst only, what a caption that repeats a content phrase ("a boat ... a
        boat") loses of its CIDEr-D reward (0: nothing; issue 32).
    scst_matcher: scst only, an image-caption matcher checkpoint (``captionkit matcher``) of the
        run's encoder rows; scst_match_weight W: each caption's reward gains W times its
        discriminability for its photo (how much better it fits this photo than the matcher's
        bank of training photos; Luo et al. 2018). 0: the plain reward (issue 32).
    scst_bleu_weight: scst only, each caption's reward gains this weight times its sentence
        BLEU-4 against its photo's references (smoothed; scoring.metrics.SentenceBleu), beside
        CIDEr-D. 0: the plain reward (issue 32).
    scst_meteor_weight: scst only, each caption's reward gains this weight times its METEOR 1.5
        against its photo's references (the coco-caption jar: needs Java; ~0.3 s a batch),
        beside CIDEr-D. 0: the plain reward (issue 32).
    scst_xe_weight: scst only, the mixed objective: the self-critical loss plus this weight
        times the cross-entropy of the batch images' own reference captions (all of them,
        mirrored with the image under train.flip), which keeps probability on the words people
        use. 0: the plain self-critical loss (issue 32).
    finetune_blocks: train the encoder's last N blocks too (0: frozen encoder).
    encoder_lr: their learning rate (decayed together with lr).
    lr_groups: learning rates of the model's named parameter groups, for families that name
        them (prefix_lm: projector, lora, lm_blocks), e.g. {projector = 1e-3, lora = 2e-4};
        a group not listed trains at lr. All follow lr's schedule and decay in proportion.
    tensorboard: a folder to write TensorBoard event files into (each epoch's training figures,
        dev scores and dev loss; see captionkit.training.tblog); empty: none."""

    SECTION: ClassVar[str] = "train"

    epochs: int = spec(20, ge=1)
    batch_size: int = spec(32, ge=1)
    optimizer: str = spec("adam", choices=("adam", "adamw", "rmsprop"))
    lr: float = spec(4e-4, gt=0)
    weight_decay: float = spec(0.0, ge=0)
    grad_clip: float = spec(5.0, ge=0)  # 0: no clipping
    alpha_c: float = spec(1.0, ge=0)
    device: str = "auto"
    precision: str = spec("auto", choices=PRECISIONS)
    seed: int = spec(0, ge=0, le=2 ** 32 - 1)
    val_beam: int = spec(3, ge=1)
    val_metric: str = spec("CIDEr", choices=VAL_METRICS)
    val_max_images: int = spec(0, ge=0)  # 0: the whole dev split
    train_max_images: int = spec(0, ge=0)  # 0: the whole train split
    val_every: int = spec(1, ge=1)
    patience: int = spec(5, ge=1)
    min_delta: float = spec(0.0, ge=0)
    lr_patience: int = spec(2, ge=1)
    lr_decay: float = spec(0.5, gt=0, le=1)
    max_len: int = spec(20, ge=1)
    checkpoint_every: int = spec(1000, ge=0)  # 0: only at the end of each epoch
    keep_epochs: int = spec(0, ge=0)
    length_penalties: list[float] = spec(default_factory=lambda: [0.0], min_len=1)
    objective: str = spec("xe", choices=("xe", "scst"))
    init: str = ""
    samples: int = spec(5, ge=1)
    scst_baseline: str = spec("greedy", choices=BASELINES)
    scst_repeat_penalty: float = spec(0.0, ge=0)
    scst_matcher: str = ""
    scst_match_weight: float = spec(0.0, ge=0)
    scst_xe_weight: float = spec(0.0, ge=0)
    scst_bleu_weight: float = spec(0.0, ge=0)
    scst_meteor_weight: float = spec(0.0, ge=0)
    finetune_blocks: int = spec(0, ge=0)
    encoder_lr: float = spec(1e-4, gt=0)
    schedule: str = spec("plateau", choices=("plateau", "cosine", "inverse_sqrt"))
    warmup_steps: int = spec(0, ge=0)
    label_smoothing: float = spec(0.0, ge=0, lt=1)
    caption_sampling: str = spec("all", choices=("all", "random_one"))
    flip: float = spec(0.0, ge=0, le=1)
    batching: str = spec("length", choices=("length", "image"))
    glove: str = ""
    freeze_embeddings: bool = False
    lr_groups: dict[str, float] = spec(default_factory=dict, gt=0)
    tensorboard: str = ""

    def __post_init__(self):
        check_fields(self)
        try:
            check_device_name(self.device)
        except ValueError:
            raise field_error(self, "device", f"must be {DEVICE_HELP}, not {show(self.device)}") from None
        if self.schedule == "inverse_sqrt" and self.warmup_steps < 1:
            raise field_error(self, "warmup_steps", "must be >= 1 for the inverse_sqrt schedule")
        if self.freeze_embeddings and not self.glove:
            raise field_error(self, "freeze_embeddings", "needs train.glove (frozen random embeddings learn nothing)")
        if self.scst_baseline == "mean" and self.samples < 2:
            raise field_error(self, "scst_baseline", "= \"mean\" needs train.samples >= 2")
        if self.scst_match_weight and not self.scst_matcher:
            raise field_error(self, "scst_match_weight", "needs train.scst_matcher (a matcher checkpoint folder: "
                                                         "captionkit matcher trains one)")
        rewards = (("scst_matcher", self.scst_matcher), ("scst_bleu_weight", self.scst_bleu_weight),
                   ("scst_meteor_weight", self.scst_meteor_weight),
                   ("scst_repeat_penalty", self.scst_repeat_penalty))
        for reward, value in rewards:  # each would be silently unused under "xe"
            if value and self.objective != "scst":
                raise field_error(self, reward, "is a self-critical reward: it needs train.objective = \"scst\"")
        if self.scst_meteor_weight and not java_available():  # said before any data is read
            raise field_error(self, "scst_meteor_weight", "needs Java for the METEOR 1.5 jar (apt-get install "
                                                          "default-jre)")
        if self.scst_xe_weight and self.objective != "scst":
            raise field_error(self, "scst_xe_weight", "mixes cross-entropy into the self-critical loss: it needs "
                                                      "train.objective = \"scst\"")
        if self.scst_matcher and self.finetune_blocks:
            raise field_error(self, "scst_matcher", "reads the encoder's cached rows, which train.finetune_blocks "
                                                    "changes as it trains: use one or the other")
        if self.glove and self.init:
            raise field_error(self, "glove", "initialises a new model's embedding; with train.init the "
                                             "embedding comes from that checkpoint")


SECTIONS = ("data", "encoder", "model", "train")
# [model] fields the trainer fills in from the tokenizer and the encoder; a config leaves them out
TRAINER_SET = {"vocab_size": "the tokenizer's size", "feat_dim": "the encoder's", "grid": "the encoder's"}
# What stands in for them while the file is read, before a tokenizer or an encoder exists: the
# families' checks on these fields are lower bounds (and "the pooled grid fits in the grid"),
# which these pass; the real values are checked again when the model is built.
_STAND_INS = {"vocab_size": 1 << 30, "feat_dim": 1 << 30, "grid": [1 << 30, 1 << 30]}


@dataclass
class RunConfig:
    data: DataConfig
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    model: dict = field(default_factory=lambda: {"family": DEFAULT_FAMILY})
    train: TrainConfig = field(default_factory=TrainConfig)

    @classmethod
    def from_dict(cls, d: dict, where: str = "config") -> "RunConfig":
        """Build and check a run config from a parsed TOML document; ``where`` (the file) opens
        every error message."""
        unknown = [k for k in d if k not in SECTIONS]
        if unknown:
            raise ConfigError(f"{where}: unknown table(s): {', '.join(_key(k) for k in unknown)}"
                              f"{_did_you_mean(unknown[0], SECTIONS)}; a run config has [{'], ['.join(SECTIONS)}]")
        if "data" not in d:
            raise ConfigError(f"{where}: [data] is missing (it names the dataset: dataset = ...)")
        data = read_section(DataConfig, d["data"], where)
        encoder = read_section(EncoderConfig, d.get("encoder", {}), where)
        train = read_section(TrainConfig, d.get("train", {}), where)
        if train.init and "model" in d:
            raise ConfigError(f"{where}: with train.init the model comes from that checkpoint; leave out [model]")
        if train.glove and data.tokenizer != "word":
            raise ConfigError(f"{where}: train.glove: word vectors need a word tokenizer (data.tokenizer = "
                              f"\"word\"), not {data.tokenizer!r}")
        model = {} if train.init else read_model(d.get("model", {}), where)
        if model:
            check_model_fits_training(model, train, where)
        return cls(data, encoder, model, train)

    @classmethod
    def load(cls, path: str | Path, init: str | None = None, dataset: str | None = None,
             settings: dict[str, Any] | None = None) -> "RunConfig":
        """Read and check a TOML config; ``init`` (a checkpoint folder) replaces its train.init,
        ``dataset`` its data.dataset (which the file may then leave out), and ``settings``
        ({"train.seed": 2}: ``train --set``) the fields they name (see :func:`set_fields`)."""
        path = Path(path)
        try:
            d = tomllib.loads(path.read_bytes().decode("utf-8"))  # as written: no newline translation
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML ({e})") from None
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except IsADirectoryError:
            raise ConfigError(f"{path}: is a folder, not a config file") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not a TOML file (not UTF-8 text at byte {e.start})") from None
        if init:
            train = d.setdefault("train", {})
            if isinstance(train, dict):
                train["init"] = init
        if dataset is not None and isinstance(data := d.setdefault("data", {}), dict):
            data["dataset"] = dataset
        where = str(path)
        if settings:
            where = f"{path} with --set {','.join(f'{k}={v!r}' for k, v in settings.items())}"
            d = set_fields(d, settings, where)
        return cls.from_dict(d, where)

    def to_dict(self) -> dict:
        return {"data": asdict(self.data), "encoder": asdict(self.encoder), "model": dict(self.model),
                "train": asdict(self.train)}


def set_fields(d: dict, settings: dict[str, Any], where: str) -> dict:
    """A copy of the parsed config ``d`` with every dotted key of ``settings`` set to its value
    ({"train.seed": 2, "model.width": 512}): how ``train --set`` and a sweep's trials change a
    config without a copy of the file. The result is checked as a file is (RunConfig.from_dict);
    a key through a value, not a table, is refused here, naming ``where``."""
    d = copy.deepcopy(d)
    for key, value in settings.items():
        *tables, name = key.split(".")
        node = d
        for t in tables:
            node = node.setdefault(t, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{where}: --set {key}: {t} is a value, not a table")
        node[name] = value
    return d


def _key(name: Any) -> str:
    """A TOML key as a message shows it: bare if it is a plain name, else quoted."""
    text = str(name)
    return text if text.replace("_", "a").replace("-", "a").isalnum() and text.isascii() else show(text)


def _did_you_mean(name: str, known) -> str:
    close = difflib.get_close_matches(str(name), list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def _check_keys(table: Any, known: list[str], where: str, section: str) -> dict:
    """``table`` is a TOML table whose keys are all in ``known``."""
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [{section}] must be a table, got {show(table)}")
    unknown = [k for k in table if k not in known]
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) in [{section}]: {', '.join(_key(k) for k in unknown)}"
                          f"{_did_you_mean(unknown[0], known)}")
    return table


def read_section(cls: type, table: Any, where: str) -> Any:
    """One table of the file as the config dataclass ``cls`` (section ``cls.SECTION``), checked."""
    section = cls.SECTION
    _check_keys(table, field_names(cls), where, section)
    missing = [k for k in required_fields(cls) if k not in table]
    if missing:
        raise ConfigError(f"{where}: {section}.{missing[0]} is missing")
    try:
        return cls(**table)
    except FieldError as e:
        raise ConfigError(f"{where}: {section}.{e.path} {e.message}") from None


def check_model_fits_training(model: dict, train: TrainConfig, where: str) -> None:
    """What the [model] and [train] tables must agree on, known from the family's declarations
    before any model exists: the family can train this config (its check_trainable),
    train.lr_groups names the family's parameter groups, and decoding (train.max_len words and
    <start>) fits in the family's positions."""
    from ..models import family_config, model_class

    cls = model_class(model["family"])
    unknown = sorted(set(train.lr_groups) - set(cls.GROUPS))
    if unknown:
        raise ConfigError(f"{where}: train.lr_groups: the {model['family']} family has no parameter group "
                          f"{unknown[0]!r} (its groups: {', '.join(cls.GROUPS)})")
    fields = family_config(model["family"], {**_stand_ins(model["family"]), **{k: v for k, v in model.items() if k != "family"}})
    try:
        cls.check_trainable(fields)
    except UserError as e:
        raise ConfigError(f"{where}: {e}") from None
    limit = cls.position_limit(fields)
    if limit is not None and train.max_len + 1 > limit:
        raise ConfigError(f"{where}: train.max_len is {train.max_len}, but decoding needs max_len + 1 = "
                          f"{train.max_len + 1} positions and model.max_positions is {limit}")


def _stand_ins(family: str) -> dict:
    from ..models import family_fields

    known = family_fields(family)
    return {k: v for k, v in _STAND_INS.items() if k in known}


def read_model(table: Any, where: str) -> dict:
    """The [model] table, checked against its family's config dataclass (with stand-ins for
    the fields the trainer fills in); returned as given, with the family named."""
    from ..models import family_config, family_fields  # the families' registry (loads torch)

    if not isinstance(table, dict):
        raise ConfigError(f"{where}: [model] must be a table, got {show(table)}")
    family = table.get("family", DEFAULT_FAMILY)
    if not isinstance(family, str):
        raise ConfigError(f"{where}: model.family must be a string, got {show(family)}")
    try:
        known = sorted(family_fields(family))
    except ValueError as e:
        raise ConfigError(f"{where}: model.family: {e}") from None
    settable = [k for k in known if k not in TRAINER_SET]
    for k in table:
        if k in TRAINER_SET and k in known:
            raise ConfigError(f"{where}: model.{k} is set by the trainer ({TRAINER_SET[k]}); leave it out")
    rest = {k: v for k, v in table.items() if k != "family"}
    _check_keys(rest, settable, where, "model")
    try:
        family_config(family, {**_stand_ins(family), **rest})
    except FieldError as e:
        raise ConfigError(f"{where}: model.{e.path} {e.message}") from None
    return {"family": family, **rest}
