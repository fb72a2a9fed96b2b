"""The score command: a captions file scored against references (--refs or a --dataset split),
with bootstrap intervals, per-image scores, or a paired test of two systems (--compare)."""

from __future__ import annotations

import argparse

from .common import (UsageError, _add_csv_opts, _add_overwrite, _add_score_opts, _check_targets, _diversity_doc,
                     _load_dataset, _print_diversity, _print_report, _score_opts, _write_json)


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
        # --captions alone: the diversity figures, which need no references
        needs = [opt for opt, given in (("--compare", compare), ("--per-image", per_image),
                                         ("--bootstrap", bootstrap)) if given]
        if needs:
            raise UsageError(f"{needs[0]} needs the references: --refs R.json or --dataset D --split S")
    if bootstrap < 0:
        raise UsageError(f"--bootstrap must be 0 (no intervals) or a number of resamples, got {bootstrap}")


def _references(refs: str | None, dataset: str | None, images: str | None, split: str, image_column: str,
                title_column: str, image_suffix: str) -> tuple[dict, str, list[str] | None]:
    """{image: [reference, ...]} from --refs or a --dataset split, where they came from, and the
    dataset's training captions (for the novel captions; None with --refs or no train split)."""
    if refs:
        from ..scoring.score_inputs import read_references
        return read_references(refs), refs, None
    data = _load_dataset(dataset, images, image_column, title_column, image_suffix)
    items = data.split(split)
    train = [c for it in data.splits["train"] for c in it.raw] if "train" in data.splits else None
    return {it.name: it.raw for it in items}, f"{dataset} ({split} split)", train


def add_score(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("score", help="score a {image: caption} JSON against references")
    s.set_defaults(func=cmd_score)
    s.add_argument("--captions", help="{image: caption} JSON (or coco-caption's [{\"image_id\": ..., \"caption\": ...}] list; "
                   "a caption may be a list of captions); alone, without references: the diversity figures")
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
    s.add_argument("--subset", action="store_true",
                   help="captions of only some of the references' images: score those images (said how many)")
    _add_overwrite(s, "replace the --json and --per-image files if they exist")
    _add_score_opts(s)
    _add_csv_opts(s)


def cmd_score(captions: str | None, refs: str | None, dataset: str | None, images: str | None, split: str,
              out: str | None, per_image: str | None, bootstrap: int, compare: list[str] | None,
              tokenizer: str, meteor: str, no_brevity_penalty: bool, metrics: str, seed: int,
              image_column: str, title_column: str, image_suffix: str, overwrite: bool = False,
              subset: bool = False) -> int:
    _check_score_inputs(captions, compare, per_image, refs, dataset, bootstrap)
    _check_targets(out, per_image, overwrite=overwrite)
    if not refs and not dataset:
        return _diversity_only(captions, tokenizer, out)
    ref, refs_source, train = _references(refs, dataset, images, split, image_column, title_column, image_suffix)
    opts = {**_score_opts(tokenizer, meteor, no_brevity_penalty, metrics), "refs_source": refs_source}
    if compare:
        return _score_compare(compare, ref, opts, bootstrap or 1000, seed, out, subset)
    return _score_one(captions, ref, opts, bootstrap, seed, out, per_image, subset, train)


def _diversity_only(captions: str, tokenizer: str, out: str | None) -> int:
    """score --captions C without references: the diversity figures alone."""
    from ..scoring.diversity import diversity_rows
    from ..scoring.score_inputs import read_caption_sets

    rows = diversity_rows(read_caption_sets(captions), tokenizer=tokenizer)
    _print_diversity(rows)
    if out:
        _write_json(out, {"diversity": _diversity_doc(rows)})
    return 0


def _covered(cand: dict, ref: dict, source: str, refs_source: str, subset: bool) -> tuple[dict, str]:
    """The references of the images ``cand`` captions and how to say so: all of ``ref``; with
    --subset, those of the images the captions cover (a caption of an image the references do
    not have is still refused, by score_captions). Captions of part of the references without
    --subset: one line naming --subset."""
    covered = {k: v for k, v in ref.items() if k in cand}
    if len(covered) == len(ref):
        return ref, f"{len(ref)} images"
    if not subset:
        if len(covered) == len(cand):  # a strict part: what --subset is for
            raise UsageError(f"{source}: captions {len(cand):,} of the {len(ref):,} images of {refs_source}; "
                             f"give --subset to score those {len(cand):,}")
        return ref, f"{len(ref)} images"  # strays: score_captions names them
    if not covered:
        raise UsageError(f"{source}: captions none of the images of {refs_source}")
    return covered, f"{len(covered):,} of the {len(ref):,} images of {refs_source} (--subset)"


def _score_compare(compare: list[str], ref: dict, opts: dict, rounds: int, seed: int, out: str | None,
                   subset: bool = False) -> int:
    """score --compare A B: a paired bootstrap test of two systems on the same references (with
    --subset, those of the images A captions; B must caption the same)."""
    from ..scoring.evaluation import paired_bootstrap, score_captions
    from ..scoring.score_inputs import read_captions

    systems = [read_captions(path) for path in compare]  # both files checked before scoring either
    ref, scored = _covered(systems[0], ref, compare[0], opts["refs_source"], subset)
    reps = [score_captions(c, ref, source=path, **opts) for c, path in zip(systems, compare)]
    result = paired_bootstrap(reps[0], reps[1], rounds=rounds, seed=seed)
    print(f"A = {compare[0]}, B = {compare[1]}: {scored}, paired bootstrap, {rounds} resamples; x100")
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
               per_image: str | None, subset: bool = False, train: list[str] | None = None) -> int:
    """score --captions C: one system's scores, with bootstrap intervals when asked, and the
    diversity of its captions beside the references'. An image may have several captions (an
    n-best list, samples): BLEU..CIDEr-D score its first, the diversity figures all of them."""
    from ..scoring.diversity import diversity_rows
    from ..scoring.evaluation import bootstrap as run_bootstrap
    from ..scoring.evaluation import score_captions
    from ..scoring.score_inputs import read_caption_sets

    sets = read_caption_sets(captions)
    cand = {k: v[0] for k, v in sets.items()}
    total = len(ref)
    ref, scored = _covered(cand, ref, captions, opts["refs_source"], subset)
    rep = score_captions(cand, ref, source=captions, **opts)
    if any(len(v) > 1 for v in sets.values()):
        rep.notes.append("several captions per image: BLEU..CIDEr-D score the first of each image, "
                         "the diversity figures all of them")
    ci = run_bootstrap(rep, rounds=bootstrap, seed=seed) if bootstrap else None
    rows = diversity_rows(sets, ref, train, opts["tokenizer"])
    print(scored + (f", bootstrap {bootstrap} resamples" if bootstrap else ""))
    _print_report(rep, ci)
    _print_diversity(rows)
    if out:
        doc = {k: round(100 * v, 4) for k, v in rep.scores.items()}
        if ci:
            doc["ci95"] = {k: [round(100 * lo, 4), round(100 * hi, 4)] for k, (lo, hi) in ci.items()}
        _write_json(out, {**doc, "implementation": rep.implementation, "tokenizer": rep.tokenizer,
                          "empty_captions": len(rep.empty), "notes": rep.notes,
                          **({"subset": {"images": len(ref), "of": total}} if len(ref) < total else {}),
                          "diversity": _diversity_doc(rows)})
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
