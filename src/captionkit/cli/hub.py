"""captionkit push: a model onto the Hugging Face Hub, with a generated model card
(captionkit.inference.hub; docs/hf-models.md#the-hub). Loading one back is --model hub:ORG/NAME,
which every command taking --model resolves (captionkit.inference.shipped.model_folder)."""

from __future__ import annotations

import argparse
import sys

from .common import _add_overwrite


def add_push(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("push", help="upload a model to the Hugging Face Hub with a generated model card")
    p.set_defaults(func=cmd_push)
    p.add_argument("model", metavar="MODEL", help="checkpoint or ensemble folder, or a shipped model's name")
    p.add_argument("repo_id", metavar="ORG/NAME", help="the model's repository on the Hub (created if missing)")
    p.add_argument("--private", action="store_true",
                   help="create the repository private (an existing one keeps its visibility)")
    p.add_argument("--revision", metavar="BRANCH", help="push to this branch, created from main if missing "
                                                       "(default: main)")
    p.add_argument("--dry-run", metavar="DIR",
                   help="write exactly the folder that would be uploaded into DIR, and upload nothing")
    p.add_argument("--scores", metavar="JSON", help="the scores for the card and its model-index: a JSON "
                   "`captionkit evaluate --out` wrote for this model (default: the folder's scores.json, if any)")
    p.add_argument("--samples", nargs="+", metavar="PATH", help="photos or folders whose captions the card shows "
                   "(default: the repository's samples/ when captionkit runs from a clone)")
    p.add_argument("--license", help="the card's licence, as the Hub names them (mit, apache-2.0, cc-by-4.0, ...)")
    p.add_argument("--dataset-id", action="append", dest="dataset_ids", metavar="ID",
                   help="a Hub dataset the model was trained on, for the card's metadata; repeat for several "
                        "(default: the training data's folder name)")
    p.add_argument("--message", help="the commit message (default: captionkit push: NAME)")
    _add_overwrite(p, "replace the --dry-run DIR if it is a model folder captionkit wrote")


def cmd_push(model: str, repo_id: str, private: bool, revision: str | None, dry_run: str | None,
             scores: str | None, samples: list[str] | None, license: str | None, dataset_ids: list[str] | None,
             message: str | None, overwrite: bool) -> int:
    from ..core.outputs import check_folder_target
    from ..inference.hub import require_hub
    from ..inference.hub_push import check_login, plan_push, push, stage_push

    # everything the user gave is checked before the model loads and its samples are captioned
    plan = plan_push(model, repo_id, scores, samples, license, dataset_ids)
    if dry_run:
        check_folder_target(dry_run, overwrite=overwrite, kinds=("checkpoint", "ensemble"))
    else:
        check_login(require_hub("captionkit push"))
    for note in plan.notes:
        print(f"note: {note}", file=sys.stderr)
    if dry_run:
        staged = stage_push(plan, dry_run, overwrite=overwrite)
        where = f"wrote {staged.folder} (nothing uploaded)"
    else:
        staged, url = push(plan, private=private, revision=revision, message=message)
        where = f"pushed to {url}"
    for note in staged.notes[len(plan.notes):]:
        print(f"note: {note}", file=sys.stderr)
    print(f"{where}: {len(staged.files)} files, {staged.size / 1e6:.1f} MB")
    return 0
