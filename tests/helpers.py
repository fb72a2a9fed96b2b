"""Helpers the tests share (imported as ``from helpers import ...``; pytest puts tests/ on the
path): synthetic photos of coloured shapes in the Flickr8k layout, tiny run configs, a tokenizer
trained on the shapes captions, and assertions several families' tests make. The fixtures built
from them live in conftest.py."""

from __future__ import annotations

from pathlib import Path

import pytest
from PIL import Image, ImageDraw

# Flickr8k as the shared data folder holds it, beside the clone (tests that need it skip without it)
FLICKR8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "flickr8k"

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

    from captionkit.inference.decoding import beam_search, greedy
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


def word_trainer(cfg, out):
    """A Trainer for ``cfg`` (a loaded RunConfig) built through the training stages, with a word
    vocabulary of every training token (min count 1)."""
    from captionkit.data.tokenizers import build_tokenizer
    from captionkit.training.run import build_trainer
    from captionkit.training.stages import prepare_data

    data = prepare_data(cfg)
    return build_trainer(cfg, out, data, build_tokenizer("word", [t for it in data.train_items for t in it.tokens], 1))
