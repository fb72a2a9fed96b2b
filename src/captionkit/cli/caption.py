"""The captioning commands: caption (local or --engine ray), evaluate (caption a dataset split and
score it) and zero-shot; each one's options beside its code, and the helpers they share (loading
a model or an ensemble, the caption writer, --rerank's n-best and matcher)."""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

from ..core.errors import ImageError
from ..inference.shipped import FAST_MODEL, shipped_models_text
from ..inference.zero_shot import DEFAULT_VLM, DTYPES
from .argtypes import float_at_least, int_at_least, positive_floats, positive_int
from .common import (UsageError, _add_control_opts, _add_csv_opts, _add_device_opts, _add_engine_opts, _add_overwrite,
                     _add_processes_opt, _add_score_opts, _add_tta_opt, _check_models, _check_targets, _controls,
                     _device, _load_dataset, _print_report, _processes, _ray_options, _score_opts, _write_json)
from .common import MATCH_NBEST, MATCH_WEIGHT, _diversity_doc, _print_diversity


DEFAULT_NBEST = 5  # beams --rerank mbr chooses among when --nbest is not given


def _caption_writer(command: str, paths: list[str], settings: dict, **outputs):
    """The writer both captioning commands share (captionkit.inference.writer.CaptionWriter): every output
    target checked and the images found before the model loads; with http(s) URLs among
    ``paths``, one that downloads them (:func:`_url_writer`)."""
    from ..data.fetch import is_url
    from ..inference.writer import CaptionWriter

    if outputs.get("retry_failed") and not (outputs.get("jsonl") or outputs.get("csv_out")):
        raise UsageError("--retry-failed retries the images a --jsonl or --csv file lists as failed: give one")
    kind = _url_writer() if any(is_url(p) for p in paths) else CaptionWriter
    writer = kind(command, paths, settings, **outputs)
    if not writer.total:
        raise UsageError(f"no image files found in {' '.join(paths)}")
    return writer


def _model_setting(model: str | None) -> str:
    """A checkpoint as recorded beside resumable outputs: a shipped model by its name, any
    other folder by its absolute path (so `runs/x` and `./runs/x/` compare equal)."""
    from ..inference.hf_models import hf_setting
    from ..inference.shipped import SHIPPED, model_folder

    if hf_setting(model):  # a Hugging Face model: hf: and its Hub name or folder
        return hf_setting(model)
    folder = model_folder(model)
    return folder.name if folder.parent == SHIPPED else str(folder.resolve())


def _models_setting(models: list[str] | None, weights: list[float] | None):
    """One model as before (a name or path); an ensemble as the list of its members and weights."""
    if not models or len(models) == 1:
        return _model_setting(models[0] if models else None)
    return {"members": [_model_setting(m) for m in models], "weights": weights}


def _check_model_folders(models: list[str] | None) -> None:
    """Each --model (or the default) is a folder or a shipped name: one line otherwise, before
    torch loads."""
    from ..inference.hf_models import hf_source
    from ..inference.shipped import existing_model_folder

    for m in models or [None]:
        if hf_source(m) is None:  # (an hf: folder that is not there is refused by hf_source)
            existing_model_folder(m)


def _load_captioner(models: list[str] | None, weights: list[float] | None, tta: str | None = None,
                    device=None, precision: str = "auto", matcher: str | None = None,
                    match_weight: float | None = None, match_rare_weight: float | None = None):
    """One --model (or the default), or an ensemble of several (captionkit.inference.ensemble), on
    ``device`` (None: the CPU); ``tta``: --tta (None: none, or what an ensemble folder says);
    ``matcher``: --rerank match's, at ``match_weight`` (None: MATCH_WEIGHT), with the rare-word
    gain at ``match_rare_weight`` (None: 0)."""
    from ..inference.captioner import Captioner

    place = {"tta": tta, "device": device or "cpu", "precision": precision}
    if models and len(models) > 1:
        cap = Captioner.load_ensemble(models, weights, **place)
    else:
        cap = Captioner.load(models[0] if models else None, **place)
    if matcher:
        cap.use_matcher(matcher, _match_weight(match_weight), match_rare_weight or 0.0)
    return cap


