"""The ``captionkit`` command line. Each subcommand is a typed function; errors a user can fix
are printed as one line naming the file or field, never as a traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .argtypes import device_name, float_at_least, int_at_least, positive_floats, positive_int
from .errors import CheckpointError, DatasetError, ImageError, OutputError, WeightsUnavailable
from .vlm import DEFAULT_VLM, DTYPES


class UsageError(ValueError):
    pass


DEFAULT_NBEST = 5  # beams --rerank mbr chooses among when --nbest is not given


def _write_json(path: str | Path, obj) -> None:
    from .outputs import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=1, ensure_ascii=False))


def _caption_writer(command: str, paths: list[str], settings: dict, **outputs):
    """The writer both captioning commands share (captionkit.batch.CaptionWriter): every output
    target checked and the images found before the model loads."""
    from .batch import CaptionWriter

    if outputs.get("retry_failed") and not (outputs.get("jsonl") or outputs.get("csv_out")):
        raise UsageError("--retry-failed retries the images a --jsonl or --csv file lists as failed: give one")
    writer = CaptionWriter(command, paths, settings, **outputs)
    if not writer.total:
        raise UsageError(f"no image files found in {' '.join(paths)}")
    return writer


def _model_setting(model: str | None) -> str:
    """A checkpoint as recorded beside resumable outputs: a shipped model by its name, any
    other folder by its absolute path (so `runs/x` and `./runs/x/` compare equal)."""
    from .captioner import SHIPPED, model_folder

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
    device that is not here: called before anything loads (captionkit.devices)."""
    from .devices import resolve_device
    from .precision import resolve_precision

    try:
        where = resolve_device(device)
        return where, resolve_precision(precision, where)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _load_captioner(models: list[str] | None, weights: list[float] | None, device=None, precision: str = "auto"):
    """One --model (or the default), or an ensemble of several (captionkit.ensemble), on
    ``device`` (None: the CPU)."""
    from .captioner import Captioner
    place = {"device": device or "cpu", "precision": precision}
    if models and len(models) > 1:
        return Captioner.load_ensemble(models, weights, **place)
    return Captioner.load(models[0] if models else None, **place)


def _nbest(rerank: str | None, nbest: int | None) -> int | None:
    """The n-best size to decode: --nbest, or the default one for --rerank."""
    return nbest or (DEFAULT_NBEST if rerank else None)


def cmd_caption(paths: list[str], model: list[str] | None, beam: int, json_out: str | None,
                attention: str | None, batch_size: int, length_penalty: float | None,
                jsonl: str | None = None, csv_out: str | None = None, workers: int = 2,
                onnx: str | None = None, overwrite: bool = False, retry_failed: bool = False,
                verbose: bool = False, weights: list[float] | None = None, rerank: str | None = None,
                nbest: int | None = None, candidates: str | None = None, device: str = "auto",
                precision: str = "auto") -> int:
    if onnx and model:
        raise UsageError("give either --model or --onnx")
    if onnx and (device not in ("auto", "cpu") or precision != "auto"):
        raise UsageError("--device and --precision apply to PyTorch models; --onnx runs on onnxruntime's CPU")
    _check_models(model, weights, rerank, nbest, candidates)
    if onnx and (rerank or nbest):
        raise UsageError("--rerank, --nbest and --candidates need a PyTorch model (--model), not --onnx")
    settings = {"model": None if onnx else _models_setting(model, weights),
                "onnx": str(Path(onnx).resolve()) if onnx else None,
                "beam": beam, "length_penalty": length_penalty}
    if rerank or nbest:  # recorded only when used: other runs' settings stay as they were
        settings.update(rerank=rerank, nbest=_nbest(rerank, nbest))
    if candidates:
        from .outputs import check_file_target
        candidates_path = check_file_target(candidates, overwrite=overwrite)
    where, precision = _device("cpu" if onnx else device, precision)
    writer = _caption_writer("caption", paths, settings, json_out=json_out, jsonl=jsonl, csv_out=csv_out,
                             attention=attention, overwrite=overwrite, retry_failed=retry_failed, verbose=verbose)
    if onnx:
        from .onnx_runtime import load_onnx_captioner
        cap = load_onnx_captioner(onnx)
        return writer.run(lambda files: cap.caption_files(files, beam=beam, batch_size=batch_size,
                                                          length_penalty=length_penalty, workers=workers))
    cap = _load_captioner(model, weights, where, precision)
    lists: dict[str, list[str]] = {}

    def results(files: list[Path]):
        for path, res in cap.caption_files(files, beam=beam, batch_size=batch_size, length_penalty=length_penalty,
                                           workers=workers, nbest=_nbest(rerank, nbest), rerank=rerank):
            if not isinstance(res, ImageError) and res.candidates is not None:
                lists[writer.keys[path]] = res.candidates
            yield path, res

    code = writer.run(results)
    if candidates:
        from .outputs import atomic_write_text
        atomic_write_text(candidates_path, json.dumps(lists, indent=1, ensure_ascii=False))
    return code


