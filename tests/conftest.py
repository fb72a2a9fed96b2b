"""Shared fixtures: synthetic photos of coloured shapes in the Flickr8k layout, a tiny training
config on a random-weight encoder, and a tiny model trained from it once per session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

SHAPES = [
    ("red", (220, 30, 30), "circle"),
    ("blue", (30, 60, 220), "square"),
    ("green", (30, 180, 60), "triangle"),
]
TEMPLATES = ["a {c} {s} on a white background", "a {c} {s}", "one {c} {s} in the middle",
             "the {s} is {c}", "a picture of a {c} {s}"]


def shape_image(k: int, size: int = 96, jitter: int = 0) -> Image.Image:
    _, rgb, shape = SHAPES[k % len(SHAPES)]
    im = Image.new("RGB", (size, size), (255, 255, 255))
    d = ImageDraw.Draw(im)
    a, b = 20 + jitter, size - 20 + jitter
    if shape == "circle":
        d.ellipse([a, a, b, b], fill=rgb)
    elif shape == "square":
        d.rectangle([a, a, b, b], fill=rgb)
    else:
        d.polygon([(size // 2, a), (a, b), (b, b)], fill=rgb)
    return im


def write_flickr8k(root: Path, n_train: int = 9, n_dev: int = 3, n_test: int = 3) -> Path:
    """A dataset in the original Flickr8k layout; image i shows shape i % 3."""
    img_dir = root / "Flicker8k_Dataset"
    img_dir.mkdir(parents=True)
    lines, names = [], []
    for i in range(n_train + n_dev + n_test):
        name = f"img{i:03d}.jpg"
        names.append(name)
        shape_image(i, jitter=i % 4).save(img_dir / name, quality=95)
        c, _, s = SHAPES[i % 3]
        lines += [f"{name}#{j}\t{t.format(c=c, s=s)}" for j, t in enumerate(TEMPLATES)]
    (root / "Flickr8k.token.txt").write_text("\n".join(lines) + "\n")
    splits = {"train": names[:n_train], "dev": names[n_train:n_train + n_dev], "test": names[n_train + n_dev:]}
    for split, ns in splits.items():
        (root / f"Flickr_8k.{split}Images.txt").write_text("\n".join(ns) + "\n")
    return root


TINY_CONFIG = """
[data]
dataset = "{dataset}"
min_count = 1

[encoder]
name = "efficientnet_lite0"
weights = "random"

[model]
family = "sat"
embed_dim = 16
hidden_dim = 24
attn_dim = 12
dropout = 0.0

[train]
epochs = 3
batch_size = 8
lr = 1e-2
precision = "fp32"
val_beam = 2
checkpoint_every = 0
max_len = 12
length_penalties = [0.0, 1.0]
"""


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["CAPTIONKIT_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture
def no_expensive_work(monkeypatch):
    """Fail the test if a command gets as far as loading a dataset, features or a model: user
    mistakes (a bad config, a refused output folder) are reported before any of these."""
    import captionkit.captioner
    import captionkit.train

    def expensive(*a, **k):
        raise AssertionError("expensive work started before the user's input was checked")

    monkeypatch.setattr(captionkit.train, "load_dataset", expensive)
    monkeypatch.setattr(captionkit.train, "build_features", expensive)
    monkeypatch.setattr(captionkit.captioner.Captioner, "load", expensive)


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
    from captionkit.train import train

    out = tmp_path_factory.mktemp("run")
    train(tiny_config, out=out, progress=False)
    return out


LM_CONFIG = """
[data]
dataset = "{dataset}"
tokenizer = "lm"

[encoder]
{encoder}

[model]
{model}

[train]
epochs = {epochs}
batch_size = 8
lr = 3e-3
precision = "fp32"
val_beam = 2
checkpoint_every = 0
max_len = 10
length_penalties = [0.0]
{train}
"""


def write_lm_config(path: Path, dataset: Path, encoder: str, model: str, epochs: int = 1, train: str = "") -> Path:
    """A tiny run config of a pretrained-LM family (the LM's own tokens, float32, beam 2 on dev),
    with the caller's ``[encoder]`` and ``[model]`` lines and extra ``[train]`` lines."""
    path.write_text(LM_CONFIG.format(dataset=dataset, encoder=encoder, model=model, epochs=epochs, train=train))
    return path


def shapes_bpe(specials: list[str], extra_texts: tuple[str, ...] = ()):
    """A byte-level BPE (vocabulary 300, the tiny LM tests' tokenizer) trained on the shapes
    captions and ``extra_texts``, with ``specials`` as its special tokens."""
    import tokenizers as tk

    bpe = tk.Tokenizer(tk.models.BPE())
    bpe.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tk.decoders.ByteLevel()
    texts = [t.format(c=c, s=s) for c, _, s in SHAPES for t in TEMPLATES] + list(extra_texts)
    bpe.train_from_iterator(texts, tk.trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                          initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(),
                                                          show_progress=False))
    return bpe


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


def import_graph_module():
    """benchmarks/import_graph.py as a module (it is a script, not part of the package)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / "import_graph.py"
    spec = importlib.util.spec_from_file_location("import_graph", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_beam_one_is_greedy(model, feats, max_len: int) -> list:
    """The decoding equivalence every family keeps: beam search with one beam gives greedy's
    captions, log-probabilities and attention (one row over the L locations per word)."""
    import torch

    from captionkit.decoding import beam_search, greedy
    g = greedy(model, feats, max_len=max_len)
    b = beam_search(model, feats, beam=1, max_len=max_len)
    assert len(g) == len(b) == feats.shape[0]
    for x, y in zip(g, b):
        assert x.ids == y.ids
        assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
        torch.testing.assert_close(x.attention, y.attention)
        assert x.attention.shape == (len(x.ids), feats.shape[1])
    return g


def assert_shared_image_matches_repeats(model, feats, ids, image_index, **tolerance):
    """batching = "image": training_loss with each image once, indexed per caption by
    image_index, equals it with every caption given its own copy of the image -- the loss and
    the gradient of every trained parameter. Returns the shared loss."""
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    shared, _ = model.training_loss(feats, ids[:, :-1], ids[:, 1:], image_index=image_index)
    repeated, _ = model.training_loss(feats.index_select(0, image_index), ids[:, :-1], ids[:, 1:])
    torch.testing.assert_close(shared, repeated)
    for g, h in zip(torch.autograd.grad(shared, params), torch.autograd.grad(repeated, params)):
        torch.testing.assert_close(g, h, **tolerance)
    return shared
