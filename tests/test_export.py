"""ONNX export: graphs that onnxruntime runs to the same captions as PyTorch."""

import json

import pytest
import torch

pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from captionkit.cli.main import main  # noqa: E402
from captionkit.data.images import find_images  # noqa: E402
from captionkit.export.exporters import decoder_export, export_onnx  # noqa: E402
from captionkit.export.onnx_runtime import load_onnx_captioner, parity_check  # noqa: E402
from captionkit.inference.captioner import Captioner  # noqa: E402
from captionkit.kernels import EnergyContext, kernel_available, plain_pytorch  # noqa: E402


@pytest.fixture(scope="module")
def tiny_export(tiny_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("onnx")
    cap = Captioner.load(tiny_run / "best")
    export_onnx(cap, out, int8=True, model_name="tiny", log=lambda s: None)
    return cap, out


def test_plain_pytorch_switch_turns_the_kernel_off():
    proj = torch.randn(2, 5, 4)
    with plain_pytorch():
        assert not kernel_available()
        assert not EnergyContext(proj).fused
    assert EnergyContext(proj).fused == kernel_available()


def test_manifest_describes_graphs_vocab_and_preprocessing(tiny_export):
    cap, out = tiny_export
    m = json.loads((out / "manifest.json").read_text())
    assert m["format"] == "captionkit-onnx" and m["family"] == "sat"
    assert m["vocab"] == cap.vocab.words and m["special"] == {"pad": 0, "start": 1, "end": 2, "unk": 3}
    assert m["preprocess"]["size"] == cap.encoder.preprocess.size and m["preprocess"]["resample"] == "bicubic"
    assert m["state"] == ["h", "c"] and m["memory"] == ["feats", "proj"]
    assert m["step"]["inputs"] == ["tokens", "h", "c", "feats", "proj"]
    assert m["step"]["outputs"] == ["logprobs", "h_next", "c_next", "attention"]
    assert m["decoding"] == {"max_len": cap.max_len, "length_penalty": cap.length_penalty}
    for variant in ("float32", "int8"):
        for f in m["graphs"][variant].values():
            assert (out / f).is_file()


@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.slow  # decodes with ONNX Runtime and PyTorch
def test_onnx_captions_equal_pytorch(tiny_export, flickr_dir, beam):
    cap, out = tiny_export
    files = find_images([flickr_dir / "Flicker8k_Dataset"])
    rep = parity_check(cap, out, files, beam=beam)
    assert rep["images"] == len(files) and rep["identical"] == len(files), rep["differ"]
    assert rep["numeric"]["features"] < 1e-3 and rep["numeric"]["logprobs"] < 1e-3
    assert rep["numeric"]["attention"] < 1e-6  # the decoder's, from the same features (measured: 7e-9)
    # attention weights come through too. The ONNX encoder's features differ from PyTorch's by
    # float32 rounding (the check's image: 6.9e-5 at most, features up to 6), and the trained
    # tiny attention's scores amplify that: its weights (up to 0.12 over 49 locations) moved by
    # 4.5e-3, 65x the feature difference. Held to 150x this run's feature difference.
    onnx_cap = load_onnx_captioner(out)
    (_, res), = list(onnx_cap.caption_files(files[:1], beam=beam))
    (_, ref), = list(cap.caption_files(files[:1], beam=beam))
    atol = max(1e-4, 150 * rep["numeric"]["features"])
    assert res.words == ref.words and torch.allclose(res.attention, ref.attention, atol=atol)


@pytest.mark.slow  # quantises and runs the ONNX graphs
def test_int8_graphs_are_smaller_and_caption(tiny_export, flickr_dir):
    cap, out = tiny_export
    assert (out / "step.int8.onnx").stat().st_size < (out / "step.onnx").stat().st_size
    files = find_images([flickr_dir / "Flicker8k_Dataset"])[:4]
    rep = parity_check(cap, out, files, beam=2, variant="int8")
    assert rep["images"] == 4  # int8 may change words; it must run and give captions


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="cannot be exported"):
        decoder_export("no-such-family", torch.nn.Linear(1, 1))


@pytest.mark.slow  # exports and runs the ONNX graphs
def test_cli_export_with_check(tiny_run, flickr_dir, tmp_path, capsys):
    out = tmp_path / "exp"
    rc = main(["export", "onnx", "--model", str(tiny_run / "best"), "--out", str(out),
               "--check", str(flickr_dir / "Flicker8k_Dataset"), "--check-beam", "2"])
    text = capsys.readouterr().out
    assert rc == 0 and (out / "manifest.json").exists()
    assert "15 of 15 captions identical" in text
    # captionkit caption --onnx gives the PyTorch captions
    rc = main(["caption", str(flickr_dir / "Flicker8k_Dataset" / "img000.jpg"), "--onnx", str(out), "--beam", "2"])
    onnx_line = capsys.readouterr().out
    main(["caption", str(flickr_dir / "Flicker8k_Dataset" / "img000.jpg"), "--model", str(tiny_run / "best"),
          "--beam", "2"])
    assert rc == 0 and onnx_line == capsys.readouterr().out


def test_cli_export_bad_model(tmp_path, capsys):
    assert main(["export", "onnx", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 2
    assert "no such model folder" in capsys.readouterr().err


def test_cli_export_int8_adds_quantised_decoder_graphs(picky_models, tmp_path, capsys):
    """export onnx --int8: the manifest gains an int8 variant whose decoder graphs hold int8
    weights, and its parity is reported; without it, float32 graphs only."""
    import onnx
    a, _ = picky_models

    def int8_weights(path) -> int:
        return sum(t.data_type in (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)
                   for t in onnx.load(str(path)).graph.initializer)

    assert main(["export", "onnx", "--model", str(a), "--out", str(tmp_path / "plain")]) == 0
    assert "int8:" not in capsys.readouterr().out
    assert main(["export", "onnx", "--model", str(a), "--out", str(tmp_path / "q"), "--int8"]) == 0
    assert "int8: largest difference from PyTorch" in capsys.readouterr().out
    plain = json.loads((tmp_path / "plain" / "manifest.json").read_text())["graphs"]
    graphs = json.loads((tmp_path / "q" / "manifest.json").read_text())["graphs"]
    assert list(plain) == ["float32"] and list(graphs) == ["float32", "int8"]
    for g in ("init", "step"):
        assert int8_weights(tmp_path / "q" / graphs["float32"][g]) == 0
        assert int8_weights(tmp_path / "q" / graphs["int8"][g]) > 0
