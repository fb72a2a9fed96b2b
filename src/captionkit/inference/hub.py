"""captionkit models on the Hugging Face Hub (docs/hf-models.md#the-hub).

``captionkit push MODEL ORG/NAME`` uploads what :func:`stage_push` writes: the model's files (a
checkpoint's ``config.json`` and tensor files, or an ensemble's ``ensemble.json`` and each
member's), a model card ``README.md`` with the Hub's metadata (captionkit.inference.hub_card), the
scores as ``scores.json`` when there are any, and :data:`DIGEST_FILE`, the sha256 of every file but
the card. ``--model hub:ORG/NAME[@REVISION]`` and ``Captioner.from_pretrained("ORG/NAME")`` download a
pushed model through huggingface_hub's cache (:func:`hub_folder`: revisions, ``HF_HUB_OFFLINE``,
``HF_HOME`` as huggingface_hub has them) and check every file against that digest before anything
loads: a changed or damaged file is refused with one line naming it, and a model without the
digest is refused too. Nothing falls back to other weights.

Light at import (no torch, no huggingface_hub): ``--model`` is resolved through here before torch
loads (captionkit.inference.shipped.model_folder)."""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from ..core.errors import CheckpointError, UserError, WeightsUnavailable
from .shipped import ENSEMBLE_FILE, SCORES_FILE, SHIPPED, existing_model_folder, is_ensemble

HUB_PREFIX = "hub:"  # --model hub:ORG/NAME[@REVISION]
DIGEST_FILE = "captionkit-digest.json"  # {"format", "version", "sha256": {path in the repository: hex digest}}
DIGEST_FORMAT, DIGEST_VERSION = "captionkit-digest", 1
CARD_FILE = "README.md"
# not in the digest: the card is the model's page on the Hub, which its owners may edit there
UNDIGESTED = (CARD_FILE, DIGEST_FILE)
TRAINING_ONLY = "optimizer.safetensors"  # a training checkpoint's optimizer state: not pushed
REPO_SAMPLES = Path(__file__).resolve().parents[3] / "samples"  # the repository's photos, in a clone
HUB_EXTRA = "pip install 'captionkit[hub]'"


def require_hub(needed_by: str):
    """The ``huggingface_hub`` module, or one line saying how to install it."""
    try:
        import huggingface_hub
    except ImportError:
        raise UserError(f"{needed_by} needs the 'huggingface_hub' package ({HUB_EXTRA})") from None
    return huggingface_hub


def check_repo_id(repo_id: str, given: str | None = None) -> str:
    """``repo_id`` if the Hub can name a model so (NAME or ORG/NAME), else one line."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(repo_id)
    except HFValidationError:
        raise UserError(f"{given or repo_id!r}: not a model name on the Hub (ORG/NAME, of letters, digits, "
                        f"'-', '_' and '.')") from None
    return repo_id


def parse_hub_ref(text: str) -> tuple[str, str | None]:
    """``hub:ORG/NAME[@REVISION]`` (or the same without ``hub:``) -> (ORG/NAME, REVISION or None)."""
    require_hub(f"--model {text}")
    body = text[len(HUB_PREFIX):] if text.startswith(HUB_PREFIX) else text
    repo_id, at, revision = body.partition("@")
    if at and not revision:
        raise UserError(f"{text}: nothing after '@' (hub:ORG/NAME@REVISION: a branch, a tag or a commit)")
    return check_repo_id(repo_id, text), revision or None


def hub_ref(repo_id: str, revision: str | None = None) -> str:
    """How --model names a Hub model: ``hub:ORG/NAME`` or ``hub:ORG/NAME@REVISION``."""
    return f"{HUB_PREFIX}{repo_id}" + (f"@{revision}" if revision else "")


def hub_model_folder(text: str) -> Path:
    """The verified local folder of ``--model hub:ORG/NAME[@REVISION]``."""
    return hub_folder(*parse_hub_ref(text))


def _offline_env() -> bool:
    """HF_HUB_OFFLINE as set now (huggingface_hub reads it once, when it is first imported)."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")


