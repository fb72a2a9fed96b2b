"""``--engine ray``: captioning and feature extraction on Ray (docs/scale.md).

One pipeline serves both commands:

- the image list is cut into shards of ``shard_size`` consecutive images (in the order the local
  engine takes them); only shards not already on disk are sent to Ray;
- a pool of model replicas (Ray actors: ``replicas`` of them, ``num_gpus`` each on a GPU cluster)
  is handed chunks of paths (``CHUNK_BATCHES`` model batches each, two chunks queued per
  replica so none waits for the driver); each replica reads its chunk through the local
  engine's own loader (:func:`captionkit.encoders.image_batches.image_batches`: reader threads
  one batch ahead of the model on a CPU, DataLoader processes on a GPU), so an unreadable file
  gets the very message the local engine gives and no image passes through Ray's object
  store, and encodes (and decodes captions) as the local engine does;
- the driver gathers each shard's rows and writes the shard atomically when it is complete
  (so a killed run keeps every finished shard and a rerun computes only the rest).

Plain Ray actors, not Ray Data: the pipeline is one map over a list of paths, and Ray Data
added three helper actors and its executor in the driver (about 400 MiB on one node, more
than the model) for it. The driver imports neither torch nor a model: it lists paths and
writes captions.

Paths travel as bytes (``os.fsencode``): file names need not be UTF-8.
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
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ..core.errors import OutputError
from ..core import signals
from ..core.outputs import atomic_write_text, check_folder_target, write_marker
from ..core.process_count import cpu_processes
from ..core.stderr_filter import dropping_lines

# Ray's core worker logs this "E" line for a restartable actor whose constructor arguments are in
# the object store (ray-project/ray#53727; Ray Data's actor pools, which captionkit used, did so
# on every run). The replicas' arguments are small and passed inline, so it should not appear;
# should it (a large argument), it only warns that a restart could fail if those objects were
# lost, and captionkit drops exactly this line from standard error while the replicas run.
RESTARTABLE_ACTOR_LINE = (r"core_worker\.cc:\d+: Actor with class name: '.*' .*has constructor arguments in "
                          r"the object store and max_restarts > 0")

INSTALL_HINT = "--engine ray needs Ray: pip install 'captionkit[ray]'"
CAPTION_SHARDS_KIND = "caption-shards"  # the outputs.MARKER kind of a --jsonl OUT's OUT.shards folder
SHARDS_SUFFIX = ".shards"
DEFAULT_SHARD_SIZE = 1000
# Model batches in one chunk of paths handed to a replica: the replica's reader threads decode one
# model batch ahead within it, so only a chunk's first batch waits for its images (1/8 of the
# decoding; decoding is ~5% of a CPU replica's time), while a chunk stays small beside a shard.
CHUNK_BATCHES = 8
# The object store of a local Ray: only paths and captions (or a chunk's feature rows, 27 MB at
# 128 Lite2 images, two chunks queued per replica) pass through it, so Ray's default (30% of the
# machine's memory) is never needed; Ray's floor is 75 MiB.
LOCAL_OBJECT_STORE = 256 * 2**20
QUEUED = 2  # chunks handed to a replica at a time: one it works on, one waiting behind it
POLL_S = 0.5  # a wait on Ray's results looks for a stop signal this often (_ready)
RESTARTS = 3  # a replica lost (its node, its memory) is restarted and its chunks retried this often


def ray_missing() -> str | None:
    """Why ``--engine ray`` cannot run here (None when it can). Ray is found, not imported."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:
        return INSTALL_HINT
    return None


@dataclass(frozen=True)
class RayOptions:
    """How the work is spread: ``address`` of a running cluster (None: a local Ray of ``cpus``
    CPUs), ``replicas`` model actors (None: auto, resolved for each run by :meth:`for_images`)
    holding ``cpus_per_replica`` CPUs and ``gpus_per_replica`` GPUs each, running ``threads``
    torch threads (None: ``cpus_per_replica``) and ``workers`` image readers (threads on a CPU,
    DataLoader processes on a GPU, as the local engine's ``--workers``); images per model call
    ``batch_size``, images per output shard ``shard_size``."""

    address: str | None = None
    cpus: int | None = None
    replicas: int | None = None
    cpus_per_replica: float = 1
    gpus_per_replica: float = 0
    batch_size: int = 16
    shard_size: int = DEFAULT_SHARD_SIZE
    threads: int | None = None
    workers: int = 2

    def torch_threads(self) -> int:
        return self.threads or max(1, int(self.cpus_per_replica))

    def for_images(self, images: int, chunks: int) -> RayOptions:
        """These options for a run of ``images`` images in ``chunks`` chunks, ``replicas`` auto
        (None) resolved: on a local Ray of CPUs, the local engine's ``--processes auto``
        (captionkit.core.process_count: one replica per torch thread, as the batches and half the
        available memory allow), no more than the chunks (a replica with no chunk would idle),
        the CPUs shared as :func:`local_options` shares them, so both engines hold as many models
        and run as many threads; on a cluster, with GPUs, or where ``cpus`` is not known (Ray
        counts them), one. A count given stays as it is."""
        if self.replicas is not None:
            return self
        if self.address is not None or self.gpus_per_replica or not self.cpus:
            return replace(self, replicas=1)
        cpus = self.cpus
        count = min(cpu_processes(self.threads or cpus, images, self.batch_size), max(1, chunks))
        return local_options(cpus, count, self.threads, gpus_per_replica=self.gpus_per_replica,
                             batch_size=self.batch_size, shard_size=self.shard_size, workers=self.workers)


