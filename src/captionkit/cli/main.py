"""The ``captionkit`` command line: it parses and calls the library. Each subcommand is a small
typed function ``cmd_NAME``, bound to its parser by ``set_defaults(func=...)``. A user's mistake
(:class:`captionkit.core.errors.UserError`) is printed as one line naming the file or field; any other
exception is an internal error and keeps its traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..core.errors import ImageError, UserError, WeightsUnavailable
from ..inference.shipped import FAST_MODEL, list_shipped_models, shipped_models_text
from ..inference.zero_shot import DEFAULT_VLM, DTYPES
from .argtypes import device_name, float_at_least, int_at_least, positive_floats, positive_int


class UsageError(UserError):
    """Options that do not fit together, or a value the parser cannot check alone."""


DEFAULT_NBEST = 5  # beams --rerank mbr chooses among when --nbest is not given


def _write_json(path: str | Path, obj) -> None:
    from ..core.outputs import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=1, ensure_ascii=False))


def _caption_writer(command: str, paths: list[str], settings: dict, **outputs):
    """The writer both captioning commands share (captionkit.inference.writer.CaptionWriter): every output
    target checked and the images found before the model loads."""
    from ..inference.writer import CaptionWriter

    if outputs.get("retry_failed") and not (outputs.get("jsonl") or outputs.get("csv_out")):
        raise UsageError("--retry-failed retries the images a --jsonl or --csv file lists as failed: give one")
    writer = CaptionWriter(command, paths, settings, **outputs)
    if not writer.total:
        raise UsageError(f"no image files found in {' '.join(paths)}")
    return writer


def _model_setting(model: str | None) -> str:
    """A checkpoint as recorded beside resumable outputs: a shipped model by its name, any
    other folder by its absolute path (so `runs/x` and `./runs/x/` compare equal)."""
    from ..inference.captioner import SHIPPED, model_folder

    folder = model_folder(model)
    return folder.name if folder.parent == SHIPPED else str(folder.resolve())


def _models_setting(models: list[str] | None, weights: list[float] | None):
    """One model as before (a name or path); an ensemble as the list of its members and weights."""
    if not models or len(models) == 1:
        return _model_setting(models[0] if models else None)
    return {"members": [_model_setting(m) for m in models], "weights": weights}


def _check_models(models: list[str] | None, weights: list[float] | None, rerank: str | None = None,
                  nbest: int | None = None, candidates: str | None = None) -> None:
    """--model/--weights/--rerank/--nbest that do not fit together, refused before anything loads."""
    if weights and len(weights) != len(models or []):
        raise UsageError(f"--weights gives {len(weights)} weights for {len(models or [])} --model: "
                         f"give one per model (ensembles: several --model)")
    if nbest and not (rerank or candidates):
        raise UsageError("--nbest is the number of beams --rerank mbr chooses among, or --candidates "
                         "writes: give one of them")
    if candidates and not (rerank or nbest):
        raise UsageError("--candidates writes the n best beams: give --nbest N (or --rerank mbr)")


def _device(device: str, precision: str = "auto"):
    """--device and --precision -> (torch.device, resolved precision), or one line naming the
    device that is not here: called before anything loads (captionkit.core.devices)."""
    from ..core.devices import resolve_device
    from ..core.precision import resolve_precision

    where = resolve_device(device)
    return where, resolve_precision(precision, where)


def _load_captioner(models: list[str] | None, weights: list[float] | None, tta: str | None = None,
                    device=None, precision: str = "auto"):
    """One --model (or the default), or an ensemble of several (captionkit.inference.ensemble), on
    ``device`` (None: the CPU); ``tta``: --tta (None: none, or what an ensemble folder says)."""
    from ..inference.captioner import Captioner

    place = {"tta": tta, "device": device or "cpu", "precision": precision}
    if models and len(models) > 1:
        return Captioner.load_ensemble(models, weights, **place)
    return Captioner.load(models[0] if models else None, **place)


def _nbest(rerank: str | None, nbest: int | None) -> int | None:
    """The n-best size to decode: --nbest, or the default one for --rerank."""
    return nbest or (DEFAULT_NBEST if rerank else None)


def _check_caption_sources(model: list[str] | None, onnx: str | None, weights: list[float] | None,
                           rerank: str | None, nbest: int | None, candidates: str | None,
                           tta: str | None = None) -> None:
    """caption's model options that do not fit together, refused before anything loads."""
    if onnx and model:
        raise UsageError("give either --model or --onnx")
    if onnx and tta:
        raise UsageError("--tta needs a PyTorch model (--model), not --onnx")
    _check_models(model, weights, rerank, nbest, candidates)
    if onnx and (rerank or nbest):
        raise UsageError("--rerank, --nbest and --candidates need a PyTorch model (--model), not --onnx")


def _caption_settings(model: list[str] | None, weights: list[float] | None, onnx: str | None, beam: int,
                      length_penalty: float | None, rerank: str | None, nbest: int | None,
                      tta: str | None = None) -> dict:
    """What decides caption's captions, recorded beside resumable outputs (captionkit.inference.writer)."""
    settings = {"model": None if onnx else _models_setting(model, weights),
                "onnx": str(Path(onnx).resolve()) if onnx else None,
                "beam": beam, "length_penalty": length_penalty}
    if rerank or nbest:  # recorded only when used: other runs' settings stay as they were
        settings.update(rerank=rerank, nbest=_nbest(rerank, nbest))
    if tta:  # likewise
        settings.update(tta=tta)
    return settings


def _caption_with_candidates(writer, cap, candidates: Path | None, **options) -> int:
    """Run the writer on a PyTorch captioner; with ``candidates``, also write each image's
    n best beams there ({key: [caption, ...]}) at the end."""
    lists: dict[str, list[str]] = {}

    def results(files: list[Path]):
        for path, res in cap.caption_files(files, **options):
            if not isinstance(res, ImageError) and res.candidates is not None:
                lists[writer.keys[path]] = res.candidates
            yield path, res

    code = writer.run(results)
    if candidates:
        _write_json(candidates, lists)
    return code


def _listed_paths(listing: str | None) -> list[str]:
    """The image paths of a --paths-from file: one a line; blank lines and # comments skipped."""
    if not listing:
        return []
    try:
        text = Path(listing).read_text(encoding="utf-8", errors="surrogateescape")
    except OSError as e:
        raise UsageError(f"{listing}: cannot read the list of images ({e.strerror})") from None
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def _check_ray_caption(out: str | None, **unsupported) -> None:
    """--engine ray's one-line refusals, before anything is read or loaded."""
    from ..inference.ray_engine import ray_missing

    if not out:
        raise UsageError("--engine ray writes its shards beside a --jsonl or --csv file: give one")
    given = [name for name, value in unsupported.items() if value]
    if given:
        raise UsageError(f"--engine ray does not support --{given[0]}; use the local engine for it")
    if ray_missing():
        raise UsageError(ray_missing())


def _ray_options(address: str | None, replicas: int, gpus_per_replica: float, batch_size: int,
                 shard_size: int | None):
    from ..inference.ray_engine import DEFAULT_SHARD_SIZE, RayOptions

    return RayOptions(address=address, cpus=None if address else os.cpu_count(), replicas=replicas,
                      gpus_per_replica=gpus_per_replica, batch_size=batch_size,
                      shard_size=shard_size or DEFAULT_SHARD_SIZE)