def cmd_ensemble(model: list[str], weights: list[float] | None, length_penalty: float | None, combine: str,
                 out: str, overwrite: bool) -> int:
    """Write an ensemble folder (captionkit.ensemble) naming the members, after loading them
    together once, so a folder that is written is one that loads."""
    from .captioner import SHIPPED, Captioner
    from .ensemble import KIND, member_entry, write_ensemble
    from .outputs import check_folder_target

    _check_models(model, weights)
    target = check_folder_target(out, overwrite=overwrite, kinds=(KIND,))
    cap = Captioner.load_ensemble(model, weights, length_penalty=length_penalty, combine=combine, with_encoder=False)
    members = [member_entry(Path(p), target, SHIPPED) for p in cap.config["ensemble"]["members"]]
    path = write_ensemble(target, members, cap.decoder.weights, cap.length_penalty, cap.max_len, combine)
    print(f"wrote {path}: {len(members)} members, weights "
          + ", ".join(f"{w:.3g}" for w in cap.decoder.weights) + f", length penalty {cap.length_penalty:g}")
    return 0


def cmd_rerank(candidates: list[str], json_out: str | None, overwrite: bool) -> int:
    from .rerank import rerank_files

    chosen = rerank_files(candidates, json_out, overwrite)
    if not json_out:
        for k, c in chosen.items():
            print(f"{k}\t{c}")
    return 0


def cmd_export(format: str, model: str | None, out: str, int8: bool, int8_encoder: bool,
               check: list[str] | None, check_beam: int, web: bool, overwrite: bool) -> int:
    from .captioner import Captioner
    from .outputs import check_folder_target
    try:
        from .export import export_onnx, web_demo_source
        from .onnx_runtime import parity_check
    except ImportError as e:
        raise UsageError(f"ONNX export needs the onnx extra: pip install 'captionkit[onnx]' ({e})") from None
    from .captioner import DEFAULT_MODEL, model_folder
    from .ensemble import is_ensemble_folder

    if is_ensemble_folder(model_folder(model)):
        raise UsageError(f"{model}: is an ensemble; ONNX export takes one model: export a member")

    from .images import find_images

    check_folder_target(out, overwrite=overwrite, kinds=("onnx",))  # all before the model loads
    if web:
        try:
            web_demo_source()
        except FileNotFoundError as e:
            raise UsageError(str(e)) from None
    files = find_images(check) if check else []
    if check and not files:
        raise UsageError(f"no image files found in {' '.join(check)}")
    cap = Captioner.load(model)
    manifest = export_onnx(cap, out, int8=int8 or int8_encoder, int8_encoder=int8_encoder,
                           model_name=Path(model or DEFAULT_MODEL).name, overwrite=overwrite, web=web)
    print(f"wrote {manifest.parent}: " + ", ".join(
        f"{p.name} {p.stat().st_size / 1e6:.1f} MB" for p in sorted(manifest.parent.glob("*.onnx"))))
    if web:
        print(f"in-browser demo: serve {out} with any static file server and open index.html")
    variants = ["float32"] + (["int8"] if int8 or int8_encoder else [])
    for variant in variants:
        rep = parity_check(cap, out, files, beam=check_beam, variant=variant)
        num = rep["numeric"]
        print(f"{variant}: largest difference from PyTorch on a test input: features {num['features']:.2e}, "
              f"log-probabilities {num['logprobs']:.2e}, attention {num['attention']:.2e}")
        if files:
            print(f"{variant}: {rep['identical']} of {rep['images']} captions identical to PyTorch's "
                  f"(beam {check_beam})")
            for d in rep["differ"][:5]:
                print(f"  {d['image']}: pytorch {d['pytorch']!r} / onnx {d['onnx']!r}")
    return 0


