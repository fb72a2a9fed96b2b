"""--device on the commands that run a model (docs/devices.md): on the CPU it gives exactly the
captions and features of the plain path; a device that is not here, or a misspelt one, is one
line before any model loads. The tests marked ``cuda`` run the same work on a GPU and compare
it with the CPU's; they are skipped where torch sees no GPU."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from captionkit.cli.main import main
from captionkit.data.images import load_rgb, to_tensor
from captionkit.encoders import create_encoder
from captionkit.encoders.features import build_features
from captionkit.inference.captioner import Captioner
from captionkit.inference.decoding import beam_search, greedy

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch sees none)")


def _images(flickr_dir):
    return sorted((flickr_dir / "Flicker8k_Dataset").glob("*.jpg"))


def _plain_captions(model: str, paths, beam: int) -> dict[str, str]:
    """The captions of the plain path: each image read in this process, one encoder batch, no
    DataLoader, the CPU (what `captionkit caption` computed before --device existed)."""
    cap = Captioner.load(model)
    feats = cap.encode_batch([to_tensor(load_rgb(p), cap.encoder.preprocess) for p in paths])
    return {p.name: cap.result(c).text for p, c in zip(paths, cap.decode_features(feats, beam))}


def _caption_json(tmp_path, name: str, argv: list[str]) -> dict[str, str]:
    out = tmp_path / name
    assert main(["caption", *argv, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_caption_on_cpu_is_the_plain_path(tiny_run, flickr_dir, tmp_path):
    model, paths = str(tiny_run / "best"), _images(flickr_dir)
    base = ["--model", model, "--beam", "2", "--batch-size", "4", *map(str, paths)]
    plain = _plain_captions(model, paths, beam=2)
    assert _caption_json(tmp_path, "none.json", base) == plain  # no flag (auto: the CPU here)
    assert _caption_json(tmp_path, "cpu.json", [*base, "--device", "cpu", "--workers", "0"]) == plain
    assert _caption_json(tmp_path, "w2.json", [*base, "--device", "cpu", "--precision", "fp32"]) == plain


def test_evaluate_on_cpu_gives_the_captions_of_no_flag(tiny_run, flickr_dir, tmp_path, capsys):
    def run(name: str, *extra: str) -> dict:
        out = tmp_path / name
        assert main(["evaluate", "--model", str(tiny_run / "best"), "--dataset", str(flickr_dir), "--split", "test",
                     "--beam", "2", "--metrics", "bleu", "--tokenizer", "python", "--out", str(out), *extra]) == 0
        return json.loads(out.read_text())

    default, cpu = run("a.json"), run("b.json", "--device", "cpu", "--workers", "0")
    assert default["captions"] and cpu["captions"] == default["captions"] and cpu["scores"] == default["scores"]


def test_features_on_cpu_are_the_plain_encoders(flickr_dir, tmp_path, monkeypatch):
    paths = _images(flickr_dir)

    def cached(name: str, *extra: str) -> np.ndarray:
        monkeypatch.setenv("CAPTIONKIT_CACHE", str(tmp_path / name))
        assert main(["features", "--dataset", str(flickr_dir), "--encoder", "patches", *extra]) == 0
        feats, = (tmp_path / name).rglob("feats.npy")
        return np.load(feats)

    default = cached("a")
    assert np.array_equal(cached("b", "--device", "cpu", "--workers", "0"), default)
    enc = create_encoder("patches")
    plain = enc.encode_batch([to_tensor(load_rgb(p), enc.preprocess) for p in paths]).numpy().astype(np.float16)
    assert np.array_equal(default, plain)


def test_feature_cache_of_a_cnn_is_the_same_in_worker_processes(flickr_dir, tmp_path):
    """Decoding in worker processes changes nothing: the rows equal the in-process ones."""
    paths = _images(flickr_dir)[:6]
    enc = create_encoder("efficientnet_lite0", weights="random")
    one = build_features(enc, paths, root=tmp_path / "a", batch_size=4, progress=False, workers=0)
    two = build_features(enc, paths, root=tmp_path / "b", batch_size=4, progress=False, workers=2)
    assert np.array_equal(np.asarray(one.feats), np.asarray(two.feats))


@pytest.mark.parametrize("argv", [
    ["caption", "x.jpg", "--device", "cuda"],
    ["caption", "x.jpg", "--device", "cuda:3", "--json", "out.json"],
    ["evaluate", "--dataset", "d", "--device", "cuda"],
    ["features", "--dataset", "d", "--device", "cuda"],
    ["zero-shot", "x.jpg", "--device", "cuda"],
])
def test_an_absent_gpu_is_one_line_before_any_model_loads(argv, no_expensive_work, monkeypatch, capsys):
    import captionkit.cli.caption
    import captionkit.cli.training
    import captionkit.inference.zero_shot

    def expensive(*a, **k):
        raise AssertionError("a model or dataset loaded before the device was checked")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(captionkit.cli.caption, "_load_dataset", expensive)  # evaluate's
    monkeypatch.setattr(captionkit.cli.training, "_load_dataset", expensive)  # features'
    monkeypatch.setattr(captionkit.inference.zero_shot.ZeroShotCaptioner, "load", expensive)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    device = argv[argv.index("--device") + 1]
    assert "\n" not in err and f"device '{device}'" in err and "no CUDA GPU" in err


def test_serve_refuses_an_absent_gpu_before_it_binds(monkeypatch, capsys):
    import captionkit.serve.net

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(captionkit.serve.net, "bind", lambda *a: pytest.fail("bound before the device was checked"))
    assert main(["serve", "--device", "cuda:0", "--port", "0"]) == 2
    assert "device 'cuda:0': no CUDA GPU" in capsys.readouterr().err


def test_fp16_is_refused_on_the_cpu(capsys):
    assert main(["caption", "x.jpg", "--device", "cpu", "--precision", "fp16"]) == 2
    assert "precision fp16 needs a CUDA device" in capsys.readouterr().err


# ---- on a GPU (skipped without one) -----------------------------------------------------------

@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("beam", [1, 3])
def test_decoding_on_cuda_matches_the_cpu(tiny_run, beam):
    """Greedy and beam search in float32 on the GPU: the CPU's words, log-probabilities close
    (float32 on both: the words' margins are far above float32 rounding, so the words are equal;
    the log-probabilities differ by the kernels' summation order)."""
    cpu = Captioner.load(tiny_run / "best", with_encoder=False, device="cpu", precision="fp32")
    gpu = Captioner.load(tiny_run / "best", with_encoder=False, device="cuda", precision="fp32")
    (H, W), D = cpu.grid, cpu.decoder.cfg.feat_dim
    feats = torch.randn(5, H * W, D, generator=torch.Generator().manual_seed(0))
    search = greedy if beam == 1 else (lambda m, f, n: beam_search(m, f, beam, n))
    on_cpu = search(cpu.decoder, feats, 12)
    with torch.no_grad():
        on_gpu = search(gpu.decoder, feats.cuda(), 12)
    assert [c.ids for c in on_gpu] == [c.ids for c in on_cpu]
    assert all(c.attention.device.type == "cpu" for c in on_gpu)  # Captions are CPU-side
    assert np.allclose([c.logprob for c in on_gpu], [c.logprob for c in on_cpu], atol=1e-3)


@pytest.mark.cuda
@needs_cuda
def test_caption_on_cuda_matches_the_cpu(tiny_run, flickr_dir, tmp_path):
    model, paths = str(tiny_run / "best"), _images(flickr_dir)
    base = ["--model", model, "--beam", "3", "--batch-size", "4", *map(str, paths)]
    # the CPU baseline in float32: "auto" is bf16 on CPUs that multiply it natively (AMX,
    # AVX512-BF16: most GPU servers), and bf16 is not bit-equal to anything
    cpu = _caption_json(tmp_path, "cpu.json", [*base, "--device", "cpu", "--precision", "fp32"])
    fp32 = _caption_json(tmp_path, "fp32.json", [*base, "--device", "cuda", "--precision", "fp32"])
    auto = _caption_json(tmp_path, "auto.json", [*base, "--device", "cuda"])  # bf16 autocast on Ampere+
    assert fp32 == cpu
    # bf16 rounds each matmul to 8 bits of mantissa: near-ties between words may flip, so at
    # least 80% of the captions are the float32 ones (a device bug garbles them all)
    assert auto.keys() == cpu.keys() and sum(auto[k] == cpu[k] for k in cpu) >= 0.8 * len(cpu)


@pytest.mark.cuda
@needs_cuda
def test_features_on_cuda_match_the_cpu(flickr_dir, tmp_path, monkeypatch):
    """Features in float32 on both, stored as float16. With cuDNN's TF32 off the GPU's are the
    CPU's to float16 rounding; as shipped (TF32 convolutions, 10-bit mantissas through ~20 layers)
    an H200's largest difference was 1.8% of the largest feature, the mean far below it."""
    paths = _images(flickr_dir)
    enc = create_encoder("efficientnet_lite0", weights="random")
    cpu = build_features(enc, paths, root=tmp_path / "cpu", progress=False)
    a = np.asarray(cpu.feats, dtype=np.float32)
    scale = np.abs(a).max()
    assert scale > 1.0  # features that see the photo (random_init), not a constant
    gpu = build_features(enc.to("cuda"), paths, root=tmp_path / "gpu", progress=False)
    b = np.asarray(gpu.feats, dtype=np.float32)
    diff = np.abs(a - b)
    assert diff.max() <= 5e-2 * scale and diff.mean() <= 1e-2 * np.abs(a).mean(), (diff.max(), diff.mean())
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    strict = build_features(enc, paths, root=tmp_path / "strict", progress=False)
    c = np.asarray(strict.feats, dtype=np.float32)
    assert np.abs(a - c).max() <= 4e-3 * scale  # float16's spacing near the largest feature: 2**-10


@pytest.mark.cuda
@needs_cuda
def test_shipped_default_captions_on_cuda_as_on_the_cpu(monkeypatch):
    """The shipped default (the ensemble: a transformer's key/value cache and masks, and an
    LSTM's state, on the GPU) in float32. With CUDA's TF32 off the GPU gives the CPU's captions
    and log-probabilities to float32 rounding; as shipped (fp32 = TF32 matmuls on CUDA,
    docs/devices.md) a caption may change only where two are nearly tied. On an H200: 4 of the
    5 samples' captions equal, chelsea.jpg's two at log-probabilities -6.4083 and -6.4049."""
    import contextlib
    from pathlib import Path

    from captionkit.core import precision

    photos = [str(p) for p in sorted((Path(__file__).resolve().parents[1] / "samples").glob("*.jpg"))]
    cpu = Captioner.load(device="cpu", precision="fp32")(photos, beam=3)  # (auto: bf16 on AMX/AVX512-BF16 CPUs)
    gpu = Captioner.load(device="cuda", precision="fp32")
    assert gpu.device.type == "cuda" and next(gpu.decoder.parameters()).is_cuda
    shipped = gpu(photos, beam=3)
    assert sum(a.text == b.text for a, b in zip(cpu, shipped)) >= len(photos) - 1
    for a, b in zip(cpu, shipped):  # a changed caption is a near tie, not a garbled one
        assert abs(a.logprob - b.logprob) < (1e-2 if a.text == b.text else 5e-2), (a.text, b.text)
    monkeypatch.setattr(precision, "tf32_matmuls", contextlib.nullcontext)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    strict = gpu(photos, beam=3)
    assert [r.text for r in strict] == [r.text for r in cpu]
    assert max(abs(a.logprob - b.logprob) for a, b in zip(cpu, strict)) < 1e-4


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("controls", [
    ["--sample", "--seed", "7", "--temperature", "0.8", "--top-p", "0.9", "--num-captions", "3"],
    ["--beam", "3", "--no-repeat-ngram", "2", "--repetition-penalty", "1.3", "--min-words", "4"],
    ["--beam", "3", "--num-captions", "3", "--beam-groups", "3", "--diversity-strength", "0.7"],
    ["--beam", "3", "--rare-word-bonus", "0.8", "--no-repeat-ngram", "2", "--repetition-penalty", "1.2"],
], ids=["sampling", "blocking", "diverse-beam", "rare-word-bonus"])
def test_caption_controls_on_cuda_match_the_cpu(tiny_run, flickr_dir, tmp_path, controls):
    """The caption controls (docs/decoding-controls.md) keep their state on the decoding device:
    a sampling seed's noise is a hash, not a generator's state, so the GPU draws the CPU's words."""
    model, paths = str(tiny_run / "best"), _images(flickr_dir)
    base = ["--model", model, "--batch-size", "4", "--precision", "fp32", *controls, *map(str, paths)]
    cpu = _caption_json(tmp_path, "cpu.json", [*base, "--device", "cpu"])
    gpu = _caption_json(tmp_path, "gpu.json", [*base, "--device", "cuda"])
    assert gpu == cpu and len(cpu) == len(paths)


@pytest.mark.cuda
@needs_cuda
def test_captioning_on_cuda_stays_in_one_process(tiny_run, flickr_dir, tmp_path, capsys):
    """--processes auto is one process on a GPU (the device is one, fed by one process), with
    batches enough for several on this machine's CPU; a count above one is refused in one line."""
    import shutil

    from captionkit.inference.processes import auto_processes

    model, many = str(tiny_run / "best"), []
    for k in range(4):  # distinct files: batches of 1 enough for several CPU processes
        for p in _images(flickr_dir):
            many.append(str(shutil.copy(p, tmp_path / f"{k}_{p.name}")))
    assert auto_processes("cpu", max(2, torch.get_num_threads()), len(many), 1) > 1
    assert main(["caption", "--model", model, "--batch-size", "1", "--device", "cuda", *many,
                 "--json", str(tmp_path / "a.json")]) == 0
    assert "processes" not in capsys.readouterr().err
    assert len(json.loads((tmp_path / "a.json").read_text())) == len(many)
    assert main(["caption", "--model", model, "--device", "cuda", "--processes", "2", *many]) == 2
    assert "--processes 2 splits the work of a CPU" in capsys.readouterr().err
