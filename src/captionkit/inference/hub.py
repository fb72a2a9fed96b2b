"""captionkit models on the Hugging Face Hub (docs/hf-models.md#the-hub).

``captionkit push MODEL ORG/NAME`` uploads what captionkit.inference.hub_push.stage_push writes: the model's files (a
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
from pathlib import Path, PurePosixPath

from ..core.errors import CheckpointError, UserError, WeightsUnavailable
from .folders import ENSEMBLE_FILE, is_ensemble

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