def local_options(cpus: int, replicas: int | None, torch_threads: int | None, **options) -> RayOptions:
    """The options of a local Ray on ``cpus`` CPUs: the replicas share the CPUs (their readers
    run beside the model, as in the local engine), each running the local engine's
    ``torch_threads`` torch threads (None: torch's default, all the CPUs) or its share of the
    CPUs when that is fewer. ``replicas`` None (auto) is resolved per run
    (:meth:`RayOptions.for_images`): on 2 cores, two replicas of one thread, as the local
    engine's two processes (docs/scale.md)."""
    if replicas is None:
        return RayOptions(cpus=cpus, replicas=None, cpus_per_replica=cpus, threads=torch_threads, **options)
    share = max(1, cpus // replicas)
    return RayOptions(cpus=cpus, replicas=replicas, cpus_per_replica=share, threads=min(share, torch_threads or share),
                      **options)


# A replica starts new reader threads for every chunk it is handed, and glibc gives threads
# arenas of their own (up to 8 a core), over which freed memory spreads: a replica captioning
# 2,000 Flickr8k photos on 2 cores peaked 150 MiB higher than with 2 arenas (docs/scale.md). The
# arena count is read when a process starts, so it is the replica's environment, set by Ray.
REPLICA_ENV = {"MALLOC_ARENA_MAX": "2"}


def init_ray(opts: RayOptions) -> None:
    import ray

    if not ray.is_initialized():
        local = opts.address is None
        # the local Ray started here says it enabled token authentication, a notice that
        # reads like a problem on a run that went well (Ray's own log files keep it)
        if local:
            logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
        # A local Ray is trimmed to what the pipeline uses: an object store sized for paths and
        # captions, and no idle workers started ahead (the replicas are the only workers; Ray
        # would otherwise start one idle process per CPU, ~45 MiB each). A cluster's own settings
        # are its own: ray.init(address=...) is given none of these.
        # Ray also starts its workers at niceness 15 (its worker_niceness), so on a machine where
        # anything else runs the replicas get the CPU last, where the local engine competes on
        # equal terms (docs/scale.md): a local Ray's replicas run at 0, as the command does.
        trimmed = {"object_store_memory": LOCAL_OBJECT_STORE,
                   "_system_config": {"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                                      "worker_niceness": 0}}
        with signals.deferred():  # (a stop while Ray starts: raised once it has, not inside its code)
            ray.init(address=opts.address, num_cpus=opts.cpus if local else None, include_dashboard=False,
                     log_to_driver=False, configure_logging=False, **(trimmed if local else {}))
            if local:
                _stop_unused_head_processes(ray)
            signals.reinstall()  # ray.init's SIGTERM handler exits anywhere: the caller's stop handling instead


def _ready(ray, refs: list, num_returns: int) -> list:
    """``ray.wait`` until ``num_returns`` of ``refs`` are ready; returns those. Stop signals are
    deferred within each call and taken between calls, every POLL_S: a handler's exception raised
    inside ``ray.wait`` comes out of it as a SystemError (signals.deferred), not the Preempted a
    preempted command exits 75 with."""
    while True:
        with signals.deferred():
            ready, _ = ray.wait(refs, num_returns=num_returns, timeout=POLL_S)
        if len(ready) >= num_returns:
            return ready


def _get(ray, refs: list) -> list:
    """``ray.get`` of ``refs``, waiting for them as :func:`_ready` does."""
    _ready(ray, refs, len(refs))
    with signals.deferred():
        return ray.get(refs)


def _stop_unused_head_processes(ray) -> None:
    """Stop the processes a local Ray's head starts that this pipeline never uses (~160 MiB
    together here): the autoscaler's monitor (a local Ray of fixed CPUs never scales), the log
    monitor (it forwards workers' output to drivers, and log_to_driver is off) and the
    dashboard's head (include_dashboard=False still starts it for Ray's job and state APIs).
    ray.init has no option for any of them; Ray's node object can stop each, as Ray's own
    tests do. A Ray without those methods keeps its processes."""
    node = getattr(getattr(ray, "_private", None), "worker", None)
    node = getattr(node, "_global_node", None)
    for name in ("kill_monitor", "kill_log_monitor", "kill_dashboard"):
        stop = getattr(node, name, None)
        if stop is not None:
            stop(check_alive=False)


def shard_ranges(n: int, shard_size: int) -> list[range]:
    """Image positions of each shard: consecutive runs of ``shard_size`` (the last shorter)."""
    return [range(s, min(s + shard_size, n)) for s in range(0, n, shard_size)]


# ---- the model replicas (Ray actors) ------------------------------------------------------------
def replica_device():
    """The device of a model replica in a Ray worker: its GPU when Ray gave it one (Ray hides
    the others: the one it gave is ``cuda`` to this process), else the CPU."""
    import ray

    from ..core.devices import resolve_device

    return resolve_device("cuda" if ray.get_gpu_ids() else "cpu")


def batch_paths(batch: dict[str, np.ndarray]) -> list[Path]:
    """The image paths of a Ray batch (they travel as bytes)."""
    return [Path(os.fsdecode(bytes(raw))) for raw in batch["path"]]


class _Replica:
    """A model replica: ``load()`` builds the model once per actor and ``place()`` puts it on
    the replica's device (a GPU when Ray gave it one); each Ray batch of paths is read by
    ``workers`` readers and encoded in model batches of ``batch_size``, as the local engine
    does."""

    def __init__(self, load: Callable, threads: int, batch_size: int = 16, workers: int = 2):
        import torch

        from ..core.allocator import tune_allocator
        from ..core.errors import UserError, WeightsUnavailable

        tune_allocator()  # the command line's (the local engine's); the arenas: REPLICA_ENV
        torch.set_num_threads(threads)
        self.batch_size, self.workers = batch_size, workers
        self.failed: Exception | None = None
        try:
            self.model = load()
        except (UserError, WeightsUnavailable) as e:
            # a user's mistake (a damaged checkpoint, weights not on this node): kept for
            # ready(), so the driver says it in one line; raised here, Ray would retry the
            # actor and print its traceback at every try
            self.failed = e
            return
        self.device = replica_device()
        self.place()

    def ready(self) -> Exception | None:
        """Why this replica has no model (None when it has one)."""
        return self.failed

    def place(self) -> None:
        raise NotImplementedError

    def run(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """What the driver calls on the actor (Ray calls methods by name)."""
        return self(batch)


class CaptionReplica(_Replica):
    """Captions a batch of paths with a :class:`captionkit.inference.captioner.Captioner` (greedy
    or beam), through its ``caption_files``: the local engine's reading, batching and decoding."""

    def __init__(self, load: Callable, threads: int, beam: int, length_penalty: float | None,
                 precision: str | None = None, batch_size: int = 16, workers: int = 2):
        self.precision = precision  # (place() in the base's __init__ reads it)
        super().__init__(load, threads, batch_size, workers)
        self.beam, self.length_penalty = beam, length_penalty

    def place(self) -> None:
        # the captioner's own placement: its device, encoder and decoder agree, and the
        # precision the user asked for (None: the captioner's own, at first auto) is resolved
        # for the replica's device, not the driver's
        self.model.place(self.device, self.precision)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..core.errors import ImageError

        captions, errors = [], []
        for _, res in self.model.caption_files(batch_paths(batch), beam=self.beam, batch_size=self.batch_size,
                                               length_penalty=self.length_penalty, workers=self.workers):
            failed = isinstance(res, ImageError)
            captions.append("" if failed else res.text)
            errors.append(str(res) if failed else "")
        return {"pos": batch["pos"], "caption": np.array(captions, dtype=object),
                "error": np.array(errors, dtype=object)}


class FeatureReplica(_Replica):
    """Encodes a batch of paths with an :class:`captionkit.encoders.Encoder` into float16 rows."""

    def __init__(self, load: Callable, threads: int, shape: tuple[int, int], batch_size: int = 16,
                 workers: int = 2):
        super().__init__(load, threads, batch_size, workers)
        self.shape = shape  # (L, D)

    def place(self) -> None:
        self.model.to(self.device)  # an encoder knows where it is (encoders.module_device)

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..encoders.image_batches import image_batches

        paths = batch_paths(batch)
        rows = np.zeros((len(paths), *self.shape), dtype=np.float16)  # (B, L, D); unreadable images: zeros
        errors = [""] * len(paths)
        start = 0
        for part in image_batches(paths, self.model.preprocess, self.batch_size, self.workers, self.device):
            for k, e in part.errors.items():
                errors[start + k] = str(e)
            if part.pixels is not None:
                # written straight into the batch's rows (float32 -> float16 on assignment)
                rows[[start + k for k in part.good]] = self.model.encode(part.pixels).float().cpu().numpy()
            start += len(part.paths)
        return {"pos": batch["pos"], "feats": rows, "error": np.array(errors, dtype=object)}


def run_shards(paths: list[Path], shards: list[int], shard_size: int, replica: type, replica_args: dict,
               opts: RayOptions) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """Run ``shards`` (indices into :func:`shard_ranges`) of ``paths`` through ``replica``
    actors; yield each shard as soon as all its rows are back: (shard, columns in the shard's
    image order)."""
    import ray

    ranges = shard_ranges(len(paths), shard_size)
    size = opts.batch_size * CHUNK_BATCHES
    # a chunk never spans two shards: a shard is written as soon as its own chunks are back
    chunks = [list(ranges[s][k:k + size]) for s in shards for k in range(0, len(ranges[s]), size)]
    if not chunks:
        return
    auto, opts = opts.replicas is None, opts.for_images(sum(map(len, chunks)), len(chunks))
    if auto and opts.replicas > 1:  # as the local engine says its --processes auto
        threads = opts.torch_threads()
        print(f"ray: {opts.replicas} replicas of {threads} torch thread{'s' * (threads > 1)} each "
              f"(--replicas 1: one replica)", file=sys.stderr, flush=True)
    init_ray(opts)
    actor = ray.remote(replica).options(num_cpus=opts.cpus_per_replica, num_gpus=opts.gpus_per_replica or None,
                                        runtime_env={"env_vars": REPLICA_ENV},
                                        max_restarts=RESTARTS, max_task_retries=RESTARTS)
    args = {**replica_args, "threads": opts.torch_threads(), "batch_size": opts.batch_size, "workers": opts.workers}
    replicas = [actor.remote(**args) for _ in range(min(opts.replicas, len(chunks)))]
    try:
        failed = [e for e in _get(ray, [rep.ready.remote() for rep in replicas]) if e is not None]
        if failed:
            raise failed[0]
    except BaseException:
        for rep in replicas:
            ray.kill(rep)
        raise
    running: dict = {}  # the result of a chunk handed out -> its replica
    handed = 0

    def hand(rep) -> None:
        nonlocal handed
        part = chunks[handed]
        batch = {"pos": np.array(part, dtype=np.int64),
                 "path": np.array([os.fsencode(str(paths[i])) for i in part], dtype=object)}
        running[rep.run.remote(batch)] = rep
        handed += 1

    for _ in range(QUEUED):
        for rep in replicas:
            if handed < len(chunks):
                hand(rep)
    pending: dict[int, list[dict[str, np.ndarray]]] = {}
    got: dict[int, int] = {}
    try:
        with dropping_lines(RESTARTABLE_ACTOR_LINE):
            while running:
                [ready] = _ready(ray, list(running), 1)
                rep = running.pop(ready)
                [batch] = _get(ray, [ready])
                if handed < len(chunks):
                    hand(rep)
                for s in np.unique(batch["pos"] // shard_size):
                    part = {k: v[batch["pos"] // shard_size == s] for k, v in batch.items()}
                    pending.setdefault(int(s), []).append(part)
                    got[int(s)] = got.get(int(s), 0) + len(part["pos"])
                    if got[int(s)] == len(ranges[s]):
                        parts = pending.pop(int(s))
                        cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
                        order = np.argsort(cols["pos"], kind="stable")
                        yield int(s), {k: v[order] for k, v in cols.items()}
    finally:
        for rep in replicas:  # their processes go now, not when Ray shuts down
            ray.kill(rep)


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
                     retry_failed: bool, load: Callable, beam: int, length_penalty: float | None,
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
    rows = run_shards(all_paths, missing, opts.shard_size, CaptionReplica,
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
        for s, cols in run_shards(paths, missing, shard_size, FeatureReplica,
                                  {"load": load, "shape": shape}, opts):
            failed = {int(i): e for i, e in zip(cols["pos"], cols["error"]) if e}
            write_shard(folder, s, cols["feats"], [str(paths[i]) for i in ranges[s]], failed)
            progress.update(len(ranges[s]), failed=len(failed))
            skipped += failed.values()
        progress.close()
        for msg in skipped:  # as the local engine reports them
            print(f"skipped: {msg}", file=sys.stderr)
        return ShardedFeatureStore(folder)

