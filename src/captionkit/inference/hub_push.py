"""``captionkit push``: a model folder staged for the Hugging Face Hub and uploaded
(docs/hf-models.md#the-hub). What is staged, and how a pushed model is downloaded and checked:
captionkit.inference.hub. Apart from it because it needs the captioner (the sample captions) and
the ensemble's reader, which ``--model hub:`` resolution must not import."""

from __future__ import annotations

import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from ..core.errors import CheckpointError, UserError
from .folders import ENSEMBLE_FILE, SCORES_FILE, is_ensemble
from .hub import (CARD_FILE, REPO_SAMPLES, _is_network_error, check_repo_id, checkpoint_files, model_files,
                  require_hub, write_digest)
from .shipped import SHIPPED, existing_model_folder

if TYPE_CHECKING:
    from .rerank import FolderRerank


@dataclass
class Staged:
    """What :func:`stage_push` wrote: the folder, its files, and what the user should know."""

    folder: Path
    files: list[str]
    size: int  # bytes, all files together
    notes: list[str] = field(default_factory=list)


def _members(folder: Path) -> tuple[list[tuple[Path, str]], dict | None, FolderRerank | None]:
    """An ensemble's members as (source folder, path in the pushed folder), its ensemble.json
    rewritten to name those paths (None when it already does), and its own reranker (None: none):
    a member inside the folder keeps its path, a shipped or outside one is copied in under its
    folder's name."""
    from .ensemble import read_ensemble

    spec = read_ensemble(folder)  # checked: one line for a broken file
    doc = json.loads((folder / ENSEMBLE_FILE).read_text())
    used, members, entries, changed = set(), [], [], False
    for m, source in zip(spec.members, spec.member_folders(SHIPPED)):
        rel = PurePosixPath(m["path"]) if "path" in m else None
        if rel is not None and not rel.is_absolute() and ".." not in rel.parts:
            dest = rel.as_posix()
        else:  # a shipped model or a folder outside: the pushed folder holds its own copy
            base, dest, k = source.resolve().name, source.resolve().name, 1
            while dest in used:
                k += 1
                dest = f"{base}-{k}"
            changed = True
        used.add(dest)
        members.append((source, dest))
        entries.append({"path": dest, **{k: v for k, v in m.items() if k not in ("path", "shipped")}})
    return members, ({**doc, "members": entries} if changed else None), spec.rerank


def _copy_checkpoint(source: Path, dest: Path, label: str) -> list[str]:
    """Copy a checkpoint's loaded files (and its captionkit marker) into ``dest``; refused if a
    tensor file is not the one its config.json records (changed or damaged on this disk)."""
    from ..core.checkpoint import DIGESTS, file_sha256, read_config
    from ..core.outputs import MARKER

    recorded = read_config(source).get(DIGESTS) or {}
    dest.mkdir(parents=True, exist_ok=True)
    names = checkpoint_files(source, label)
    for name in names + ([MARKER] if (source / MARKER).is_file() else []):
        if not (source / name).is_file():
            raise CheckpointError(f"{source / name}: missing")
        shutil.copyfile(source / name, dest / name)
        if name in recorded and file_sha256(dest / name) != recorded[name]:
            raise CheckpointError(f"{source / name}: its sha256 differs from the one {source / 'config.json'} "
                                  f"records (corrupted, or changed while pushing); nothing was pushed")
    return names


def default_samples() -> list[Path]:
    """The repository's sample photos when captionkit runs from a clone of it, else none."""
    if (REPO_SAMPLES / "LICENSE.md").is_file():
        return sorted(REPO_SAMPLES.glob("*.jpg"))
    return []


@dataclass
class PushPlan:
    """A push's inputs, all checked before the model loads (:func:`plan_push`)."""

    folder: Path
    repo_id: str
    scores: Path | None
    samples: list[Path]
    license: str | None = None
    dataset_ids: list[str] | None = None
    notes: list[str] = field(default_factory=list)


def plan_push(model: str | None, repo_id: str, scores: str | None = None, samples: list[str] | None = None,
              license: str | None = None, dataset_ids: list[str] | None = None) -> PushPlan:
    """Check what ``captionkit push`` was given, cheaply: the name, the model folder and its files,
    the scores file (captionkit.inference.hub_card.read_scores), the sample photos."""
    from ..data.images import scan_images
    from .hub_card import read_scores

    require_hub("captionkit push")
    check_repo_id(repo_id)
    folder = existing_model_folder(model)
    for rel in model_files(folder, str(folder)):  # a folder that is not a model: one line now
        if not (folder / rel).is_file():
            raise CheckpointError(f"{folder / rel}: missing")
    notes = []
    if scores is None and (folder / SCORES_FILE).is_file():
        scores_path: Path | None = folder / SCORES_FILE
    elif scores is not None:
        scores_path = Path(scores)
    else:
        scores_path = None
        notes.append("no scores: the card has none and no model-index (give --scores, a JSON "
                     "`captionkit evaluate --out` wrote)")
    if scores_path is not None:
        read_scores(scores_path, folder)
    if samples is None:
        photos = default_samples()
    else:
        scan = scan_images(samples)
        if scan.refused:
            raise UserError(f"--samples: {scan.refused[0].path}: {scan.refused[0].reason}")
        if not scan.images:
            raise UserError(f"--samples: no image files found in {' '.join(samples)}")
        photos = scan.images
    if not photos:
        notes.append("no sample photos: the card shows no sample captions (give --samples)")
    return PushPlan(folder, repo_id, scores_path, photos, license, dataset_ids, notes)


