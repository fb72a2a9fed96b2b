"""Checkpoints: a folder holding ``model.safetensors`` (weights), ``config.json`` (everything
needed to rebuild the model: family and sizes, encoder, vocabulary, training state) and, for
resumable training checkpoints, ``optimizer.safetensors``. Nothing is ever unpickled.

Writes are atomic: the folder is written under a temporary name and renamed into place, so a
killed run leaves the previous checkpoint intact.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .errors import CheckpointError
from .outputs import CHECKPOINT_FORMAT, write_marker

FORMAT, VERSION = CHECKPOINT_FORMAT, 1
ENCODER_PREFIX = "encoder."  # fine-tuned encoder tensors, stored beside the decoder's


def split_weights(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's tensors -> (the decoder's, the fine-tuned encoder's without the prefix)."""
    decoder = {k: v for k, v in weights.items() if not k.startswith(ENCODER_PREFIX)}
    encoder = {k[len(ENCODER_PREFIX):]: v for k, v in weights.items() if k.startswith(ENCODER_PREFIX)}
    return decoder, encoder


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, folder: Path, replace: bool) -> None:
    """Rename the finished ``tmp`` to ``folder``. An existing folder of that name (an empty
    one, or any with ``replace``: the caller has checked that it may go, see
    captionkit.outputs) is first renamed to ``.<name>.old`` and removed after the swap, so a
    crash between the two renames leaves the old folder, which :func:`resolve` finds."""
    if folder.is_dir() and not folder.is_symlink() and (replace or not any(folder.iterdir())):
        old = folder.with_name(f".{folder.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        os.replace(tmp, folder)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, folder)  # a full folder without ``replace``: the OS refuses (ENOTEMPTY)
    _fsync_dir(folder.parent)


def _ordinary_permissions(tmp: Path) -> None:
    """mkdtemp makes a folder private; what captionkit writes is an ordinary folder."""
    umask = os.umask(0)
    os.umask(umask)
    for f in [tmp, *tmp.iterdir()]:
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~umask)


@contextmanager
def atomic_folder(folder: str | Path, kind: str | None = None, replace: bool = False) -> Iterator[Path]:
    """Write a folder atomically: the block writes into a temporary folder beside ``folder``,
    which is renamed to ``folder`` when the block ends, or removed if it fails. ``kind``: the
    folder is marked as captionkit's (``.captionkit.json``, see captionkit.outputs), so that
    ``--overwrite`` may replace it later. An existing empty ``folder`` is replaced; a full one
    only with ``replace``, after the caller checked it (``outputs.check_folder_target``)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        yield tmp
        if kind:
            write_marker(tmp, kind)
        _ordinary_permissions(tmp)
        _publish(tmp, folder, replace)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint(folder: str | Path, weights: dict[str, torch.Tensor], config: dict,
                    optimizer: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a checkpoint folder atomically and fsynced (an existing folder of that name is
    replaced: callers check the target first, see captionkit.outputs)."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, tmp / "model.safetensors")
        if optimizer:
            save_file({k: v.contiguous().cpu() for k, v in optimizer.items()}, tmp / "optimizer.safetensors")
        body = {k: v for k, v in config.items() if k not in ("format", "version")}  # ours, never a copy's
        (tmp / "config.json").write_text(json.dumps({"format": FORMAT, "version": VERSION, **body}, indent=1))
        write_marker(tmp, "checkpoint")
        _ordinary_permissions(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        _publish(tmp, folder, replace=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def resolve(folder: str | Path) -> Path:
    """The checkpoint folder, or the previous one if a crash interrupted the swap in
    :func:`save_checkpoint` between its two renames."""
    folder = Path(folder)
    old = folder.with_name(f".{folder.name}.old")
    if not folder.exists() and old.is_dir():
        return old
    return folder


def optimizer_tensors(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """Split an optimizer's state into named tensors (for safetensors) and JSON hyper-parameters."""
    sd = opt.state_dict()
    tensors = {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            tensors[f"state.{idx}.{k}"] = v if torch.is_tensor(v) else torch.tensor(v)
    return tensors, sd["param_groups"]


def restore_optimizer(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], groups: list[dict]) -> None:
    state: dict[int, dict] = {}
    for key, v in tensors.items():
        if key.startswith("state."):
            _, idx, k = key.split(".", 2)
            state.setdefault(int(idx), {})[k] = v
    opt.load_state_dict({"state": state, "param_groups": groups})


def read_config(folder: str | Path) -> dict:
    folder = resolve(folder)
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{folder}: not a captionkit checkpoint (no config.json)")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from None
    if cfg.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a captionkit checkpoint (format {cfg.get('format')!r})")
    if cfg.get("version", 0) > VERSION:
        raise CheckpointError(f"{path}: written by a newer captionkit (version {cfg['version']})")
    return cfg


def read_weights(folder: str | Path, name: str = "model.safetensors") -> dict[str, torch.Tensor]:
    path = resolve(folder) / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    try:
        return load_file(path)
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None


def load_into(module: torch.nn.Module, weights: dict[str, torch.Tensor], where: str | Path) -> None:
    """Load weights into ``module``, turning any mismatch into one clear CheckpointError."""
    own = module.state_dict()
    missing = sorted(set(own) - set(weights))
    extra = sorted(set(weights) - set(own))
    shapes = [f"{k} {tuple(weights[k].shape)} vs {tuple(own[k].shape)}"
              for k in own if k in weights and weights[k].shape != own[k].shape]
    if missing or extra or shapes:
        detail = "; ".join(filter(None, [
            f"missing {', '.join(missing[:3])}" if missing else "",
            f"unexpected {', '.join(extra[:3])}" if extra else "",
            f"shape {', '.join(shapes[:3])}" if shapes else ""]))
        raise CheckpointError(f"{where}: weights do not fit the model its config describes ({detail})")
    module.load_state_dict({k: v.to(own[k].dtype) for k, v in weights.items()})