def _run_rerank(models: list[str] | None, rerank: str | None, nbest: int | None, matcher: str | None,
                match_weight: float | None, match_rare_weight: float | None, given: dict, beam: int) -> tuple:
    """(rerank, nbest, matcher, match_weight, match_rare_weight) as a run uses them, rerank None
    or a reranker: as given (--rerank none: none); when no --rerank is given, the one --model's
    (or the default's) own reranker if its ensemble folder has one (Captioner.rerank_plan): its
    matcher, n-best size and weights, each replaced by the flag that gives it -- wherever the
    decoding is the beam's one caption (not --beam 1, sampling, several captions or beam
    groups). Read before anything loads (captionkit.inference.rerank.read_folder_rerank), and
    before the outputs are checked: a folder that is not there, or one on the Hub (fetched only
    after the outputs are checked), is left to the loader (its own reranker then applies there,
    unrecorded) and to the checks that name it."""
    from ..inference.controls import DEFAULT
    from ..inference.folders import is_ensemble
    from ..inference.hf_models import hf_source
    from ..inference.hub import HUB_PREFIX
    from ..inference.rerank import RERANK_OFF, read_folder_rerank
    from ..inference.shipped import model_folder

    asked = (rerank, nbest, matcher, match_weight, match_rare_weight)
    if rerank == RERANK_OFF:
        return None, *asked[1:]
    if rerank is not None or (models and len(models) > 1) or not DEFAULT.with_options(**given).gives_the_beams_best(beam):
        return asked
    if models and (hf_source(models[0]) is not None or str(models[0]).startswith(HUB_PREFIX)):
        return asked
    folder = model_folder(models[0] if models else None)
    own = read_folder_rerank(folder) if is_ensemble(folder) else None
    if own is None:
        return asked
    return (own.method, nbest or own.nbest, matcher or str(own.matcher),
            own.weight if match_weight is None else match_weight,
            own.rare_weight if match_rare_weight is None else match_rare_weight)


def _match_weight(given: float | None) -> float:
    """--match-weight, or its default."""
    return MATCH_WEIGHT if given is None else given


def _nbest(rerank: str | None, nbest: int | None) -> int | None:
    """The n-best size to decode: --nbest, or the default one for --rerank."""
    return nbest or (MATCH_NBEST if rerank == "match" else DEFAULT_NBEST if rerank else None)


def _check_caption_sources(model: list[str] | None, onnx: str | None, weights: list[float] | None,
                           rerank: str | None, nbest: int | None, candidates: str | None,
                           tta: str | None = None, matcher: str | None = None,
                           match_weight: float | None = None, match_rare_weight: float | None = None) -> None:
    """caption's model options that do not fit together, refused before anything loads."""
    if onnx and model:
        raise UsageError("give either --model or --onnx")
    if onnx and tta:
        raise UsageError("--tta needs a PyTorch model (--model), not --onnx")
    _check_models(model, weights, rerank, nbest, candidates, matcher, match_weight, match_rare_weight)
    if onnx and (rerank or nbest):
        raise UsageError("--rerank, --nbest and --candidates need a PyTorch model (--model), not --onnx")


def _check_controls_fit(given: dict, rerank: str | None, nbest: int | None, candidates: str | None,
                        engine: str = "local") -> None:
    """Caption controls that do not fit the other options (refused before anything loads)."""
    if given and engine == "ray":
        raise UsageError(f"--engine ray does not support --{next(iter(given)).replace('_', '-')}; use the local "
                         f"engine for it")
    several = [f"--{k.replace('_', '-')}" for k in ("num_captions", "sample", "beam_groups")
               if given.get(k) not in (None, False, 1)]
    if several and (rerank or nbest or candidates):
        raise UsageError(f"{several[0]} does not go with --rerank, --nbest or --candidates (they take the beam's "
                         f"n best): give one or the other")


