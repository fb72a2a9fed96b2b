"""The commands about models as wholes: models (the shipped ones, with their test scores),
ensemble (an ensemble folder: several models decoded as one) and rerank (several files'
candidates, one caption each by consensus); each one's options beside its code."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..inference.shipped import list_shipped_models
from .argtypes import float_at_least, int_at_least, positive_floats
from .common import MATCH_NBEST, MATCH_WEIGHT, _add_overwrite, _add_rule_opts, _add_tta_opt, _check_models


def add_models(sub: argparse._SubParsersAction) -> None:
    o = sub.add_parser("models", help="list the shipped models (any of them is a --model NAME)")
    o.set_defaults(func=cmd_models)


MODELS_SCORES = (("Bleu_4", "BLEU-4"), ("METEOR", "METEOR"), ("CIDEr", "CIDEr-D"))  # captionkit models' columns


def cmd_models() -> int:
    """The shipped models as a table: name, family, encoder, size and Flickr8k test scores
    (read from each folder: config.json or ensemble.json, and scores.json)."""
    from ..inference.shipped import shipped_model_facts

    facts = [shipped_model_facts(name) for name in list_shipped_models()]
    rows = [["model", "family", "encoder", "size", *(label for _, label in MODELS_SCORES), ""]]
    for f in facts:
        scores = [f"{f['scores'][k]:.2f}" if k in f["scores"] else "-" for k, _ in MODELS_SCORES]
        rows.append([f["name"], f["family"], f["encoder"], f"{f['size_mb']:.1f} MB", *scores,
                     "(the default)" if f["default"] else ""])
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    numeric = range(3, 3 + 1 + len(MODELS_SCORES))  # size and the scores: right-aligned
    for row in rows:
        cells = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        print("  ".join(cells).rstrip())
    print("scores: Flickr8k test split (1,000 images), beam 3, coco-caption scorers, x100; "
          "each model's card has the commands that reproduce them")
    return 0


def add_ensemble(sub: argparse._SubParsersAction) -> None:
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
    _add_rule_opts(n.add_argument_group("caption rules the ensemble decodes with unless told otherwise "
                                        "(docs/decoding-controls.md)"), default="the first member's")
    r = n.add_argument_group("the folder's own reranker: its captions chosen among the beam's n best by a matcher "
                             "unless told otherwise (--rerank none; docs/decoding-controls.md)")
    r.add_argument("--rerank", choices=("match",), help="match: by probability, the matcher's score and the "
                                                        "rare-word gain, as caption --rerank match chooses")
    r.add_argument("--matcher", metavar="DIR", help="the matcher checkpoint (captionkit matcher); a copy is kept "
                                                    "in the folder, narrowed to the members' words")
    r.add_argument("--match-weight", type=float_at_least(0), metavar="W",
                   help=f"the matcher's weight (default {MATCH_WEIGHT})")
    r.add_argument("--match-rare-weight", type=float_at_least(0), metavar="C",
                   help="the rare-word gain's weight (default 0)")
    r.add_argument("--nbest", type=int_at_least(2), metavar="N",
                   help=f"beams the reranker chooses among (default {MATCH_NBEST})")
    n.add_argument("--out", required=True, help="the ensemble folder to write")
    _add_overwrite(n, "replace the ensemble.json of an existing ensemble folder (and its matcher)")


def cmd_ensemble(model: list[str], weights: list[float] | None, length_penalty: float | None, combine: str,
                 out: str, overwrite: bool, tta: str | None = None, rerank: str | None = None,
                 matcher: str | None = None, match_weight: float | None = None,
                 match_rare_weight: float | None = None, nbest: int | None = None, **rule_options) -> int:
    """Write an ensemble folder (captionkit.inference.ensemble) naming the members, after loading them
    together once (with the matcher, when it has its own reranker), so a folder that is written
    is one that loads."""
    from ..core.outputs import check_folder_target
    from ..inference.captioner import Captioner
    from ..inference.ensemble import KIND, member_entry, write_ensemble
    from ..inference.rerank import FolderRerank
    from ..inference.shipped import SHIPPED

    _check_models(model, weights, rerank, nbest, None, matcher, match_weight, match_rare_weight)
    rules = {k: v for k, v in rule_options.items() if v is not None}  # the rule options given
    target = check_folder_target(out, overwrite=overwrite, kinds=(KIND,))
    own = FolderRerank(Path(matcher), nbest or MATCH_NBEST, MATCH_WEIGHT if match_weight is None else match_weight,
                       match_rare_weight or 0.0) if rerank else None
    # loaded only to check the members fit (and the matcher them: its encoder, the vocabulary's kind)
    cap = Captioner.load_ensemble(model, weights, length_penalty=length_penalty, rules=rules, combine=combine,
                                  with_encoder=own is not None, device="cpu")
    if own:
        cap.use_matcher(own.matcher, own.weight, own.rare_weight)
    members = [member_entry(Path(p), target, SHIPPED) for p in cap.config["ensemble"]["members"]]
    words = set(cap.vocab.words) if own and cap.vocab.kind == "word" else None  # what its captions can say
    path = write_ensemble(target, members, cap.decoder.weights, cap.length_penalty, cap.max_len, combine, tta, rules,
                          own, words)
    print(f"wrote {path}: {len(members)} members, weights "
          + ", ".join(f"{w:.3g}" for w in cap.decoder.weights) + f", length penalty {cap.length_penalty:g}"
          + (f", test-time {tta}" if tta else "") + "".join(f", {k} {v:g}" for k, v in rules.items())
          + (f", reranked by its matcher over the {own.nbest} best beams (weight {own.weight:g}, rare-word gain "
             f"{own.rare_weight:g})" if own else ""))
    return 0


def add_rerank(sub: argparse._SubParsersAction) -> None:
    r = sub.add_parser("rerank", help="choose each image's caption among several files' candidates by consensus (MBR)")
    r.set_defaults(func=cmd_rerank)
    r.add_argument("candidates", nargs="+", metavar="FILE",
                   help="JSON {image: [caption, ...]} or {image: caption}, one per model; all cover the same images")
    r.add_argument("--json", dest="json_out", metavar="OUT", help="write {image: caption} here")
    _add_overwrite(r, "replace an existing OUT")


def cmd_rerank(candidates: list[str], json_out: str | None, overwrite: bool) -> int:
    from ..inference.rerank import rerank_files

    chosen = rerank_files(candidates, json_out, overwrite)
    if not json_out:
        for k, c in chosen.items():
            print(f"{k}\t{c}")
    return 0
