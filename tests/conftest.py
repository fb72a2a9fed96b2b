"""Shared fixtures: a dataset of synthetic photos of coloured shapes in the Flickr8k layout, a tiny
training config on a random-weight encoder, a tiny model trained from it once per session, and tiny
pretrained models for the LM families. Plain helpers live in helpers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from helpers import TINY_CONFIG, shapes_bpe, write_flickr8k, write_picky_decoder, write_picky_flickr8k


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["CAPTIONKIT_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def no_expensive_work(monkeypatch):
    """Fail the test if a command gets as far as loading a dataset, features or a model: user
    mistakes (a bad config, a refused output folder) are reported before any of these."""
    import captionkit.inference.captioner
    import captionkit.training.stages

    def expensive(*a, **k):
        raise AssertionError("expensive work started before the user's input was checked")

    monkeypatch.setattr(captionkit.training.stages, "load_dataset", expensive)
    monkeypatch.setattr(captionkit.training.stages, "build_features", expensive)
    monkeypatch.setattr(captionkit.inference.captioner.Captioner, "load", expensive)


@pytest.fixture(scope="session")
def flickr_dir(tmp_path_factory) -> Path:
    return write_flickr8k(tmp_path_factory.mktemp("flickr"))


@pytest.fixture(scope="session")
def tiny_config(flickr_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cfg") / "tiny.toml"
    path.write_text(TINY_CONFIG.format(dataset=flickr_dir))
    return path


@pytest.fixture(scope="session")
def tiny_run(tiny_config, tmp_path_factory) -> Path:
    """A run folder with 'best' and 'last' checkpoints of a tiny model trained 3 epochs."""
    from captionkit.training.run import train

    out = tmp_path_factory.mktemp("run")
    train(tiny_config, out=out, progress=False)
    return out


@pytest.fixture(scope="session")
def picky_data(tmp_path_factory) -> Path:
    """Twelve photos that are not their own mirror images, in the Flickr8k layout (4 per split)."""
    return write_picky_flickr8k(tmp_path_factory.mktemp("picky_data"))


@pytest.fixture(scope="session")
def picky_models(tmp_path_factory) -> tuple[Path, Path]:
    """Two checkpoints of one vocabulary on the patches encoder whose captions follow the pixels
    (helpers.write_picky_decoder): what the options' tests compare outputs on."""
    root = tmp_path_factory.mktemp("picky_models")
    return write_picky_decoder(root / "a", seed=0), write_picky_decoder(root / "b", seed=1)


# ---- tiny pretrained models for the LM families (no network; shared by their tests) ---------------
@pytest.fixture(scope="session")
def tiny_lm(tmp_path_factory) -> str:
    """A folder with a random 2-layer LLaMA and its tokenizer, as save_pretrained writes them."""
    pytest.importorskip("transformers")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    folder = tmp_path_factory.mktemp("tiny_lm")
    bpe = shapes_bpe(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], ("The dogs' ball, in a park!",))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      initializer_range=0.2)  # at the usual 0.02 a width-32 LM's logits are all ~0, and
    # with its output layer frozen, no adapter could make it pick a word
    LlamaForCausalLM(cfg).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_vit(tmp_path_factory) -> str:
    """A random 2-block ViT and its image processor (mean = std = 0.5, bilinear), as
    save_pretrained writes them."""
    pytest.importorskip("transformers")
    import torch
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    folder = tmp_path_factory.mktemp("tiny_vit")
    torch.manual_seed(0)
    ViTModel(ViTConfig(image_size=32, patch_size=8, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=48)).save_pretrained(folder)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> str:
    """A random 2-block GPT-2 (without cross-attention, as a pretrained GPT-2 comes) and a
    GPT-2 tokenizer whose byte-level BPE is trained here on the shapes captions."""
    pytest.importorskip("transformers")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

    folder = tmp_path_factory.mktemp("tiny_gpt2")
    bpe = shapes_bpe(["<|endoftext|>"])
    tok = GPT2TokenizerFast(tokenizer_object=bpe, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                            unk_token="<|endoftext|>")
    tok.save_pretrained(folder)
    torch.manual_seed(0)
    eos = tok.eos_token_id
    # initializer_range 0.2: at GPT-2's 0.02 a width-32 model's logits are all ~0 and a random
    # model's captions would be a coin toss between <end> and a word at every step
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                               bos_token_id=eos, eos_token_id=eos, initializer_range=0.2)).save_pretrained(folder)
    return str(folder)