def _caption_ray(writer, model: list[str] | None, weights: list[float] | None, beam: int,
                 length_penalty: float | None, overwrite: bool, retry_failed: bool, out: str, opts) -> int:
    """caption --engine ray: the images not yet in OUT captioned by Ray (captionkit.inference.ray_engine),
    in shards kept in OUT.shards, and written by the same writer as the local engine's."""
    from functools import partial

    from ..inference import ray_engine

    folder = ray_engine.caption_shards_folder(out)
    shard_settings = {**writer.settings, "shard_size": opts.shard_size}
    ray_engine.check_caption_shards(folder, shard_settings, overwrite)
    preprocess = _load_captioner(model, weights).encoder.preprocess  # decode tasks need it; ~1 s
    readable = [p for p in writer.keys if p not in writer.refused]
    load = partial(_load_captioner, model, weights)
    return writer.run(lambda todo: ray_engine.caption_with_ray(
        readable, todo, folder, shard_settings, overwrite, retry_failed, load, preprocess, beam, length_penalty,
        opts))


def cmd_caption(paths: list[str], model: list[str] | None, beam: int, json_out: str | None,
                attention: str | None, batch_size: int, length_penalty: float | None,
                jsonl: str | None = None, csv_out: str | None = None, workers: int = 2,
                onnx: str | None = None, overwrite: bool = False, retry_failed: bool = False,
                verbose: bool = False, weights: list[float] | None = None, rerank: str | None = None,
                nbest: int | None = None, candidates: str | None = None, engine: str = "local",
                address: str | None = None, replicas: int = 1, shard_size: int | None = None,
                gpus_per_replica: float = 0, paths_from: str | None = None, tta: str | None = None,
                device: str = "auto", precision: str = "auto") -> int:
    from ..core.outputs import check_file_target

    paths = [*paths, *_listed_paths(paths_from)]
    if not paths:
        raise UsageError("give image files or folders to caption, or --paths-from FILE")
    if engine == "ray":
        _check_ray_caption(jsonl or csv_out, onnx=onnx, attention=attention, rerank=rerank, nbest=nbest,
                           candidates=candidates, tta=tta)
    _check_caption_sources(model, onnx, weights, rerank, nbest, candidates, tta)
    if onnx and (device not in ("auto", "cpu") or precision != "auto"):
        raise UsageError("--device and --precision apply to PyTorch models; --onnx runs on onnxruntime's CPU")
    where, precision = _device("cpu" if onnx else device, precision)
    settings = _caption_settings(model, weights, onnx, beam, length_penalty, rerank, nbest, tta)
    candidates_path = check_file_target(candidates, overwrite=overwrite) if candidates else None
    writer = _caption_writer("caption", paths, settings, json_out=json_out, jsonl=jsonl, csv_out=csv_out,
                             attention=attention, overwrite=overwrite, retry_failed=retry_failed, verbose=verbose)
    if engine == "ray":
        return _caption_ray(writer, model, weights, beam, length_penalty, overwrite, retry_failed, jsonl or csv_out,
                            _ray_options(address, replicas, gpus_per_replica, batch_size, shard_size))
    options = {"beam": beam, "batch_size": batch_size, "length_penalty": length_penalty, "workers": workers}
    if onnx:
        from ..export.onnx_runtime import load_onnx_captioner
        cap = load_onnx_captioner(onnx)
        return writer.run(lambda files: cap.caption_files(files, **options))
    return _caption_with_candidates(writer, _load_captioner(model, weights, tta, where, precision), candidates_path,
                                    nbest=_nbest(rerank, nbest), rerank=rerank, **options)


def cmd_ensemble(model: list[str], weights: list[float] | None, length_penalty: float | None, combine: str,
                 out: str, overwrite: bool, tta: str | None = None) -> int:
    """Write an ensemble folder (captionkit.inference.ensemble) naming the members, after loading them
    together once, so a folder that is written is one that loads."""
    from ..core.outputs import check_folder_target
    from ..inference.captioner import SHIPPED, Captioner
    from ..inference.ensemble import KIND, member_entry, write_ensemble

    _check_models(model, weights)
    target = check_folder_target(out, overwrite=overwrite, kinds=(KIND,))
    cap = Captioner.load_ensemble(model, weights, length_penalty=length_penalty, combine=combine, with_encoder=False)
    members = [member_entry(Path(p), target, SHIPPED) for p in cap.config["ensemble"]["members"]]
    path = write_ensemble(target, members, cap.decoder.weights, cap.length_penalty, cap.max_len, combine, tta)
    print(f"wrote {path}: {len(members)} members, weights "
          + ", ".join(f"{w:.3g}" for w in cap.decoder.weights) + f", length penalty {cap.length_penalty:g}"
          + (f", test-time {tta}" if tta else ""))
    return 0


def cmd_rerank(candidates: list[str], json_out: str | None, overwrite: bool) -> int:
    from ..inference.rerank import rerank_files

    chosen = rerank_files(candidates, json_out, overwrite)
    if not json_out:
        for k, c in chosen.items():
            print(f"{k}\t{c}")
    return 0


def _check_onnx_export(model: str | None, out: str, web: bool, check: list[str] | None,
                       overwrite: bool) -> tuple[str, list[Path]]:
    """export onnx's inputs and target, refused before the model loads; -> the model to export
    (--model, or the fast single model: the default captioner is an ensemble) and the --check
    photos."""
    from ..core.outputs import check_folder_target
    from ..data.images import find_images
    from ..export.exporters import web_demo_source
    from ..inference.captioner import model_folder
    from ..inference.ensemble import is_ensemble_folder

    model = model or FAST_MODEL.name
    if is_ensemble_folder(model_folder(model)):
        raise UsageError(f"{model}: is an ensemble; ONNX export takes one model: export a member")
    check_folder_target(out, overwrite=overwrite, kinds=("onnx",))
    if web:
        try:
            web_demo_source()
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None
    files = find_images(check) if check else []
    if check and not files:
        raise UsageError(f"no image files found in {' '.join(check)}")
    return model, files


def _print_parity(rep: dict, variant: str, check_beam: int) -> None:
    num = rep["numeric"]
    print(f"{variant}: largest difference from PyTorch on a test input: features {num['features']:.2e}, "
          f"log-probabilities {num['logprobs']:.2e}, attention {num['attention']:.2e}")
    if rep["images"]:
        print(f"{variant}: {rep['identical']} of {rep['images']} captions identical to PyTorch's "
              f"(beam {check_beam})")
        for d in rep["differ"][:5]:
            print(f"  {d['image']}: pytorch {d['pytorch']!r} / onnx {d['onnx']!r}")


def cmd_export_onnx(model: str | None, out: str, int8: bool, int8_encoder: bool,
                    check: list[str] | None, check_beam: int, web: bool, overwrite: bool) -> int:
    try:
        from ..export.exporters import export_onnx
        from ..export.onnx_runtime import parity_check
    except ImportError as e:
        raise UsageError(f"ONNX export needs the onnx extra: pip install 'captionkit[onnx]' ({e})") from None
    from ..inference.captioner import Captioner

    model, files = _check_onnx_export(model, out, web, check, overwrite)
    cap = Captioner.load(model)
    manifest = export_onnx(cap, out, int8=int8 or int8_encoder, int8_encoder=int8_encoder,
                           model_name=Path(model).name, overwrite=overwrite, web=web)
    print(f"wrote {manifest.parent}: " + ", ".join(
        f"{p.name} {p.stat().st_size / 1e6:.1f} MB" for p in sorted(manifest.parent.glob("*.onnx"))))
    if web:
        print(f"in-browser demo: serve {out} with any static file server and open index.html")
    for variant in ["float32"] + (["int8"] if int8 or int8_encoder else []):
        _print_parity(parity_check(cap, out, files, beam=check_beam, variant=variant), variant, check_beam)
    return 0


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


