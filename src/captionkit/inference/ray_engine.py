"""``--engine ray``: captioning and feature extraction on Ray Data (docs/scale.md).

One pipeline serves both commands:

- the image list is cut into shards of ``shard_size`` consecutive images (in the order the local
  engine takes them); only shards not already on disk are sent to Ray;
- Ray tasks read and decode the images (``map_batches`` over a ``from_items`` dataset of
  positions and paths), each through :func:`captionkit.data.images.load_rgb`, so an unreadable file
  gets the very message the local engine gives;
- an actor pool of model replicas (``map_batches`` with a callable class, ``concurrency`` =
  replicas, ``num_gpus`` per replica on a GPU cluster) encodes (and decodes captions);
- the driver gathers each shard's rows and writes the shard atomically when it is complete
  (so a killed run keeps every finished shard and a rerun computes only the rest).

Paths travel as bytes (``os.fsencode``): Arrow strings must be UTF-8, file names need not be.
Every node must see the image paths (a shared file system) and only the driver writes.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.errors import OutputError
from ..core import signals
from ..core.outputs import atomic_write_text, check_folder_target, write_marker
from ..core.stderr_filter import dropping_lines

# Ray Data puts every actor pool's constructor arguments in the object store and makes its actors
# restartable, so the driver's core worker logs this "E" line on every run, one that went well
# included (ray-project/ray#53727; Ray 2.60 has no undeprecated way to change either). It only
# warns that a restart could fail if those objects were lost; a failed restart is reported on
# its own. captionkit drops exactly this line from standard error while the replicas run.
RESTARTABLE_ACTOR_LINE = (r"core_worker\.cc:\d+: Actor with class name: '.*' .*has constructor arguments in "
                          r"the object store and max_restarts > 0")

INSTALL_HINT = "--engine ray needs Ray Data: pip install 'captionkit[ray]'"
CAPTION_SHARDS_KIND = "caption-shards"  # the outputs.MARKER kind of a --jsonl OUT's OUT.shards folder
SHARDS_SUFFIX = ".shards"
DEFAULT_SHARD_SIZE = 1000
DECODE_CPUS = 0.5  # Ray CPUs a decoding task holds


def ray_missing() -> str | None:
    """Why ``--engine ray`` cannot run here (None when it can)."""
    try:
        import ray.data  # noqa: F401
    except ImportError:
        return INSTALL_HINT
    return None


@dataclass(frozen=True)
class RayOptions:
    """How the work is spread: ``address`` of a running cluster (None: a local Ray of ``cpus``
    CPUs), ``replicas`` model actors holding ``cpus_per_replica`` CPUs (torch threads) and
    ``gpus_per_replica`` GPUs each, images per model call ``batch_size``, images per output
    shard ``shard_size``."""

    address: str | None = None
    cpus: int | None = None
    replicas: int = 1
    cpus_per_replica: float = 1
    gpus_per_replica: float = 0
    batch_size: int = 16
    shard_size: int = DEFAULT_SHARD_SIZE


def init_ray(opts: RayOptions) -> None:
    import ray
    import ray.data

    from ray.util.debug import log_once

    if not ray.is_initialized():
        # the local Ray started here says it enabled token authentication, a notice that
        # reads like a problem on a run that went well (Ray's own log files keep it)
        if opts.address is None:
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        ray.init(address=opts.address, num_cpus=None if opts.address else opts.cpus, include_dashboard=False,
                 log_to_driver=False, configure_logging=False)
        signals.reinstall()  # ray.init's SIGTERM handler exits anywhere: the caller's stop handling instead
    logging.getLogger("ray.data").setLevel(logging.WARNING)  # not a line per dataset executed
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # captionkit draws its own (captionkit.core.progress)
    log_once("ray_data_progress_manager_disabled")  # ...so Ray need not warn that its own are off
    ctx.print_on_execution_start = False


def shard_ranges(n: int, shard_size: int) -> list[range]:
    """Image positions of each shard: consecutive runs of ``shard_size`` (the last shorter)."""
    return [range(s, min(s + shard_size, n)) for s in range(0, n, shard_size)]


# ---- the Ray stages (run in Ray workers) -------------------------------------------------------
def _decode(batch: dict[str, np.ndarray], preprocess) -> dict[str, np.ndarray]:
    """Read and preprocess a batch of images; an unreadable one gets a zero image and its
    ImageError message (the local engine's message, from the same load_rgb)."""
    from ..data.images import ImageError, load_rgb, to_tensor

    size = preprocess.size
    images = np.zeros((len(batch["path"]), 3, size, size), dtype=np.float32)
    errors = []
    for i, raw in enumerate(batch["path"]):
        try:
            images[i] = to_tensor(load_rgb(Path(os.fsdecode(bytes(raw)))), preprocess).numpy()
            errors.append("")
        except ImageError as e:
            errors.append(str(e))
    return {"pos": batch["pos"], "image": images, "error": np.array(errors, dtype=object)}


def replica_device():
    """The device of a model replica in a Ray worker: its GPU when Ray gave it one (Ray hides
    the others: the one it gave is ``cuda`` to this process), else the CPU."""
    import ray

    from ..core.devices import resolve_device

    return resolve_device("cuda" if ray.get_gpu_ids() else "cpu")


class _Replica:
    """A model replica: ``load()`` builds the model once per actor and ``place()`` puts it on
    the replica's device (a GPU when Ray gave it one), where batches of decoded images are
    encoded."""

    def __init__(self, load: Callable, threads: int):
        import torch

        torch.set_num_threads(threads)
        self.model = load()
        self.device = replica_device()
        self.place()

    def place(self) -> None:
        raise NotImplementedError

    def encode(self, pixels):
        """Pixels (B, 3, S, S) on the host -> the model's rows on the replica's device."""
        raise NotImplementedError

    def _encode(self, batch: dict[str, np.ndarray]):
        """The rows of the readable images of ``batch`` (their mask, and (B, L, D) or None)."""
        import torch

        ok = np.array([e == "" for e in batch["error"]], dtype=bool)
        if not ok.any():
            return ok, None
        # one host array (B, 3, S, S), copied to the device once by the encoder
        return ok, self.encode(torch.from_numpy(np.ascontiguousarray(batch["image"][ok])))


class CaptionReplica(_Replica):
    """Captions a batch with a :class:`captionkit.inference.captioner.Captioner` (greedy or beam)."""

    def __init__(self, load: Callable, threads: int, beam: int, length_penalty: float | None,
                 precision: str | None = None):
        self.precision = precision  # (place() in the base's __init__ reads it)
        super().__init__(load, threads)
        self.beam, self.length_penalty = beam, length_penalty

    def place(self) -> None:
        # the captioner's own placement: its device, encoder and decoder agree, and the
        # precision the user asked for (None: the captioner's own, at first auto) is resolved
        # for the replica's device, not the driver's
        self.model.place(self.device, self.precision)

    def encode(self, pixels):
        # through the captioner: its test-time augmentation and precision, as the local engine
        return self.model.encode(pixels)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ok, feats = self._encode(batch)
        captions = np.array([""] * len(ok), dtype=object)
        if feats is not None:
            caps = self.model.decode_features(feats, self.beam, self.length_penalty)
            captions[ok] = [self.model.result(c).text for c in caps]
        return {"pos": batch["pos"], "caption": captions, "error": batch["error"]}


class FeatureReplica(_Replica):
    """Encodes a batch with an :class:`captionkit.encoders.Encoder` into float16 rows."""

    def __init__(self, load: Callable, threads: int, shape: tuple[int, int]):
        super().__init__(load, threads)
        self.shape = shape  # (L, D)

    def place(self) -> None:
        self.model.to(self.device)  # an encoder knows where it is (encoders.module_device)

    def encode(self, pixels):
        return self.model.encode(pixels)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ok, feats = self._encode(batch)
        rows = np.zeros((len(ok), *self.shape), dtype=np.float16)
        if feats is not None:
            rows[ok] = feats.float().cpu().numpy().astype(np.float16)
        return {"pos": batch["pos"], "feats": rows, "error": batch["error"]}


def run_shards(paths: list[Path], shards: list[int], shard_size: int, preprocess, replica: type,
               replica_args: dict, opts: RayOptions) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Run ``shards`` (indices into :func:`shard_ranges`) of ``paths`` through decode tasks and
    ``replica`` actors; yield each shard as soon as all its rows are back: (shard, columns in
    the shard's image order)."""
    import ray.data
    from ray.data import ActorPoolStrategy

    ranges = shard_ranges(len(paths), shard_size)
    items = [{"pos": i, "path": os.fsencode(str(paths[i]))} for s in shards for i in ranges[s]]
    if not items:
        return
    init_ray(opts)
    blocks = max(1, min(len(items) // opts.batch_size, 1000))
    ds = ray.data.from_items(items, override_num_blocks=blocks)
    # Decoding holds half a CPU (it also waits on the disk). Its remote arguments differing from
    # the replicas' keeps Ray from fusing it into the actors, so images are decoded by tasks
    # while the replicas run the model.
    ds = ds.map_batches(_decode, batch_size=opts.batch_size, fn_kwargs={"preprocess": preprocess},
                        num_cpus=DECODE_CPUS)
    ds = ds.map_batches(replica, batch_size=opts.batch_size, compute=ActorPoolStrategy(size=opts.replicas),
                        num_cpus=opts.cpus_per_replica, num_gpus=opts.gpus_per_replica or None,
                        fn_constructor_kwargs={**replica_args, "threads": max(1, int(opts.cpus_per_replica))})
    pending: dict[int, list[dict[str, np.ndarray]]] = {}
    got: dict[int, int] = {}
    with dropping_lines(RESTARTABLE_ACTOR_LINE):
        for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
            for s in np.unique(batch["pos"] // shard_size):
                part = {k: v[batch["pos"] // shard_size == s] for k, v in batch.items()}
                pending.setdefault(int(s), []).append(part)
                got[int(s)] = got.get(int(s), 0) + len(part["pos"])
                if got[int(s)] == len(ranges[s]):
                    parts = pending.pop(int(s))
                    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
                    order = np.argsort(cols["pos"], kind="stable")
                    yield int(s), {k: v[order] for k, v in cols.items()}


# ---- captions ------------------------------------------------------------------------------
@dataclass
class ShardCaption:
    """A caption read back from a shard (what the caption writer needs of a Result)."""

    text: str


def caption_shards_folder(out: str | Path) -> Path:
    """Where ``--engine ray`` keeps the shards of ``--jsonl/--csv OUT``: ``OUT.shards``."""
    return Path(str(out) + SHARDS_SUFFIX)


def check_caption_shards(folder: Path, settings: dict, overwrite: bool) -> None:
    """Before any model loads: a shards folder is new, or captionkit's with the same settings
    (resumed), or replaced with ``--overwrite`` (only one captionkit wrote)."""
    check_folder_target(folder, overwrite=True, kinds=(CAPTION_SHARDS_KIND,))  # never a stranger's folder
    manifest = folder / "manifest.json"
    if not manifest.exists() or overwrite:
        return
    recorded = json.loads(manifest.read_text()).get("settings")
    if recorded != settings:
        raise OutputError(f"{folder}: holds shards written with other settings ({manifest.name}); use the same "
                          f"options to resume, --overwrite to start again, or write to another file")


def _shard_file(folder: Path, s: int, paths: list[Path]) -> Path:
    """A caption shard's file, named by its images too: a changed folder never reuses (nor
    replaces) a shard of other images."""
    digest = hashlib.sha1("\n".join(map(str, paths)).encode("utf-8", "surrogateescape")).hexdigest()[:10]
    return folder / f"part-{s:05d}-{digest}.jsonl"


def _has_error(shard: Path, all_paths: list[Path], wanted: set[Path]) -> bool:
    """Whether a caption shard records an error for one of the ``wanted`` images."""
    records = (json.loads(line) for line in shard.read_text().splitlines())
    return any("error" in r and all_paths[r["pos"]] in wanted for r in records)


def caption_with_ray(all_paths: list[Path], todo: list[Path], folder: Path, settings: dict, overwrite: bool,
                     retry_failed: bool, load: Callable, preprocess, beam: int, length_penalty: float | None,
                     opts: RayOptions, precision: str | None = None) -> Iterator[tuple[Path, object]]:
    """Caption ``todo`` (a subset of ``all_paths``, in its order) on Ray: shards of
    ``all_paths`` holding a todo image and not on disk are computed (and, with
    ``retry_failed``, those recording an error for a todo image, replaced); yields (path,
    ShardCaption or ImageError) for the todo images, in order, as their shards are done.
    ``precision``: --precision as the user gave it, resolved by each replica for its device."""
    from ..data.images import ImageError

    if overwrite and folder.exists():
        shutil.rmtree(folder)  # captionkit's own shards folder (check_caption_shards), --overwrite given
    if not (folder / "manifest.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_marker(folder, CAPTION_SHARDS_KIND)
        atomic_write_text(folder / "manifest.json", json.dumps(
            {"format": "captionkit-caption-shards", "settings": settings}, indent=1) + "\n")
    ranges = shard_ranges(len(all_paths), opts.shard_size)
    wanted = set(todo)
    needed = [s for s, r in enumerate(ranges) if any(all_paths[i] in wanted for i in r)]
    files = {s: _shard_file(folder, s, [all_paths[i] for i in ranges[s]]) for s in needed}
    missing = [s for s in needed if not files[s].exists() or (retry_failed and _has_error(files[s], all_paths, wanted))]
    if missing:
        print(f"ray: {len(missing)} of {len(ranges)} shards to compute ({len(needed) - len(missing)} "
              f"already in {folder})", file=sys.stderr)

    def emit(s: int) -> Iterator[tuple[Path, object]]:
        for line in files[s].read_text().splitlines():
            rec = json.loads(line)
            path = all_paths[rec["pos"]]
            if path in wanted:
                yield path, ImageError(rec["error"]) if "error" in rec else ShardCaption(rec["caption"])

    done = set(needed) - set(missing)
    shown = 0  # shards already yielded, in order
    rows = run_shards(all_paths, missing, opts.shard_size, preprocess, CaptionReplica,
                      {"load": load, "beam": beam, "length_penalty": length_penalty, "precision": precision}, opts)
    for s, cols in rows:
        lines = [json.dumps({"pos": int(p), "error": e} if e else {"pos": int(p), "caption": c}) + "\n"
                 for p, c, e in zip(cols["pos"], cols["caption"], cols["error"])]
        atomic_write_text(files[s], "".join(lines))
        done.add(s)
        while shown < len(needed) and needed[shown] in done:
            yield from emit(needed[shown])
            shown += 1
    for s in needed[shown:]:
        yield from emit(s)


# ---- features ------------------------------------------------------------------------------
def build_features_ray(encoder_name: str, encoder_weights: str | None, paths: list[Path],
                       root: Path | None, opts: RayOptions):
    """The Ray engine's :func:`captionkit.encoders.features.build_features`: a sharded store
    (:class:`captionkit.encoders.features.ShardedFeatureStore`) beside where the local engine keeps its
    single file; a rerun computes only the shards not on disk."""
    from functools import partial

    from ..encoders import create_encoder
    from ..encoders.features import (ShardedFeatureStore, building, default_cache_root, open_sharded, shard_file,
                                     sharded_folder_for, write_shard)
    from .writer import Progress

    encoder = create_encoder(encoder_name, weights=encoder_weights)  # its key, grid and preprocessing
    with building(sharded_folder_for(root or default_cache_root(), encoder, paths), f"features {encoder_name} (ray)"):
        folder, shard_size = open_sharded(encoder, paths, root, opts.shard_size)
        ranges = shard_ranges(len(paths), shard_size)
        missing = [s for s in range(len(ranges)) if not shard_file(folder, s, ".json").exists()]
        print(f"features ray: {len(missing)} of {len(ranges)} shards to compute in {folder}", file=sys.stderr)
        grid = encoder.grid()
        shape = (grid[0] * grid[1], encoder.dim)
        load = partial(create_encoder, encoder_name, weights=encoder_weights)
        progress = Progress(sum(len(ranges[s]) for s in missing), desc="features ray")
        skipped: list[str] = []
        for s, cols in run_shards(paths, missing, shard_size, encoder.preprocess, FeatureReplica,
                                  {"load": load, "shape": shape}, opts):
            failed = {int(i): e for i, e in zip(cols["pos"], cols["error"]) if e}
            write_shard(folder, s, cols["feats"], [str(paths[i]) for i in ranges[s]], failed)
            progress.update(len(ranges[s]), failed=len(failed))
            skipped += failed.values()
        progress.close()
        for msg in skipped:  # as the local engine reports them
            print(f"skipped: {msg}", file=sys.stderr)
        return ShardedFeatureStore(folder)

