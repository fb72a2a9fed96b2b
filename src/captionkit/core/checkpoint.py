"""Checkpoints: a folder holding ``model.safetensors`` (weights), ``config.json`` (everything
needed to rebuild the model: family and sizes, encoder, vocabulary, training state) and, for
resumable training checkpoints, ``optimizer.safetensors``. Nothing is ever unpickled.

Writes are atomic: the folder is written under a temporary name and renamed into place, so a
killed run leaves the previous checkpoint intact. ``config.json`` records the sha256 of each
tensor file (under ``sha256``), checked on load, so a truncated or bit-flipped file is one
clear error; checkpoints written before there were digests load unchecked.
"""

from __future__ import annotations

import glob
import hashlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from .diskspace import check_free, dir_bytes, disk_errors, translate
from .errors import CheckpointError, OutputError
from .outputs import CHECKPOINT_FORMAT, owner_kind, write_marker

FORMAT, VERSION = CHECKPOINT_FORMAT, 1
ENCODER_PREFIX = "encoder."  # fine-tuned encoder tensors, stored beside the decoder's
DIGESTS = "sha256"  # config.json's {tensor file name: sha256 hex digest}
KILL_ENV = "CAPTIONKIT_TEST_KILL"  # test-only, see kill_point
_reached: Counter[str] = Counter()


