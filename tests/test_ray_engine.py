"""--engine ray (captionkit.inference.ray_engine) on a local Ray of 2 CPUs, against the local engine:
the same captions and error records, the same features, and shard-level resume."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import local_ray as helpers_local_ray
from helpers import shape_image

from captionkit.cli import main as cli
from captionkit.cli.caption import _listed_paths
from captionkit.encoders.features import ShardedFeatureStore, build_features, shard_file, shards_for_rank
from captionkit.inference.ray_engine import RayOptions, caption_shards_folder


def test_shards_for_rank_splits_every_shard_once():
    ranks = [shards_for_rank(7, r, 3) for r in range(3)]
    assert ranks == [[0, 3, 6], [1, 4], [2, 5]]
    with pytest.raises(ValueError):
        shards_for_rank(7, 3, 3)


def test_engine_ray_without_ray_says_how_to_install(monkeypatch, tmp_path, capsys):
    import captionkit.inference.ray_engine as engine

    monkeypatch.setattr(engine, "ray_missing", lambda: engine.INSTALL_HINT)
    code = cli.main(["caption", str(tmp_path), "--engine", "ray", "--jsonl", str(tmp_path / "o.jsonl")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "pip install 'captionkit[ray]'" in err[0]


def test_engine_ray_refuses_what_it_cannot_do_before_loading(tmp_path, capsys, no_expensive_work):
    code = cli.main(["caption", str(tmp_path), "--engine", "ray"])
    assert code == 2 and "--jsonl or --csv" in capsys.readouterr().err
    code = cli.main(["caption", str(tmp_path), "--engine", "ray", "--jsonl", str(tmp_path / "o.jsonl"),
                     "--attention", str(tmp_path / "fig")])
    assert code == 2 and "--attention" in capsys.readouterr().err


def test_caption_engine_ray_loads_no_model_in_the_driver(picky_models, tmp_path, monkeypatch):
    """The driver lists paths and writes captions; only the replicas load the model (the
    driver used to load a whole one to learn the preprocessing: memory and a second of work)."""
    pytest.importorskip("ray")
    import captionkit.inference.ray_engine as engine
    from captionkit.inference.captioner import Captioner

    loaded, seen = [], {}
    real_load = Captioner.load.__func__
    monkeypatch.setattr(Captioner, "load", classmethod(lambda cls, *a, **k: loaded.append(a) or real_load(cls, *a, **k)))

    def fake_ray(readable, todo, folder, settings, overwrite, retry_failed, load, *args, **kwargs):
        seen["load"] = load
        return iter(())

    monkeypatch.setattr(engine, "caption_with_ray", fake_ray)
    photo = tmp_path / "a.png"
    shape_image(0).save(photo)
    cli.main(["caption", str(photo), "--model", str(picky_models[0]), "--engine", "ray",
              "--jsonl", str(tmp_path / "o.jsonl")])
    assert "load" in seen and loaded == []
    assert isinstance(seen["load"](), Captioner) and len(loaded) == 1  # what each replica calls


@pytest.mark.parametrize("extra", [[], ["--precision", "fp32"]])
def test_the_driver_of_engine_ray_imports_no_torch(picky_models, tmp_path, extra):
    """torch costs ~300 MiB of private memory in each process that imports it (this build):
    the driver of --engine ray, which only lists paths and writes captions, goes without, with
    --precision given too (the replicas resolve it; the driver did, importing torch)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("ray")
    photo = tmp_path / "a.png"
    shape_image(0).save(photo)
    script = (
        "import sys\n"
        "import captionkit.inference.ray_engine as engine\n"
        "engine.caption_with_ray = lambda *a, **k: iter(())  # the driver's side only\n"
        "from captionkit.cli.main import main\n"
        f"main(['caption', {str(photo)!r}, '--model', {str(picky_models[0])!r}, '--engine', 'ray',"
        f" '--jsonl', {str(tmp_path / 'o.jsonl')!r}, *{extra!r}])\n"
        "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    assert out.stdout.strip().splitlines()[-1] == "False", out.stderr


def test_a_local_ray_shares_the_cpus_as_its_replicas_are_given(monkeypatch):
    """On this machine's own Ray the replicas share its CPUs and run the local engine's torch
    threads or their share of the CPUs; on a cluster one CPU and thread each."""
    import os

    from captionkit.cli.common import _ray_options

    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    one = _ray_options(None, 1, 0, 16, None, workers=3)
    assert (one.cpus, one.replicas, one.cpus_per_replica, one.torch_threads(), one.workers) == (8, 1, 8, 8, 3)
    monkeypatch.setenv("OMP_NUM_THREADS", "6")
    assert _ray_options(None, 1, 0, 16, None).torch_threads() == 6
    four = _ray_options(None, 4, 0, 16, None)
    assert (four.cpus_per_replica, four.torch_threads()) == (2, 2)
    assert four.for_images(10_000, 79) == four  # a count given stays
    cluster = _ray_options("auto", 4, 1, 16, None)
    assert (cluster.cpus, cluster.cpus_per_replica, cluster.torch_threads()) == (None, 1, 1)


def test_replicas_auto_is_the_local_engines_processes_auto(monkeypatch):
    """--replicas auto (the default) on a local Ray holds as many models, of as many threads, as
    the local engine's --processes auto on the same machine and images: on 2 cores two replicas
    of one thread for a large job, one of two for a small one; the memory cap, OMP_NUM_THREADS
    and the chunk count (a replica with no chunk would idle) hold it down; a cluster or GPUs
    get one."""
    import os

    from captionkit.cli.common import _ray_options
    from captionkit.core import process_count
    from captionkit.inference.processes import auto_processes
    from captionkit.inference.ray_engine import CHUNK_BATCHES

    monkeypatch.setattr(process_count, "available_memory", lambda: 64 * 2**30)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    for cpus in (1, 2, 8):
        monkeypatch.setattr(os, "cpu_count", lambda: cpus)
        auto = _ray_options(None, None, 0, 16, None)
        assert auto.replicas is None
        for images in (10, 100, 300, 8000):
            chunks = -(-images // (16 * CHUNK_BATCHES))
            sized = auto.for_images(images, chunks)
            want = min(auto_processes("cpu", cpus, images, 16), chunks)
            assert sized.replicas == want, (cpus, images)
            assert sized.torch_threads() == max(1, cpus // want)
            assert sized.cpus_per_replica == max(1, cpus // want)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    two = _ray_options(None, None, 0, 16, None).for_images(8000, 63)
    assert (two.replicas, two.cpus_per_replica, two.torch_threads()) == (2, 1, 1)
    assert _ray_options(None, None, 0, 16, None).for_images(100, 1).replicas == 1  # one chunk of 128
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the local engine runs one process of one thread
    one = _ray_options(None, None, 0, 16, None).for_images(8000, 63)
    assert (one.replicas, one.torch_threads()) == (1, 1)
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setattr(process_count, "available_memory", lambda: 5 * 2**30)  # half holds two models
    assert _ray_options(None, None, 0, 16, None).for_images(8000, 63).replicas == 2
    assert _ray_options("auto", None, 0, 16, None).for_images(8000, 63).replicas == 1  # a cluster
    assert _ray_options(None, None, 1, 16, None).for_images(8000, 63).replicas == 1  # GPUs
    bare = RayOptions().for_images(8000, 63)  # the Python API's options: Ray counts the CPUs, as before
    assert (bare.replicas, bare.cpus, bare.torch_threads()) == (1, None, 1)


def test_the_replicas_started_are_the_resolved_count(monkeypatch, capsys):
    """run_shards resolves --replicas auto for the images it was given before it starts Ray, and
    says the count in a line, as the local engine says its processes."""
    pytest.importorskip("ray")
    import captionkit.inference.ray_engine as engine
    from captionkit.core import process_count

    class Started(Exception):
        pass

    seen = []

    def init_ray(opts):
        seen.append(opts)
        raise Started

    monkeypatch.setattr(engine, "init_ray", init_ray)
    monkeypatch.setattr(process_count, "available_memory", lambda: 64 * 2**30)
    paths = [Path(f"p{i}.jpg") for i in range(1000)]
    for images, given, want in ((1000, None, (2, 1)), (100, None, (1, 2)), (1000, 1, (1, 2))):
        with pytest.raises(Started):
            list(engine.run_shards(paths[:images], [0], 1000, object, {}, engine.local_options(2, given, None)))
        assert (seen[-1].replicas, seen[-1].torch_threads()) == want
        said = "ray: 2 replicas of 1 torch thread each" in capsys.readouterr().err
        assert said == (want[0] == 2)


def test_a_local_ray_is_trimmed_and_a_cluster_left_as_it_is(monkeypatch):
    """The local Ray gets a small object store and no idle workers started ahead; ray.init on
    a cluster's address is called as before, with none of these."""
    ray = pytest.importorskip("ray")
    import captionkit.inference.ray_engine as engine

    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.setattr(engine.signals, "reinstall", lambda: None)
    engine.init_ray(RayOptions(cpus=2))
    engine.init_ray(RayOptions(address="auto"))
    local, cluster = calls
    assert local["num_cpus"] == 2 and local["include_dashboard"] is False
    assert local["object_store_memory"] == engine.LOCAL_OBJECT_STORE
    assert local["_system_config"] == {"enable_worker_prestart": False, "prestart_worker_first_driver": False,
                                       "worker_niceness": 0}
    assert cluster == {"address": "auto", "num_cpus": None, "include_dashboard": False, "log_to_driver": False,
                       "configure_logging": False}


@pytest.mark.slow
def test_a_local_rays_replicas_run_at_the_commands_priority_with_two_malloc_arenas():
    """In a fresh process (a Ray of its own): the local Ray init_ray starts runs a worker given
    the replicas' runtime environment (run_shards' REPLICA_ENV) at niceness 0 (Ray's default is
    15) and with MALLOC_ARENA_MAX=2 in its environment (glibc reads it as the process starts)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("ray")
    code = (
        "import os, ray\n"
        "import captionkit.inference.ray_engine as engine\n"
        "engine.init_ray(engine.local_options(2, 1, None))\n"
        "probe = ray.remote(lambda: (os.nice(0), os.environ.get('MALLOC_ARENA_MAX')))\n"
        "print(ray.get(probe.options(runtime_env={'env_vars': engine.REPLICA_ENV}).remote()))\n"
        "ray.shutdown()\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "(0, '2')"


@pytest.fixture(scope="session")
def local_ray():
    """One local Ray of 2 CPUs for the whole session (starting one takes ~10 s)."""
    with helpers_local_ray() as ray:
        yield ray


@pytest.fixture
def photos(tmp_path) -> Path:
    """Five shapes photos, a corrupt file and an empty one."""
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(5):
        shape_image(i, jitter=i % 4).save(folder / f"p{i}.jpg", quality=95)
    (folder / "broken.jpg").write_bytes(b"not a jpeg at all")
    (folder / "empty.png").write_bytes(b"")
    return folder


@pytest.mark.slow
def test_caption_engine_ray_matches_local(local_ray, tiny_run, photos, tmp_path, capsys):
    model = str(tiny_run / "best")
    common = ["caption", str(photos), "--model", model, "--beam", "2", "--batch-size", "2"]
    assert cli.main([*common, "--jsonl", str(tmp_path / "local.jsonl")]) == 1  # 1: two unreadable files
    ray_out = tmp_path / "ray.jsonl"
    assert cli.main([*common, "--jsonl", str(ray_out), "--engine", "ray", "--shard-size", "3"]) == 1
    local = (tmp_path / "local.jsonl").read_text()
    assert ray_out.read_text() == local
    records = [json.loads(line) for line in local.splitlines()]
    assert sum("error" in r for r in records) == 2 and sum("caption" in r for r in records) == 5
    shards = sorted(caption_shards_folder(ray_out).glob("part-*.jsonl"))
    assert len(shards) == 3  # 7 images in shards of 3

    # the shards are the resumable state: with OUT gone, a rerun rebuilds it from them, no Ray work
    ray_out.unlink()
    capsys.readouterr()
    assert cli.main([*common, "--jsonl", str(ray_out), "--engine", "ray", "--shard-size", "3"]) == 1
    assert "shards to compute" not in capsys.readouterr().err
    assert ray_out.read_text() == local

    # other settings are refused with one line, before any work
    other = ["caption", str(photos), "--model", model, "--beam", "1", "--jsonl", str(ray_out), "--engine", "ray"]
    assert cli.main(other) == 2
    assert "--beam" in capsys.readouterr().err

    # --retry-failed recomputes the shard that recorded the (now repaired) broken file, only it
    shape_image(1).save(photos / "broken.jpg")
    assert cli.main([*common, "--jsonl", str(ray_out), "--engine", "ray", "--shard-size", "3", "--retry-failed"]) == 1
    assert "1 of 3 shards to compute" in capsys.readouterr().err
    records = {r["image"]: r for r in map(json.loads, ray_out.read_text().splitlines())}
    assert "caption" in records["broken.jpg"] and "error" in records["empty.png"] and len(records) == 7

    # with OUT gone, the shards' own record of the settings still refuses other ones
    ray_out.unlink()
    assert cli.main(other) == 2
    assert "other settings" in capsys.readouterr().err


@pytest.mark.slow
def test_engine_ray_prints_no_ray_error_line_on_success(local_ray, tiny_run, tmp_path, capfd):
    """A run that goes well prints captionkit's lines only: not the "E ... core_worker.cc" line
    that Ray's C++ core worker writes to file descriptor 2 on every actor pool (capfd reads the
    descriptor, where capsys would not see it)."""
    folder = tmp_path / "ok"
    folder.mkdir()
    for i in range(3):
        shape_image(i).save(folder / f"p{i}.jpg", quality=95)
    out = tmp_path / "ray.jsonl"
    capfd.readouterr()
    assert cli.main(["caption", str(folder), "--model", str(tiny_run / "best"), "--beam", "2",
                     "--jsonl", str(out), "--engine", "ray"]) == 0
    err = capfd.readouterr().err
    assert len(out.read_text().splitlines()) == 3
    assert "core_worker" not in err and not re.search(r"(?m)^\[[^\]]* E \d", err), err


@pytest.mark.slow
def test_engine_ray_says_a_damaged_model_in_one_line(local_ray, tiny_run, photos, tmp_path, capsys):
    """The driver loads no model, so a checkpoint that does not load is found by the replicas:
    the command still says it in one line (no Ray retries, no traceback)."""
    import shutil

    broken = tmp_path / "broken-model"
    shutil.copytree(tiny_run / "best", broken)
    weights = next(broken.glob("*.safetensors"))
    weights.write_bytes(weights.read_bytes()[:1000])
    capsys.readouterr()
    code = cli.main(["caption", str(photos), "--model", str(broken), "--jsonl", str(tmp_path / "o.jsonl"),
                     "--engine", "ray"])
    err = capsys.readouterr().err
    assert code == 2 and "corrupted or truncated" in err.strip().splitlines()[-1]
    assert "Traceback" not in err and "retries" not in err, err


@pytest.mark.slow
def test_features_engine_ray_matches_local_and_resumes_one_shard(local_ray, photos, tmp_path, capsys):
    from captionkit.encoders import create_encoder
    from captionkit.inference.ray_engine import build_features_ray

    paths = sorted(photos.iterdir())
    root = tmp_path / "cache"
    local = build_features(create_encoder("efficientnet_lite0", weights="random"), paths, root=root, progress=False)
    opts = RayOptions(replicas=1, batch_size=2, shard_size=3)
    store = build_features_ray("efficientnet_lite0", "random", paths, root, opts)
    assert isinstance(store, ShardedFeatureStore) and store.complete and store.num_shards == 3
    names = sorted(local.index)
    assert sorted(store.index) == names and len(names) == 5  # the two unreadable files left out
    np.testing.assert_allclose(store.rows(names).astype(np.float32), local.rows(names).astype(np.float32),
                               rtol=1e-3, atol=1e-3)
    assert "broken.jpg: cannot read image" in capsys.readouterr().err

    # a rerun after one shard is removed computes that shard only
    files = {s: (shard_file(store.folder, s, ".npy"), shard_file(store.folder, s, ".json")) for s in range(3)}
    before = {s: [f.stat().st_mtime_ns for f in fs] for s, fs in files.items()}
    for f in files[1]:
        f.unlink()
    assert not ShardedFeatureStore(store.folder).complete
    again = build_features_ray("efficientnet_lite0", "random", paths, root, opts)
    assert "1 of 3 shards to compute" in capsys.readouterr().err
    assert [f.stat().st_mtime_ns for f in files[0]] == before[0]
    assert [f.stat().st_mtime_ns for f in files[2]] == before[2]
    assert all(f.exists() for f in files[1])
    np.testing.assert_array_equal(again.rows(names), store.rows(names))

    # the trainer's entry point now reads the complete sharded store
    found = build_features(create_encoder("efficientnet_lite0", weights="random"), paths, root=root)
    assert isinstance(found, ShardedFeatureStore) and found.folder == store.folder


def test_paths_from_lists_images_for_either_engine(photos, tmp_path, capsys, no_expensive_work):
    """--paths-from: the images are found (and a missing list is one line) before any model loads."""
    listing = tmp_path / "list.txt"
    listing.write_text(f"# photos\n{photos / 'p0.jpg'}\n\n{photos / 'p1.jpg'}\n")
    assert _listed_paths(str(listing)) == [str(photos / "p0.jpg"), str(photos / "p1.jpg")]
    assert cli.main(["caption", "--paths-from", str(tmp_path / "nope.txt")]) == 2
    assert "nope.txt: cannot read the list of images" in capsys.readouterr().err
    assert cli.main(["caption"]) == 2
    assert "--paths-from" in capsys.readouterr().err


def test_sharded_store_reads_lazily_and_splits_by_rank(tmp_path):
    """The sharded layout without Ray: shards written by write_shard, read by name, a rank's
    store indexing only its shards, unreadable images left out."""
    from captionkit.encoders import create_encoder
    from captionkit.encoders.features import open_sharded, write_shard

    enc = create_encoder("patches", weights="random")
    paths = [tmp_path / f"im{i}.jpg" for i in range(5)]
    folder, _ = open_sharded(enc, paths, tmp_path / "cache", shard_size=2)
    L, D = enc.grid()[0] * enc.grid()[1], enc.dim
    rows = np.random.default_rng(0).standard_normal((5, L, D)).astype(np.float16)  # each row its own values
    for s in range(3):
        part = range(2 * s, min(2 * s + 2, 5))
        write_shard(folder, s, rows[list(part)], [str(paths[i]) for i in part], {3: "im3.jpg: empty file"} if s == 1 else {})
    store = ShardedFeatureStore(folder)
    assert store.complete and store.num_shards == 3 and "im3.jpg" not in store and len(store.index) == 4
    np.testing.assert_array_equal(store.rows(["im4.jpg", "im0.jpg"]), rows[[4, 0]])
    assert store._arrays.keys() == {0, 2}  # shard 1 never opened
    mine = ShardedFeatureStore(folder, shards=shards_for_rank(store.num_shards, 1, 2))
    assert sorted(mine.index) == ["im2.jpg"] and mine.shard_names == [[], ["im2.jpg"], []]


@pytest.mark.slow
def test_trainer_reads_the_sharded_store(local_ray, tiny_config, tmp_path, monkeypatch):
    """After features --engine ray, training takes its features from the sharded store."""
    import captionkit.training.stages
    from captionkit.inference.ray_engine import build_features_ray
    from captionkit.training.run import train

    real = captionkit.training.stages.build_features
    used = []

    def ray_first(encoder, paths, **options):  # (options: the run's own, e.g. only= its images)
        build_features_ray("efficientnet_lite0", "random", paths, None, RayOptions(batch_size=4, shard_size=6))
        used.append(real(encoder, paths, **options))
        return used[-1]

    monkeypatch.setattr(captionkit.training.stages, "build_features", ray_first)
    train(tiny_config, out=tmp_path / "run", max_steps=2, progress=False)
    assert isinstance(used[0], ShardedFeatureStore) and (tmp_path / "run" / "last" / "config.json").exists()
