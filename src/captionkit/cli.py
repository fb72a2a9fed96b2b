"""The ``captionkit`` command line. Each subcommand is a typed function; errors a user can fix
are printed as one line naming the file or field, never as a traceback."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import CheckpointError, DatasetError, ImageError, WeightsUnavailable


class UsageError(ValueError):
    pass


def _write_json(path: str | Path, obj) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, ensure_ascii=False))
    os.replace(tmp, path)


def _read_json(path: str | Path, what: str):
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: no such {what} file") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None


def cmd_caption(paths: list[str], model: str | None, beam: int, json_out: str | None,
                attention: str | None, batch_size: int, length_penalty: float | None) -> int:
    from .captioner import Captioner
    from .images import find_images, load_rgb

    files = find_images(paths)
    if not files:
        raise UsageError(f"no image files found in {' '.join(paths)}")
    cap = Captioner.load(model)
    names = [f.name for f in files]
    dup = {n for n in names if names.count(n) > 1}
    captions: dict[str, str] = {}
    failed = 0
    for path, res in cap.caption_files(files, beam=beam, batch_size=batch_size, length_penalty=length_penalty):
        if isinstance(res, ImageError):
            failed += 1
            print(f"error: {res}", file=sys.stderr)
            continue
        key = str(path) if path.name in dup else path.name
        captions[key] = res.text
        print(f"{key}\t{res.text}", flush=True)
        if attention:
            from .figures import save_attention_figure
            fig = Path(attention) / f"{Path(key).stem if path.name not in dup else key.replace(os.sep, '_')}.png"
            save_attention_figure(load_rgb(path), res.words, res.attention, res.grid, fig)
    if json_out:
        _write_json(json_out, captions)
    if failed:
        print(f"{failed} of {len(files)} images could not be captioned", file=sys.stderr)
        return 1
    return 0


def _refs_for(dataset: str, images: str | None, split: str) -> dict[str, list[str]]:
    from .data import load_dataset
    return {it.name: it.raw for it in load_dataset(dataset, images).split(split)}


def cmd_evaluate(model: str | None, dataset: str, images: str | None, split: str, beam: int,
                 out: str | None, batch_size: int, length_penalty: float | None,
                 tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str) -> int:
    from .captioner import Captioner
    from .data import load_dataset
    from .evaluation import score_captions

    items = load_dataset(dataset, images).split(split)
    cap = Captioner.load(model)
    captions, failed = {}, []
    for path, res in cap.caption_files([it.path for it in items], beam=beam, batch_size=batch_size,
                                       length_penalty=length_penalty):
        if isinstance(res, ImageError):
            failed.append(str(res))
        else:
            captions[path.name] = res.text
    if failed:
        raise UsageError(f"{len(failed)} {split} images could not be read, e.g. {failed[0]}")
    rep = score_captions(captions, {it.name: it.raw for it in items},
                         **_score_opts(tokenizer, meteor, no_brevity_penalty, metrics))
    lp = cap.length_penalty_or(length_penalty)
    print(f"{split} split, {len(items)} images, beam {beam}, length penalty {lp:g}")
    _print_report(rep)
    if out:
        _write_json(out, {"model": str(model or "shipped default"), "dataset": dataset, "split": split,
                          "beam": beam, "length_penalty": lp, "scale": "x100",
                          "scores": {k: round(100 * v, 4) for k, v in rep.scores.items()},
                          "implementation": rep.implementation, "tokenizer": rep.tokenizer,
                          "captions": captions})
    return 0


def _print_report(rep, ci: dict | None = None) -> None:
    print(f"tokenisation: {rep.tokenizer}; scores x100")
    for k, v in rep.scores.items():
        interval = f"  [{100 * ci[k][0]:.2f}, {100 * ci[k][1]:.2f}] 95% CI" if ci and k in ci else ""
        print(f"  {k:8s} {100 * v:6.2f}{interval}   {rep.implementation[k]}")


def _score_opts(tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str) -> dict:
    return {"tokenizer": tokenizer, "meteor": meteor, "brevity_penalty": not no_brevity_penalty,
            "metrics": [m.strip() for m in metrics.split(",") if m.strip()]}


def cmd_score(captions: str | None, refs: str | None, dataset: str | None, images: str | None, split: str,
              out: str | None, per_image: str | None, bootstrap: int, compare: list[str] | None,
              tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str, seed: int) -> int:
    from .evaluation import bootstrap as run_bootstrap
    from .evaluation import paired_bootstrap, score_captions

    if refs:
        ref = _read_json(refs, "references")
    elif dataset:
        ref = _refs_for(dataset, images, split)
    else:
        raise UsageError("give the references: --refs R.json or --dataset D --split S")
    opts = _score_opts(tokenizer, meteor, no_brevity_penalty, metrics)
    if compare:
        if captions:
            raise UsageError("give either --captions or --compare A.json B.json")
        reps = []
        for path in compare:
            reps.append(score_captions(_read_json(path, "captions"), ref, source=path, **opts))
        rounds = bootstrap or 1000
        result = paired_bootstrap(reps[0], reps[1], rounds=rounds, seed=seed)
        print(f"A = {compare[0]}, B = {compare[1]}: {len(ref)} images, paired bootstrap, {rounds} resamples; x100")
        for k, r in result.items():
            verdict = ("A beats B" if r["p_A_not_better"] < 0.05 else
                       "B beats A" if r["p_B_not_better"] < 0.05 else "no significant difference")
            p = min(r["p_A_not_better"], r["p_B_not_better"])
            print(f"  {k:8s} A {100 * r['A']:6.2f}  B {100 * r['B']:6.2f}  delta {100 * r['delta']:+6.2f}  "
                  f"p = {p:.4f}  {verdict}")
        if out:
            _write_json(out, {k: {**{x: round(100 * r[x], 4) for x in ("A", "B", "delta")},
                                  "p_A_not_better": r["p_A_not_better"], "p_B_not_better": r["p_B_not_better"]}
                              for k, r in result.items()})
        return 0
    if not captions:
        raise UsageError("give --captions C.json (or --compare A.json B.json)")
    cand = _read_json(captions, "captions")
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
        _write_json(out, doc)
    if per_image:
        _write_per_image(per_image, rep, cand)
    return 0


def _write_per_image(path: str, rep, cand: dict) -> None:
    import csv
    import io

    from .metrics import bleu_from_sums
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
    tmp = Path(path).with_name(f".{Path(path).name}.{os.getpid()}.tmp")
    tmp.write_text(buf.getvalue())
    os.replace(tmp, path)


def cmd_train(config: str, out: str | None, max_steps: int | None, resume: bool, init: str | None) -> int:
    from .train import train
    train(config, out=out, max_steps=max_steps, resume=resume, init=init)
    return 0


def cmd_features(dataset: str, images: str | None, encoder: str) -> int:
    from .data import load_dataset
    from .encoders import create_encoder
    from .features import build_features

    ds = load_dataset(dataset, images)
    store = build_features(create_encoder(encoder), [it.path for it in ds.all_items()])
    print(f"{len(store.index)} images, grid {store.grid}: {store.folder}")
    return 0


def cmd_pack(checkpoint: str, out: str, fp16: bool) -> int:
    """Copy a trained checkpoint without its optimizer state (optionally its decoder in float16)
    for shipping; fine-tuned encoder blocks stay float32, like the rest of the encoder."""
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


def _add_score_opts(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", choices=("auto", "java", "python"), default="auto",
                   help="PTB tokenisation by the Java jar or the Python re-implementation (auto: Java if present)")
    p.add_argument("--meteor", choices=("auto", "jar", "nltk", "none"), default="auto",
                   help="METEOR 1.5 jar (Java) or nltk's approximation (auto: the jar if Java is present)")
    p.add_argument("--no-brevity-penalty", action="store_true",
                   help="BLEU without the brevity penalty, as the Show, Attend and Tell paper reports")
    p.add_argument("--metrics", default="bleu,meteor,rouge,cider",
                   help="comma-separated: bleu, meteor, rouge, cider, spice")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="captionkit", description="Image captioning: caption, train, evaluate.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("caption", help="caption image files or folders")
    c.add_argument("paths", nargs="+")
    c.add_argument("--model", help="checkpoint folder (default: the shipped model)")
    c.add_argument("--beam", type=int, default=3)
    c.add_argument("--json", dest="json_out", help="write {filename: caption} here")
    c.add_argument("--attention", metavar="DIR", help="write one attention figure per image here")
    c.add_argument("--batch-size", type=int, default=16)
    c.add_argument("--length-penalty", type=float, default=None,
                   help="rank beams by logprob / (words + 1) ** this (0: plain sum; default: the model's)")

    e = sub.add_parser("evaluate", help="caption a dataset split and score it (coco-caption scorers)")
    e.add_argument("--model")
    e.add_argument("--dataset", required=True)
    e.add_argument("--images", help="image folder of a JSON dataset")
    e.add_argument("--split", default="test")
    e.add_argument("--beam", type=int, default=3)
    e.add_argument("--out", help="write scores and every caption to this JSON")
    e.add_argument("--batch-size", type=int, default=16)
    e.add_argument("--length-penalty", type=float, default=None)
    _add_score_opts(e)

    s = sub.add_parser("score", help="score a {image: caption} JSON against references")
    s.add_argument("--captions", help="{image: caption} JSON")
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
    _add_score_opts(s)

    t = sub.add_parser("train", help="train a decoder from a TOML config")
    t.add_argument("--config", required=True)
    t.add_argument("--out", help="run folder (default runs/<config name>)")
    t.add_argument("--max-steps", type=int)
    t.add_argument("--resume", action="store_true", help="continue from OUT/last")
    t.add_argument("--init", metavar="DIR", help="start from this checkpoint (replaces the config's train.init)")

    f = sub.add_parser("features", help="compute and cache a dataset's encoder features")
    f.add_argument("--dataset", required=True)
    f.add_argument("--images")
    f.add_argument("--encoder", default="efficientnet_lite2")

    k = sub.add_parser("pack", help="copy a checkpoint without optimizer state, for shipping")
    k.add_argument("checkpoint")
    k.add_argument("out")
    k.add_argument("--fp16", action="store_true")
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
    fn = globals()[f"cmd_{command}"]
    try:
        if args.get("beam") is not None and args["beam"] < 1:
            raise UsageError(f"--beam must be at least 1, got {args['beam']}")
        return fn(**args)
    except (UsageError, ImageError, DatasetError, CheckpointError, WeightsUnavailable) as e:
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
