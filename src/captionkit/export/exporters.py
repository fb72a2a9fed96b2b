"""Exports of a trained captioner for other runtimes: ONNX (:func:`export_onnx`) and plain
Hugging Face ``transformers`` folders (:func:`export_transformers`). What is family-specific
comes from the exporter each family registers (``@register_exporter("onnx", family)`` in
:mod:`captionkit.core.registry`); nothing here knows a family.

ONNX: the encoder as one graph, the decoder as two (``init``: the per-image memory and the
first recurrent state; ``step``: one word), plus a ``manifest.json`` with the vocabulary, the
preprocessing and the decoding settings.

The step graph follows the decoder step contract with tensors only::

    init:  feats (B, L, D)                          -> *memory, *state
    step:  tokens (B,) int64, *state, feats, *memory -> logprobs (B, V), *state_next, attention (B, L)

Every state and memory tensor is batch-first, so a runtime (``captionkit.export.onnx_runtime``, the
browser demo's ``decode.js``) can run greedy and beam search for any family by reordering rows,
without knowing what the tensors mean: an LSTM's ``h``/``c``, or a transformer's key/value
cache. A family plugs in by registering ``fn(decoder) -> DecoderExport``
(:class:`~captionkit.models.base.DecoderExport`).

transformers: a family registers ``fn(model, checkpoint, out) ->``
:class:`~captionkit.models.base.TransformersExport`; see :func:`export_transformers`.

Needs the ``onnx`` extra (onnx, onnxscript, onnxruntime) for ONNX, the family's extra for
transformers; nothing here is imported by the rest of the library.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..core.checkpoint import ENCODER_PREFIX, CheckpointError, atomic_folder, read_weights, save_checkpoint
from ..core.errors import UserError
from ..core.outputs import ONNX_FORMAT, check_folder_target
from ..core.registry import EXPORTERS, list_exporters
from ..data.vocab import Vocab
from ..inference.captioner import Captioner
from ..kernels import plain_pytorch
from ..models.base import DecoderExport
from .checks import check_onnx_extra, web_demo_source

FORMAT = ONNX_FORMAT
VERSION = 1
GRAPHS = ("encoder", "init", "step")


def decoder_export(family: str, decoder: nn.Module) -> DecoderExport:
    """The ONNX export spec of a decoder, from its family's registered exporter."""
    if family not in EXPORTERS["onnx"]:
        raise UserError(f"model family {family!r} cannot be exported to ONNX yet "
                         f"(exportable: {', '.join(list_exporters('onnx'))})")
    return EXPORTERS["onnx"].get(family)(decoder)


# ---- ONNX ----------------------------------------------------------------------------------------
class _EncoderGraph(nn.Module):
    def __init__(self, encoder):
        super().__init__()
        self.encoder = encoder

    def forward(self, image):
        return self.encoder(image)


def _onnx_export(module: nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str],
                 dynamic: dict[str, dict[int, str]]) -> None:
    """One graph, float32, the batch (and any other named axis) dynamic, weights inside the file."""
    import warnings
    module = module.eval().float()
    with torch.no_grad(), plain_pytorch(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # The TorchScript-based exporter: fast, and every op here (convolutions, matmuls,
        # tanh/sigmoid, softmax, gathers) maps one-to-one onto ONNX opset 17.
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes=dynamic, opset_version=17, dynamo=False, do_constant_folding=True)


def export_onnx(captioner, out: str | Path, int8: bool = False, int8_encoder: bool = False,
                model_name: str | None = None, log: Callable[[str], None] = print,
                overwrite: bool = False, web: bool = False) -> Path:
    """Write ``manifest.json``, ``encoder.onnx``, ``init.onnx``, ``step.onnx`` (and the
    ``*.int8.onnx`` graphs with ``int8``; the in-browser demo page with ``web``) to the folder
    ``out``; returns the manifest path. ``out`` must be missing or empty, or with ``overwrite``
    an ONNX export captionkit wrote (captionkit.core.outputs); it is written atomically and marked."""
    check_onnx_extra("ONNX export")  # one line before any work
    out = check_folder_target(out, overwrite=overwrite, kinds=("onnx",))
    if web:
        web_demo_source()
    if captioner.encoder is None:
        raise ValueError("the captioner was loaded without its encoder")
    with atomic_folder(out, kind="onnx", replace=overwrite) as tmp:
        _write_onnx(captioner, tmp, int8, int8_encoder, model_name, log)
        if web:
            copy_web_demo(tmp)
    return out / "manifest.json"