def hub_folder(repo_id: str, revision: str | None = None, *, cache_dir: str | Path | None = None,
               local_files_only: bool = False) -> Path:
    """A model ``captionkit push`` wrote, downloaded into huggingface_hub's cache (``cache_dir``, or
    where HF_HUB_CACHE / HF_HOME say; from the cache alone with ``local_files_only`` or
    HF_HUB_OFFLINE=1) at ``revision`` (a branch, tag or commit; default main), every file checked
    against its digest (:func:`verify_digest`). The snapshot's folder; once per process for the same
    arguments, so the several looks the command line takes at --model see one commit."""
    offline = local_files_only or _offline_env()
    return _verified_snapshot(repo_id, revision, None if cache_dir is None else str(cache_dir), offline)


@functools.cache
def _verified_snapshot(repo_id: str, revision: str | None, cache_dir: str | None, offline: bool) -> Path:
    from ..core.version import __version__

    hub = require_hub(f"--model {hub_ref(repo_id, revision)}")
    check_repo_id(repo_id)
    label = hub_ref(repo_id, revision)
    try:
        folder = Path(hub.snapshot_download(repo_id, revision=revision, cache_dir=cache_dir,
                                            local_files_only=offline, library_name="captionkit",
                                            library_version=__version__))
    except Exception as e:
        mapped = _download_error(e, label, revision, cache_dir or hub.constants.HF_HUB_CACHE, offline)
        if mapped is None:
            raise
        raise mapped from None
    verify_digest(folder, label)
    return folder


def _is_network_error(e: Exception) -> bool:
    """An error of the connection or of the Hub's answer (OSError or huggingface_hub's HTTP
    client's errors), not of captionkit's code."""
    return isinstance(e, OSError) or type(e).__module__.split(".")[0] in ("huggingface_hub", "httpx", "httpx2",
                                                                          "requests", "urllib3")


def _download_error(e: Exception, label: str, revision: str | None, cache: str, offline: bool) -> Exception | None:
    """One line for a failed download; None for an error that is not the user's or the network's."""
    from huggingface_hub import errors

    if isinstance(e, errors.RevisionNotFoundError):
        return CheckpointError(f"{label}: the Hub has no revision {revision!r} of this model")
    if isinstance(e, errors.GatedRepoError):
        return WeightsUnavailable(f"{label}: a gated model: accept its terms on the Hub, then log in "
                                  f"(hf auth login, or HF_TOKEN)")
    if isinstance(e, errors.RepositoryNotFoundError):
        return CheckpointError(f"{label}: no such model on the Hub (a private one needs a login: hf auth login, "
                               f"or HF_TOKEN)")
    if isinstance(e, errors.LocalEntryNotFoundError):
        why = "offline (HF_HUB_OFFLINE)" if offline else "the Hub could not be reached"
        return WeightsUnavailable(f"{label}: not in the Hugging Face cache {cache} (or only in part), and {why}")
    if _is_network_error(e):
        return WeightsUnavailable(f"{label}: download failed ({(str(e).strip().splitlines() or [type(e).__name__])[0]})")
    return None


# ---- the model's files and their digest -----------------------------------------------------------
def _read_json(path: Path, label: str) -> dict:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{label}: {path.name}: unreadable JSON ({e})") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{label}: {path.name}: not a JSON object")
    return doc


def checkpoint_files(folder: Path, label: str | None = None) -> list[str]:
    """A checkpoint's files that loading reads: config.json and the tensor files its digests
    name (model.safetensors in one that records none), without the optimizer's state."""
    cfg = _read_json(folder / "config.json", label or str(folder))
    from ..core.checkpoint import DIGESTS

    tensors = sorted(n for n in (cfg.get(DIGESTS) or {"model.safetensors": ""}) if n != TRAINING_ONLY)
    return ["config.json", *tensors]