def kill_point(point: str, where: object = "") -> None:
    """Test-only hook for the kill-anywhere tests (tests/killharness.py): with the environment
    variable CAPTIONKIT_TEST_KILL=POINT[@N], the process kills itself with SIGKILL the N-th
    time (default the first) it reaches POINT, after one line on stderr. Points:
    ``save:model`` (model.safetensors written, the rest not), ``save:files`` (every file
    written and fsynced, nothing renamed), ``save:swap`` (the old folder renamed aside, the new
    one not yet in place), ``save:done`` (the new folder in place, the old one not removed) and
    ``validate`` (dev captions decoded, not yet scored). Unset, it does nothing."""
    spec = os.environ.get(KILL_ENV)
    if not spec or spec.partition("@")[0] != point:
        return
    _reached[point] += 1
    if _reached[point] == int(spec.partition("@")[2] or 1):
        print(f"{KILL_ENV}: killed at {point} {where}".rstrip(), file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


def file_sha256(path: str | Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def split_weights(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A checkpoint's tensors -> (the decoder's, the fine-tuned encoder's without the prefix)."""
    decoder = {k: v for k, v in weights.items() if not k.startswith(ENCODER_PREFIX)}
    encoder = {k[len(ENCODER_PREFIX):]: v for k, v in weights.items() if k.startswith(ENCODER_PREFIX)}
    return decoder, encoder


# int8 storage (``captionkit pack --int8``): a matrix W is stored as int8 Q under its own name and
# one float32 scale per row under NAME + INT8_SCALE, W ~ Q * scale (symmetric, scale = the row's
# largest |w| / 127); read_weights gives W back as float32, so nothing past reading knows.
INT8_SCALE = ".int8_scale"


def quantize_int8(weights: dict[str, torch.Tensor], min_size: int = 4096) -> dict[str, torch.Tensor]:
    """The decoder's floating matrices of at least ``min_size`` entries as int8 with per-row
    scales; vectors, small tensors and fine-tuned encoder tensors stay as they are."""
    out: dict[str, torch.Tensor] = {}
    for k, v in weights.items():
        if v.is_floating_point() and v.dim() == 2 and v.numel() >= min_size and not k.startswith(ENCODER_PREFIX):
            scale = v.float().abs().amax(1, keepdim=True).clamp_min(1e-12) / 127  # (rows, 1)
            out[k] = (v.float() / scale).round().clamp(-127, 127).to(torch.int8)
            out[k + INT8_SCALE] = scale
        else:
            out[k] = v
    return out


def dequantize_int8(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Undo :func:`quantize_int8` (a no-op for checkpoints without int8 tensors)."""
    scales = {k[:-len(INT8_SCALE)]: v for k, v in weights.items() if k.endswith(INT8_SCALE)}
    return {k: (v.float() * scales[k] if k in scales else v) for k, v in weights.items()
            if not k.endswith(INT8_SCALE)}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(tmp: Path, folder: Path, replace: bool) -> None:
    """Rename the finished ``tmp`` to ``folder``. An existing folder of that name (an empty
    one, or any with ``replace``: the caller has checked that it may go, see
    captionkit.core.outputs) is first renamed to ``.<name>.old`` and removed after the swap, so a
    crash between the two renames leaves the old folder, which :func:`resolve` finds."""
    old = folder.with_name(f".{folder.name}.old")
    if folder.is_dir() and not folder.is_symlink() and (replace or not any(folder.iterdir())):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
        kill_point("save:swap", folder)
        os.replace(tmp, folder)
    else:
        os.replace(tmp, folder)  # a full folder without ``replace``: the OS refuses (ENOTEMPTY)
    kill_point("save:done", folder)
    shutil.rmtree(old, ignore_errors=True)  # also one that a save killed between the renames left
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
    folder is marked as captionkit's (``.captionkit.json``, see captionkit.core.outputs), so that
    ``--overwrite`` may replace it later. An existing empty ``folder`` is replaced; a full one
    only with ``replace``, after the caller checked it (``outputs.check_folder_target``)."""
    folder = Path(folder)
    kept = _kept(folder)
    with disk_errors(folder, None, kept):
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        yield tmp
        if kind:
            write_marker(tmp, kind)
        _ordinary_permissions(tmp)
        _publish(tmp, folder, replace)
    except Exception as e:
        written = dir_bytes(tmp)  # what fitted before the disk filled: the folder needs more
        shutil.rmtree(tmp, ignore_errors=True)
        err = translate(e, folder, written, kept, at_least=True)
        if err is e:
            raise
        raise err from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def save_checkpoint(folder: str | Path, weights: dict[str, torch.Tensor], config: dict,
                    optimizer: dict[str, torch.Tensor] | None = None) -> Path:
    """Write a checkpoint folder atomically and fsynced, with the sha256 of each tensor file in
    its config.json (an existing folder of that name is replaced: callers check the target
    first, see captionkit.core.outputs). Refused before anything is written when the disk has
    less room than the checkpoint needs (:func:`checkpoint_bytes`); a disk that fills anyway, or
    a read-only folder, is one line (captionkit.core.diskspace) and the previous checkpoint of
    that name stays as it was."""
    folder = Path(folder)
    needed = checkpoint_bytes(weights, config, optimizer)
    kept = _kept(folder)
    with disk_errors(folder, needed, kept):  # a full disk or a read-only folder: one line
        folder.parent.mkdir(parents=True, exist_ok=True)
        # the previous checkpoint stays until the new one is whole: all of it must fit beside it
        check_free(folder.parent, needed, f"the checkpoint {folder}")
        _write_checkpoint(folder, weights, config, optimizer)
    return folder


def checkpoint_bytes(weights: dict[str, torch.Tensor], config: dict,
                     optimizer: dict[str, torch.Tensor] | None = None) -> int:
    """About the bytes :func:`save_checkpoint` writes: the tensors' (exact), their safetensors
    headers and the JSON files (estimated a little high)."""
    tensors = [*weights.items(), *(optimizer or {}).items()]
    data = sum(v.numel() * v.element_size() for _, v in tensors)
    headers = sum(len(k) + 96 for k, _ in tensors)  # {"NAME":{"dtype":..,"shape":[..],"data_offsets":[..]}}
    return data + headers + len(json.dumps(config, indent=1, default=str)) + 4096


def _kept(folder: Path) -> str:
    """What a failed write of ``folder`` leaves the user, for its message."""
    return f"{folder} is as it was" if resolve(folder).exists() else "nothing was written"


def _write_checkpoint(folder: Path, weights: dict[str, torch.Tensor], config: dict,
                      optimizer: dict[str, torch.Tensor] | None) -> None:
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, tmp / "model.safetensors")
        kill_point("save:model", folder)
        if optimizer:
            save_file({k: v.contiguous().cpu() for k, v in optimizer.items()}, tmp / "optimizer.safetensors")
        digests = {f.name: file_sha256(f) for f in sorted(tmp.glob("*.safetensors"))}  # as written on disk
        # format, version and digests are ours, never a copy's (a re-saved config carries old ones)
        body = {k: v for k, v in config.items() if k not in ("format", "version", DIGESTS)}
        (tmp / "config.json").write_text(json.dumps({"format": FORMAT, "version": VERSION, **body,
                                                     DIGESTS: digests}, indent=1))
        write_marker(tmp, "checkpoint")
        _ordinary_permissions(tmp)
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        kill_point("save:files", folder)
        _publish(tmp, folder, replace=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_leftovers(folder: str | Path, *, with_folder: bool = False) -> None:
    """Remove what killed saves of ``folder`` left beside it: temporary folders of saves killed
    before their rename (.NAME.XXXXXXXX, mkdtemp's eight characters), and .NAME.old once NAME
    is in place (a save killed just after its rename, with no save of NAME since; resolve needs
    .NAME.old only while NAME is missing). ``with_folder``: NAME goes too (a checkpoint no longer
    kept), and with it any .NAME.old. Only for a folder that one process writes at a time: a
    run's last, best and epoch-K."""
    folder = Path(folder)
    leftovers = list(folder.parent.glob(f".{glob.escape(folder.name)}.????????"))
    if folder.is_dir() or with_folder:
        leftovers.append(folder.with_name(f".{folder.name}.old"))
    if with_folder:
        leftovers.append(folder)
    for path in leftovers:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)


def epoch_names(run: str | Path) -> list[str]:
    """The ``epoch-K`` folders of a run (train.keep_epochs), with those only killed saves left."""
    run = Path(run)
    names = {p.name for p in run.glob("epoch-*")} | {p.name[1:].rsplit(".", 1)[0] for p in run.glob(".epoch-*")}
    return sorted(names)


def prune_epochs(run: str | Path, keep_from: int) -> None:
    """Remove a run's ``epoch-J`` checkpoints of J < ``keep_from`` (train.keep_epochs' older
    epochs), with what killed saves of them left. Only folders holding a captionkit checkpoint
    go: a folder of the user's with such a name stays."""
    for name in epoch_names(run):
        folder = Path(run) / name
        j = name.removeprefix("epoch-")
        if not j.isdigit() or int(j) >= keep_from or folder.is_symlink():
            continue
        if folder.exists() and owner_kind(folder) != "checkpoint":
            continue  # the user's
        remove_leftovers(folder, with_folder=True)


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


def verify(folder: str | Path, name: str) -> None:
    """Check a tensor file against the digest its config.json records (none recorded: a
    checkpoint from before digests, accepted as it is). The error names the file."""
    folder = resolve(folder)
    want = read_config(folder).get(DIGESTS, {}).get(name)
    if want is not None and file_sha256(folder / name) != want:
        size = (folder / name).stat().st_size
        raise CheckpointError(f"{folder / name}: corrupted or truncated ({size:,} bytes; its sha256 differs "
                              f"from the one {folder / 'config.json'} records)")


def read_weights(folder: str | Path, name: str = "model.safetensors", *,
                 as_stored: bool = False) -> dict[str, torch.Tensor]:
    """A checkpoint's tensor file, verified against its recorded digest (int8 matrices of
    ``pack --int8`` given back as float32; ``as_stored``: as the file holds them, each int8
    matrix and its scales under NAME + INT8_SCALE)."""
    path = resolve(folder) / name
    if not path.is_file():
        raise CheckpointError(f"{path}: missing")
    verify(folder, name)
    try:
        weights = load_file(path)
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{path}: unreadable safetensors file ({e})") from None
    return weights if as_stored else dequantize_int8(weights)


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


def pack_checkpoint(checkpoint: str | Path, out: str | Path, *, fp16: bool = False, int8: bool = False,
                    overwrite: bool = False) -> int:
    """Copy a trained checkpoint without its optimizer state (optionally its decoder in float16,
    or its decoder's matrices in int8 with per-row scales, :func:`quantize_int8`) to ``out``, for
    shipping; return the size of its tensors in bytes. Fine-tuned encoder blocks stay float32,
    like the rest of the encoder. ``out`` is checked first (captionkit.core.outputs):
    a new or empty folder, or with ``overwrite`` a checkpoint captionkit wrote."""
    from .outputs import check_folder_target

    if Path(out).resolve() == resolve(checkpoint).resolve():
        raise OutputError(f"{out}: is the checkpoint being packed; choose another folder")
    check_folder_target(out, overwrite=overwrite, kinds=("checkpoint",))
    cfg = read_config(checkpoint)
    cfg.pop("optimizer_groups", None)
    return _save_shipped(out, read_weights(checkpoint), cfg, fp16=fp16, int8=int8)


def _save_shipped(out: str | Path, weights: dict[str, torch.Tensor], cfg: dict, *, fp16: bool, int8: bool) -> int:
    """Save ``weights`` as ``pack`` stores them (the decoder's in float16, or its matrices in int8,
    when asked); the size of the tensors written, in bytes."""
    if fp16:
        weights = {k: v.to(torch.float16) if v.is_floating_point() and not k.startswith(ENCODER_PREFIX) else v
                   for k, v in weights.items()}
    if int8:
        weights = quantize_int8(weights)
    save_checkpoint(out, weights, cfg)
    return sum(v.numel() * v.element_size() for v in weights.values())


# what must agree for two checkpoints' weights to mean the same thing (the vocabulary's words
# index the embedding and output rows; the encoder gives the features the decoder was trained on)
_SAME_MODEL = ("family", "model", "encoder", "vocab")


def average_checkpoints(checkpoints: list[str | Path], out: str | Path, weights: list[float] | None = None, *,
                        fp16: bool = False, int8: bool = False, overwrite: bool = False) -> int:
    """Write the weighted average of checkpoints of one model (same family, sizes, encoder and
    vocabulary) to ``out``; return the size of its tensors in bytes.

    ``weights`` (default equal) must sum to 1; a negative one extrapolates (WiSE-FT's
    interpolation between a run's start and its end is ``[1 - a, a]``). The average is only a
    good model when the checkpoints lie on one training path (the epochs of a run, a fine-tuning
    and its start), not for independently trained models. Float tensors are averaged in float32;
    any other tensor must be equal in all of them. The config is the first checkpoint's without
    its training state, plus ``averaged``: each checkpoint's folder and weight. Each refusal is
    one line naming the folder: the weights, the target and the configs before any tensor is
    read, the tensors (names, shapes, LoRA factors, unequal whole-number ones) before anything
    is written."""
    from .outputs import check_folder_target

    folders = [resolve(c) for c in checkpoints]
    if len(folders) < 2:
        raise CheckpointError(f"averaging needs two checkpoints or more, got {len(folders)}")
    weights = [1 / len(folders)] * len(folders) if weights is None else list(weights)
    if len(weights) != len(folders):
        raise CheckpointError(f"{len(weights)} weights for {len(folders)} checkpoints; give one per checkpoint")
    if not all(math.isfinite(w) for w in weights) or abs(sum(weights) - 1) > 1e-6:
        raise CheckpointError(f"the weights {', '.join(f'{w:g}' for w in weights)} must be finite and sum to 1")
    if any(Path(out).resolve() == f.resolve() for f in folders):
        raise OutputError(f"{out}: is one of the checkpoints being averaged; choose another folder")
    check_folder_target(out, overwrite=overwrite, kinds=("checkpoint",))
    configs = [read_config(f) for f in folders]
    for f, cfg in zip(folders[1:], configs[1:]):
        for key in _SAME_MODEL:
            if cfg.get(key) != configs[0].get(key):
                raise CheckpointError(f"{f}/config.json: its {key!r} differs from {folders[0]}'s; only checkpoints "
                                      f"of one model (family, sizes, encoder, vocabulary) can be averaged")
    # A running sum, one checkpoint read at a time: memory is about three times one model's
    # float32 size (the sum, the first's other tensors, the one being read), not N times.
    acc: dict[str, torch.Tensor] = {}
    first: dict[str, torch.Tensor] = {}  # the first's shapes and dtypes; its non-float tensors kept whole
    for i, (f, wt) in enumerate(zip(folders, weights)):
        w = read_weights(f)
        lora = next((k for k in w if ".lora_A." in k or ".lora_B." in k), None)
        if lora:
            raise CheckpointError(f"{f}: holds LoRA factors ({lora}); averaging them is not averaging the "
                                  f"fine-tunings (export the merged model first: captionkit export hf)")
        if i == 0:
            first = {k: t if not t.is_floating_point() else torch.empty(t.shape, dtype=t.dtype, device="meta")
                     for k, t in w.items()}
        elif w.keys() != first.keys():
            odd = sorted(w.keys() ^ first.keys())[:3]
            raise CheckpointError(f"{f}: its tensors differ from {folders[0]}'s ({', '.join(odd)})")
        for k, t in w.items():
            if t.shape != first[k].shape:
                raise CheckpointError(f"{f}: {k} is {tuple(t.shape)}, {tuple(first[k].shape)} in {folders[0]}")
            if first[k].is_floating_point():
                acc[k] = wt * t.float() if i == 0 else acc[k].add_(t.float(), alpha=wt)
            elif not torch.equal(t, first[k]):
                raise CheckpointError(f"{f}: its {k} ({first[k].dtype}) differs from {folders[0]}'s and cannot be averaged")
        del w
    mean = {k: acc[k].to(t.dtype) if t.is_floating_point() else t for k, t in first.items()}
    cfg = {k: v for k, v in configs[0].items() if k not in ("state", "optimizer_groups")}
    cfg["averaged"] = [{"checkpoint": str(f), "weight": w} for f, w in zip(folders, weights)]
    return _save_shipped(out, mean, cfg, fp16=fp16, int8=int8)
