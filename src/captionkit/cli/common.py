"""What several command groups share: the usage error, the checks and helpers they call
(devices, datasets, outputs, Ray options, score options and the printed scores report), and the
functions adding the options they have in common (--overwrite, --device, a CSV dataset's
columns, the scorers, --engine ray)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..core.errors import UserError
from .argtypes import device_name, float_at_least, int_at_least, positive_int, processes_count


class UsageError(UserError):
    """Options that do not fit together, or a value the parser cannot check alone."""


MATCH_NBEST = 3  # beams --rerank match chooses among when --nbest is not given (chosen on Flickr8k dev)
MATCH_WEIGHT = 0.03  # --match-weight's default (chosen on Flickr8k dev, docs/decoding-controls.md)


def _write_json(path: str | Path, obj) -> None:
    from ..core.outputs import atomic_write_text

    atomic_write_text(path, json.dumps(obj, indent=1, ensure_ascii=False))


def _device(device: str, precision: str = "auto"):
    """--device and --precision -> (torch.device, resolved precision), or one line naming the
    device that is not here: called before anything loads (captionkit.core.devices)."""
    from ..core.devices import resolve_device
    from ..core.precision import resolve_precision

    where = resolve_device(device)
    return where, resolve_precision(precision, where)


def _load_dataset(dataset: str, images: str | None, image_column: str, title_column: str, image_suffix: str):
    from ..data.datasets import load_dataset
    return load_dataset(dataset, images, image_column, title_column, image_suffix)


def _ray_options(address: str | None, replicas: int | None, gpus_per_replica: float, batch_size: int,
                 shard_size: int | None, workers: int = 2):
    """--engine ray's options. On a cluster (``address``) each replica holds one CPU and runs
    one torch thread; on the local Ray the replicas share this machine's CPUs and run the
    local engine's torch threads (OMP_NUM_THREADS when set) or their share of the CPUs
    (captionkit.inference.ray_engine.local_options)."""
    from ..inference.ray_engine import DEFAULT_SHARD_SIZE, RayOptions, local_options

    shared = {"gpus_per_replica": gpus_per_replica, "batch_size": batch_size,
              "shard_size": shard_size or DEFAULT_SHARD_SIZE, "workers": workers}
    if address:
        return RayOptions(address=address, replicas=replicas, **shared)
    return local_options(os.cpu_count() or 1, replicas, _omp_threads(), **shared)


def _omp_threads() -> int | None:
    """OMP_NUM_THREADS as torch reads it (None when unset or not a positive number), without
    importing torch."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def _check_targets(*paths: str | None, overwrite: bool) -> None:
    """The files a scoring command will write: refused now, before any work, if they exist
    (without --overwrite) or cannot be written (see captionkit.core.outputs)."""
    from ..core.outputs import check_file_target

    given = [p for p in paths if p]
    for p in given:
        check_file_target(p, overwrite=overwrite)
    if len({Path(p).resolve() for p in given}) < len(given):
        raise UsageError(f"{given[0]}: given for two outputs; choose a file for each")


def _score_opts(tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str) -> dict:
    return {"tokenizer": tokenizer, "meteor": meteor, "brevity_penalty": not no_brevity_penalty,
            "metrics": [m.strip() for m in metrics.split(",") if m.strip()]}


def _print_report(rep, ci: dict | None = None) -> None:
    print(f"tokenisation: {rep.tokenizer}; scores x100")
    for k, v in rep.scores.items():
        interval = f"  [{100 * ci[k][0]:.2f}, {100 * ci[k][1]:.2f}] 95% CI" if ci and k in ci else ""
        print(f"  {k:8s} {100 * v:6.2f}{interval}   {rep.implementation[k]}")
    for note in rep.notes:
        print(f"note: {note}")


def _print_diversity(rows: dict) -> None:
    """The diversity figures (captionkit.scoring.diversity) of the captions and, when the
    references are known, of the references: the human row."""
    from ..scoring.diversity import format_diversity

    d = rows["captions"]
    human = ("; human: the references, " + ("the first of each image" if d.captions_per_image == 1 else
             f"the first {d.captions_per_image} of each image") +
             (" (all of them for the per-image figures)" if d.mbleu_4 is not None or
              rows["human"].mbleu_4 is not None else "")) if "human" in rows else ""
    novel = "; novel: not a training caption" if d.novel_captions is not None else ""
    print(f"diversity: PTB words, {d.captions:,} captions of {d.images:,} images{human}{novel}")
    print(format_diversity(rows))


