"""The training commands: train (one process, or DDP under torchrun), features (the encoder
feature cache, local or --engine ray), matcher (the image-caption matcher of --rerank match)
pack (a checkpoint for shipping) and average (checkpoints of one training path); each one's
options beside its code."""

from __future__ import annotations

import argparse
from pathlib import Path

from .argtypes import (Setting, config_setting, device_name, float_at_least, int_at_least, mixing_weights,
                       positive_int)
from .common import (UsageError, _add_csv_opts, _add_device_opts, _add_engine_opts, _add_overwrite, _device,
                     _load_dataset, _ray_options)


def add_train(sub: argparse._SubParsersAction) -> None:
    t = sub.add_parser("train", help="train a decoder from a TOML config")
    t.set_defaults(func=cmd_train)
    t.add_argument("--config", required=True, help="the run's TOML config (configs/ has examples)")
    t.add_argument("--out", help="run folder (default runs/<config name>); a new run needs a new or empty one")
    t.add_argument("--max-steps", type=positive_int,
                   help="stop after this many optimizer steps, counted from the run's start (the features of "
                        "every image the config uses are computed first; a quick start from nothing: "
                        "configs/quickstart.toml)")
    t.add_argument("--resume", nargs="?", const=True, default=False, type=resume_mode, metavar="auto",
                   help="continue the run in OUT from OUT/last; --resume auto: continue it if OUT has a "
                        "checkpoint, else start it (for requeued and restarted jobs; docs/robustness.md)")
    t.add_argument("--stop-signals", default="SIGTERM,SIGUSR1", metavar="SIGS",
                   help="on these signals (comma-separated, or none) finish the step, save OUT/last and "
                        "exit 75, to resume with --resume auto (default SIGTERM,SIGUSR1)")
    t.add_argument("--init", metavar="DIR", help="start from this checkpoint (replaces the config's train.init)")
    _add_overwrite(t, "start the run in OUT again, replacing the run captionkit wrote there")
    t.add_argument("--tensorboard", metavar="DIR",
                   help="write TensorBoard event files here (replaces the config's train.tensorboard)")
    t.add_argument("--device", type=device_name,
                   help="auto (a GPU when there is one), cpu, cuda, cuda:N or mps (replaces the config's train.device)")
    t.add_argument("--set", dest="sets", action="append", type=config_setting, metavar="TABLE.FIELD=VALUE",
                   help="replace a field of the config, e.g. --set train.seed=2 --set train.flip=0.5 (TOML "
                        "values; repeatable; give the same ones again to --resume the run)")
    t.add_argument("--nproc", type=positive_int, default=1,
                   help="train with DDP in this many processes on this machine (torchrun's launcher; "
                        "see docs/distributed-training.md)")
    t.add_argument("--threads", type=positive_int,
                   help="torch threads per process (default: torch's, one per core; on a machine other "
                        "work keeps busy, fewer run faster: see docs/training.md)")


def resume_mode(value: str) -> str:
    if value != "auto":
        raise argparse.ArgumentTypeError(f"--resume takes no value or 'auto', not {value!r}")
    return value


def cmd_train(config: str, out: str | None, max_steps: int | None, resume: bool | str, init: str | None,
              overwrite: bool, tensorboard: str | None = None, device: str | None = None, nproc: int = 1,
              threads: int | None = None, stop_signals: str = "SIGTERM,SIGUSR1",
              sets: list[Setting] | None = None) -> int:
    settings = {}
    for s in sets or []:
        if s.key in settings:
            raise UsageError(f"--set {s.key} is given twice")
        settings[s.key] = s.value
    if nproc > 1:  # the same command in nproc processes under torchrun (DDP); see docs/distributed-training.md
        from ..training.distributed import launch
        from ..training.run import auto_resume, check_run
        # (each rank decides "auto" again, before any rank writes)
        how = auto_resume(Path(out or Path("runs") / Path(config).stem), overwrite) if resume == "auto" \
            else (resume, overwrite)
        check_run(config, out, max_steps, how[0], init, how[1], device, nproc,  # one line here, not one per rank
                  settings=settings)
        flags = {"--out": out, "--max-steps": max_steps, "--init": init, "--tensorboard": tensorboard,
                 "--device": device, "--threads": threads, "--stop-signals": stop_signals}
        args = ["train", "--config", config, *[x for k, v in flags.items() if v is not None for x in (k, str(v))],
                *[x for s in sets or [] for x in ("--set", s.text)]]
        resumed = ["--resume", "auto"] if resume == "auto" else ["--resume"] * bool(resume)
        return launch(nproc, args + resumed + ["--overwrite"] * overwrite)
    from ..training.run import train
    train(config, out=out, max_steps=max_steps, resume=resume, init=init, overwrite=overwrite,
          tensorboard=tensorboard, device=device, threads=threads, busy_warning=True, stop_signals=stop_signals,
          settings=settings)
    return 0