def _check_serve_limits(port: int, **limits: float | None) -> None:
    """serve's numeric options, each positive when given (by its option name in the message)."""
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {port}")
    for name, value in limits.items():
        if value is not None and not value > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {value:g}")


def _serve_api_key(api_key: str | None) -> str | None:
    """--api-key, or $CAPTIONKIT_API_KEY when it is not given; printable ASCII without spaces."""
    import re

    if api_key is None:
        api_key = os.environ.get("CAPTIONKIT_API_KEY")
    if api_key is not None and not re.fullmatch(r"[!-~]+", api_key):
        raise UsageError("--api-key (or CAPTIONKIT_API_KEY) must be printable ASCII without spaces, and not empty")
    return api_key


def _listen(host: str, port: int, api_key: str | None):
    """The server's listening socket; a warning on stderr when it is reachable without a key."""
    from ..serve.net import bind, exposure_warning

    try:
        sock = bind(host, port)
    except OSError as e:
        raise UsageError(f"cannot listen on --host {host} --port {port}: {e.strerror or e}") from None
    warning = exposure_warning(sock, api_key)
    if warning:
        print(f"captionkit serve: {warning}", file=sys.stderr)
    return sock


def cmd_serve(model: list[str] | None, host: str, port: int, max_upload_mb: float, queue_size: int,
              max_batch: int, threads: int | None, onnx: str | None, api_key: str | None = None,
              rate_limit: float | None = None, max_pixels: int | None = None, decode_workers: int = 2,
              decode_memory_mb: float = 512, decode_queue: int = 16, max_connections: int = 100,
              header_timeout: float = 10.0, body_timeout: float = 30.0, device: str = "auto",
              precision: str = "auto") -> int:
    _check_serve_limits(port, max_upload_mb=max_upload_mb, queue_size=queue_size, max_batch=max_batch,
                        threads=threads, rate_limit=rate_limit, max_pixels=max_pixels, decode_workers=decode_workers,
                        decode_memory_mb=decode_memory_mb, decode_queue=decode_queue, max_connections=max_connections,
                        header_timeout=header_timeout, body_timeout=body_timeout)
    api_key = _serve_api_key(api_key)
    if onnx and not (Path(onnx) / "manifest.json").exists():
        raise UsageError(f"{onnx}: no manifest.json (make one with captionkit export onnx --out {onnx})")
    where, precision = _device(device, precision)
    sock = _listen(host, port, api_key)  # before anything heavy: a bad --host or --port fails at once
    try:
        from ..serve.app import ServeConfig, serve
    except ImportError as e:
        sock.close()
        raise UsageError(f"the server needs the serve extra: pip install 'captionkit[serve]' ({e})") from None
    limits = {"max_pixels": max_pixels} if max_pixels is not None else {}
    cfg = ServeConfig(max_upload_bytes=int(max_upload_mb * 2 ** 20), queue_size=queue_size,
                      max_batch=max_batch, onnx_dir=onnx, api_key=api_key, rate_limit=rate_limit,
                      decode_workers=decode_workers, max_decode_bytes=int(decode_memory_mb * 2 ** 20),
                      decode_queue=decode_queue, max_connections=max_connections,
                      header_timeout=header_timeout, body_timeout=body_timeout, **limits)
    serve(model, sock, cfg, threads=threads, device=where, precision=precision)
    return 0


def _load_dataset(dataset: str, images: str | None, image_column: str, title_column: str, image_suffix: str):
    from ..data.datasets import load_dataset
    return load_dataset(dataset, images, image_column, title_column, image_suffix)


def _check_targets(*paths: str | None, overwrite: bool) -> None:
    """The files a scoring command will write: refused now, before any work, if they exist
    (without --overwrite) or cannot be written (see captionkit.core.outputs)."""
    from ..core.outputs import check_file_target

    given = [p for p in paths if p]
    for p in given:
        check_file_target(p, overwrite=overwrite)
    if len({Path(p).resolve() for p in given}) < len(given):
        raise UsageError(f"{given[0]}: given for two outputs; choose a file for each")


def _caption_split(cap, items: list, split: str, **options) -> dict[str, str]:
    """{image name: caption} of a dataset split; one line if any of its images cannot be read."""
    captions, failed = {}, []
    for path, res in cap.caption_files([it.path for it in items], **options):
        if isinstance(res, ImageError):
            failed.append(str(res))
        else:
            captions[path.name] = res.text
    if failed:
        raise UsageError(f"{len(failed)} {split} images could not be read, e.g. {failed[0]}")
    return captions


def cmd_evaluate(model: list[str] | None, dataset: str, images: str | None, split: str, beam: int,
                 out: str | None, batch_size: int, length_penalty: float | None,
                 tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str,
                 image_column: str, title_column: str, image_suffix: str, overwrite: bool = False,
                 weights: list[float] | None = None, rerank: str | None = None, nbest: int | None = None,
                 tta: str | None = None, device: str = "auto", precision: str = "auto", workers: int = 2) -> int:
    _check_targets(out, overwrite=overwrite)  # before torch, the dataset and the model load
    from ..scoring.evaluation import score_captions

    _check_models(model, weights, rerank, nbest)
    where, precision = _device(device, precision)
    items = _load_dataset(dataset, images, image_column, title_column, image_suffix).split(split)
    cap = _load_captioner(model, weights, tta, where, precision)
    captions = _caption_split(cap, items, split, beam=beam, batch_size=batch_size, length_penalty=length_penalty,
                              nbest=_nbest(rerank, nbest), rerank=rerank, workers=workers)
    rep = score_captions(captions, {it.name: it.raw for it in items}, source="the model's captions",
                         refs_source=f"{dataset} ({split} split)",
                         **_score_opts(tokenizer, meteor, no_brevity_penalty, metrics))
    lp = cap.length_penalty_or(length_penalty)
    mbr = _nbest(rerank, nbest)
    print(f"{split} split, {len(items)} images, beam {beam}, length penalty {lp:g}"
          + (f", MBR over the {mbr} best beams" if mbr else "") + (f", test-time {cap.tta}" if cap.tta else ""))
    _print_report(rep)
    if out:
        _write_json(out, {"model": _models_setting(model, weights), "dataset": dataset, "split": split,
                          "beam": beam, "length_penalty": lp, "mbr_nbest": mbr, "tta": cap.tta, "scale": "x100",
                          "scores": {k: round(100 * v, 4) for k, v in rep.scores.items()},
                          "implementation": rep.implementation, "tokenizer": rep.tokenizer,
                          "empty_captions": len(rep.empty), "notes": rep.notes, "captions": captions})
    return 0