def _caption_settings(model: list[str] | None, weights: list[float] | None, onnx: str | None, beam: int,
                      length_penalty: float | None, rerank: str | None, nbest: int | None,
                      tta: str | None = None, matcher: str | None = None, match_weight: float | None = None,
                      match_rare_weight: float | None = None) -> dict:
    """What decides caption's captions, recorded beside resumable outputs (captionkit.inference.writer)."""
    settings = {"model": None if onnx else _models_setting(model, weights),
                "onnx": str(Path(onnx).resolve()) if onnx else None,
                "beam": beam, "length_penalty": length_penalty}
    if rerank or nbest:  # recorded only when used: other runs' settings stay as they were
        settings.update(rerank=rerank, nbest=_nbest(rerank, nbest))
    if matcher:  # likewise
        settings.update(matcher=str(Path(matcher).resolve()),
                        match_weight=_match_weight(match_weight))
        if match_rare_weight:  # (recorded only when used, as above)
            settings.update(match_rare_weight=match_rare_weight)
    if tta:  # likewise
        settings.update(tta=tta)
    return settings


def _caption_with_candidates(writer, load, candidates: Path | None, controls: dict | None = None,
                             processes: int | None = 1, device=None, **options) -> int:
    """Run the writer on the PyTorch captioner ``load()`` returns (called only when there are
    images to caption); with ``candidates``, also write each image's n best beams there
    ({key: [caption, ...]}) at the end. ``controls``: the caption controls given (over the
    model's own); ``processes``: --processes (None: auto) on ``device`` (:func:`_caption_files`)."""
    lists: dict[str, list[str]] = {}

    def results(files: list[Path]):
        _, outcomes = _caption_files(load, files, processes, device, controls, **options)
        for path, res in outcomes:
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


def _check_sources(paths: list[str], engine: str = "local") -> None:
    """What caption and zero-shot read are local files or folders, or http(s) URLs: another
    scheme (ftp://, file://), a URL for --engine ray (whose tasks read local files), or a bad
    CAPTIONKIT_URL_* limit is refused with one line, before torch."""
    from ..data.fetch import check_url, is_url, url_limits

    for p in paths:
        check_url(p)
    urls = [p for p in paths if is_url(p)]
    if urls and engine == "ray":
        raise UsageError(f"{urls[0]}: --engine ray reads local files; download the images first, or use the "
                         f"local engine")
    if urls:
        url_limits()


