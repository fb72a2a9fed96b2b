"""Hugging Face image-to-text captioners as caption families: a transformers model loaded through its
own class from a Hub name or a ``save_pretrained`` folder, decoded and trained through the model
contract (:mod:`.base`). The architectures are the families of :mod:`.hf_families` (``hf_blip``:
BlipForConditionalGeneration, ``hf_git``: GitForCausalLM, ``hf_ved``: any VisionEncoderDecoderModel,
``hf_idefics3``: Idefics3/SmolVLM through AutoModelForImageTextToText); this module holds what they
share. ``--model hf:ORG/NAME`` (captionkit.inference.hf_models) picks the family from the model's
``model_type`` (:func:`family_of`).

The image side. The encoder is ``hf_pixels`` (:mod:`captionkit.encoders.hf_pixels`): the photo at
the vision side's input size as rows of patch pixels in [0, 1]; the family normalises them with the
model's image processor (mean, std) and runs the model's whole vision tower on them. So the
trainer's feature cache holds pixels, and ``training = "full"`` trains the vision tower too.

Tokens are the model's own tokenizer's (the ``lm`` tokenizer kind, :mod:`.lm_tokens`, numbered
from 4). A caption follows the model's *prompt*: the ids it generates after -- BLIP's ``[DEC]``,
GIT's ``[CLS]``, the decoder start of a VisionEncoderDecoderModel, followed by the tokens of
``prompt`` when one is given (BLIP's "a picture of"); for Idefics3 the chat template's user turn
(the image, ``prompt`` as the instruction) and "Assistant:". captionkit's <start> stands for the
prompt's last id and <end> for the model's own end of caption (BLIP's [SEP], the generation
config's ``eos_token_id``: the most probable of them when it lists several). The tokenizer's
other special tokens ([PAD], [UNK], <image>...) are never produced: their logits are masked
before the softmax, as ``generate(suppress_tokens=...)`` would; a trained model gives them no
mass anyway.

Decoding uses captionkit's own greedy and beam search over the step contract (not the model's
``generate``): ``prepare`` runs the vision tower and the prompt once per image and keeps what the
steps reuse (the memory); the state is the decoder's self-attention KV cache, one position longer
per step. With greedy decoding the tokens are those of the model's ``generate(do_sample=False,
suppress_tokens=...)`` (a test checks each architecture); beam search ranks by captionkit's
length penalty, not transformers'. The attention a step returns is the new position's attention
(mean over layers and heads) over the image tokens, on the vision side's patch grid: the models
load with eager attention so that the weights exist.

What trains (``training``): ``"full"`` everything; ``"decoder"`` the language side and the
connector between the two (GIT's visual projection, a VisionEncoderDecoderModel's projection,
Idefics3's connector) with the vision tower frozen; ``"lora"`` LoRA adapters (peft) on the
language side's attention projections only; ``"frozen"`` nothing (what ``hf:`` captions with).
Parameter groups for ``train.lr_groups``: encoder, connector, decoder, lora. The module's
``state_dict()`` holds the trained tensors only (:class:`~.base.TrainedTensorsMixin`), so a
checkpoint stores them and ``source``; ``captionkit export hf`` writes the model (LoRA merged) with
its processor as a plain transformers folder (:func:`transformers_export`).
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.checkpoint import read_config
from ..core.errors import CheckpointError, UserError, WeightsUnavailable
from ..core.fields import check_fields, spec
from ..core.hf import load_lm_tokenizer, load_pretrained, refuse_missing
from ..core.hf_image_text import (
    WHAT,
    captioner_config,
    hf_transformers,
    image_settings,
    normalisation,
    pixel_geometry,
)
from ..core.registry import register_exporter, register_family
from ..data.vocab import Vocab
from .base import CaptionModel, KVMemory, TrainedTensorsMixin, TransformersExport, pixel_rows_to_images
from .lm_tokens import N_SPECIAL, LMTokens

TRAINING = ("full", "decoder", "lora", "frozen")
# the attention projections LoRA adapts when lora_targets is empty: BERT's (BLIP, GIT, BERT
# decoders), GPT-2's fused ones (its self- and cross-attention) and LLaMA's -- those of them the
# language side has
DEFAULT_LORA_TARGETS = ("query", "value", "c_attn", "q_attn", "q_proj", "v_proj")
PROMPT_FILE = "captionkit-hf.json"  # beside an exported model: its prompt and decoding settings
BY_MODEL_TYPE: dict[str, str] = {}  # a transformers model_type -> the family that takes it


@dataclass
class HFCaptionerConfig:
    """A Hugging Face image-to-text captioner.

    vocab_size: the model's tokenizer's size + 4 (set by the trainer; train with data.tokenizer = "lm").
    source: the model: a Hub name (``Salesforce/blip-image-captioning-base``) or a folder
        ``save_pretrained`` wrote, with its tokenizer and image processor. [encoder] is
        ``hf_pixels`` with weights naming the same model. An absolute folder path is safest: a
        relative one is taken from the working directory.
    feat_dim, grid: the rows of encoder ``hf_pixels``: 3 x p x p pixels per patch of the vision
        side's (S/p) x (S/p) grid (set by the trainer).
    prompt: the text a caption follows (BLIP: e.g. "a picture of"; Idefics3/SmolVLM: the
        instruction, which that family needs); "" for none.
    training: "full", "decoder" (the vision tower frozen), "lora" (adapters on the language side
        only) or "frozen" (nothing trains).
    lora_rank, lora_alpha, lora_dropout: the LoRA adapters (Hu et al. 2021).
    lora_targets: the names of the language side's layers LoRA adapts (the last part of a module's
        name, e.g. ["q_proj", "v_proj"]); empty: its attention's query and value projections.
    """

    vocab_size: int = spec(ge=1)
    source: str = spec(min_len=1)
    feat_dim: int = spec(768, ge=1)
    grid: list[int] = spec(default_factory=lambda: [14, 14], length=2, ge=1)
    prompt: str = ""
    training: str = spec("lora", choices=TRAINING)
    lora_rank: int = spec(8, ge=1)
    lora_alpha: float = spec(16.0, gt=0)
    lora_dropout: float = spec(0.05, ge=0, lt=1)
    lora_targets: list[str] = spec(default_factory=list)

    def __post_init__(self):
        check_fields(self)


def hf_family(name: str):
    """Class decorator: register an :class:`HFCaptioner` subclass as the family ``name`` (with its
    transformers exporter) and as the family of its ``model_types``."""
    def wrap(cls: type) -> type:
        register_family(name, HFCaptionerConfig)(cls)
        register_exporter("transformers", name)(transformers_export)
        for t in cls.model_types:
            BY_MODEL_TYPE[t] = name
        return cls
    return wrap


def family_of(source: str) -> str:
    """The family of a Hugging Face model (by its config's model_type), or a one-line error."""
    model_type = captioner_config(source).model_type
    if model_type not in BY_MODEL_TYPE:
        raise UserError(f"{source!r} is a {model_type} model; captionkit captions with "
                         f"{', '.join(sorted(BY_MODEL_TYPE))} models")
    return BY_MODEL_TYPE[model_type]


def reference_config(source: str, prompt: str = "") -> dict:
    """The model config (a dict, ``training = "frozen"``) that captions with ``source`` as it is,
    and its encoder's grid: what ``--model hf:SOURCE`` builds."""
    size, patch = pixel_geometry(captioner_config(source), source)
    return {"vocab_size": len(load_lm_tokenizer(source)) + N_SPECIAL, "source": source, "feat_dim": 3 * patch ** 2,
            "grid": [size // patch] * 2, "prompt": prompt, "training": "frozen"}


def token_ids(*values) -> list[int]:
    """The token ids of the first config field of ``values`` that names any (an id or a list)."""
    for value in values:
        ids = [int(v) for v in (value if isinstance(value, (list, tuple)) else [value]) if v is not None]
        if ids:
            return ids
    return []


def grid_attention(att: torch.Tensor, grid: list[int]) -> torch.Tensor:
    """(B, K) attention over a model's image tokens -> over the H x W cells of the patch grid,
    renormalised. K >= H*W: the patch tokens are the last H*W (class tokens before them); a grid
    pooled r x r (Idefics3's pixel shuffle: K = H*W / r^2) is spread back evenly; else uniform."""
    B, K = att.shape
    H, W = grid
    if K >= H * W:
        cells = att[:, K - H * W:]
    else:
        r = math.isqrt(H * W // K)
        if r * r * K == H * W and H % r == 0 and W % r == 0:
            cells = att.reshape(B, H // r, 1, W // r, 1).expand(B, H // r, r, W // r, r).reshape(B, H * W)
        else:
            cells = att.new_ones(B, H * W)
    return cells / cells.sum(1, keepdim=True).clamp_min(1e-12)


class CrossMemory(KVMemory):
    """Per image, for a decoder with cross-attention: the image states (B, L, D), each layer's
    cross-attention keys/values of them, and the self-attention keys/values of the prompt before
    its last token (B, heads, n - 1, head_dim)."""

    def __init__(self, hidden: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                 prompt_keys: list[torch.Tensor], prompt_values: list[torch.Tensor]):
        super().__init__(keys, values)
        self.hidden, self.prompt_keys, self.prompt_values = hidden, prompt_keys, prompt_values

    def index_select(self, idx: torch.Tensor) -> "CrossMemory":
        def pick(ts):
            return [t.index_select(0, idx) for t in ts]
        return CrossMemory(self.hidden.index_select(0, idx), pick(self.keys), pick(self.values),
                           pick(self.prompt_keys), pick(self.prompt_values))


class HFCaptioner(TrainedTensorsMixin, LMTokens, CaptionModel):
    """What the hf_* families share; a family (:mod:`.hf_families`) says how its model is loaded and
    split into sides, builds its prompt and runs it (``prepare``, ``_run``)."""

    GROUPS = ("encoder", "connector", "decoder", "lora")
    default_lm = ""
    model_types: ClassVar[tuple[str, ...]] = ()  # the transformers model_types the family takes
    model_class: ClassVar[str] = ""  # the transformers class that loads them
    # parameter-name prefixes in the transformers model of its vision tower, its connector, and
    # its language side (where LoRA goes)
    vision_prefixes: ClassVar[tuple[str, ...]] = ()
    connector_prefixes: ClassVar[tuple[str, ...]] = ()
    language_prefixes: ClassVar[tuple[str, ...]] = ()
    #: the model answers an instruction: ``prompt`` must say what (``hf:`` gives it a template's)
    needs_prompt: ClassVar[bool] = False

    @classmethod
    def tokenizer_source(cls, model_cfg: dict) -> str | None:
        """The ``lm`` tokenizer is the model's own."""
        return model_cfg.get("source")

    def __init__(self, cfg: HFCaptionerConfig):
        super().__init__()
        self.cfg = cfg
        tf = hf_transformers()
        config = captioner_config(cfg.source)
        if config.model_type not in self.model_types:
            raise UserError(f"{cfg.source!r} is a {config.model_type} model; the {self.family} family takes "
                             f"{' or '.join(self.model_types)} models ({family_hint(config.model_type)})")
        tok = load_lm_tokenizer(cfg.source)
        if cfg.vocab_size != len(tok) + N_SPECIAL:
            raise UserError(f"HFCaptionerConfig.vocab_size is {cfg.vocab_size}, but the tokenizer of {cfg.source!r} "
                             f"has {len(tok)} tokens + {N_SPECIAL} specials (train with data.tokenizer = \"lm\")")
        size, self.patch = pixel_geometry(config, cfg.source)
        side = size // self.patch
        if cfg.feat_dim != 3 * self.patch ** 2 or list(cfg.grid) != [side, side]:
            raise UserError(f"the image rows are {cfg.grid[0]}x{cfg.grid[1]} x {cfg.feat_dim}, but {cfg.source!r} "
                             f"takes {side}x{side} patches of 3x{self.patch}x{self.patch} pixels: use [encoder] "
                             f"name = \"hf_pixels\" with weights = {cfg.source!r}")
        model, info = load_pretrained(getattr(tf, self.model_class), cfg.source, WHAT, dtype=torch.float32,
                                      attn_implementation="eager", output_loading_info=True)
        # a vision tower's pooler, which captioning never uses, may be missing (ViTs saved without one)
        refuse_missing(info, cfg.source, WHAT, never_used)
        mean, std = normalisation(image_settings(cfg.source))
        self.register_buffer("pixel_mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("pixel_std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

        prompt, ends = self.setup(model, tok)  # the family's own (before LoRA wraps the model)
        self.n_lm = len(tok)
        ends = [i for i in ends if i < self.n_lm]
        if not prompt or not ends:
            raise UserError(f"{cfg.source!r}: its config names no {'start' if not prompt else 'end'} token")
        self.register_buffer("prompt_ids", torch.tensor([prompt]), persistent=False)  # (1, n)
        # a model may end a caption with any of several tokens (a generation config's list):
        # <end> stands for the most probable of them, and is taught as the tokenizer's own end
        # when it is one of them (SmolVLM's <end_of_utterance>), else as the first
        self.register_buffer("end_ids", torch.tensor(ends), persistent=False)
        self.bos_id = prompt[-1]
        self.eos_id = tok.eos_token_id if tok.eos_token_id in ends else ends[0]
        width = self.output_layer(model).out_features
        if self.n_lm > width:
            raise UserError(f"{cfg.source!r}: the tokenizer has more tokens ({self.n_lm}) than the model's output layer")
        suppressed = torch.zeros(self.n_lm, dtype=torch.bool)
        suppressed[[i for i in tok.all_special_ids if i not in ends and i < self.n_lm]] = True
        self.register_buffer("suppressed", suppressed, persistent=False)
        self.hf = self._trainable(model)
        # what training changes: saved in checkpoints, everything else comes from cfg.source
        self.set_trained({n: self._group(n) for n, p in self.named_parameters() if p.requires_grad})

    # ---- the family's part -------------------------------------------------------------------
    def setup(self, model: nn.Module, tok) -> tuple[list[int], list[int]]:
        """Read what the family needs of its model -> (the prompt's ids, the ids that end a caption)."""
        raise NotImplementedError

    @staticmethod
    def output_layer(model: nn.Module) -> nn.Module:
        """The model's output layer (its logits' width)."""
        return model.get_output_embeddings()

    def _run(self, ids: torch.Tensor, state, mem, attention: bool):
        """ids (B, T) of the model's own vocabulary after the state -> (logits (B, T, V_model),
        the state T positions longer, attention (B, H*W) of the last position or None)."""
        raise NotImplementedError

    # ---- loading and what trains -------------------------------------------------------------
    @property
    def core(self) -> nn.Module:
        """The transformers model (with the LoRA layers in place, if any), without peft's wrapper."""
        return self.hf.get_base_model() if self.cfg.training == "lora" else self.hf

    def _side(self, name: str) -> str:
        """encoder, connector or decoder: the side of the transformers model a parameter is on."""
        if name.startswith(self.vision_prefixes):
            return "encoder"
        return "connector" if name.startswith(self.connector_prefixes) else "decoder"

    def _group(self, name: str) -> str:
        """The group of a trained parameter of this module, by its name."""
        if "lora_" in name:
            return "lora"
        return self._side(name.removeprefix("hf.").removeprefix("base_model.model."))

    def _trainable(self, model: nn.Module) -> nn.Module:
        training = self.cfg.training
        for name, p in model.named_parameters():
            wanted = training == "full" or (training == "decoder" and self._side(name) != "encoder")
            p.requires_grad_(wanted and not never_used(name))
        if training != "lora":
            return model
        try:
            import peft
        except ImportError:
            raise WeightsUnavailable("training = \"lora\" needs the 'peft' package (pip install 'captionkit[hf]')") from None
        wanted = tuple(self.cfg.lora_targets) or DEFAULT_LORA_TARGETS
        targets = {name: m for name, m in model.named_modules() if name.startswith(self.language_prefixes)
                   and name.rsplit(".", 1)[-1] in wanted and not list(m.children())}
        if not targets:
            raise UserError(f"{self.cfg.source!r}: its language side has no layer named "
                             f"{' or '.join(wanted)} for LoRA (set [model] lora_targets)")
        # GPT-2's projections are Conv1D, whose weight is stored transposed: peft must be told
        transposed = all(type(m).__name__ == "Conv1D" for m in targets.values())
        lora = peft.LoraConfig(r=self.cfg.lora_rank, lora_alpha=self.cfg.lora_alpha, bias="none",
                               lora_dropout=self.cfg.lora_dropout, target_modules=list(targets),
                               fan_in_fan_out=transposed)
        with warnings.catch_warnings():  # peft calls transformers APIs deprecated in v5
            warnings.simplefilter("ignore", FutureWarning)
            return peft.get_peft_model(model, lora)  # freezes everything but the adapters

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """The trained tensors (TrainedTensorsMixin's rule), less a vision pooler: full fine-tuning
        checkpoints written before it was frozen (see :func:`never_used`) carry its untrained tensors."""
        kept = {k: v for k, v in state_dict.items() if not never_used(k.removeprefix("hf."))}
        return super().load_state_dict(kept, strict=strict, assign=assign)

    @classmethod
    def check_trainable(cls, cfg: HFCaptionerConfig) -> None:
        if cfg.training == "frozen":
            raise UserError(f"model.training = \"frozen\" trains nothing of the {cls.family} model; set it to "
                             f"\"full\", \"decoder\" or \"lora\"")

    # ---- shared pieces -----------------------------------------------------------------------
    def pixels(self, feats: torch.Tensor) -> torch.Tensor:
        """hf_pixels rows (B, H*W, 3*p*p) in [0, 1] -> the model's normalised input (B, 3, S, S)."""
        return (pixel_rows_to_images(feats, self.cfg.grid, self.patch) - self.pixel_mean) / self.pixel_std

    def prompt(self, batch: int) -> torch.Tensor:
        """The prompt's ids for every image (B, n)."""
        return self.prompt_ids.expand(batch, -1)

    def to_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """The model's logits (..., >= n_lm) -> log-probabilities over captionkit ids (..., n_lm + 4),
        as LMTokens' but with the special tokens other than the ends masked before the softmax,
        and <end> the most probable of the ends (so greedy ends where generate() stops)."""
        logp = F.log_softmax(logits[..., :self.n_lm].float().masked_fill(self.suppressed, float("-inf")), dim=-1)
        never = torch.full((*logp.shape[:-1], 1), float("-inf"), device=logp.device)
        specials = [never] * N_SPECIAL
        specials[Vocab.end] = logp.index_select(-1, self.end_ids).amax(-1, keepdim=True)
        words = logp.index_fill(-1, self.end_ids, float("-inf"))
        return torch.cat([*specials, words], -1)  # (..., n_lm + 4)

    # ---- the step contract and teacher forcing -----------------------------------------------
    def init_state(self, mem) -> tuple[torch.Tensor, ...]:
        """The decoder's self-attention cache, at first the prompt's but its last token:
        (keys_0, values_0, keys_1, ...) (B, heads, n - 1 [+ image tokens], head_dim)."""
        keys, values = (mem.prompt_keys, mem.prompt_values) if isinstance(mem, CrossMemory) else (mem.keys, mem.values)
        return tuple(t for kv in zip(keys, values) for t in kv)

    def step(self, tokens: torch.Tensor, state, mem):
        """tokens (B,) -> (log-probs (B, V), the cache one position longer, attention (B, H*W))."""
        logits, state, attention = self._run(self.lm_ids(tokens).unsqueeze(1), state, mem, True)
        return self.to_vocab(logits[:, -1]), state, attention

    def lm_logits(self, feats: torch.Tensor, inputs: torch.Tensor, image_index: torch.Tensor | None = None):
        """feats (B or U, H*W, 3*p*p), inputs (B, T) = <start> w_1 .. w_{T-1} -> the model's logits
        (B, T, V_model). As in decoding, the image and the prompt run first (once per image with
        image_index (B,): caption b is image image_index[b]'s) and the caption after them;
        gradients flow back through the memory to whatever trains."""
        mem = self.prepare(feats)
        if image_index is not None:
            mem = mem.index_select(image_index)
        return self._run(self.lm_ids(inputs), self.init_state(mem), mem, False)[0]

    # ---- export --------------------------------------------------------------------------------
    def standalone(self) -> nn.Module:
        """The transformers model with what was trained folded in (LoRA merged into its weights:
        this captioner's model changes in place)."""
        return self.hf.merge_and_unload() if self.cfg.training == "lora" else self.hf


def never_used(name: str) -> bool:
    """A parameter of the transformers model that captioning never reaches: a vision tower's
    pooler (VisionEncoderDecoderModel loads its ViT with one; the decoder reads the patch states,
    not the pooled one). It stays frozen whatever ``training`` says: it would get no gradient,
    which DistributedDataParallel refuses at the second step ("parameters that were not used in
    producing loss"), and a checkpoint would save it, untrained, as trained."""
    return ".pooler." in f".{name}"


def family_hint(model_type: str) -> str:
    """How to name the family of a model_type, for errors."""
    family = BY_MODEL_TYPE.get(model_type)
    return f"family = \"{family}\" takes it" if family else f"captionkit has no family for {model_type} models"


def save_processor(source: str, folder: Path) -> None:
    """The model's processor (tokenizer, image processor, chat template) into ``folder``."""
    tf = hf_transformers()
    processor = load_pretrained(tf.AutoProcessor, source, WHAT)
    processor.save_pretrained(folder)
    if not hasattr(processor, "image_processor"):  # a tokenizer alone (a VisionEncoderDecoderModel's)
        load_pretrained(tf.AutoImageProcessor, source, WHAT).save_pretrained(folder)


def read_export_settings(folder: Path) -> dict | None:
    """What ``captionkit export hf`` kept beside a model (its prompt and decoding settings); None
    for a folder it did not write."""
    path = Path(folder) / PROMPT_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def transformers_export(model: HFCaptioner, checkpoint: str, out: Path) -> TransformersExport:
    """The transformers model, LoRA merged, with its processor: a folder ``from_pretrained`` of the
    model's class loads. Beside it (``captionkit-hf.json``, which ``--model hf:FOLDER`` reads) the
    prompt it was trained with and the checkpoint's decoding settings (its longest caption, the
    length penalty chosen on dev), so that it captions as the checkpoint does."""
    if model.cfg.training == "frozen":
        raise CheckpointError(f"{checkpoint}: nothing of it was trained (training = \"frozen\"); "
                              f"{model.cfg.source!r} is the model as it is")
    settings = {"family": model.family, "prompt": model.cfg.prompt,
                "decoding": read_config(checkpoint).get("decoding", {})}

    def save(folder: Path) -> None:
        model.standalone().save_pretrained(folder)
        save_processor(model.cfg.source, folder)
        (folder / PROMPT_FILE).write_text(json.dumps(settings, indent=1) + "\n")

    return TransformersExport(save)