def _print_report(rep, ci: dict | None = None) -> None:
    print(f"tokenisation: {rep.tokenizer}; scores x100")
    for k, v in rep.scores.items():
        interval = f"  [{100 * ci[k][0]:.2f}, {100 * ci[k][1]:.2f}] 95% CI" if ci and k in ci else ""
        print(f"  {k:8s} {100 * v:6.2f}{interval}   {rep.implementation[k]}")
    for note in rep.notes:
        print(f"note: {note}")


def _score_opts(tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str) -> dict:
    return {"tokenizer": tokenizer, "meteor": meteor, "brevity_penalty": not no_brevity_penalty,
            "metrics": [m.strip() for m in metrics.split(",") if m.strip()]}


def _check_score_inputs(captions: str | None, compare: list[str] | None, per_image: str | None,
                        refs: str | None, dataset: str | None, bootstrap: int) -> None:
    """score's options that do not fit together, refused before anything is read or scored."""
    if compare and captions:
        raise UsageError("give either --captions or --compare A.json B.json")
    if not compare and not captions:
        raise UsageError("give --captions C.json (or --compare A.json B.json)")
    if compare and per_image:
        raise UsageError("--per-image writes one system's scores: use it with --captions, not --compare")
    if refs and dataset:
        raise UsageError("give the references once: --refs R.json or --dataset D --split S")
    if not refs and not dataset:
        raise UsageError("give the references: --refs R.json or --dataset D --split S")
    if bootstrap < 0:
        raise UsageError(f"--bootstrap must be 0 (no intervals) or a number of resamples, got {bootstrap}")


def _references(refs: str | None, dataset: str | None, images: str | None, split: str, image_column: str,
                title_column: str, image_suffix: str) -> tuple[dict, str]:
    """{image: [reference, ...]} from --refs or a --dataset split, and where they came from."""
    if refs:
        from ..scoring.score_inputs import read_references
        return read_references(refs), refs
    items = _load_dataset(dataset, images, image_column, title_column, image_suffix).split(split)
    return {it.name: it.raw for it in items}, f"{dataset} ({split} split)"


def cmd_score(captions: str | None, refs: str | None, dataset: str | None, images: str | None, split: str,
              out: str | None, per_image: str | None, bootstrap: int, compare: list[str] | None,
              tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str, seed: int,
              image_column: str, title_column: str, image_suffix: str, overwrite: bool = False) -> int:
    _check_score_inputs(captions, compare, per_image, refs, dataset, bootstrap)
    _check_targets(out, per_image, overwrite=overwrite)
    ref, refs_source = _references(refs, dataset, images, split, image_column, title_column, image_suffix)
    opts = {**_score_opts(tokenizer, meteor, no_brevity_penalty, metrics), "refs_source": refs_source}
    if compare:
        return _score_compare(compare, ref, opts, bootstrap or 1000, seed, out)
    return _score_one(captions, ref, opts, bootstrap, seed, out, per_image)


def _score_compare(compare: list[str], ref: dict, opts: dict, rounds: int, seed: int, out: str | None) -> int:
    """score --compare A B: a paired bootstrap test of two systems on the same references."""
    from ..scoring.evaluation import paired_bootstrap, score_captions
    from ..scoring.score_inputs import read_captions

    systems = [read_captions(path) for path in compare]  # both files checked before scoring either
    reps = [score_captions(c, ref, source=path, **opts) for c, path in zip(systems, compare)]
    result = paired_bootstrap(reps[0], reps[1], rounds=rounds, seed=seed)
    print(f"A = {compare[0]}, B = {compare[1]}: {len(ref)} images, paired bootstrap, {rounds} resamples; x100")
    for k, r in result.items():
        verdict = ("A beats B" if r["p_A_not_better"] < 0.05 else
                   "B beats A" if r["p_B_not_better"] < 0.05 else "no significant difference")
        p = min(r["p_A_not_better"], r["p_B_not_better"])
        print(f"  {k:8s} A {100 * r['A']:6.2f}  B {100 * r['B']:6.2f}  delta {100 * r['delta']:+6.2f}  "
              f"p = {p:.4f}  {verdict}")
    for name, rep in zip("AB", reps):
        for note in rep.notes:
            print(f"note: {name}: {note}")
    if out:
        _write_json(out, {k: {**{x: round(100 * r[x], 4) for x in ("A", "B", "delta")},
                              "p_A_not_better": r["p_A_not_better"], "p_B_not_better": r["p_B_not_better"]}
                          for k, r in result.items()})
    return 0


def _score_one(captions: str, ref: dict, opts: dict, bootstrap: int, seed: int, out: str | None,
               per_image: str | None) -> int:
    """score --captions C: one system's scores, with bootstrap intervals when asked."""
    from ..scoring.evaluation import bootstrap as run_bootstrap
    from ..scoring.evaluation import score_captions
    from ..scoring.score_inputs import read_captions

    cand = read_captions(captions)
    rep = score_captions(cand, ref, source=captions, **opts)
    ci = run_bootstrap(rep, rounds=bootstrap, seed=seed) if bootstrap else None
    print(f"{len(cand)} images" + (f", bootstrap {bootstrap} resamples" if bootstrap else ""))
    _print_report(rep, ci)
    if out:
        doc = {k: round(100 * v, 4) for k, v in rep.scores.items()}
        if ci:
            doc["ci95"] = {k: [round(100 * lo, 4), round(100 * hi, 4)] for k, (lo, hi) in ci.items()}
        _write_json(out, {**doc, "implementation": rep.implementation, "tokenizer": rep.tokenizer,
                          "empty_captions": len(rep.empty), "notes": rep.notes})
    if per_image:
        _write_per_image(per_image, rep, cand)
    return 0


def _write_per_image(path: str, rep, cand: dict) -> None:
    import csv
    import io

    from ..core.outputs import atomic_write_text
    from ..scoring.metrics import bleu_from_sums
    cols = {}
    if rep.bleu is not None:
        b = bleu_from_sums(rep.bleu.testlen, rep.bleu.reflen, rep.bleu.correct, rep.bleu.guess,
                           brevity_penalty=rep.bleu_brevity_penalty)
        cols["Bleu_4"] = [row[3] for row in b]
    cols.update({k: v.tolist() for k, v in rep.per_image.items()})
    buf = io.StringIO()
    w = csv.writer(buf)
    w.writerow(["image", "caption", *cols])
    for i, img in enumerate(rep.images):
        w.writerow([img, cand[img], *(f"{100 * cols[c][i]:.4f}" for c in cols)])
    atomic_write_text(path, buf.getvalue())


def cmd_train(config: str, out: str | None, max_steps: int | None, resume: bool, init: str | None,
              overwrite: bool, tensorboard: str | None = None, device: str | None = None, nproc: int = 1) -> int:
    if nproc > 1:  # the same command in nproc processes under torchrun (DDP); see docs/distributed-training.md
        from ..training.distributed import launch
        from ..training.run import check_run
        check_run(config, out, max_steps, resume, init, overwrite, device)  # one line here, not one per process
        flags = {"--out": out, "--max-steps": max_steps, "--init": init, "--tensorboard": tensorboard, "--device": device}
        args = ["train", "--config", config, *[x for k, v in flags.items() if v is not None for x in (k, str(v))]]
        return launch(nproc, args + ["--resume"] * resume + ["--overwrite"] * overwrite)
    from ..training.run import train
    train(config, out=out, max_steps=max_steps, resume=resume, init=init, overwrite=overwrite,
          tensorboard=tensorboard, device=device)
    return 0