def _url_writer():
    """The CaptionWriter of a command given http(s) URLs (captionkit.data.fetch): each URL stands
    in the writer as an empty file in a temporary folder, is written under its URL (stdout,
    JSON keys, --jsonl/--csv lines, so a resumed run knows it), and is downloaded into that
    file only when it is to be captioned -- after the outputs are checked and a resumed run
    has dropped what is done, before the model loads; a download that fails is that image's
    error line, naming the URL, and the others go on."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    from ..data.fetch import fetch_url, is_url
    from ..inference.writer import CaptionWriter, figure_names

    class UrlCaptionWriter(CaptionWriter):
        def __post_init__(self) -> None:
            self.folder = tempfile.TemporaryDirectory(prefix="captionkit-urls-")
            self.urls: dict[Path, str] = {}  # placeholder file -> its URL
            given = {}
            for p in self.paths:
                if is_url(p) and p not in given:  # a URL given twice is captioned once, as a file is
                    given[p] = Path(self.folder.name) / f"url-{len(given)}"
                    given[p].touch()
                    self.urls[given[p]] = p
            self.paths = [str(given[p]) if p in given else p for p in self.paths]
            super().__post_init__()
            self.keys.update({f: u for f, u in self.urls.items() if f in self.keys})
            if self.attention:
                self.figures = figure_names(self.keys.values())

        def run(self, caption) -> int:
            try:
                return super().run(lambda files: self._downloading(caption, files))
            finally:
                self.folder.cleanup()

        def _downloading(self, caption, files: list[Path]):
            def fetch(f: Path) -> ImageError | None:
                try:
                    f.write_bytes(fetch_url(self.urls[f]))
                except ImageError as e:
                    return e
                return None

            wanted = [f for f in files if f in self.urls]
            with ThreadPoolExecutor(max_workers=4) as pool:  # downloads overlap; four at most at a time
                failed = {f: e for f, e in zip(wanted, pool.map(fetch, wanted)) if e is not None}
            good = [f for f in files if f not in failed]
            results = iter(caption(good) if good else ())  # the model loads only for something to caption
            for f in files:
                yield (f, failed[f]) if f in failed else next(results)

    return UrlCaptionWriter


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


def _caption_ray(writer, model: list[str] | None, weights: list[float] | None, beam: int,
                 length_penalty: float | None, overwrite: bool, retry_failed: bool, out: str, opts,
                 precision: str = "auto") -> int:
    """caption --engine ray: the images not yet in OUT captioned by Ray (captionkit.inference.ray_engine),
    in shards kept in OUT.shards, and written by the same writer as the local engine's. ``precision``:
    --precision as typed; each replica resolves it for the device Ray gives it."""

    from ..inference import ray_engine

    folder = ray_engine.caption_shards_folder(out)
    shard_settings = {**writer.settings, "shard_size": opts.shard_size}
    ray_engine.check_caption_shards(folder, shard_settings, overwrite)
    # No model loads here: the replicas read and preprocess the images themselves (each with
    # its model's encoder), so the driver holds only paths and captions.
    readable = writer.readable
    load = partial(_load_captioner, model, weights)
    return writer.run(lambda todo: ray_engine.caption_with_ray(
        readable, todo, folder, shard_settings, overwrite, retry_failed, load, beam, length_penalty,
        opts, precision=precision))


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


def _add_ensemble_opts(p: argparse.ArgumentParser) -> None:
    """Ensembles and consensus reranking (docs/ensembles.md), for caption and evaluate."""
    p.add_argument("--weights", type=positive_floats, metavar="W1,W2,..",
                   help="the ensemble members' weights, one per --model (default: equal)")
    p.add_argument("--rerank", choices=("mbr", "match", "none"),  # rerank.RERANKERS and RERANK_OFF
                   help="mbr: choose each caption among the best beams by consensus (expected CIDEr-D); match: "
                        "by probability plus how much better it fits the photo than other photos (--matcher); "
                        "none: the beam's best, even where an ensemble folder has its own reranker (default: "
                        "none, or the folder's own)")
    p.add_argument("--nbest", type=int_at_least(2), metavar="N",
                   help=f"beams --rerank chooses among (default {DEFAULT_NBEST} for mbr, {MATCH_NBEST} for match; "
                        f"the beam widens to N)")
    p.add_argument("--matcher", metavar="DIR", help="--rerank match's matcher checkpoint (captionkit matcher)")
    p.add_argument("--match-weight", type=float_at_least(0), metavar="W",
                   help=f"--rerank match: the weight of the matcher's score against the caption's length-normalised "
                        f"log-probability (default {MATCH_WEIGHT}; 0: the probability alone)")
    p.add_argument("--match-rare-weight", type=float_at_least(0), metavar="C",
                   help="--rerank match: also add C times each caption's rare-word gain (what --rare-word-bonus 1 "
                        "gives its words; word vocabularies only; default 0)")
    _add_tta_opt(p)


def _add_candidates_opt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--candidates", metavar="OUT",
                   help="also write each image's --nbest best beams here as {image: [caption, ...]}, "
                        "input for captionkit rerank (the images captioned in this run; written at the end)")


def add_caption(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser("caption", help="caption image files or folders (docs/captioning.md)")
    c.set_defaults(func=cmd_caption)
    c.add_argument("paths", nargs="*", metavar="PATH",
                   help="image files, folders to caption every image in, or http(s) URLs (downloaded with a "
                        "size limit and a timeout, docs/captioning.md) (or none, with --paths-from)")
    c.add_argument("--paths-from", metavar="FILE",
                   help="also caption the images this file lists, one path or URL a line")
    c.add_argument("--model", action="append",
                   help=f"checkpoint or ensemble folder, a shipped model by name: {shipped_models_text()}, or "
                        "hub:ORG/NAME[@REVISION], or a Hugging Face captioner hf:ORG/NAME (docs/hf-models.md); "
                        "repeat for an ensemble (docs/ensembles.md)")
    c.add_argument("--fast", action="store_true",
                   help=f"caption with the fastest good shipped model, {FAST_MODEL.name} (--model "
                        f"{FAST_MODEL.name}): one encoder pass and one decoder a photo instead of the default's "
                        f"two and four, about twice its images/s, for 4.9 points less CIDEr-D on Flickr8k test "
                        f"(docs/speed.md)")
    _add_ensemble_opts(c)
    _add_candidates_opt(c)
    c.add_argument("--beam", type=positive_int, help="beam width (1: greedy; default 3)")
    c.add_argument("--attention", metavar="DIR", help="write one attention figure per image here (x.jpg -> DIR/x.jpg.png)")
    c.add_argument("--batch-size", type=positive_int, default=16, help="images captioned together (default 16)")
    c.add_argument("--length-penalty", type=float_at_least(0), default=None,
                   help="rank beams by logprob / (words + 1) ** this (0: plain sum; default: the model's)")
    c.add_argument("--onnx", metavar="DIR", help="caption with an ONNX export (captionkit export onnx) instead")
    _add_control_opts(c, default="the model's")
    _add_device_opts(c, workers=True)
    _add_processes_opt(c)
    _add_caption_outputs(c)
    _add_engine_opts(c)


def cmd_caption(paths: list[str], model: list[str] | None, beam: int | None, json_out: str | None,
                attention: str | None, batch_size: int, length_penalty: float | None,
                jsonl: str | None = None, csv_out: str | None = None, workers: int = 2,
                onnx: str | None = None, overwrite: bool = False, retry_failed: bool = False,
                verbose: bool = False, weights: list[float] | None = None, rerank: str | None = None,
                nbest: int | None = None, candidates: str | None = None, engine: str = "local",
                address: str | None = None, replicas: int | None = None, shard_size: int | None = None,
                gpus_per_replica: float = 0, paths_from: str | None = None, tta: str | None = None,
                device: str = "auto", precision: str = "auto", fast: bool = False, processes: int | None = None,
                matcher: str | None = None, match_weight: float | None = None,
                match_rare_weight: float | None = None, **controls) -> int:
    """``controls``: the caption controls' options (cli/common.py: _add_control_opts), None where not given."""
    from ..core.outputs import check_file_target
    from ..inference.rerank import RERANK_OFF

    if fast:  # one flag for the fast single model: recorded, checked and loaded as --model NAME is
        if model or onnx:
            raise UsageError(f"--fast is --model {FAST_MODEL.name}: give --fast, --model or --onnx, not two")
        model = [FAST_MODEL.name]
    # everything the user gave is checked before torch is imported (seconds), and the photos
    # are found before the model loads: a mistake costs nothing
    paths = [*paths, *_listed_paths(paths_from)]
    if not paths:
        raise UsageError("give image files or folders to caption, or --paths-from FILE")
    _check_sources(paths, engine)
    if engine == "ray":
        _check_ray_caption(jsonl or csv_out, onnx=onnx, attention=attention, rerank=rerank, nbest=nbest,
                           candidates=candidates, tta=tta, processes=processes)
    if onnx and processes not in (None, 1):
        raise UsageError("--processes runs PyTorch models (--model); --onnx runs in onnxruntime's own threads")
    given, beam_used = _controls(controls, beam)
    off = rerank == RERANK_OFF  # (--rerank none: not even the model's own, below)
    if not onnx and engine == "local":  # (Ray's replicas decode as their model says: caption_files)
        rerank, nbest, matcher, match_weight, match_rare_weight = _run_rerank(
            model, rerank, nbest, matcher, match_weight, match_rare_weight, given, beam_used)
    _check_caption_sources(model, onnx, weights, rerank, nbest, candidates, tta, matcher, match_weight,
                           match_rare_weight)
    _check_controls_fit(given, rerank, nbest, candidates, engine)
    if onnx and (device not in ("auto", "cpu") or precision != "auto"):
        raise UsageError("--device and --precision apply to PyTorch models; --onnx runs on onnxruntime's CPU")
    if onnx:
        from ..export.checks import check_onnx_extra, read_manifest
        read_manifest(onnx)
        check_onnx_extra("--onnx", ("onnxruntime",))
    settings = _caption_settings(model, weights, onnx, beam_used, length_penalty, rerank, nbest, tta, matcher,
                                 match_weight, match_rare_weight)
    settings.update(given)  # recorded only when given: other runs' settings stay as they were
    candidates_path = check_file_target(candidates, overwrite=overwrite) if candidates else None
    writer = _caption_writer("caption", paths, settings, json_out=json_out, jsonl=jsonl, csv_out=csv_out,
                             attention=attention, overwrite=overwrite, retry_failed=retry_failed, verbose=verbose,
                             late=("precision",))  # known once the device is (below)
    if not onnx:
        _check_model_folders(model)
    asked_precision = precision  # (resolved below for this machine; Ray's replicas resolve it for theirs)
    # an explicit device is checked anyway; Ray's replicas resolve their own, and their own
    # precision (the driver of --engine ray need not import torch: ~300 MiB of private memory
    # with this build; --precision's spelling is argparse's)
    if (engine == "local" and (writer.readable or precision != "auto")) or device != "auto":
        where, precision = _device("cpu" if onnx else device, precision)
        if engine == "local":  # (Ray's replicas resolve their own)
            # bf16/fp16 captions differ from fp32 ones: a resumed file keeps to one (recorded when
            # not fp32, so files from before it was recorded resume as fp32 ones; ONNX is fp32)
            writer.add_settings(precision=None if onnx or precision == "fp32" else precision)
    if not writer.readable:  # every path given is missing or refused: said without torch or a model
        return writer.run(lambda files: iter(()))
    if engine == "ray":
        return _caption_ray(writer, model, weights, beam_used, length_penalty, overwrite, retry_failed, jsonl or csv_out,
                            _ray_options(address, replicas, gpus_per_replica, batch_size, shard_size, workers),
                            precision=asked_precision)
    options = {"beam": beam, "batch_size": batch_size, "length_penalty": length_penalty, "workers": workers}
    if onnx:
        def onnx_results(files: list[Path]):
            from ..export.onnx_runtime import load_onnx_captioner
            cap = load_onnx_captioner(onnx)
            yield from cap.caption_files(files, controls=cap.controls_for(None, beam, **given), **options)
        return writer.run(onnx_results)
    load = partial(_load_captioner, model, weights, tta, where, precision, matcher, match_weight,
                   match_rare_weight)
    return _caption_with_candidates(writer, load, candidates_path, given, processes, where,
                                    nbest=_nbest(rerank, nbest), rerank=RERANK_OFF if off else rerank, **options)