def _write_onnx(captioner, out: Path, int8: bool, int8_encoder: bool, model_name: str | None,
                log: Callable[[str], None]) -> None:
    import onnx

    cfg = captioner.config
    spec = decoder_export(cfg["family"], captioner.decoder)
    enc, pre = captioner.encoder, captioner.encoder.preprocess
    S, B = pre.size, 2
    image = torch.zeros(B, 3, S, S)
    with torch.no_grad():
        feats = enc(image).float()
        init_out = spec.init.eval()(feats)
    n_mem = len(spec.memory)
    memory, state = list(init_out[:n_mem]), list(init_out[n_mem:])
    tokens = torch.full((B,), Vocab.start, dtype=torch.long)
    batch = {0: "batch"}
    t0 = time.perf_counter()
    _onnx_export(_EncoderGraph(enc), (image,), out / "encoder.onnx", ["image"], ["feats"],
                 {"image": batch, "feats": batch})
    init_outputs = spec.memory + spec.state
    _onnx_export(spec.init, (feats,), out / "init.onnx", ["feats"], init_outputs,
                 {"feats": batch, **{n: batch for n in init_outputs}})
    step_inputs = ["tokens", *spec.state, "feats", *spec.memory]
    step_outputs = ["logprobs", *(f"{n}_next" for n in spec.state), "attention"]
    _onnx_export(spec.step, (tokens, *state, feats, *memory), out / "step.onnx", step_inputs, step_outputs,
                 {n: batch for n in step_inputs + step_outputs})
    # the exporter drops inputs a graph never reads (a transformer's step reads the cross-
    # attention keys/values, not feats): runtimes feed what the graph has, as the manifest says
    read = {i.name for i in onnx.load(str(out / "step.onnx"), load_external_data=False).graph.input}
    step_inputs = [n for n in step_inputs if n in read]
    log(f"exported encoder, init and step graphs in {time.perf_counter() - t0:.1f} s")
    graphs = {"float32": {g: f"{g}.onnx" for g in GRAPHS}}
    if int8:
        graphs["int8"] = quantize_int8(out, encoder=int8_encoder, log=log)
    manifest = {
        "format": FORMAT, "version": VERSION,
        "model": model_name or "model",
        "family": cfg["family"],
        # the browser demo reads "vocab" (word vocabularies); runtimes in Python read "tokenizer"
        "vocab": list(captioner.vocab.words) if captioner.vocab.kind == "word" else None,
        "tokenizer": captioner.vocab.to_json(),
        "special": {"pad": Vocab.pad, "start": Vocab.start, "end": Vocab.end, "unk": Vocab.unk},
        "preprocess": {**asdict(pre), "layout": "NCHW", "scale": 1 / 255,
                       "formula": "(rgb / 255 - mean) / std, after resizing to size x size"},
        "grid": list(captioner.grid),
        "feat_dim": int(feats.shape[2]),
        "decoding": {"max_len": captioner.max_len, "length_penalty": captioner.length_penalty},
        "attention_view": captioner.decoder.attention_view,
        "graphs": graphs,
        "init": {"inputs": ["feats"], "outputs": init_outputs},
        "step": {"inputs": step_inputs, "outputs": step_outputs},
        "state": spec.state,
        "memory": [n for n in ("feats", *spec.memory) if n in read],
        "config": {k: cfg[k] for k in ("family", "model", "encoder", "decoding") if k in cfg},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


# ---- transformers -------------------------------------------------------------------------------
def export_transformers(checkpoint: str | Path, out: str | Path, overwrite: bool = False) -> Path:
    """Write a checkpoint as a plain transformers folder ``out`` through its family's registered
    exporter (prefix_lm: its LM with LoRA merged, and in ``out/captioner`` a captionkit
    checkpoint that captions with it; vit_gpt2: the VisionEncoderDecoderModel). ``out`` must be
    missing or empty, or with ``overwrite`` a transformers export captionkit wrote
    (captionkit.core.outputs). Atomic: written under a temporary name, then renamed. -> the folder."""
    out = check_folder_target(out, overwrite=overwrite, kinds=("transformers",)).resolve()
    cap = Captioner.load(checkpoint, with_encoder=False, device="cpu")  # exported from CPU tensors
    cfg = cap.config
    if cfg["family"] not in EXPORTERS["transformers"]:
        raise CheckpointError(f"{checkpoint}: a {cfg['family']} model; transformers exports exist for "
                              f"{', '.join(list_exporters('transformers'))}")
    spec = EXPORTERS["transformers"].get(cfg["family"])(cap.decoder, str(checkpoint), out)
    encoder = {k: v for k, v in read_weights(checkpoint).items() if k.startswith(ENCODER_PREFIX)}
    with atomic_folder(out, kind="transformers", replace=overwrite) as tmp:
        spec.save(tmp)
        if spec.weights is not None:  # a captionkit checkpoint that loads from the exported folder
            captioner = dict(cfg, model=dict(cfg["model"], **(spec.model_changes or {})),
                             vocab=dict(cfg["vocab"], **(spec.vocab_changes or {})),
                             exported_from=str(Path(checkpoint).resolve()))
            captioner.pop("optimizer_groups", None)
            save_checkpoint(tmp / "captioner", {**spec.weights, **encoder}, captioner)
    return out


def quantize_int8(out: Path, encoder: bool = False, log: Callable[[str], None] = print) -> dict[str, str]:
    """Dynamic int8 quantisation (int8 weights; activations quantised on the fly) of the decoder
    graphs' matrix products -> ``init.int8.onnx``, ``step.int8.onnx``. The encoder's
    convolutions are quantised too (per channel) only with ``encoder=True``: onnxruntime's
    ConvInteger is slower than its float convolutions on CPU and costs more accuracy."""
    import logging

    from onnxruntime.quantization import QuantType, quantize_dynamic

    files = {"encoder": "encoder.onnx"}
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # onnxruntime logs a generic "consider pre-processing" warning
    try:
        for g in GRAPHS:
            if g == "encoder" and not encoder:
                continue
            src, dst = out / f"{g}.onnx", out / f"{g}.int8.onnx"
            quantize_dynamic(str(src), str(dst), weight_type=QuantType.QInt8, per_channel=g == "encoder",
                             op_types_to_quantize=["Conv"] if g == "encoder" else ["MatMul", "Gemm"])
            files[g] = dst.name
            log(f"int8 {g}: {src.stat().st_size / 1e6:.1f} MB -> {dst.stat().st_size / 1e6:.1f} MB")
    finally:
        root.setLevel(level)
    return files


def copy_web_demo(out: str | Path) -> None:
    """Copy the in-browser demo page next to the exported graphs (open ``out/index.html``
    from any static file server)."""
    src = web_demo_source()
    out = Path(out)
    for item in ("index.html", "js", "css", "vendor"):
        s = src / item
        if s.is_dir():
            shutil.copytree(s, out / item, dirs_exist_ok=True)
        else:
            shutil.copy2(s, out / item)