def cmd_features(dataset: str, images: str | None, encoder: str,
                 image_column: str, title_column: str, image_suffix: str, engine: str = "local",
                 address: str | None = None, replicas: int = 1, shard_size: int | None = None,
                 gpus_per_replica: float = 0, batch_size: int = 16, flip: bool = False, device: str = "auto",
                 workers: int = 2) -> int:
    from ..core.outputs import check_writable_folder
    from ..encoders import create_encoder, list_encoders
    from ..encoders.features import build_features, default_cache_root

    if encoder not in list_encoders():
        raise UsageError(f"--encoder: unknown encoder {encoder!r}; known: {', '.join(list_encoders())}")
    where, _ = _device(device)
    check_writable_folder(default_cache_root())
    if engine == "ray":
        from ..inference.ray_engine import build_features_ray, ray_missing
        if flip:
            raise UsageError("--engine ray does not support --flip; use the local engine for it")
        if ray_missing():
            raise UsageError(ray_missing())
    ds = _load_dataset(dataset, images, image_column, title_column, image_suffix)
    paths = [it.path for it in ds.all_items()]
    if engine == "ray":
        opts = _ray_options(address, replicas, gpus_per_replica, batch_size, shard_size)
        store = build_features_ray(encoder, None, paths, None, opts)
    else:
        store = build_features(create_encoder(encoder).to(where), paths, workers=workers, flip=flip)
    print(f"{len(store.index)} images, grid {store.grid}: {store.folder}")
    return 0


def cmd_pack(checkpoint: str, out: str, fp16: bool, overwrite: bool, int8: bool = False) -> int:
    from ..core.checkpoint import pack_checkpoint

    if fp16 and int8:
        raise UsageError("give --fp16 or --int8, not both")
    size = pack_checkpoint(checkpoint, out, fp16=fp16, int8=int8, overwrite=overwrite)
    print(f"wrote {out} ({size / 1e6:.1f} MB)")
    return 0


def cmd_models() -> int:
    """The shipped models, one line each: name, family, encoder (read from their config.json)."""
    from ..inference.shipped import describe_shipped_model

    for name in list_shipped_models():
        print(describe_shipped_model(name))
    return 0


def cmd_zero_shot(paths: list[str], model: str, prompts: str | None, template: str | None,
                  json_out: str | None, batch_size: int, max_new_tokens: int, download: bool, dtype: str,
                  jsonl: str | None = None, csv_out: str | None = None, overwrite: bool = False,
                  retry_failed: bool = False, verbose: bool = False, device: str = "auto") -> int:
    from ..inference.zero_shot import ZeroShotCaptioner, load_prompts

    where, _ = _device(device)
    prompt = load_prompts(prompts).get(template)
    settings = {"model": str(Path(model).resolve()) if Path(model).is_dir() else model, "prompt": prompt,
                "max_new_tokens": max_new_tokens, "dtype": dtype}
    writer = _caption_writer("zero-shot", paths, settings, json_out=json_out, jsonl=jsonl, csv_out=csv_out,
                             overwrite=overwrite, retry_failed=retry_failed, verbose=verbose)
    cap = ZeroShotCaptioner.load(model, download=download, dtype=dtype, device=where)

    def answers(files: list[Path]):
        for path, res in cap.caption_files(files, prompt, batch_size=batch_size, max_new_tokens=max_new_tokens):
            if not isinstance(res, ImageError) and not res.text:
                print(f"warning: {writer.keys[path]}: nothing left of the answer {res.raw!r} after cleaning",
                      file=sys.stderr)
            yield path, res

    return writer.run(answers)


def _add_engine_opts(p: argparse.ArgumentParser) -> None:
    """--engine ray and its options (captionkit.inference.ray_engine; docs/scale.md)."""
    p.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local: this process; ray: Ray Data tasks and model replicas, shards resumable")
    p.add_argument("--address", help="ray: a running Ray cluster (default: a local Ray on this machine's CPUs)")
    p.add_argument("--replicas", type=positive_int, default=1, help="ray: model replicas (actors), one CPU each")
    p.add_argument("--gpus-per-replica", type=float_at_least(0), default=0,
                   help="ray: GPUs each replica holds (e.g. 1, or 0.5 for two replicas a GPU; default 0: CPU)")
    p.add_argument("--shard-size", type=positive_int, help="ray: images per output shard (default 1000)")


def _add_caption_outputs(p: argparse.ArgumentParser) -> None:
    """The outputs of caption and zero-shot (one writer, captionkit.inference.writer; docs/captioning.md)."""
    p.add_argument("--json", dest="json_out", metavar="OUT", help="write {filename: caption} here")
    p.add_argument("--jsonl", metavar="OUT", help="append one JSON line per image here; resumes: images "
                   "already in OUT are skipped (unreadable ones are listed with an \"error\")")
    p.add_argument("--csv", dest="csv_out", metavar="OUT", help="the same as CSV (image,caption,error)")
    _add_overwrite(p, "replace existing outputs (a --jsonl/--csv file is started again instead of resumed)")
    p.add_argument("--retry-failed", action="store_true",
                   help="caption again the images a --jsonl/--csv file lists with an error")
    p.add_argument("--verbose", action="store_true", help="name every file skipped in the given folders")


def cmd_sweep(config: str, sets: list[str] | None, out: str, metric: str | None, engine: str,
              random: int | None, seed: int, cpus: int, cpus_per_trial: float, address: str | None,
              grace_epochs: int) -> int:
    from ..experiments.sweep import define, format_table, ray_missing, run_local, run_ray

    if engine == "ray" and ray_missing():
        raise UsageError(ray_missing())
    if cpus < 1 or cpus_per_trial <= 0 or grace_epochs < 1:
        raise UsageError("--cpus, --cpus-per-trial and --grace-epochs must be positive")
    sweep = define(config, sets or [], out, metric=metric, random_count=random, seed=seed, engine=engine)
    print(f"{out}: {len(sweep.trials)} trials, {len(sweep.todo())} to run ({engine}); metric {sweep.metric}",
          file=sys.stderr)
    if engine == "local":
        rows = run_local(sweep)
    else:
        rows = run_ray(sweep, cpus=cpus, cpus_per_trial=cpus_per_trial, address=address, grace_epochs=grace_epochs)
    print(format_table(rows))
    print(f"summary: {Path(out) / 'summary.csv'}, {Path(out) / 'summary.json'} (scores x100)", file=sys.stderr)
    return 0


def cmd_plot(runs: list[str], out: str, metrics: str | None, x: str, data: str | None, overwrite: bool) -> int:
    from ..core.outputs import atomic_write_bytes, atomic_write_text, check_file_target
    from ..experiments.plot import curve_series, default_metrics, draw_curves
    from ..experiments.runs import find_runs

    target = check_file_target(out, overwrite=overwrite)
    data_target = check_file_target(data, overwrite=overwrite) if data else None
    found = find_runs(runs)
    names = [m.strip() for m in metrics.split(",") if m.strip()] if metrics else default_metrics(found)
    series = curve_series(found, names, x)
    atomic_write_bytes(target, draw_curves(series))
    if data_target:
        atomic_write_text(data_target, json.dumps(series, indent=1))
    print(f"wrote {out}: {len(series['panels'])} panels ({', '.join(names)}), {len(found)} runs")
    return 0