def _caption_files(load, files: list[Path], processes: int | None, device, controls: dict | None = None,
                   **options):
    """(``load()``, its ``caption_files(files, **options)``) under the caption controls given over
    the model's own, in --processes processes (None: auto) for ``device``: more than one is said
    on standard error, and their helpers are started before this process loads its model, so all
    load at once (captionkit.inference.processes; ``load`` is picklable)."""
    from ..inference.processes import caption_in_processes, start_helpers

    batch_size = options.pop("batch_size", 16)
    n = _processes(processes, device or "cpu", len(files), batch_size)
    helpers = start_helpers(load, n)
    if helpers is not None:
        share = helpers.threads
        print(f"captionkit: captioning in {n} processes of {share} torch thread{'s' * (share > 1)} each "
              f"(--processes 1: in this one)", file=sys.stderr, flush=True)
    try:
        cap = load()
        given = cap.controls_for(None, options.get("beam"), **(controls or {}))
    except BaseException:
        if helpers is not None:
            helpers.close()
        raise
    return cap, caption_in_processes(cap, load, files, n, batch_size=batch_size, helpers=helpers, controls=given,
                                     **options)


def _caption_split(results, items: list, split: str, lists: dict | None = None) -> dict[str, str]:
    """{image name: caption} of a dataset split from its images' ``results`` (path, Result or
    ImageError); one line if any of its images cannot be read. ``lists``: filled with {image
    name: [caption, ...]} when the controls ask for several."""
    from ..core.progress import progress

    captions, failed = {}, []
    for path, res in progress(results, total=len(items), desc=f"evaluate {split}", unit="image"):
        if isinstance(res, ImageError):
            failed.append(str(res))
        else:
            captions[path.name] = res.text
            if lists is not None and res.captions is not None:
                lists[path.name] = res.captions
    if failed:
        raise UsageError(f"{len(failed)} {split} images could not be read, e.g. {failed[0]}")
    return captions