def _diversity_doc(rows: dict) -> dict:
    """The diversity figures as the JSON outputs write them (shares 0..1, counts, words)."""
    return {label: d.as_dict() for label, d in rows.items()}


def _add_overwrite(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--overwrite", action="store_true",
                   help=f"{what} (a folder captionkit did not write is never replaced; see docs/outputs.md)")


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


def _add_processes_opt(p: argparse.ArgumentParser) -> None:
    """--processes: captioning on a CPU in several processes (captionkit.inference.processes)."""
    p.add_argument("--processes", type=processes_count, default=None, metavar="N",
                   help="CPU only: caption in N processes of threads/N torch threads each, every process "
                        "holding the model (1: this process alone; default auto: one per thread where the "
                        "images and memory allow, docs/speed.md); the captions are the same")


def _processes(processes: int | None, device, images: int, batch_size: int) -> int:
    """--processes resolved: ``auto`` (None) for this device and these images; a count given on
    a GPU is one line (the GPU is one device, fed by one process)."""
    import torch

    from ..inference.processes import auto_processes

    if processes is None:
        return auto_processes(device, torch.get_num_threads(), images, batch_size)
    if processes > 1 and torch.device(device).type != "cpu":
        raise UsageError(f"--processes {processes} splits the work of a CPU; the model runs on {device}: "
                         f"leave --processes out (or give 1)")
    return processes


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


def _add_engine_opts(p: argparse.ArgumentParser) -> None:
    """--engine ray and its options (captionkit.inference.ray_engine; docs/scale.md)."""
    p.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="local: this process; ray: model replicas on Ray, shards resumable")
    p.add_argument("--address", help="ray: a running Ray cluster (default: a local Ray on this machine's CPUs)")
    p.add_argument("--replicas", type=processes_count, default=None, metavar="N",
                   help="ray: model replicas (actors): on a cluster one CPU each (default 1), on the local Ray "
                        "sharing this machine's CPUs (default auto: caption as --processes auto, one per thread "
                        "where the images and memory allow; features 1)")
    p.add_argument("--gpus-per-replica", type=float_at_least(0), default=0,
                   help="ray: GPUs each replica holds (e.g. 1, or 0.5 for two replicas a GPU; default 0: CPU)")
    p.add_argument("--shard-size", type=positive_int, help="ray: images per output shard (default 1000)")


def _add_rule_opts(g, default: str) -> None:
    """The caption controls' rules (controls.MODEL_DEFAULTS), which a model's config or an
    ensemble folder may also set, on the argument group ``g``; ``default``: what one not given
    means. Shared by caption, evaluate, serve (_add_control_opts) and ensemble."""
    g.add_argument("--no-repeat-ngram", type=int_at_least(0), metavar="N",
                   help=f"block a word that would repeat an N-gram of the caption (0: none; default {default})")
    g.add_argument("--repetition-penalty", type=float_at_least(0), metavar="P",
                   help=f"CTRL's penalty on words the caption already holds (1: none, 1.2: the paper's; "
                        f"default {default})")
    g.add_argument("--rare-word-bonus", type=float_at_least(0), metavar="B",
                   help=f"favour words rarer than the 30 most frequent by B x ln(rank / 30) (word vocabularies; "
                        f"0: none; default {default})")
    g.add_argument("--min-words", type=int_at_least(0), metavar="N", help="no <end> before N words")
    g.add_argument("--max-words", type=positive_int, metavar="N",
                   help="end captions at N words (at most the model's own longest)")


