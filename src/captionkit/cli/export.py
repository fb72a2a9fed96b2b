"""The export commands: export onnx (graphs, a manifest and the parity check), export hf (a Hugging
Face transformers folder) and merge-lora, export hf's old name; each one's options beside its code."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..inference.shipped import FAST_MODEL, single_models
from .argtypes import positive_int
from .common import UsageError, _add_overwrite


def add_export(sub: argparse._SubParsersAction) -> None:
    xs = sub.add_parser("export", help="export a model for other runtimes: onnx, hf (Hugging Face transformers)")
    xf = xs.add_subparsers(dest="subcommand", required=True, metavar="FORMAT")
    _add_export_onnx(xf)
    _add_export_hf(xf)


def _check_onnx_export(model: str | None, out: str, web: bool, check: list[str] | None,
                       overwrite: bool) -> tuple[str, list[Path]]:
    """export onnx's inputs and target, refused before torch is imported and the model loads;
    -> the model to export (--model, or the fast single model: the default captioner is an
    ensemble) and the --check photos."""
    from ..core.outputs import check_folder_target
    from ..data.images import scan_images
    from ..export.checks import check_onnx_extra, web_demo_source
    from ..inference.shipped import existing_model_folder, is_ensemble

    check_onnx_extra("ONNX export")
    check_folder_target(out, overwrite=overwrite, kinds=("onnx",))
    model = model or FAST_MODEL.name
    if is_ensemble(existing_model_folder(model)):
        raise UsageError(f"{model}: is an ensemble; ONNX export takes one model: export a member")
    if web:
        web_demo_source()
    scan = scan_images(check or [])
    if scan.refused:
        first = scan.refused[0]
        raise UsageError(f"--check: {first.path}: {first.reason}")
    if check and not scan.images:
        raise UsageError(f"no image files found in {' '.join(check)}")
    return model, scan.images


def _print_parity(rep: dict, variant: str, check_beam: int) -> None:
    num = rep["numeric"]
    print(f"{variant}: largest difference from PyTorch on a test input: features {num['features']:.2e}, "
          f"log-probabilities {num['logprobs']:.2e}, attention {num['attention']:.2e}")
    if rep["images"]:
        print(f"{variant}: {rep['identical']} of {rep['images']} captions identical to PyTorch's "
              f"(beam {check_beam})")
        for d in rep["differ"][:5]:
            print(f"  {d['image']}: pytorch {d['pytorch']!r} / onnx {d['onnx']!r}")


def _add_export_onnx(xf: argparse._SubParsersAction) -> None:
    x = xf.add_parser("onnx", help="ONNX graphs and a manifest, for onnxruntime and the in-browser demo")
    x.set_defaults(func=cmd_export_onnx)
    x.add_argument("--model", help=f"checkpoint folder, or a shipped single model by name: {', '.join(single_models())} "
                                   f"(default {FAST_MODEL.name}; export takes one model, not an ensemble)")
    x.add_argument("--out", required=True, help="folder for manifest.json and the graphs")
    x.add_argument("--int8", action="store_true", help="also write dynamically int8-quantised decoder graphs")
    x.add_argument("--int8-encoder", action="store_true", help="quantise the encoder's convolutions too")
    x.add_argument("--check", nargs="+", metavar="PATH",
                   help="photos or folders to caption with PyTorch and onnxruntime and compare")
    x.add_argument("--check-beam", type=positive_int, default=3, help="beam width of the --check captions")
    x.add_argument("--web", action="store_true", help="copy the in-browser demo page into OUT (its onnxruntime-web "
                                                      "files come from `make web` in a clone of the repository)")
    _add_overwrite(x, "replace OUT if it is an ONNX export captionkit wrote")


def cmd_export_onnx(model: str | None, out: str, int8: bool, int8_encoder: bool,
                    check: list[str] | None, check_beam: int, web: bool, overwrite: bool) -> int:
    model, files = _check_onnx_export(model, out, web, check, overwrite)  # before torch
    from ..export.exporters import export_onnx
    from ..export.onnx_runtime import parity_check
    from ..inference.captioner import Captioner

    cap = Captioner.load(model, device="cpu")  # traced and parity-checked on the CPU, as onnxruntime runs
    manifest = export_onnx(cap, out, int8=int8 or int8_encoder, int8_encoder=int8_encoder,
                           model_name=Path(model).name, overwrite=overwrite, web=web)
    print(f"wrote {manifest.parent}: " + ", ".join(
        f"{p.name} {p.stat().st_size / 1e6:.1f} MB" for p in sorted(manifest.parent.glob("*.onnx"))))
    if web:
        print(f"in-browser demo: serve {out} with any static file server and open index.html")
    for variant in ["float32"] + (["int8"] if int8 or int8_encoder else []):
        _print_parity(parity_check(cap, out, files, beam=check_beam, variant=variant), variant, check_beam)
    return 0


def _add_export_hf_opts(p: argparse.ArgumentParser) -> None:
    """The options of export hf and of merge-lora, its old name."""
    p.add_argument("--model", required=True, help="a prefix_lm, vit_gpt2 or hf_* checkpoint folder")
    p.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    _add_overwrite(p, "replace OUT if it is a transformers export captionkit wrote")


def _add_export_hf(xf: argparse._SubParsersAction) -> None:
    h = xf.add_parser("hf", help="a plain Hugging Face transformers folder (prefix_lm: its LM with LoRA merged; "
                      "vit_gpt2: a VisionEncoderDecoderModel; hf_*: the fine-tuned model, LoRA merged, with its "
                      "processor)")
    h.set_defaults(func=cmd_export_hf)
    _add_export_hf_opts(h)


def add_merge_lora(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("merge-lora", help="the old name of export hf: a prefix_lm model's LM with LoRA merged")
    m.set_defaults(func=cmd_export_hf)
    _add_export_hf_opts(m)


def cmd_export_hf(model: str, out: str, overwrite: bool) -> int:
    """A checkpoint as a plain Hugging Face transformers folder (captionkit.export.exporters.export_transformers);
    ``captionkit merge-lora`` is its old name."""
    from ..core.outputs import check_folder_target

    check_folder_target(out, overwrite=overwrite, kinds=("transformers",))  # before torch is imported
    from ..export.exporters import export_transformers

    folder = export_transformers(model, out, overwrite=overwrite)
    print(f"wrote {folder} (a transformers folder)"
          + (f" and {folder / 'captioner'} (a captionkit checkpoint captioning with it)"
             if (folder / "captioner").is_dir() else ""))
    return 0