def add_evaluate(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("evaluate", help="caption a dataset split and score it (coco-caption scorers)")
    e.set_defaults(func=cmd_evaluate)
    e.add_argument("--model", action="append", help="as caption's --model; repeat for an ensemble")
    _add_ensemble_opts(e)
    e.add_argument("--dataset", required=True,
                   help="a Flickr8k, Kaggle or imagefolder folder, WebDataset shards, a saved Hugging Face "
                        "dataset, a Karpathy or COCO JSON file, or a title CSV (docs/datasets.md)")
    e.add_argument("--images", help="image folder of a JSON or CSV dataset")
    e.add_argument("--split", default="test", help="the split to caption and score (default test)")
    e.add_argument("--max-images", type=positive_int, metavar="N",
                   help="caption and score only the split's first N images (a quick look; scores on part of "
                        "a split are not comparable to the whole split's)")
    e.add_argument("--beam", type=positive_int, help="beam width (1: greedy; default 3)")
    e.add_argument("--out", help="write scores and every caption to this JSON (with --num-captions, each "
                                 "image's list too, as caption_lists; the first caption is scored)")
    e.add_argument("--batch-size", type=int, default=16, help="images captioned together (default 16)")
    e.add_argument("--length-penalty", type=float, default=None,
                   help="rank beams by logprob / (words + 1) ** this (0: plain sum; default: the model's)")
    _add_overwrite(e, "replace the --out file if it exists")
    _add_control_opts(e, default="the model's")
    _add_device_opts(e, workers=True)
    _add_processes_opt(e)
    _add_score_opts(e)
    _add_csv_opts(e)


def cmd_evaluate(model: list[str] | None, dataset: str, images: str | None, split: str, beam: int | None,
                 out: str | None, batch_size: int, length_penalty: float | None,
                 tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str,
                 image_column: str, title_column: str, image_suffix: str, overwrite: bool = False,
                 weights: list[float] | None = None, rerank: str | None = None, nbest: int | None = None,
                 tta: str | None = None, device: str = "auto", precision: str = "auto", workers: int = 2,
                 max_images: int | None = None, processes: int | None = None, matcher: str | None = None,
                 match_weight: float | None = None, match_rare_weight: float | None = None, **controls) -> int:
    _check_targets(out, overwrite=overwrite)  # before torch, the dataset and the model load
    from ..inference.rerank import RERANK_OFF
    from ..scoring.diversity import diversity_rows
    from ..scoring.evaluation import score_captions

    given, beam = _controls(controls, beam)  # the caption controls given, and the beam width used
    off = rerank == RERANK_OFF  # (--rerank none: not even the model's own, below)
    rerank, nbest, matcher, match_weight, match_rare_weight = _run_rerank(
        model, rerank, nbest, matcher, match_weight, match_rare_weight, given, beam)
    _check_models(model, weights, rerank, nbest, matcher=matcher, match_weight=match_weight,
                  match_rare_weight=match_rare_weight)
    _check_controls_fit(given, rerank, nbest, None)
    _check_model_folders(model)
    where, precision = _device(device, precision)
    data = _load_dataset(dataset, images, image_column, title_column, image_suffix)
    items = data.split(split)
    split_size = len(items)
    items = items[:max_images] if max_images else items  # the split's order: the same N every time
    load = partial(_load_captioner, model, weights, tta, where, precision, matcher, match_weight,
                   match_rare_weight)
    lists: dict[str, list[str]] = {}
    cap, results = _caption_files(load, [it.path for it in items], processes, where, given, beam=beam,
                                  batch_size=batch_size, length_penalty=length_penalty,
                                  nbest=_nbest(rerank, nbest), rerank=RERANK_OFF if off else rerank, workers=workers)
    captions = _caption_split(results, items, split, lists)
    rep = score_captions(captions, {it.name: it.raw for it in items}, source="the model's captions",
                         refs_source=f"{dataset} ({split} split)",
                         **_score_opts(tokenizer, meteor, no_brevity_penalty, metrics))
    train = [c for it in data.splits["train"] for c in it.raw] if "train" in data.splits else None
    diversity = diversity_rows(captions, {it.name: it.raw for it in items}, train, tokenizer)
    lp = cap.length_penalty_or(length_penalty)
    n_best = _nbest(rerank, nbest)
    mbr = n_best if rerank != "match" else None
    scored = f"{len(items)} of its {split_size} images (--max-images)" if len(items) < split_size else \
        f"{len(items)} images"
    rules, own = _caption_rules(cap, beam, given)
    print(f"{split} split, {scored}, beam {beam}, length penalty {lp:g}"
          + (f", MBR over the {mbr} best beams" if mbr else "")
          + (f", matcher over the {n_best} best beams (weight {cap.match_weight:g}"
             + (f", rare-word gain {cap.match_rare_weight:g}" if cap.match_rare_weight else "") + ")"
             if rerank == "match" else "")
          + (f", test-time {cap.tta}" if cap.tta else "")
          + "".join(f", {k.replace('_', ' ')} {v}" for k, v in given.items())
          + "".join(f", {k.replace('_', ' ')} {v} (the model's)" for k, v in own.items()))
    _print_report(rep)
    _print_diversity(diversity)
    if out:
        _write_json(out, {"model": _models_setting(model, weights), "dataset": dataset, "split": split,
                          "beam": beam, "length_penalty": lp, "mbr_nbest": mbr, "tta": cap.tta, "scale": "x100",
                          **({"rerank": "match", "nbest": n_best, "matcher": str(Path(matcher).resolve()),
                              "match_weight": cap.match_weight, "match_rare_weight": cap.match_rare_weight}
                             if rerank == "match" else {}),
                          "scores": {k: round(100 * v, 4) for k, v in rep.scores.items()},
                          "implementation": rep.implementation, "tokenizer": rep.tokenizer,
                          "empty_captions": len(rep.empty), "notes": rep.notes, "captions": captions,
                          "rules": rules, **({"controls": given} if given else {}),
                          **({"caption_lists": lists} if lists else {}),
                          **({"max_images": max_images, "images": len(items), "split_images": split_size}
                             if max_images else {}), "diversity": _diversity_doc(diversity)})
    return 0


def _caption_rules(cap, beam: int | None, given: dict) -> tuple[dict, dict]:
    """The caption rules a run decoded with: the model's own (its config, or an ensemble folder's
    ensemble.json) under the flags ``given`` (captionkit.inference.controls.MODEL_DEFAULTS); and
    of those, the model's own that are in force (not given, and not the plain default)."""
    from ..inference.controls import DEFAULT, MODEL_DEFAULTS

    used = cap.controls_for(None, beam, **given)
    rules = {k: getattr(used, k) for k in MODEL_DEFAULTS}
    return rules, {k: v for k, v in rules.items() if k not in given and v != getattr(DEFAULT, k)}


def add_zero_shot(sub: argparse._SubParsersAction) -> None:
    z = sub.add_parser("zero-shot", help="caption photos with an instruction-tuned vision-language model")
    z.set_defaults(func=cmd_zero_shot)
    z.add_argument("paths", nargs="+", metavar="PATH",
                   help="image files, folders to caption every image in, or http(s) URLs")
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


def cmd_zero_shot(paths: list[str], model: str, prompts: str | None, template: str | None,
                  json_out: str | None, batch_size: int, max_new_tokens: int, download: bool, dtype: str,
                  jsonl: str | None = None, csv_out: str | None = None, overwrite: bool = False,
                  retry_failed: bool = False, verbose: bool = False, device: str = "auto") -> int:
    from ..inference.zero_shot import ZeroShotCaptioner, load_prompts

    _check_sources(paths)
    where, _ = _device(device)
    prompt = load_prompts(prompts).get(template)
    settings = {"model": str(Path(model).resolve()) if Path(model).is_dir() else model, "prompt": prompt,
                "max_new_tokens": max_new_tokens, "dtype": dtype}
    writer = _caption_writer("zero-shot", paths, settings, json_out=json_out, jsonl=jsonl, csv_out=csv_out,
                             overwrite=overwrite, retry_failed=retry_failed, verbose=verbose)

    def answers(files: list[Path]):  # the model loads only when there are photos to answer
        cap = ZeroShotCaptioner.load(model, download=download, dtype=dtype, device=where)
        for path, res in cap.caption_files(files, prompt, batch_size=batch_size, max_new_tokens=max_new_tokens):
            if not isinstance(res, ImageError) and not res.text:
                print(f"warning: {writer.keys[path]}: nothing left of the answer {res.raw!r} after cleaning",
                      file=sys.stderr)
            yield path, res

    return writer.run(answers)