def cmd_report(runs: list[str], out: str, split: str, images: int, beam: int, bootstrap: int, seed: int,
               overwrite: bool, tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str,
               data: str | None = None, max_images: int = 0) -> int:
    from ..core.outputs import atomic_write_text, check_file_target
    from ..experiments.report import build_report, report_data
    from ..experiments.runs import find_runs

    if images < 0 or bootstrap < 0 or max_images < 0:
        raise UsageError("--images, --max-images and --bootstrap must be >= 0")
    target = check_file_target(out, overwrite=overwrite)
    data_target = check_file_target(data, overwrite=overwrite) if data else None
    found = find_runs(runs)
    page, results = build_report(found, split=split, images=images, beam=beam, rounds=bootstrap, seed=seed,
                                 score_opts=_score_opts(tokenizer, meteor, no_brevity_penalty, metrics),
                                 progress=lambda line: print(line, file=sys.stderr, flush=True),
                                 max_images=max_images)
    atomic_write_text(target, page)
    if data_target:
        atomic_write_text(data_target, json.dumps(report_data(results, split, beam, bootstrap), indent=1))
    print(f"wrote {out} ({len(page.encode()) / 1e6:.1f} MB): {len(found)} runs, {images} images")
    return 0


def _add_csv_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--image-column", default="Image_Name", help="a CSV dataset's column of image names")
    p.add_argument("--title-column", default="Title", help="a CSV dataset's column of titles")
    p.add_argument("--image-suffix", default=".jpg", help="appended to a CSV's image names to name the files")


def _add_score_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", choices=("auto", "java", "python"), default="auto",
                   help="PTB tokenisation by the Java jar or the Python re-implementation (auto: Java if present)")
    p.add_argument("--meteor", choices=("auto", "jar", "nltk", "none"), default="auto",
                   help="METEOR 1.5 jar (Java) or nltk's approximation (auto: the jar if Java is present)")
    p.add_argument("--no-brevity-penalty", action="store_true",
                   help="BLEU without the brevity penalty, as the Show, Attend and Tell paper reports")
    p.add_argument("--metrics", default="bleu,meteor,rouge,cider",
                   help="comma-separated: bleu, meteor, rouge, cider, spice")


def _add_overwrite(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help=f"{what} (a folder captionkit did not write is never replaced; see docs/outputs.md)")


def _add_export_hf_opts(p: argparse.ArgumentParser) -> None:
    """The options of export hf and of merge-lora, its old name."""
    p.add_argument("--model", required=True, help="a prefix_lm or vit_gpt2 checkpoint folder")
    p.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    _add_overwrite(p, "replace OUT if it is a transformers export captionkit wrote")


def _add_ensemble_opts(p: argparse.ArgumentParser) -> None:
    """Ensembles and consensus reranking (docs/ensembles.md), for caption and evaluate."""
    p.add_argument("--weights", type=positive_floats, metavar="W1,W2,..",
                   help="the ensemble members' weights, one per --model (default: equal)")
    p.add_argument("--rerank", choices=("mbr",),
                   help="mbr: choose each caption among the best beams by consensus (expected CIDEr-D)")
    p.add_argument("--nbest", type=int_at_least(2), metavar="N",
                   help=f"beams --rerank mbr chooses among (default {DEFAULT_NBEST}; the beam widens to N)")
    _add_tta_opt(p)


def _add_tta_opt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tta", choices=("flip", "none"),  # captionkit.inference.ensemble.TTA and TTA_OFF, without torch
                   help="test-time augmentation: flip decodes each photo and its mirror image as one ensemble "
                        "(a second encoder pass); none: no augmentation, even where an ensemble folder asks "
                        "for one (default: none, or what an ensemble folder says)")


def _add_device_opts(p: argparse.ArgumentParser, workers: bool = False, precision: bool = True) -> None:
    """Where a command computes (docs/devices.md): spelling checked here, presence before any model loads."""
    from ..core.devices import DEVICE_HELP
    from ..core.precision import PRECISIONS

    p.add_argument("--device", type=device_name, default="auto", help=f"where the model runs: {DEVICE_HELP}")
    if precision:
        p.add_argument("--precision", choices=PRECISIONS, default="auto",
                       help="float format of the model's matmuls (auto: bf16 on a GPU that has it and on a CPU "
                            "that multiplies it natively, else fp32; fp16: CUDA only)")
    if workers:
        p.add_argument("--workers", type=int_at_least(0), default=2,
                       help="processes decoding images ahead of a GPU (0: in this process); "
                            "threads on the CPU")