def stage_push(plan: PushPlan, out: str | Path, overwrite: bool = False) -> Staged:
    """Write into ``out`` exactly what ``captionkit push`` uploads (see the module's text): the
    model loaded once on the CPU in float32 (every tensor file checked against its recorded
    digest) to caption the sample photos, then its files copied, the card, the scores and the
    digest written. ``out`` must be new or empty, or, with ``overwrite``, a model folder captionkit
    wrote (captionkit.core.outputs)."""
    from ..core.checkpoint import atomic_folder
    from ..core.outputs import check_folder_target, write_marker
    from .captioner import Captioner
    from .hub_card import card_facts, render_card

    check_folder_target(out, overwrite=overwrite, kinds=("checkpoint", "ensemble"))
    folder = plan.folder
    cap = Captioner.load(folder, device="cpu", precision="fp32")
    captions = [(Path(r.source).name, r.text if r.ok else None) for r in cap(list(map(str, plan.samples)))] \
        if plan.samples else []
    notes = list(plan.notes)
    kind = "ensemble" if is_ensemble(folder) else "checkpoint"
    with atomic_folder(out, replace=overwrite) as tmp:  # (marked below, before the digest that lists the marker)
        if kind == "checkpoint":
            _copy_checkpoint(folder, tmp, str(folder))
        else:
            members, rewritten, own = _members(folder)
            for source, dest in members:
                _copy_checkpoint(source, tmp / dest, str(folder))
            if own is not None:  # its own reranker's matcher, inside the folder: at the same place
                shutil.copytree(own.matcher, tmp / own.matcher.relative_to(folder))
            if rewritten is None:
                shutil.copyfile(folder / ENSEMBLE_FILE, tmp / ENSEMBLE_FILE)
            else:
                (tmp / ENSEMBLE_FILE).write_text(json.dumps(rewritten, indent=1) + "\n")
                notes.append("members outside the ensemble folder (or shipped ones) are copied into it: "
                             + ", ".join(dest for _, dest in members))
        if plan.scores is not None:
            shutil.copyfile(plan.scores, tmp / SCORES_FILE)  # as written: the card's figures are its figures
        write_marker(tmp, kind)  # so that --overwrite may replace a --dry-run folder
        facts = card_facts(tmp, cap, plan, captions)
        notes += facts.warnings
        (tmp / CARD_FILE).write_text(render_card(facts))
        write_digest(tmp)
    out = Path(out)
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    return Staged(out, files, sum((out / f).stat().st_size for f in files), notes)


# ---- the upload ------------------------------------------------------------------------------------
def check_login(hub) -> None:
    """A token for the upload (hf auth login, or HF_TOKEN), checked before the model loads."""
    if not hub.get_token():
        raise UserError("not logged in to the Hugging Face Hub: run `hf auth login` or set HF_TOKEN "
                        "(--dry-run DIR writes the folder without uploading)")


def upload(staged: Staged, repo_id: str, *, private: bool = False, revision: str | None = None,
           message: str | None = None) -> str:
    """Upload a staged folder (the repository created if missing, ``revision`` as a branch from
    main if missing); -> the commit's URL. A refusal or a failed connection is one line."""
    hub = require_hub("captionkit push")
    api = hub.HfApi()
    try:
        api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        info = api.upload_folder(repo_id=repo_id, folder_path=staged.folder, revision=revision,
                                 commit_message=message or f"captionkit push: {staged.folder.name}")
    except Exception as e:
        if not _is_network_error(e):
            raise
        raise UserError(f"push to {repo_id}: {(str(e).strip().splitlines() or [type(e).__name__])[0]}") from None
    return str(getattr(info, "commit_url", info))


def push(plan: PushPlan, *, private: bool = False, revision: str | None = None,
         message: str | None = None) -> tuple[Staged, str]:
    """Stage into a temporary folder and upload it (:func:`stage_push`, :func:`upload`)."""
    with tempfile.TemporaryDirectory(prefix="captionkit-push-") as tmp:
        staged = stage_push(plan, Path(tmp) / plan.repo_id.split("/")[-1])
        return staged, upload(staged, plan.repo_id, private=private, revision=revision, message=message)