def _add_control_opts(p: argparse.ArgumentParser, default: str = "none") -> None:
    """The caption controls (captionkit.inference.controls; docs/decoding-controls.md) of caption,
    evaluate and serve; each None unless given. ``default``: what an option not given means."""
    g = p.add_argument_group("caption controls (docs/decoding-controls.md)")
    _add_rule_opts(g, default)
    g.add_argument("--sample", action="store_true", default=None,
                   help="draw each word from the model's distribution instead of beam search (reproducible by "
                        "--seed)")
    g.add_argument("--temperature", type=float_at_least(0), metavar="T",
                   help="--sample: flatten (> 1) or sharpen (< 1) the distribution; 0: the most probable word "
                        "(default 1)")
    g.add_argument("--top-k", type=int_at_least(0), metavar="K", help="--sample: only among the K most probable "
                                                                       "words (0: all; default 0)")
    g.add_argument("--top-p", type=float_at_least(0), metavar="P",
                   help="--sample: only among the most probable words that together hold P of the probability "
                        "(nucleus sampling; default 1: all)")
    g.add_argument("--seed", type=int_at_least(0), metavar="S",
                   help="--sample: the seed (default 0); an image's draws depend only on it, the image and "
                        "the options, not on the batch")
    g.add_argument("--num-captions", type=positive_int, metavar="K",
                   help="K distinct captions per image: the beam's K best (K <= --beam), K draws with "
                        "--sample, or one per group in turn with --beam-groups; written as lists")
    g.add_argument("--beam-groups", type=positive_int, metavar="G",
                   help="diverse beam search (Vijayakumar et al. 2018): the beam split into G groups, each "
                        "penalised for the words of the groups before it (--beam a multiple of G)")
    g.add_argument("--diversity-strength", type=float_at_least(0), metavar="L",
                   help="--beam-groups: what a word costs per earlier group that chose it at that step "
                        "(default 0.5)")


CONTROLS_NEED = {"temperature": "sample", "top_k": "sample", "top_p": "sample", "seed": "sample",
                 "diversity_strength": "beam_groups"}


def _controls(options: dict, beam: int | None) -> tuple[dict, int]:
    """The caption controls given on the command line -> ({field: value} of those given, the
    beam width decoding uses: --beam, else 1 to sample and 3 for beam search), checked alone
    and against --beam (None: not given) without torch: one line for a value out of range or
    options that do not fit together."""
    from ..inference.controls import DEFAULT

    given = {k: v for k, v in options.items() if v is not None}
    for name, needs in CONTROLS_NEED.items():
        if name in given and not given.get(needs):
            raise UsageError(f"--{name.replace('_', '-')} is a --{needs.replace('_', '-')} option: give "
                             f"--{needs.replace('_', '-')} too")
    controls = DEFAULT.with_options(**given).check(beam)
    # what asks for nothing is not recorded (so a resumed file needs no option it was written
    # without); the rules are, even at their defaults: they override a model's own
    for name in ("num_captions", "beam_groups", "sample"):
        if name in given and given[name] == getattr(DEFAULT, name):
            del given[name]
    return given, controls.beam(beam)


def _check_models(models: list[str] | None, weights: list[float] | None, rerank: str | None = None,
                  nbest: int | None = None, candidates: str | None = None, matcher: str | None = None,
                  match_weight: float | None = None, match_rare_weight: float | None = None) -> None:
    """--model/--weights/--rerank/--nbest/--matcher that do not fit together, refused before
    anything loads."""
    if rerank == "match" and not matcher:
        raise UsageError("--rerank match needs --matcher DIR (captionkit matcher trains one)")
    for flag, given in (("--matcher", matcher), ("--match-weight", match_weight is not None),
                        ("--match-rare-weight", match_rare_weight is not None)):
        if given and rerank != "match":
            raise UsageError(f"{flag} is for --rerank match: give it too")
    if matcher and not (Path(matcher) / "config.json").is_file():
        raise UsageError(f"--matcher {matcher}: not a checkpoint folder (no config.json)")
    if weights and len(weights) != len(models or []):
        raise UsageError(f"--weights gives {len(weights)} weights for {len(models or [])} --model: "
                         f"give one per model (ensembles: several --model)")
    if nbest and not (rerank or candidates):
        raise UsageError("--nbest is the number of beams --rerank mbr chooses among, or --candidates "
                         "writes: give one of them")
    if candidates and not (rerank or nbest):
        raise UsageError("--candidates writes the n best beams: give --nbest N (or --rerank mbr)")


def _add_tta_opt(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tta", choices=("flip", "flip-zoom", "none"),  # ensemble.TTA and TTA_OFF, without torch
                   help="test-time augmentation: flip decodes each photo and its mirror image as one ensemble "
                        "(a second encoder pass); flip-zoom four views, those two and the centre crop of 0.85 "
                        "of each side and its mirror image (four passes); none: no augmentation, even where an "
                        "ensemble folder asks for one (default: none, or what an ensemble folder says)")
