"""Shared fixtures: a dataset of synthetic photos of coloured shapes in the Flickr8k layout, a tiny
training config on a random-weight encoder, a tiny model trained from it once per session, and tiny
pretrained models for the LM families. Plain helpers live in helpers.py."""

from __future__ import annotations

import os

# Under pytest-xdist (`make test` runs two workers), each worker takes its share of the cores
# for its thread pools and its child processes, set before torch is imported: two workers
# with a thread per core each would oversubscribe the cores, and OpenMP threads that wait on
# a descheduled peer run many times slower. An OMP_NUM_THREADS the user set is kept.
if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    _share = (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, _share))

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from helpers import (  # noqa: E402
    TINY_CONFIG,
    CudaView,
    hide_gpus,
    show_gpus,
    write_flickr8k,
    write_picky_decoder,
    write_picky_flickr8k,
    write_tiny_gpt2,
    write_tiny_lm,
    write_tiny_vit,
)


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    os.environ["CAPTIONKIT_CACHE"] = str(tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session", autouse=True)
def _cpu_unless_marked_cuda() -> CudaView:
    """Tests run on the CPU even on a GPU host: ``auto`` devices (the tiny configs' train.device,
    commands without --device, torchrun's children) resolve to the CPU, whose outputs the tests
    compare. Session-wide, so session fixtures (tiny_run...) train on the CPU too; tests marked
    ``cuda`` get the real GPUs back (:func:`_real_gpus_for_cuda_tests`). Yields the real view."""
    mp = pytest.MonkeyPatch()
    real = hide_gpus(mp)
    yield real
    mp.undo()


@pytest.fixture(autouse=True)
def _real_gpus_for_cuda_tests(request, monkeypatch, _cpu_unless_marked_cuda):
    if request.node.get_closest_marker("cuda"):
        show_gpus(monkeypatch, _cpu_unless_marked_cuda)


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
def sided(tmp_path_factory):
    """The shapes dataset, with one caption of every image naming a side (left, right, left, ...):
    train.flip's mirrored captions differ from the plain ones."""
    root = write_flickr8k(tmp_path_factory.mktemp("sided"))
    tokens = root / "Flickr8k.token.txt"
    lines = []
    for i, line in enumerate(tokens.read_text().splitlines()):
        key, text = line.split("\t")
        lines.append(f"{key}\t{text} on the {('left', 'right')[i // 5 % 2]}" if key.endswith("#4") else line)
    tokens.write_text("\n".join(lines) + "\n")
    return root


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
def tiny_matcher(flickr_dir, tmp_path_factory) -> Path:
    """An image-caption matcher checkpoint of the tiny config's encoder rows (efficientnet_lite0,
    random weights): train.scst_matcher's."""
    from captionkit.training.matcher import train_matcher

    out = tmp_path_factory.mktemp("tiny_matcher") / "m"
    train_matcher(str(flickr_dir), out, encoder="efficientnet_lite0", encoder_weights="random", epochs=2,
                  embed_dim=8, word_dim=4, min_count=1, bank_size=4, batch_size=4)
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
    return write_tiny_lm(tmp_path_factory.mktemp("tiny_lm"))


@pytest.fixture(scope="session")
def tiny_vit(tmp_path_factory) -> str:
    """A random 2-block ViT and its image processor (mean = std = 0.5, bilinear), as
    save_pretrained writes them."""
    pytest.importorskip("transformers")
    return write_tiny_vit(tmp_path_factory.mktemp("tiny_vit"))


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory) -> dict[str, str]:
    """Tiny random Hugging Face captioners (BLIP, GIT, VisionEncoderDecoderModel, Idefics3) with
    their processors, as save_pretrained writes them: {architecture: folder} (hf_tiny.py)."""
    pytest.importorskip("transformers")
    from hf_tiny import write_tiny_hf_models
    return write_tiny_hf_models(tmp_path_factory.mktemp("tiny_hf"))


@pytest.fixture(scope="session")
def tiny_gpt2(tmp_path_factory) -> str:
    """A random 2-block GPT-2 (without cross-attention, as a pretrained GPT-2 comes) and a
    GPT-2 tokenizer whose byte-level BPE is trained here on the shapes captions."""
    pytest.importorskip("transformers")
    return write_tiny_gpt2(tmp_path_factory.mktemp("tiny_gpt2"))