def add_features(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("features", help="compute and cache a dataset's encoder features")
    f.set_defaults(func=cmd_features)
    f.add_argument("--dataset", required=True,
                   help="a Flickr8k, Kaggle or imagefolder folder, WebDataset shards, a saved Hugging Face "
                        "dataset, a Karpathy or COCO JSON file, or a title CSV (docs/datasets.md)")
    f.add_argument("--images", help="image folder of a JSON or CSV dataset")
    f.add_argument("--encoder", default="efficientnet_lite2", help="the image encoder (default efficientnet_lite2)")
    f.add_argument("--flip", action="store_true",
                   help="cache the mirror images' features instead (for --tta flip experiments; docs/ensembles.md)")
    f.add_argument("--verify", action="store_true",
                   help="check every shard's sha256 (a full read of the store) and compute the bad ones again, alone")
    _add_device_opts(f, workers=True, precision=False)
    _add_csv_opts(f)
    _add_engine_opts(f)
    f.add_argument("--batch-size", type=positive_int, default=16, help="ray: images per model call")


def cmd_features(dataset: str, images: str | None, encoder: str,
                 image_column: str, title_column: str, image_suffix: str, engine: str = "local",
                 address: str | None = None, replicas: int | None = None, shard_size: int | None = None,
                 gpus_per_replica: float = 0, batch_size: int = 16, flip: bool = False, device: str = "auto",
                 workers: int = 2, verify: bool = False) -> int:
    from ..core.outputs import check_writable_folder
    from ..encoders import create_encoder
    from ..encoders.features import build_features, default_cache_root, verify_sharded

    _check_encoder(encoder)
    where, _ = _device(device)
    check_writable_folder(default_cache_root())
    if engine == "ray":
        from ..inference.ray_engine import build_features_ray, ray_missing
        if flip:
            raise UsageError("--engine ray does not support --flip; use the local engine for it")
        if ray_missing():
            raise UsageError(ray_missing())
    ds = _load_dataset(dataset, images, image_column, title_column, image_suffix)
    paths = [it.path for it in ds.all_items()]
    if engine == "ray":
        # one replica unless given: the local engine extracts features in one process
        opts = _ray_options(address, replicas or 1, gpus_per_replica, batch_size, shard_size, workers)
        if verify:  # the bad shards lose their record: the Ray run below computes them with the missing ones
            verify_sharded(create_encoder(encoder), paths)
        store = build_features_ray(encoder, None, paths, None, opts)
    else:
        store = build_features(create_encoder(encoder).to(where), paths, workers=workers, flip=flip, verify=verify)
    print(f"{len(store.index)} images, grid {store.grid}: {store.folder}")
    return 0


def add_matcher(sub: argparse._SubParsersAction) -> None:
    m = sub.add_parser("matcher", help="train the image-caption matcher that --rerank match scores captions with")
    m.set_defaults(func=cmd_matcher)
    m.add_argument("--dataset", required=True, help="a captioned dataset with a training and a dev split "
                                                    "(any layout captionkit reads, docs/datasets.md)")
    m.add_argument("--images", help="image folder of a JSON or CSV dataset")
    m.add_argument("--out", required=True, help="the checkpoint folder to write (new or empty)")
    m.add_argument("--encoder", default="efficientnet_lite2",
                   help="the image encoder whose cached rows it reads: the captioner's (default efficientnet_lite2)")
    m.add_argument("--epochs", type=positive_int, default=15, help="epochs (default 15; the dev-best one is kept)")
    m.add_argument("--embed-dim", type=int_at_least(2), default=512, help="the joint space's size (even; default 512)")
    m.add_argument("--word-dim", type=positive_int, default=300, help="word embedding size (default 300)")
    m.add_argument("--dropout", type=float_at_least(0), default=0.2, help="dropout while training (default 0.2)")
    m.add_argument("--min-count", type=positive_int, default=2,
                   help="words seen fewer times in the training captions are unknown to it (default 2)")
    m.add_argument("--bank-size", type=positive_int, default=1000,
                   help="training photos kept as the bank a caption is contrasted against (default 1000)")
    m.add_argument("--batch-size", type=int_at_least(2), default=128, help="photos per step (default 128)")
    m.add_argument("--lr", type=float_at_least(0), default=1e-3, help="peak learning rate (default 1e-3)")
    m.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    _add_overwrite(m, "replace OUT if it is a checkpoint captionkit wrote")


def cmd_matcher(dataset: str, images: str | None, out: str, encoder: str, epochs: int, embed_dim: int, word_dim: int,
                dropout: float, min_count: int, bank_size: int, batch_size: int, lr: float, seed: int,
                overwrite: bool) -> int:
    from ..training.matcher import train_matcher

    _check_encoder(encoder)  # (the sizes are the matcher config's to check, before any work too)
    train_matcher(dataset, out, images=images, encoder=encoder, epochs=epochs, embed_dim=embed_dim, word_dim=word_dim,
                  dropout=dropout, min_count=min_count, bank_size=bank_size, batch_size=batch_size, lr=lr, seed=seed,
                  overwrite=overwrite, log=lambda line: print(line, flush=True))
    return 0


def _check_encoder(name: str) -> None:
    """--encoder names a registered encoder: one line listing them otherwise."""
    from ..encoders import list_encoders

    if name not in list_encoders():
        raise UsageError(f"--encoder: unknown encoder {name!r}; known: {', '.join(list_encoders())}")


def add_pack(sub: argparse._SubParsersAction) -> None:
    k = sub.add_parser("pack", help="copy a checkpoint without optimizer state, for shipping")
    k.set_defaults(func=cmd_pack)
    k.add_argument("checkpoint", help="the checkpoint folder to copy (e.g. runs/NAME/best)")
    k.add_argument("out", help="the folder to write")
    k.add_argument("--fp16", action="store_true", help="store the decoder's weights in float16 (half the size)")
    k.add_argument("--int8", action="store_true",
                   help="the decoder's matrices as int8 with one scale per row (a quarter of float32's size)")
    _add_overwrite(k, "replace OUT if it is a checkpoint captionkit wrote")


def cmd_pack(checkpoint: str, out: str, fp16: bool, overwrite: bool, int8: bool = False) -> int:
    from ..core.checkpoint import pack_checkpoint

    if fp16 and int8:
        raise UsageError("give --fp16 or --int8, not both")
    size = pack_checkpoint(checkpoint, out, fp16=fp16, int8=int8, overwrite=overwrite)
    print(f"wrote {out} ({size / 1e6:.1f} MB)")
    return 0


def add_average(sub: argparse._SubParsersAction) -> None:
    a = sub.add_parser("average", help="average the weights of checkpoints of one model (a run's epochs, a "
                                       "fine-tuning and its start)")
    a.set_defaults(func=cmd_average)
    a.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT",
                   help="two or more checkpoint folders of one model: same family, sizes, encoder, vocabulary")
    a.add_argument("--out", required=True, help="the folder to write (a checkpoint: caption, evaluate, train.init)")
    a.add_argument("--weights", type=mixing_weights, metavar="W1,W2,..",
                   help="one per checkpoint, summing to 1 (default: equal); 1-a,a interpolates from the first "
                        "to the second, a negative weight extrapolates (write --weights=-0.25,1.25)")
    a.add_argument("--fp16", action="store_true", help="store the decoder's weights in float16, as pack --fp16")
    a.add_argument("--int8", action="store_true", help="store the decoder's matrices in int8, as pack --int8")
    _add_overwrite(a, "replace OUT if it is a checkpoint captionkit wrote")


def cmd_average(checkpoints: list[str], out: str, weights: list[float] | None, fp16: bool, int8: bool,
                overwrite: bool) -> int:
    if fp16 and int8:
        raise UsageError("give --fp16 or --int8, not both")
    if len(checkpoints) < 2:
        raise UsageError(f"averaging needs two checkpoints or more, got {len(checkpoints)}")
    if weights is not None and len(weights) != len(checkpoints):
        raise UsageError(f"--weights: {len(weights)} weights for {len(checkpoints)} checkpoints")
    from ..core.checkpoint import average_checkpoints

    size = average_checkpoints(checkpoints, out, weights, fp16=fp16, int8=int8, overwrite=overwrite)
    mix = ", ".join(f"{w:g}" for w in weights) if weights else "equal weights"
    print(f"wrote {out} ({size / 1e6:.1f} MB): the average of {len(checkpoints)} checkpoints ({mix})")
    return 0