def _add_candidates_opt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--candidates", metavar="OUT",
                   help="also write each image's --nbest best beams here as {image: [caption, ...]}, "
                        "input for captionkit rerank (the images captioned in this run; written at the end)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="captionkit", description="Image captioning: caption, train, evaluate.")
    p.add_argument("--version", action="version", version=f"%(prog)s {package_version()}",
                   help="print captionkit's version and exit")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("caption", help="caption image files or folders (docs/captioning.md)")
    c.set_defaults(func=cmd_caption)
    c.add_argument("paths", nargs="*", metavar="PATH",
                   help="image files, or folders to caption every image in (or none, with --paths-from)")
    c.add_argument("--paths-from", metavar="FILE", help="also caption the images this file lists, one path a line")
    c.add_argument("--model", action="append",
                   help=f"checkpoint or ensemble folder, or a shipped model by name: {shipped_models_text()}; "
                        "repeat for an ensemble (docs/ensembles.md)")
    _add_ensemble_opts(c)
    _add_candidates_opt(c)
    c.add_argument("--beam", type=positive_int, default=3, help="beam width (1: greedy; default 3)")
    c.add_argument("--attention", metavar="DIR", help="write one attention figure per image here (x.jpg -> DIR/x.jpg.png)")
    c.add_argument("--batch-size", type=positive_int, default=16, help="images captioned together (default 16)")
    c.add_argument("--length-penalty", type=float_at_least(0), default=None,
                   help="rank beams by logprob / (words + 1) ** this (0: plain sum; default: the model's)")
    c.add_argument("--onnx", metavar="DIR", help="caption with an ONNX export (captionkit export onnx) instead")
    _add_device_opts(c, workers=True)
    _add_caption_outputs(c)
    _add_engine_opts(c)

    e = sub.add_parser("evaluate", help="caption a dataset split and score it (coco-caption scorers)")
    e.set_defaults(func=cmd_evaluate)
    e.add_argument("--model", action="append", help="as caption's --model; repeat for an ensemble")
    _add_ensemble_opts(e)
    e.add_argument("--dataset", required=True, help="a Flickr8k or Kaggle folder, a Karpathy or COCO JSON file, or a title CSV")
    e.add_argument("--images", help="image folder of a JSON or CSV dataset")
    e.add_argument("--split", default="test", help="the split to caption and score (default test)")
    e.add_argument("--beam", type=positive_int, default=3, help="beam width (1: greedy; default 3)")
    e.add_argument("--out", help="write scores and every caption to this JSON")
    e.add_argument("--batch-size", type=int, default=16, help="images captioned together (default 16)")
    e.add_argument("--length-penalty", type=float, default=None,
                   help="rank beams by logprob / (words + 1) ** this (0: plain sum; default: the model's)")
    _add_overwrite(e, "replace the --out file if it exists")
    _add_device_opts(e, workers=True)
    _add_score_opts(e)
    _add_csv_opts(e)

    s = sub.add_parser("score", help="score a {image: caption} JSON against references")
    s.set_defaults(func=cmd_score)
    s.add_argument("--captions", help="{image: caption} JSON (or coco-caption's [{\"image_id\": ..., \"caption\": ...}] list)")
    s.add_argument("--refs", help="{image: [reference, ...]} JSON")
    s.add_argument("--dataset", help="take the references from this dataset instead")
    s.add_argument("--images", help="image folder of a JSON or CSV --dataset")
    s.add_argument("--split", default="test", help="the --dataset split whose references to use (default test)")
    s.add_argument("--json", dest="out", help="write the scores (x100) here")
    s.add_argument("--per-image", help="write every image's caption and scores to this CSV")
    s.add_argument("--bootstrap", type=int, default=0, metavar="N", help="95%% intervals from N resamples")
    s.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="paired bootstrap test: does system A beat system B?")
    s.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling")
    _add_overwrite(s, "replace the --json and --per-image files if they exist")
    _add_score_opts(s)
    _add_csv_opts(s)

    t = sub.add_parser("train", help="train a decoder from a TOML config")
    t.set_defaults(func=cmd_train)
    t.add_argument("--config", required=True, help="the run's TOML config (configs/ has examples)")
    t.add_argument("--out", help="run folder (default runs/<config name>); a new run needs a new or empty one")
    t.add_argument("--max-steps", type=positive_int, help="stop after this many optimizer steps (a quick check)")
    t.add_argument("--resume", action="store_true", help="continue the run in OUT from OUT/last")
    t.add_argument("--init", metavar="DIR", help="start from this checkpoint (replaces the config's train.init)")
    _add_overwrite(t, "start the run in OUT again, replacing the run captionkit wrote there")
    t.add_argument("--tensorboard", metavar="DIR",
                   help="write TensorBoard event files here (replaces the config's train.tensorboard)")
    t.add_argument("--device", type=device_name,
                   help="auto (a GPU when there is one), cpu, cuda, cuda:N or mps (replaces the config's train.device)")
    t.add_argument("--nproc", type=positive_int, default=1,
                   help="train with DDP in this many processes on this machine (torchrun's launcher; "
                        "see docs/distributed-training.md)")

    f = sub.add_parser("features", help="compute and cache a dataset's encoder features")
    f.set_defaults(func=cmd_features)
    f.add_argument("--dataset", required=True, help="a Flickr8k or Kaggle folder, a Karpathy or COCO JSON file, or a title CSV")
    f.add_argument("--images", help="image folder of a JSON or CSV dataset")
    f.add_argument("--encoder", default="efficientnet_lite2", help="the image encoder (default efficientnet_lite2)")
    f.add_argument("--flip", action="store_true",
                   help="cache the mirror images' features instead (for --tta flip experiments; docs/ensembles.md)")
    _add_device_opts(f, workers=True, precision=False)
    _add_csv_opts(f)
    _add_engine_opts(f)
    f.add_argument("--batch-size", type=positive_int, default=16, help="ray: images per model call")

    k = sub.add_parser("pack", help="copy a checkpoint without optimizer state, for shipping")
    k.set_defaults(func=cmd_pack)
    k.add_argument("checkpoint", help="the checkpoint folder to copy (e.g. runs/NAME/best)")
    k.add_argument("out", help="the folder to write")
    k.add_argument("--fp16", action="store_true", help="store the decoder's weights in float16 (half the size)")
    k.add_argument("--int8", action="store_true",
                   help="the decoder's matrices as int8 with one scale per row (a quarter of float32's size)")
    _add_overwrite(k, "replace OUT if it is a checkpoint captionkit wrote")

    m = sub.add_parser("merge-lora", help="the old name of export hf: a prefix_lm model's LM with LoRA merged")
    m.set_defaults(func=cmd_export_hf)
    _add_export_hf_opts(m)

    z = sub.add_parser("zero-shot", help="caption photos with an instruction-tuned vision-language model")
    z.set_defaults(func=cmd_zero_shot)
    z.add_argument("paths", nargs="+", metavar="PATH", help="image files, or folders to caption every image in")
    z.add_argument("--model", default=DEFAULT_VLM,
                   help=f"a transformers model: Hub name or folder (default {DEFAULT_VLM})")
    z.add_argument("--prompts",
                   help="TOML file of prompt templates (default: the shipped captionkit/inference/vlm_prompts.toml)")
    z.add_argument("--template", help="the template to use (default: the file's default)")
    z.add_argument("--batch-size", type=positive_int, default=4, help="images answered together (default 4)")
    z.add_argument("--max-new-tokens", type=positive_int, default=32, help="the longest answer, in the model's tokens")
    z.add_argument("--download", action="store_true",
                   help="fetch the weights from the Hugging Face Hub when they are not in its cache")
    z.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="auto: the checkpoint's own (bfloat16 for Qwen2.5-VL)")
    _add_device_opts(z, precision=False)
    _add_caption_outputs(z)

    xs = sub.add_parser("export", help="export a model for other runtimes: onnx, hf (Hugging Face transformers)")
    xf = xs.add_subparsers(dest="subcommand", required=True, metavar="FORMAT")
    x = xf.add_parser("onnx", help="ONNX graphs and a manifest, for onnxruntime and the in-browser demo")
    x.set_defaults(func=cmd_export_onnx)
    x.add_argument("--model", help=f"checkpoint folder, or a shipped model by name (default {FAST_MODEL.name}: "
                                   f"export takes one model, not the default ensemble): {shipped_models_text()}")
    x.add_argument("--out", required=True, help="folder for manifest.json and the graphs")
    x.add_argument("--int8", action="store_true", help="also write dynamically int8-quantised decoder graphs")
    x.add_argument("--int8-encoder", action="store_true", help="quantise the encoder's convolutions too")
    x.add_argument("--check", nargs="+", metavar="PATH",
                   help="photos or folders to caption with PyTorch and onnxruntime and compare")
    x.add_argument("--check-beam", type=positive_int, default=3, help="beam width of the --check captions")
    x.add_argument("--web", action="store_true", help="copy the in-browser demo page into OUT")
    _add_overwrite(x, "replace OUT if it is an ONNX export captionkit wrote")
    h = xf.add_parser("hf", help="a plain Hugging Face transformers folder (prefix_lm: its LM with LoRA merged; "
                      "vit_gpt2: a VisionEncoderDecoderModel)")
    h.set_defaults(func=cmd_export_hf)
    _add_export_hf_opts(h)

    o = sub.add_parser("models", help="list the shipped models (any of them is a --model NAME)")
    o.set_defaults(func=cmd_models)

    n = sub.add_parser("ensemble", help="write an ensemble folder: several models decoded as one (docs/ensembles.md)")
    n.set_defaults(func=cmd_ensemble)
    n.add_argument("--model", action="append", required=True,
                   help="a member: checkpoint folder or shipped model name; repeat for each member")
    n.add_argument("--weights", type=positive_floats, metavar="W1,W2,..", help="one per --model (default: equal)")
    n.add_argument("--length-penalty", type=float_at_least(0), default=None,
                   help="the ensemble's length normalisation (default: the first member's)")
    n.add_argument("--combine", choices=("loglinear", "linear"), default="loglinear",
                   help="loglinear: weighted mean of log-probabilities, renormalised (default); "
                        "linear: weighted mean of probabilities")
    _add_tta_opt(n)
    n.add_argument("--out", required=True, help="the ensemble folder to write")
    _add_overwrite(n, "replace the ensemble.json of an existing ensemble folder")

    r = sub.add_parser("rerank", help="choose each image's caption among several files' candidates by consensus (MBR)")
    r.set_defaults(func=cmd_rerank)
    r.add_argument("candidates", nargs="+", metavar="FILE",
                   help="JSON {image: [caption, ...]} or {image: caption}, one per model; all cover the same images")
    r.add_argument("--json", dest="json_out", metavar="OUT", help="write {image: caption} here")
    _add_overwrite(r, "replace an existing OUT")

    v = sub.add_parser("serve", help="HTTP API and web page (FastAPI)")
    v.set_defaults(func=cmd_serve)
    v.add_argument("--model", action="append",
                   help=f"checkpoint folder or shipped model name ({shipped_models_text()}); repeat for several")
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    v.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000; 0: any free port)")
    v.add_argument("--max-upload-mb", type=float, default=10.0, help="largest upload accepted (default 10)")
    v.add_argument("--queue-size", type=int, default=32, help="requests waiting per model before 503")
    v.add_argument("--max-batch", type=int, default=8, help="queued requests captioned together")
    v.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    v.add_argument("--onnx", metavar="DIR", help="host this ONNX export for the in-browser demo at /onnx")
    v.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/ (default: $CAPTIONKIT_API_KEY; "
                                     "prefer the variable: arguments are visible to other users)")
    v.add_argument("--rate-limit", type=float, metavar="N", help="requests per minute per client to /v1/ (429 beyond)")
    v.add_argument("--max-pixels", type=int, help="largest upload in pixels, read from its header (default 89,478,485)")
    v.add_argument("--decode-workers", type=int, default=2, help="uploads decoded at once")
    v.add_argument("--decode-memory-mb", type=float, default=512, help="memory one decode may take (estimated "
                                                                        "from the header; larger uploads get 400)")
    v.add_argument("--decode-queue", type=int, default=16, help="uploads waiting to be decoded before 503")
    v.add_argument("--max-connections", type=int, default=100, help="open connections before 503")
    v.add_argument("--header-timeout", type=float, default=10.0, help="seconds a connection has to send a request head")
    v.add_argument("--body-timeout", type=float, default=30.0, help="longest silence while a request body arrives")
    _add_device_opts(v)

    w = sub.add_parser("sweep", help="train a grid (or a random sample) of config variations; see docs/experiments.md")
    w.set_defaults(func=cmd_sweep)
    w.add_argument("--config", required=True, help="the base TOML config")
    w.add_argument("--set", dest="sets", action="append", metavar="TABLE.FIELD=V1,V2",
                   help="values to sweep (repeat for a grid over several fields); "
                        "loguniform(LOW,HIGH) or uniform(LOW,HIGH) with --random")
    w.add_argument("--out", required=True, help="the sweep folder (rerun the same command to resume)")
    w.add_argument("--metric", help="dev metric to rank (and stop early) by: CIDEr, Bleu_4, METEOR, ... or "
                   "val_loss (default: the config's train.val_metric; a score also becomes every trial's)")
    w.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local: one trial after another; ray: Ray Tune with ASHA early stopping")
    w.add_argument("--random", type=int, metavar="N", help="N random trials instead of the whole grid")
    w.add_argument("--seed", type=int, default=0, help="seed of --random")
    w.add_argument("--cpus", type=int, default=2, help="ray: CPUs of the local Ray")
    w.add_argument("--cpus-per-trial", type=float, default=1, help="ray: CPUs each trial holds (and torch threads)")
    w.add_argument("--address", help="ray: an existing Ray cluster (its nodes must see --out)")
    w.add_argument("--grace-epochs", type=int, default=1, help="ray: epochs before ASHA may stop a trial")

    g = sub.add_parser("plot", help="training curves of runs and sweeps, one panel per metric")
    g.set_defaults(func=cmd_plot)
    g.add_argument("runs", nargs="+", metavar="RUN_OR_SWEEP", help="run folders (captionkit train --out) or sweep folders")
    g.add_argument("--out", required=True, help="the PNG to write")
    g.add_argument("--metrics", help="comma-separated history fields, e.g. loss,val_loss,CIDEr,lr "
                   "(default: loss, val_loss and the runs' train.val_metric)")
    g.add_argument("--x", choices=("captions", "epochs"), default="captions", help="the x axis")
    g.add_argument("--data", metavar="JSON", help="also write the plotted numbers here")
    _add_overwrite(g, "replace existing output files")

    r = sub.add_parser("report", help="one self-contained HTML page comparing runs and sweeps")
    r.set_defaults(func=cmd_report)
    r.add_argument("runs", nargs="+", metavar="RUN_OR_SWEEP", help="run folders (captionkit train --out) or sweep folders")
    r.add_argument("--out", required=True, help="the HTML file to write")
    r.add_argument("--split", default="dev", help="the split to caption and score (dev; test for final numbers)")
    r.add_argument("--images", type=int, default=10, help="images in the captions table")
    r.add_argument("--max-images", type=int, default=0, metavar="N",
                   help="caption and score the split's first N images only (0: all; default), e.g. "
                   "the dev images a run validated on (train.val_max_images)")
    r.add_argument("--beam", type=positive_int, default=3, help="beam width (1: greedy; default 3)")
    r.add_argument("--bootstrap", type=int, default=1000, metavar="N",
                   help="resamples for the 95%% intervals (0: none)")
    r.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling")
    r.add_argument("--data", metavar="FILE", help="also write the scores, intervals and every caption as JSON")
    _add_overwrite(r, "replace an existing report")
    _add_score_opts(r)
    return p