def cmd_serve(model: list[str] | None, host: str, port: int, max_upload_mb: float, queue_size: int,
              max_batch: int, threads: int | None, onnx: str | None, api_key: str | None = None,
              rate_limit: float | None = None, max_pixels: int | None = None, decode_workers: int = 2,
              decode_memory_mb: float = 512, decode_queue: int = 16, max_connections: int = 100,
              header_timeout: float = 10.0, body_timeout: float = 30.0, device: str = "auto",
              precision: str = "auto") -> int:
    import re

    from .serve.net import bind, exposure_warning
    if not 0 <= port <= 65535:
        raise UsageError(f"--port must be between 0 and 65535, got {port}")
    for flag, value in [("--max-upload-mb", max_upload_mb), ("--queue-size", queue_size), ("--max-batch", max_batch),
                        ("--threads", threads), ("--rate-limit", rate_limit), ("--max-pixels", max_pixels),
                        ("--decode-workers", decode_workers), ("--decode-memory-mb", decode_memory_mb),
                        ("--decode-queue", decode_queue), ("--max-connections", max_connections),
                        ("--header-timeout", header_timeout), ("--body-timeout", body_timeout)]:
        if value is not None and not value > 0:
            raise UsageError(f"{flag} must be positive, got {value:g}")
    if api_key is None:
        api_key = os.environ.get("CAPTIONKIT_API_KEY")
    if api_key is not None and not re.fullmatch(r"[!-~]+", api_key):
        raise UsageError("--api-key (or CAPTIONKIT_API_KEY) must be printable ASCII without spaces, and not empty")
    if onnx and not (Path(onnx) / "manifest.json").exists():
        raise UsageError(f"{onnx}: no manifest.json (make one with captionkit export onnx --out {onnx})")
    where, precision = _device(device, precision)
    try:
        sock = bind(host, port)  # before anything heavy: a bad --host or --port fails at once
    except OSError as e:
        raise UsageError(f"cannot listen on --host {host} --port {port}: {e.strerror or e}") from None
    warning = exposure_warning(sock, api_key)
    if warning:
        print(f"captionkit serve: {warning}", file=sys.stderr)
    try:
        from .serve.app import ServeConfig, serve
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
    from .data import load_dataset
    return load_dataset(dataset, images, image_column, title_column, image_suffix)


def _check_targets(*paths: str | None, overwrite: bool) -> None:
    """The files a scoring command will write: refused now, before any work, if they exist
    (without --overwrite) or cannot be written (see captionkit.outputs)."""
    from .outputs import check_file_target

    given = [p for p in paths if p]
    for p in given:
        check_file_target(p, overwrite=overwrite)
    if len({Path(p).resolve() for p in given}) < len(given):
        raise UsageError(f"{given[0]}: given for two outputs; choose a file for each")


