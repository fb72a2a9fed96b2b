"""Helpers the tests share (imported as ``from helpers import ...``; pytest puts tests/ on the
path): synthetic photos of coloured shapes in the Flickr8k layout, tiny run configs, a tokenizer
trained on the shapes captions, and assertions several families' tests make. The fixtures built
from them live in conftest.py."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import pytest
from PIL import Image, ImageDraw

from captionkit.scoring.ptb_tokenize import java_available

# Flickr8k as the shared data folder holds it, beside the clone (tests that need it skip without it)
FLICKR8K = Path(__file__).resolve().parents[2] / "shared" / "data" / "flickr8k"

# the coco-caption jars (the PTB tokenizer, METEOR 1.5) run only where Java is installed
needs_java = pytest.mark.skipif(not java_available(), reason="Java not installed: the coco-caption jars cannot run")

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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS's choice): for a rendezvous
    or a server a test starts. Another process may take it before the test binds it; the OS
    hands out ports at random, so two tests running side by side rarely draw the same one."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def benchmark_module(name: str):
    """benchmarks/NAME.py as a module (the benchmarks are scripts, not part of the package; one
    that imports its neighbours puts its folder on sys.path itself)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def import_graph_module():
    """benchmarks/import_graph.py as a module."""
    return benchmark_module("import_graph")


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


# ---- decoders whose captions follow the pixels (the options' tests) ----------------------------------
PICKY_WORDS = ["a", "red", "blue", "circle", "square", "on", "white", "the"]  # after the special tokens
PICKY_GRID = [16, 16]  # the patches encoder's grid: its rows are the photo's pixels, no weights


def picky_photos() -> dict[str, Image.Image]:
    """Twelve photos that are not their own mirror images: two shapes side by side, and one shape
    off centre."""
    photos = {}
    for a in range(3):
        for b in range(3):
            if a != b:
                im = Image.new("RGB", (64, 64), (255, 255, 255))
                im.paste(shape_image(a, size=64).resize((32, 32)), (0, 16))
                im.paste(shape_image(b, size=64).resize((32, 32)), (32, 16))
                photos[f"pair{a}{b}.png"] = im
    for k in range(3):
        for j in (-8, 8):
            photos[f"s{k}_{j}.png"] = shape_image(k, size=64, jitter=j)
    return photos


def write_picky_flickr8k(root: Path) -> Path:
    """The picky photos as a dataset in the Flickr8k layout (PNG files): 4 train, 4 dev and 4 test
    images, each with the references of the shape on its left."""
    img_dir = root / "Flicker8k_Dataset"
    img_dir.mkdir(parents=True)
    lines, names = [], []
    for i, (name, im) in enumerate(sorted(picky_photos().items())):
        im.save(img_dir / name)
        names.append(name)
        c, _, s = SHAPES[int(name[4] if name.startswith("pair") else name[1])]
        lines += [f"{name}#{j}\t{t.format(c=c, s=s)}" for j, t in enumerate(TEMPLATES)]
    (root / "Flickr8k.token.txt").write_text("\n".join(lines) + "\n")
    for k, split in enumerate(("train", "dev", "test")):
        (root / f"Flickr_8k.{split}Images.txt").write_text("\n".join(names[4 * k:4 * k + 4]) + "\n")
    return root


def write_picky_decoder(folder: Path, seed: int, more_words: tuple[str, ...] = ()) -> Path:
    """A checkpoint of a random transformer decoder on the patches encoder whose weights are
    scaled x10, so that its captions follow the pixels: on the picky photos a beam width, a
    length penalty, test-time flips, MBR, an ensemble's weights, ... each change several of them
    (checked in float32 and bf16 alike; random decoders at their usual scale, or on the random
    EfficientNet's near-zero features, give one caption whatever the photo). ``more_words``:
    words after the picky ones (rarer, in a word vocabulary's frequency order)."""
    import torch

    from captionkit.data.vocab import SPECIALS
    from captionkit.models import create_model

    words = list(SPECIALS) + PICKY_WORDS + list(more_words)
    torch.manual_seed(seed)
    decoder = create_model("transformer", {"vocab_size": len(words), "feat_dim": 192, "grid": PICKY_GRID,
                                           "width": 16, "heads": 2, "decoder_layers": 1, "dropout": 0.0,
                                           "max_positions": 16})
    with torch.no_grad():
        for p in decoder.parameters():
            p.mul_(10)
    return decoder_checkpoint(folder, decoder, "transformer", words, "patches", PICKY_GRID)


def decoder_checkpoint(folder: Path, decoder, family: str, words: list[str], encoder: str, grid: list[int],
                       length_penalty: float = 0.0) -> Path:
    """A checkpoint folder of a decoder built in a test: its config as the trainer saves it, the
    encoder by name with random weights, decoding at most 6 words."""
    from dataclasses import asdict

    from captionkit.core.checkpoint import save_checkpoint

    save_checkpoint(folder, decoder.state_dict(), {
        "family": family, "model": asdict(decoder.cfg), "vocab": list(words),
        "encoder": {"name": encoder, "weights": "random", "grid": list(grid)},
        "decoding": {"max_len": 6, "length_penalty": length_penalty}})
    return folder