def tune_allocator() -> None:
    """Keep freed tensor memory in the process (glibc): by default every large tensor is
    mmapped and returned to the OS when freed, so each batch pays page faults again; this
    made captioning ~1.5x slower. Process-wide, so done by the command line, not the library."""
    import ctypes
    import platform
    if platform.system() != "Linux":
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
    libc.mallopt(M_MMAP_THRESHOLD, 128 << 20)
    libc.mallopt(M_TRIM_THRESHOLD, 256 << 20)


def package_version() -> str:
    """captionkit's version as installed (the package metadata, from pyproject.toml)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("captionkit")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from ..core.version import __version__
        return f"{__version__} (not installed)"


def main(argv: list[str] | None = None) -> int:
    """Parse, call the command's function; a user's mistake (UserError, WeightsUnavailable) is one
    line on stderr and exit status 2, anything else an internal error with its traceback
    (CAPTIONKIT_DEBUG=1 shows the user's mistakes with theirs too)."""
    args = vars(build_parser().parse_args(argv))
    tune_allocator()
    command, func = args.pop("command"), args.pop("func")
    args.pop("subcommand", None)  # export's format: its func already says which
    try:
        return func(**args)
    except (UserError, WeightsUnavailable) as e:
        if os.environ.get("CAPTIONKIT_DEBUG"):
            raise
        print(f"captionkit {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"captionkit {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
