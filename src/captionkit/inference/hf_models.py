"""Hugging Face image-to-text models as captioners: ``--model hf:ORG/NAME`` (a Hub name, looked up in
the local Hugging Face cache before the Hub), ``--model hf:FOLDER``, or a folder ``save_pretrained``
wrote (its ``config.json`` has a ``model_type``; a captionkit checkpoint's names a ``family``).

The model is one of the ``hf_*`` families (:mod:`captionkit.models.hf_captioner`, picked by its
``model_type``) with nothing trained, the ``hf_pixels`` encoder at its input size, and its own
tokenizer: a :class:`~captionkit.inference.captioner.Captioner` like any checkpoint's
(``Captioner.load("hf:ORG/NAME", prompt=...)``, ``captionkit.load("hf:ORG/NAME")``), so caption,
evaluate, serve, the Ray engine, the outputs, bad-image handling and resuming are the same. A model
that needs an instruction (Idefics3/SmolVLM) gets the ``caption`` template of
``vlm_prompts.toml`` unless ``prompt`` says otherwise; a folder ``captionkit export hf`` wrote
keeps the prompt it was trained with and its checkpoint's decoding settings (longest caption,
length penalty).

:func:`hf_source` reads what a user typed without torch (the command line checks --model before
torch loads)."""

from __future__ import annotations

import json
from pathlib import Path

from ..core.errors import CheckpointError, UserError

HF_PREFIX = "hf:"
MAX_TOKENS = 32  # the longest caption in the model's tokens (subwords: ~20 words)
ENCODER = "hf_pixels"


def is_transformers_folder(path: Path) -> bool:
    """A folder save_pretrained wrote: its config.json names a model_type and no captionkit family."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "model_type" in config and "family" not in config


def hf_source(model) -> str | None:
    """The Hugging Face model a --model value names, as transformers takes it (an absolute folder,
    or a Hub name); None for anything else (a checkpoint, a shipped model, the default)."""
    if model is None:
        return None
    text = str(model)
    if not text.startswith(HF_PREFIX):
        path = Path(text).expanduser()
        return str(path.resolve()) if path.is_dir() and is_transformers_folder(path) else None
    source = text[len(HF_PREFIX):]
    path = Path(source).expanduser()
    if not source:
        raise UserError("hf: names no model: hf:ORG/NAME (a Hugging Face Hub name) or hf:FOLDER")
    if path.is_dir():
        return str(path.resolve())
    if path.is_absolute() or source.startswith((".", "~")) or path.exists():
        raise CheckpointError(f"{source}: no such model folder")
    return source


def hf_setting(model) -> str | None:
    """How resumable outputs record an hf model: ``hf:`` and its source (folders absolute)."""
    source = hf_source(model)
    return None if source is None else HF_PREFIX + source


def caption_prompt() -> str:
    """The ``caption`` template of the shipped vlm_prompts.toml."""
    from .zero_shot import load_prompts
    return load_prompts().get("caption")


def hf_parts(source: str, prompt: str | None = None, with_encoder: bool = True):
    """(decoder, tokenizer, config, encoder or None) of a Hugging Face model, as Captioner takes them."""
    from ..data.tokenizers import LMTokenizer
    from ..encoders import create_encoder
    from ..models import create_model, model_class
    from ..models.hf_captioner import family_of, read_export_settings, reference_config

    family = family_of(source)
    # an exported model's prompt and decoding settings, as it was trained and tuned
    exported = (read_export_settings(Path(source)) if Path(source).is_dir() else None) or {}
    if prompt is None:  # (the template when the model needs an instruction and has none)
        prompt = exported.get("prompt", caption_prompt() if model_class(family).needs_prompt else "")
    model_cfg = reference_config(source, prompt)
    decoder = create_model(family, model_cfg)
    vocab = LMTokenizer.build(source)
    config = {"family": family, "model": model_cfg, "vocab": vocab.to_json(),
              "encoder": {"name": ENCODER, "weights": source, "grid": model_cfg["grid"]},
              "decoding": {"max_len": MAX_TOKENS, "length_penalty": 0.0, **exported.get("decoding", {})}}
    encoder = create_encoder(ENCODER, weights=source) if with_encoder else None
    return decoder, vocab, config, encoder