def model_files(folder: Path, label: str) -> list[str]:
    """Every file of ``folder`` (a checkpoint or an ensemble of member folders inside it) that
    loading reads, as relative POSIX paths; an ensemble's shipped members are not files of it."""
    if not is_ensemble(folder):
        return checkpoint_files(folder, label)
    files = [ENSEMBLE_FILE]
    for m in _read_json(folder / ENSEMBLE_FILE, label).get("members") or []:
        if isinstance(m, dict) and isinstance(m.get("path"), str):
            files += [f"{PurePosixPath(m['path'])}/{name}" for name in checkpoint_files(folder / m["path"], label)]
    return files


def write_digest(folder: Path) -> dict[str, str]:
    """Write :data:`DIGEST_FILE` into ``folder``: the sha256 of every file in it but the card."""
    from ..core.checkpoint import file_sha256

    files = {p.relative_to(folder).as_posix(): file_sha256(p) for p in sorted(folder.rglob("*")) if p.is_file()}
    digests = {k: v for k, v in files.items() if k not in UNDIGESTED}
    (folder / DIGEST_FILE).write_text(json.dumps({"format": DIGEST_FORMAT, "version": DIGEST_VERSION,
                                                  "sha256": digests}, indent=1) + "\n")
    return digests


def verify_digest(folder: Path, label: str) -> None:
    """Check a downloaded model: every file :data:`DIGEST_FILE` lists has the sha256 it records,
    and it lists every file loading reads; else one CheckpointError naming the file."""
    from ..core.checkpoint import file_sha256

    if not (folder / DIGEST_FILE).is_file():
        raise CheckpointError(f"{label}: not a model `captionkit push` wrote: it has no {DIGEST_FILE} to check "
                              f"its files against ({folder})")
    doc = _read_json(folder / DIGEST_FILE, label)
    digests = doc.get("sha256")
    if doc.get("format") != DIGEST_FORMAT or not isinstance(digests, dict) or not digests:
        raise CheckpointError(f"{label}: {DIGEST_FILE} is not a captionkit digest ({folder})")
    if doc.get("version", 0) > DIGEST_VERSION:
        raise CheckpointError(f"{label}: {DIGEST_FILE} was written by a newer captionkit (version {doc['version']})")
    for name, want in sorted(digests.items()):
        rel = PurePosixPath(name)
        if rel.is_absolute() or ".." in rel.parts or not isinstance(want, str):
            raise CheckpointError(f"{label}: {DIGEST_FILE} lists {name!r}, which is not a file of the model")
        path = folder / rel
        if not path.is_file():
            raise CheckpointError(f"{label}: {name} is missing ({DIGEST_FILE} lists it; {folder})")
        if file_sha256(path) != want:
            raise CheckpointError(f"{label}: {name} is not the file that was pushed (its sha256 differs from the "
                                  f"one {DIGEST_FILE} records); refusing {path}")
    unlisted = [n for n in model_files(folder, label) if n not in digests]  # read from files checked above
    if unlisted:
        raise CheckpointError(f"{label}: {unlisted[0]} is not in {DIGEST_FILE}, so it cannot be checked; refusing "
                              f"the model ({folder})")


# ---- what push uploads ---------------------------------------------------------------------------
@dataclass
class Staged:
    """What :func:`stage_push` wrote: the folder, its files, and what the user should know."""

    folder: Path
    files: list[str]
    size: int  # bytes, all files together
    notes: list[str] = field(default_factory=list)


def _members(folder: Path) -> tuple[list[tuple[Path, str]], dict | None]:
    """An ensemble's members as (source folder, path in the pushed folder), and its ensemble.json
    rewritten to name those paths (None when it already does): a member inside the folder keeps
    its path, a shipped or outside one is copied in under its folder's name."""
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
    return members, ({**doc, "members": entries} if changed else None)


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
            members, rewritten = _members(folder)
            for source, dest in members:
                _copy_checkpoint(source, tmp / dest, str(folder))
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