def cmd_evaluate(model: list[str] | None, dataset: str, images: str | None, split: str, beam: int,
                 out: str | None, batch_size: int, length_penalty: float | None,
                 tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str,
                 image_column: str, title_column: str, image_suffix: str, overwrite: bool = False,
                 weights: list[float] | None = None, rerank: str | None = None, nbest: int | None = None,
                 device: str = "auto", precision: str = "auto", workers: int = 2) -> int:
    _check_targets(out, overwrite=overwrite)  # before torch, the dataset and the model load
    from .evaluation import score_captions

    _check_models(model, weights, rerank, nbest)
    where, precision = _device(device, precision)
    items = _load_dataset(dataset, images, image_column, title_column, image_suffix).split(split)
    cap = _load_captioner(model, weights, where, precision)
    captions, failed = {}, []
    for path, res in cap.caption_files([it.path for it in items], beam=beam, batch_size=batch_size,
                                       length_penalty=length_penalty, nbest=_nbest(rerank, nbest), rerank=rerank,
                                       workers=workers):
        if isinstance(res, ImageError):
            failed.append(str(res))
        else:
            captions[path.name] = res.text
    if failed:
        raise UsageError(f"{len(failed)} {split} images could not be read, e.g. {failed[0]}")
    rep = score_captions(captions, {it.name: it.raw for it in items}, source="the model's captions",
                         refs_source=f"{dataset} ({split} split)",
                         **_score_opts(tokenizer, meteor, no_brevity_penalty, metrics))
    lp = cap.length_penalty_or(length_penalty)
    mbr = _nbest(rerank, nbest)
    print(f"{split} split, {len(items)} images, beam {beam}, length penalty {lp:g}"
          + (f", MBR over the {mbr} best beams" if mbr else ""))
    _print_report(rep)
    if out:
        _write_json(out, {"model": _models_setting(model, weights), "dataset": dataset, "split": split,
                          "beam": beam, "length_penalty": lp, "mbr_nbest": mbr, "scale": "x100",
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


def cmd_score(captions: str | None, refs: str | None, dataset: str | None, images: str | None, split: str,
              out: str | None, per_image: str | None, bootstrap: int, compare: list[str] | None,
              tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str, seed: int,
              image_column: str, title_column: str, image_suffix: str, overwrite: bool = False) -> int:
    from .evaluation import bootstrap as run_bootstrap
    from .evaluation import paired_bootstrap, score_captions
    from .score_inputs import read_captions, read_references

    # what the user gave, checked before anything is read or scored
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
    _check_targets(out, per_image, overwrite=overwrite)
    if refs:
        ref, refs_source = read_references(refs), refs
    else:
        items = _load_dataset(dataset, images, image_column, title_column, image_suffix).split(split)
        ref, refs_source = {it.name: it.raw for it in items}, f"{dataset} ({split} split)"
    opts = {**_score_opts(tokenizer, meteor, no_brevity_penalty, metrics), "refs_source": refs_source}
    if compare:
        systems = [read_captions(path) for path in compare]  # both files checked before scoring either
        reps = [score_captions(c, ref, source=path, **opts) for c, path in zip(systems, compare)]
        rounds = bootstrap or 1000
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
    cand = read_captions(captions)
    rep = score_captions(cand, ref, source=captions, **opts)
    ci = run_bootstrap(rep, rounds=bootstrap, seed=seed) if bootstrap else None
    print(f"{len(cand)} images" + (f", bootstrap {bootstrap} resamples" if bootstrap else ""))
    _print_report(rep, ci)
    if out:
        doc = {k: round(100 * v, 4) for k, v in rep.scores.items()}
        if ci:
            doc["ci95"] = {k: [round(100 * lo, 4), round(100 * hi, 4)] for k, (lo, hi) in ci.items()}
        doc["implementation"] = rep.implementation
        doc["tokenizer"] = rep.tokenizer
        doc["empty_captions"] = len(rep.empty)
        doc["notes"] = rep.notes
        _write_json(out, doc)
    if per_image:
        _write_per_image(per_image, rep, cand)
    return 0


def _write_per_image(path: str, rep, cand: dict) -> None:
    import csv
    import io

    from .metrics import bleu_from_sums
    from .outputs import atomic_write_text
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
              overwrite: bool, tensorboard: str | None = None) -> int:
    from .train import train
    train(config, out=out, max_steps=max_steps, resume=resume, init=init, overwrite=overwrite,
          tensorboard=tensorboard)
    return 0


def cmd_features(dataset: str, images: str | None, encoder: str,
                 image_column: str, title_column: str, image_suffix: str, device: str = "auto",
                 workers: int = 2) -> int:
    from .encoders import create_encoder, list_encoders
    from .features import build_features, default_cache_root
    from .outputs import check_writable_folder

    if encoder not in list_encoders():
        raise UsageError(f"--encoder: unknown encoder {encoder!r}; known: {', '.join(list_encoders())}")
    where, _ = _device(device)
    check_writable_folder(default_cache_root())
    ds = _load_dataset(dataset, images, image_column, title_column, image_suffix)
    store = build_features(create_encoder(encoder).to(where), [it.path for it in ds.all_items()], workers=workers)
    print(f"{len(store.index)} images, grid {store.grid}: {store.folder}")
    return 0


def cmd_pack(checkpoint: str, out: str, fp16: bool, overwrite: bool) -> int:
    """Copy a trained checkpoint without its optimizer state (optionally its decoder in float16)
    for shipping; fine-tuned encoder blocks stay float32, like the rest of the encoder."""
    from .checkpoint import resolve
    from .outputs import check_folder_target

    if Path(out).resolve() == resolve(checkpoint).resolve():
        raise UsageError(f"{out}: is the checkpoint being packed; choose another folder")
    check_folder_target(out, overwrite=overwrite, kinds=("checkpoint",))
    import torch

    from .checkpoint import ENCODER_PREFIX, read_config, read_weights, save_checkpoint

    cfg = read_config(checkpoint)
    cfg.pop("optimizer_groups", None)
    w = read_weights(checkpoint)
    if fp16:
        w = {k: v.to(torch.float16) if v.is_floating_point() and not k.startswith(ENCODER_PREFIX) else v
             for k, v in w.items()}
    save_checkpoint(out, w, cfg)
    print(f"wrote {out} ({sum(v.numel() * v.element_size() for v in w.values()) / 1e6:.1f} MB)")
    return 0


def cmd_merge_lora(model: str, out: str, overwrite: bool) -> int:
    """Export a prefix_lm checkpoint's LM with its LoRA adapters merged (see
    captionkit.export.export_transformers)."""
    from .export import export_transformers

    folder = export_transformers(model, out, overwrite=overwrite)
    print(f"wrote {folder} (the merged LM, a transformers folder) and {folder / 'captioner'} "
          f"(a captionkit checkpoint captioning with it)")
    return 0


def cmd_zero_shot(paths: list[str], model: str, prompts: str | None, template: str | None,
                  json_out: str | None, batch_size: int, max_new_tokens: int, download: bool, dtype: str,
                  jsonl: str | None = None, csv_out: str | None = None, overwrite: bool = False,
                  retry_failed: bool = False, verbose: bool = False, device: str = "auto") -> int:
    from .vlm import ZeroShotCaptioner, load_prompts

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


def _add_caption_outputs(p: argparse.ArgumentParser) -> None:
    """The outputs of caption and zero-shot (one writer, captionkit.batch; docs/captioning.md)."""
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
    from .sweep import define, format_table, ray_missing, run_local, run_ray

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
    from .outputs import atomic_write_bytes, atomic_write_text, check_file_target
    from .plot import curve_series, default_metrics, draw_curves
    from .runs import find_runs

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
               overwrite: bool, tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str) -> int:
    from .outputs import atomic_write_text, check_file_target
    from .report import build_report
    from .runs import find_runs

    if images < 0 or bootstrap < 0:
        raise UsageError("--images and --bootstrap must be >= 0")
    target = check_file_target(out, overwrite=overwrite)
    found = find_runs(runs)
    page = build_report(found, split=split, images=images, beam=beam, rounds=bootstrap, seed=seed,
                        score_opts=_score_opts(tokenizer, meteor, no_brevity_penalty, metrics),
                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    atomic_write_text(target, page)
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


def _add_ensemble_opts(p: argparse.ArgumentParser) -> None:
    """Ensembles and consensus reranking (docs/ensembles.md), for caption and evaluate."""
    p.add_argument("--weights", type=positive_floats, metavar="W1,W2,..",
                   help="the ensemble members' weights, one per --model (default: equal)")
    p.add_argument("--rerank", choices=("mbr",),
                   help="mbr: choose each caption among the best beams by consensus (expected CIDEr-D)")
    p.add_argument("--nbest", type=int_at_least(2), metavar="N",
                   help=f"beams --rerank mbr chooses among (default {DEFAULT_NBEST}; the beam widens to N)")


def _add_device_opts(p: argparse.ArgumentParser, workers: bool = False, precision: bool = True) -> None:
    """Where a command computes (docs/devices.md): spelling checked here, presence before any model loads."""
    from .devices import DEVICE_HELP
    from .precision import PRECISIONS

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
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("caption", help="caption image files or folders (docs/captioning.md)")
    c.add_argument("paths", nargs="+")
    c.add_argument("--model", action="append", help="checkpoint or ensemble folder, or a shipped model by name: transformer-lite2-flickr8k (the default), sat-lite2-flickr8k, prefix-smollm2-lora-flickr8k; repeat for an ensemble (docs/ensembles.md)")
    _add_ensemble_opts(c)
    _add_candidates_opt(c)
    c.add_argument("--beam", type=positive_int, default=3)
    c.add_argument("--attention", metavar="DIR", help="write one attention figure per image here (x.jpg -> DIR/x.jpg.png)")
    c.add_argument("--batch-size", type=positive_int, default=16)
    c.add_argument("--length-penalty", type=float_at_least(0), default=None,
                   help="rank beams by logprob / (words + 1) ** this (0: plain sum; default: the model's)")
    c.add_argument("--onnx", metavar="DIR", help="caption with an ONNX export (captionkit export onnx) instead")
    _add_device_opts(c, workers=True)
    _add_caption_outputs(c)

    e = sub.add_parser("evaluate", help="caption a dataset split and score it (coco-caption scorers)")
    e.add_argument("--model", action="append", help="as caption's --model; repeat for an ensemble")
    _add_ensemble_opts(e)
    e.add_argument("--dataset", required=True)
    e.add_argument("--images", help="image folder of a JSON or CSV dataset")
    e.add_argument("--split", default="test")
    e.add_argument("--beam", type=positive_int, default=3)
    e.add_argument("--out", help="write scores and every caption to this JSON")
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--length-penalty", type=float, default=None)
    _add_overwrite(e, "replace the --out file if it exists")
    _add_device_opts(e, workers=True)
    _add_score_opts(e)
    _add_csv_opts(e)

    s = sub.add_parser("score", help="score a {image: caption} JSON against references")
    s.add_argument("--captions", help="{image: caption} JSON (or coco-caption's [{\"image_id\": ..., \"caption\": ...}] list)")
    s.add_argument("--refs", help="{image: [reference, ...]} JSON")
    s.add_argument("--dataset", help="take the references from this dataset instead")
    s.add_argument("--images")
    s.add_argument("--split", default="test")
    s.add_argument("--json", dest="out", help="write the scores (x100) here")
    s.add_argument("--per-image", help="write every image's caption and scores to this CSV")
    s.add_argument("--bootstrap", type=int, default=0, metavar="N", help="95%% intervals from N resamples")
    s.add_argument("--compare", nargs=2, metavar=("A.json", "B.json"),
                   help="paired bootstrap test: does system A beat system B?")
    s.add_argument("--seed", type=int, default=0)
    _add_overwrite(s, "replace the --json and --per-image files if they exist")
    _add_score_opts(s)
    _add_csv_opts(s)

    t = sub.add_parser("train", help="train a decoder from a TOML config")
    t.add_argument("--config", required=True)
    t.add_argument("--out", help="run folder (default runs/<config name>); a new run needs a new or empty one")
    t.add_argument("--max-steps", type=positive_int)
    t.add_argument("--resume", action="store_true", help="continue the run in OUT from OUT/last")
    t.add_argument("--init", metavar="DIR", help="start from this checkpoint (replaces the config's train.init)")
    _add_overwrite(t, "start the run in OUT again, replacing the run captionkit wrote there")
    t.add_argument("--tensorboard", metavar="DIR",
                   help="write TensorBoard event files here (replaces the config's train.tensorboard)")

    f = sub.add_parser("features", help="compute and cache a dataset's encoder features")
    f.add_argument("--dataset", required=True)
    f.add_argument("--images")
    f.add_argument("--encoder", default="efficientnet_lite2")
    _add_device_opts(f, workers=True, precision=False)
    _add_csv_opts(f)

    k = sub.add_parser("pack", help="copy a checkpoint without optimizer state, for shipping")
    k.add_argument("checkpoint")
    k.add_argument("out")
    k.add_argument("--fp16", action="store_true")
    _add_overwrite(k, "replace OUT if it is a checkpoint captionkit wrote")

    m = sub.add_parser("merge-lora", help="write a prefix_lm model's LM with LoRA merged, as a transformers folder")
    m.add_argument("--model", required=True, help="a prefix_lm checkpoint folder")
    m.add_argument("--out", required=True, help="the folder to write (must not exist, or be empty)")
    _add_overwrite(m, "replace OUT if it is a merged LM captionkit wrote")

    z = sub.add_parser("zero-shot", help="caption photos with an instruction-tuned vision-language model")
    z.add_argument("paths", nargs="+")
    z.add_argument("--model", default=DEFAULT_VLM,
                   help=f"a transformers model: Hub name or folder (default {DEFAULT_VLM})")
    z.add_argument("--prompts",
                   help="TOML file of prompt templates (default: the shipped captionkit/vlm_prompts.toml)")
    z.add_argument("--template", help="the template to use (default: the file's default)")
    z.add_argument("--batch-size", type=positive_int, default=4)
    z.add_argument("--max-new-tokens", type=positive_int, default=32, help="the longest answer, in the model's tokens")
    z.add_argument("--download", action="store_true",
                   help="fetch the weights from the Hugging Face Hub when they are not in its cache")
    z.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="auto: the checkpoint's own (bfloat16 for Qwen2.5-VL)")
    _add_device_opts(z, precision=False)
    _add_caption_outputs(z)

    x = sub.add_parser("export", help="export a model for other runtimes (ONNX)")
    x.add_argument("format", choices=["onnx"])
    x.add_argument("--model", help="checkpoint folder, or a shipped model by name: transformer-lite2-flickr8k (the default), sat-lite2-flickr8k, prefix-smollm2-lora-flickr8k")
    x.add_argument("--out", required=True, help="folder for manifest.json and the graphs")
    x.add_argument("--int8", action="store_true", help="also write dynamically int8-quantised decoder graphs")
    x.add_argument("--int8-encoder", action="store_true", help="quantise the encoder's convolutions too")
    x.add_argument("--check", nargs="+", metavar="PATH",
                   help="photos or folders to caption with PyTorch and onnxruntime and compare")
    x.add_argument("--check-beam", type=positive_int, default=3)
    x.add_argument("--web", action="store_true", help="copy the in-browser demo page into OUT")
    _add_overwrite(x, "replace OUT if it is an ONNX export captionkit wrote")

    n = sub.add_parser("ensemble", help="write an ensemble folder: several models decoded as one (docs/ensembles.md)")
    n.add_argument("--model", action="append", required=True,
                   help="a member: checkpoint folder or shipped model name; repeat for each member")
    n.add_argument("--weights", type=positive_floats, metavar="W1,W2,..", help="one per --model (default: equal)")
    n.add_argument("--length-penalty", type=float_at_least(0), default=None,
                   help="the ensemble's length normalisation (default: the first member's)")
    n.add_argument("--combine", choices=("loglinear", "linear"), default="loglinear",
                   help="loglinear: weighted mean of log-probabilities, renormalised (default); "
                        "linear: weighted mean of probabilities")
    n.add_argument("--out", required=True, help="the ensemble folder to write")
    _add_overwrite(n, "replace the ensemble.json of an existing ensemble folder")

    r = sub.add_parser("rerank", help="choose each image's caption among several files' candidates by consensus (MBR)")
    r.add_argument("candidates", nargs="+", metavar="FILE",
                   help="JSON {image: [caption, ...]} or {image: caption}, one per model; all cover the same images")
    r.add_argument("--json", dest="json_out", metavar="OUT", help="write {image: caption} here")
    _add_overwrite(r, "replace an existing OUT")

    v = sub.add_parser("serve", help="HTTP API and web page (FastAPI)")
    v.add_argument("--model", action="append", help="checkpoint folder or shipped model name; repeat for several (default: transformer-lite2-flickr8k)")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--max-upload-mb", type=float, default=10.0)
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
    g.add_argument("runs", nargs="+", metavar="RUN_OR_SWEEP")
    g.add_argument("--out", required=True, help="the PNG to write")
    g.add_argument("--metrics", help="comma-separated history fields, e.g. loss,val_loss,CIDEr,lr "
                   "(default: loss, val_loss and the runs' train.val_metric)")
    g.add_argument("--x", choices=("captions", "epochs"), default="captions", help="the x axis")
    g.add_argument("--data", metavar="JSON", help="also write the plotted numbers here")
    _add_overwrite(g, "replace existing output files")

    r = sub.add_parser("report", help="one self-contained HTML page comparing runs and sweeps")
    r.add_argument("runs", nargs="+", metavar="RUN_OR_SWEEP")
    r.add_argument("--out", required=True, help="the HTML file to write")
    r.add_argument("--split", default="dev", help="the split to caption and score (dev; test for final numbers)")
    r.add_argument("--images", type=int, default=10, help="images in the captions table")
    r.add_argument("--beam", type=positive_int, default=3)
    r.add_argument("--bootstrap", type=int, default=1000, metavar="N",
                   help="resamples for the 95%% intervals (0: none)")
    r.add_argument("--seed", type=int, default=0)
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


def main(argv: list[str] | None = None) -> int:
    args = vars(build_parser().parse_args(argv))
    tune_allocator()
    command = args.pop("command")
    fn = globals()[f"cmd_{command.replace('-', '_')}"]
    try:
        return fn(**args)
    except (UsageError, ImageError, DatasetError, CheckpointError, OutputError, WeightsUnavailable) as e:
        print(f"captionkit {command}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # config and dataset validation errors carry their file/field
        if os.environ.get("CAPTIONKIT_DEBUG"):
            raise
        print(f"captionkit {command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"captionkit {command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