def cli_captions(out_dir: Path, argv: list[str]) -> dict[str, str]:
    """The captions ``captionkit ARGV --json OUT`` writes (a new OUT in ``out_dir`` each call)."""
    from captionkit.cli.main import main

    out = out_dir / f"captions{len(list(out_dir.glob('captions*.json')))}.json"
    assert main([*argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def direct_captions(cap, paths, **options) -> dict[str, str]:
    """What a Captioner says of these photos, by file name, without the command line."""
    return {p.name: r.text for p, r in cap.caption_files(list(paths), workers=0, **options)}


# ---- tiny pretrained models for the LM families (the conftest fixtures of these names) -----------
def write_tiny_lm(folder: Path) -> str:
    """A random 2-layer LLaMA and its tokenizer in ``folder``, as save_pretrained writes them."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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


def write_tiny_vit(folder: Path) -> str:
    """A random 2-block ViT and its image processor (mean = std = 0.5, bilinear) in ``folder``."""
    import torch
    from transformers import ViTConfig, ViTImageProcessor, ViTModel

    torch.manual_seed(0)
    ViTModel(ViTConfig(image_size=32, patch_size=8, hidden_size=24, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=48)).save_pretrained(folder)
    ViTImageProcessor(size={"height": 32, "width": 32}).save_pretrained(folder)
    return str(folder)


def write_tiny_gpt2(folder: Path) -> str:
    """A random 2-block GPT-2 (without cross-attention, as a pretrained GPT-2 comes) and a GPT-2
    tokenizer whose byte-level BPE is trained here on the shapes captions, in ``folder``."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2TokenizerFast

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


# ---- the CPU for tests not marked cuda, on any host (conftest's autouse fixtures) ------------------
@dataclass
class CudaView:
    """What torch says of this host's GPUs before :func:`hide_gpus`: its own functions, and the
    CUDA_VISIBLE_DEVICES that child processes inherited (None: unset)."""

    is_available: object
    device_count: object
    visible: str | None


def hide_gpus(mp: pytest.MonkeyPatch) -> CudaView:
    """Make this process and its children see no GPU, so ``auto`` devices are the CPU (the
    suite's tests compare against CPU outputs, and torchrun children would otherwise ask for
    cuda:LOCAL_RANK). Returns the real view, for :func:`show_gpus`."""
    import torch

    real = CudaView(torch.cuda.is_available, torch.cuda.device_count, os.environ.get("CUDA_VISIBLE_DEVICES"))
    # The first CUDA query fixes which GPUs this process has: made now, before the variable that
    # hides them from child processes, so the cuda tests of this process still get them.
    real.is_available()
    mp.setattr(torch.cuda, "is_available", lambda: False)
    mp.setattr(torch.cuda, "device_count", lambda: 0)
    mp.setenv("CUDA_VISIBLE_DEVICES", "")
    return real


def show_gpus(mp: pytest.MonkeyPatch, real: CudaView) -> None:
    """Undo :func:`hide_gpus` (for a test marked cuda; ``mp`` undoes it after the test)."""
    import torch

    mp.setattr(torch.cuda, "is_available", real.is_available)
    mp.setattr(torch.cuda, "device_count", real.device_count)
    if real.visible is None:
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        mp.setenv("CUDA_VISIBLE_DEVICES", real.visible)


# ---- a local HTTP server (URLs in the Python API and the command line) -------------------------------
class LocalServer:
    """An HTTP server on 127.0.0.1 in a thread of this process, answering each path in
    ``routes`` with its handler (``handler(request)``, a BaseHTTPRequestHandler) and any other
    with 404; ``hits`` counts the requests per path. A context manager: serving inside."""

    def __init__(self, routes: dict):
        import http.server
        import threading
        from collections import Counter

        self.routes, self.hits = routes, Counter()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                server.hits[self.path] += 1
                route = server.routes.get(self.path)
                if route is None:
                    self.send_error(404)
                    return
                try:
                    route(self)
                except OSError:  # the client hung up (a refused or timed-out download): expected
                    pass

            def log_message(self, *args):  # quiet
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def __enter__(self) -> "LocalServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def http_body(data: bytes, length: bool = True, status: int = 200):
    """A route answering ``data`` (without a Content-Length header when ``length`` is False:
    the client learns the size only by reading)."""
    def route(request):
        request.send_response(status)
        if length:
            request.send_header("Content-Length", str(len(data)))
        request.send_header("Connection", "close")
        request.end_headers()
        request.wfile.write(data)
    return route


def http_trickle(data: bytes, every: float):
    """A route sending ``data`` one byte every ``every`` seconds (a server too slow to finish)."""
    import time

    def route(request):
        request.send_response(200)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        for i in range(len(data)):
            request.wfile.write(data[i:i + 1])
            request.wfile.flush()
            time.sleep(every)
    return route


def http_silent(seconds: float):
    """A route that answers nothing for ``seconds`` (a server that accepted and hangs)."""
    import time

    def route(request):
        time.sleep(seconds)
    return route


def http_redirect(location: str):
    def route(request):
        request.send_response(302)
        request.send_header("Location", location)
        request.send_header("Content-Length", "0")
        request.end_headers()
    return route


@contextlib.contextmanager
def local_ray():
    """A local Ray of 2 CPUs for the block (the test is skipped without Ray). A Ray already
    running in this process is used as it is and left running; one started here is shut down."""
    from captionkit.inference.ray_engine import ray_missing

    if ray_missing():
        pytest.skip(ray_missing())
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()


def place_in_cache(folder: Path, cache: Path, repo_id: str, commit: str, refs: tuple[str, ...] = ("main",)) -> Path:
    """``folder`` as huggingface_hub's cache holds a download of ``repo_id`` at ``commit``: each file's
    bytes in blobs/ (named by their sha256, as LFS files are), snapshots/COMMIT/PATH a relative link
    to its blob, refs/REF the commit. -> the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    for f in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = f.relative_to(folder)
        blob = repo / "blobs" / hashlib.sha256(f.read_bytes()).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(f.read_bytes())
        link = snapshot / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo / "refs" / ref).parent.mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot
