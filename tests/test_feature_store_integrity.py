"""The feature store survives the cluster (issue 30): a bit-flipped or truncated shard is detected
when read, named in one line, and `captionkit features` computes it again alone; a store from
before digests still reads; a full disk leaves the store as it was, in one line; two processes
building one cache entry do not both write it (the second waits, then uses it)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import local_ray

from captionkit.cli import main as cli
from captionkit.core.errors import OutputError
from captionkit.data.datasets import load_dataset
from captionkit.encoders import create_encoder
from captionkit.encoders import features as F
from captionkit.encoders.features import (CorruptFeatures, FeatureStore, ShardedFeatureStore, build_features,
                                          open_sharded, shard_file, write_shard)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("CAPTIONKIT_CACHE", str(root))
    return root


@pytest.fixture
def encoded(monkeypatch) -> list[int]:
    """The batch sizes every patches encoder is asked to encode from now on (any instance)."""
    calls: list[int] = []
    cls = type(create_encoder("patches"))
    real = cls.encode

    def counting(self, pixels):
        calls.append(len(pixels))
        return real(self, pixels)

    monkeypatch.setattr(cls, "encode", counting)
    return calls


def _paths(flickr_dir: Path) -> list[Path]:
    return [it.path for it in load_dataset(str(flickr_dir)).all_items()]  # as `captionkit features` lists them


def _flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x10
    path.write_bytes(bytes(data))


def _sharded(flickr_dir: Path, cache: Path, shard_size: int = 5) -> tuple[Path, list[Path]]:
    """The sharded store of the dataset's images, as `features --engine ray` leaves it (three
    shards of five images), computed here."""
    enc, paths = create_encoder("patches"), _paths(flickr_dir)
    folder, _ = open_sharded(enc, paths, cache, shard_size)
    F._fill_shards(enc, paths, folder, list(range(-(-len(paths) // shard_size))), batch_size=4, workers=0)
    return folder, paths


def _stamps(folder: Path, shard: int) -> list[tuple[int, int]]:
    return [(f.stat().st_mtime_ns, f.stat().st_ino) for f in (shard_file(folder, shard, ".npy"),
                                                              shard_file(folder, shard, ".json"))]


def test_flipped_byte_in_a_shard_is_named_and_rebuilt_alone(flickr_dir, cache, encoded, capsys):
    folder, paths = _sharded(flickr_dir, cache)
    assert len(paths) == 15
    record = json.loads(shard_file(folder, 1, ".json").read_text())
    assert record["bytes"] == shard_file(folder, 1, ".npy").stat().st_size and len(record["sha256"]) == 64
    first = ShardedFeatureStore(folder)
    names = [p.name for p in paths]
    good = first.rows(names)  # (15, L, D), every shard verified on its first open
    kept = {s: _stamps(folder, s) for s in (0, 2)}

    _flip_byte(shard_file(folder, 1, ".npy"), -1000)  # a byte of shard 1's rows
    store = ShardedFeatureStore(folder)  # a new process's view: nothing opened yet
    np.testing.assert_array_equal(store.rows(names[:5]), good[:5])  # shard 0 reads
    with pytest.raises(CorruptFeatures) as err:
        store.rows([names[7]])  # a row of shard 1
    msg = str(err.value)
    assert "\n" not in msg and str(shard_file(folder, 1, ".npy")) in msg and "corrupted" in msg
    assert "captionkit features --dataset DATASET --encoder patches --verify" in msg

    # without --verify a flipped byte (same size) is not seen: features has nothing to do
    encoded.clear()
    assert cli.main(["features", "--dataset", str(flickr_dir), "--encoder", "patches", "--workers", "0"]) == 0
    assert encoded == []
    # --verify: shard 1 alone is computed again (its 5 images), the others left as they were
    assert cli.main(["features", "--dataset", str(flickr_dir), "--encoder", "patches", "--workers", "0",
                     "--verify"]) == 0
    err_lines = capsys.readouterr().err.splitlines()
    assert [line for line in err_lines if "computing this shard again" in line] == [
        f"{shard_file(folder, 1, '.npy')}: corrupted ({record['bytes']:,} bytes; its sha256 differs from the "
        f"one its .json records); computing this shard again"]
    assert sum(encoded) == 5
    assert {s: _stamps(folder, s) for s in (0, 2)} == kept
    np.testing.assert_array_equal(ShardedFeatureStore(folder).rows(names), good)  # the same bytes again
    # a reader opened before the rebuild reads the new shard (its record is read again), no false alarm
    np.testing.assert_array_equal(store.rows([names[7]]), good[7:8])


def test_truncated_shard_is_rebuilt_by_any_features_run(flickr_dir, cache, encoded, capsys):
    folder, paths = _sharded(flickr_dir, cache)
    good = ShardedFeatureStore(folder).rows([p.name for p in paths])
    npy = shard_file(folder, 2, ".npy")
    npy.write_bytes(npy.read_bytes()[:-4096])  # a network file system's short copy
    with pytest.raises(CorruptFeatures, match="truncated"):
        ShardedFeatureStore(folder).rows([paths[-1].name])
    encoded.clear()
    assert cli.main(["features", "--dataset", str(flickr_dir), "--encoder", "patches", "--workers", "0"]) == 0
    assert "shard-00002.npy: truncated or overwritten" in capsys.readouterr().err
    assert sum(encoded) == 5
    np.testing.assert_array_equal(ShardedFeatureStore(folder).rows([p.name for p in paths]), good)


def test_store_from_before_digests_still_reads(flickr_dir, cache):
    folder, paths = _sharded(flickr_dir, cache)
    for s in range(3):  # the records as written before digests
        record = shard_file(folder, s, ".json")
        doc = json.loads(record.read_text())
        record.write_text(json.dumps({"paths": doc["paths"], "failed": doc["failed"]}) + "\n")
    _flip_byte(shard_file(folder, 1, ".npy"), -1000)
    store = ShardedFeatureStore(folder)
    assert store.rows([p.name for p in paths]).shape[0] == 15  # unverified, as old checkpoints are
    # the single file: a store without digests.json reads every row unchecked
    single = build_features(create_encoder("patches"), paths[:4], root=cache, progress=False, workers=0)
    (single.folder / F.DIGESTS).unlink()
    _flip_byte(single.folder / "feats.npy", -10)
    assert FeatureStore(single.folder).rows([p.name for p in paths[:4]]).shape[0] == 4


def test_single_file_store_block_flipped_rebuilt_alone(flickr_dir, cache, encoded, monkeypatch, capsys):
    monkeypatch.setattr(F, "BLOCK_ROWS", 4)  # 15 rows: blocks 0-3, 4-7, 8-11, 12-14
    paths, enc = _paths(flickr_dir), create_encoder("patches")
    store = build_features(enc, paths, root=cache, progress=False, workers=0)
    names = [p.name for p in paths]
    good = store.rows(names)
    digests = json.loads((store.folder / F.DIGESTS).read_text())
    assert digests["block_rows"] == 4 and len(digests["sha256"]) == 4

    row_bytes = good[0].nbytes
    header = (store.folder / "feats.npy").stat().st_size - 15 * row_bytes
    _flip_byte(store.folder / "feats.npy", header + 5 * row_bytes + 17)  # a byte of row 5: block 1
    fresh = FeatureStore(store.folder)
    np.testing.assert_array_equal(fresh.rows(names[:4]), good[:4])
    with pytest.raises(CorruptFeatures) as err:
        fresh.rows([names[6]])
    assert "rows 4-7" in str(err.value) and "feats.npy" in str(err.value) and "--verify" in str(err.value)

    encoded.clear()
    again = build_features(enc, paths, root=cache, progress=False, workers=0, verify=True)
    assert "rows 4-7 corrupted" in capsys.readouterr().err
    assert sum(encoded) == 4  # block 1's rows alone
    np.testing.assert_array_equal(again.rows(names), good)
    assert json.loads((store.folder / F.DIGESTS).read_text()) == digests

    # truncated: any build starts the file again (every row), a reader refuses it in one line
    feats = store.folder / "feats.npy"
    feats.write_bytes(feats.read_bytes()[:-100])
    with pytest.raises(CorruptFeatures, match="truncated"):
        FeatureStore(store.folder)
    encoded.clear()
    np.testing.assert_array_equal(build_features(enc, paths, root=cache, progress=False, workers=0).rows(names), good)
    assert sum(encoded) == 15


# ---- full disks ------------------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 1 MB tmpfs (skipped where this process may not mount one)."""
    where = tmp_path / "small"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_full_disk_leaves_the_sharded_store_as_it_was(small_disk):
    enc = create_encoder("patches")
    paths = [small_disk / f"im{i}.jpg" for i in range(6)]
    folder, _ = open_sharded(enc, paths, small_disk / "cache", shard_size=3)
    rows = np.random.default_rng(0).standard_normal((6, 256, 192)).astype(np.float16)  # 3 x 98 KB a shard
    write_shard(folder, 0, rows[:3], [str(p) for p in paths[:3]], {})
    before = shard_file(folder, 0, ".npy").read_bytes()
    (small_disk / "ballast").write_bytes(b"\0" * 500_000)  # what the rest of the disk holds
    with pytest.raises(OutputError) as err:
        write_shard(folder, 1, rows[3:], [str(p) for p in paths[3:]], {})
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{shard_file(folder, 1, '.npy')}: no space left")
    assert f"needs {len(F._npy_bytes(rows[3:])) / 1e3:.1f} kB ({len(F._npy_bytes(rows[3:])):,} bytes)" in msg
    assert not shard_file(folder, 1, ".json").exists()  # never indexed
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [".captionkit.json", "manifest.json", "shard-00000.json", "shard-00000.npy"])  # no partial file left
    assert shard_file(folder, 0, ".npy").read_bytes() == before
    store = ShardedFeatureStore(folder)
    assert not store.complete and sorted(store.index) == ["im0.jpg", "im1.jpg", "im2.jpg"]


def test_read_only_folder_leaves_the_sharded_store_as_it_was(small_disk):
    enc = create_encoder("patches")
    paths = [small_disk / f"im{i}.jpg" for i in range(4)]
    folder, _ = open_sharded(enc, paths, small_disk / "cache", shard_size=2)
    rows = np.zeros((4, 256, 192), dtype=np.float16)
    write_shard(folder, 0, rows[:2], [str(p) for p in paths[:2]], {})
    if subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True).returncode != 0:
        pytest.skip("cannot remount the tmpfs read-only")
    with pytest.raises(OutputError) as err:
        write_shard(folder, 1, rows[2:], [str(p) for p in paths[2:]], {})
    assert "\n" not in str(err.value) and str(err.value).startswith(
        f"{shard_file(folder, 1, '.npy')}: the folder is on a read-only file system; ")
    assert sorted(ShardedFeatureStore(folder).index) == ["im0.jpg", "im1.jpg"]


def test_full_disk_refuses_a_single_file_store_in_one_line(flickr_dir, small_disk, monkeypatch, capsys):
    """The (15, 256, 192) float16 file needs 1.5 MB: refused when created, not a SIGBUS later."""
    monkeypatch.setenv("CAPTIONKIT_CACHE", str(small_disk / "cache"))
    assert cli.main(["features", "--dataset", str(flickr_dir), "--encoder", "patches", "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "feats.npy: no space left" in err[0]
    assert f"({15 * 256 * 192 * 2 + 128:,} bytes)" in err[0]
    entry = next((small_disk / "cache").glob("patches-*/*"))
    assert not (entry / "meta.json").exists() and not (entry / "feats.npy").exists()


# ---- two writers -----------------------------------------------------------------------------------
HOLD = """
import sys, time
from pathlib import Path
from captionkit.core.locks import hold_lock
with hold_lock(Path(sys.argv[1]), "features patches"):
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
"""


def _holder(folder: Path, seconds: float) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), str(seconds)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(Path(F.__file__).parents[2])})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_builder_waits_then_uses_the_first_ones_store(flickr_dir, cache, monkeypatch, capsys):
    enc, paths = create_encoder("patches"), _paths(flickr_dir)
    folder = F._folder_for(cache, enc, paths)
    holder = _holder(folder, 3)
    t0 = time.monotonic()
    store = build_features(enc, paths, root=cache, progress=False, workers=0)
    waited = time.monotonic() - t0
    assert holder.wait(timeout=10) == 0 and waited > 2.0
    err = [line for line in capsys.readouterr().err.splitlines() if "waiting" in line]
    assert err == [f"{folder}: being built by pid {holder.pid} on {socket.gethostname()} "
                   f"(features patches); waiting for it to finish, then using its features"]
    assert len(store.index) == 15

    # a holder killed with -9 leaves nothing that blocks: the next build goes at once
    again = _holder(folder, 60)
    again.kill()
    again.wait()
    t0 = time.monotonic()
    build_features(enc, paths, root=cache, progress=False, workers=0)
    assert time.monotonic() - t0 < 1.0 and "waiting" not in capsys.readouterr().err


def test_training_on_a_flipped_store_stops_in_one_line(tiny_config, flickr_dir, cache, tmp_path, capsys):
    """End to end: the trainer's first batch meets the bad block; `train` says which file, exit 2."""
    store = build_features(create_encoder("efficientnet_lite0", weights="random"), _paths(flickr_dir),
                           progress=False, workers=0)  # the store tiny_config's run reads
    _flip_byte(store.folder / "feats.npy", -7)
    code = cli.main(["train", "--config", str(tiny_config), "--out", str(tmp_path / "run"), "--max-steps", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if "error" in line]  # (the run's set-up lines come before it)
    assert code == 2 and errors == err[-1:], err
    assert errors[0].startswith(f"captionkit train: error: {store.folder / 'feats.npy'}: corrupted (rows 0-14:")
    assert "--verify" in errors[0]


@pytest.mark.slow
def test_engine_ray_verify_recomputes_the_flipped_shard_alone(photo_paths, tmp_path, capsys):
    """features --engine ray --verify: the bad shard's record dropped, Ray computes that one only."""
    from captionkit.inference.ray_engine import RayOptions, build_features_ray

    with local_ray():
        root, opts = tmp_path / "cache", RayOptions(replicas=1, batch_size=2, shard_size=2)
        store = build_features_ray("patches", None, photo_paths, root, opts)
        names = sorted(store.index)
        good = store.rows(names)
        kept = {s: _stamps(store.folder, s) for s in (0, 2)}
        _flip_byte(shard_file(store.folder, 1, ".npy"), -100)
        assert F.verify_sharded(create_encoder("patches"), photo_paths, root) == [1]
        again = build_features_ray("patches", None, photo_paths, root, opts)
        assert "1 of 3 shards to compute" in capsys.readouterr().err
        assert {s: _stamps(store.folder, s) for s in (0, 2)} == kept
        np.testing.assert_array_equal(again.rows(names), good)


@pytest.fixture
def photo_paths(flickr_dir) -> list[Path]:
    return _paths(flickr_dir)[:6]


def test_unreadable_images_do_not_cost_a_rehash_per_build(flickr_dir, cache, tmp_path, capsys):
    """An unreadable image is tried again on every build (as before); the rows did not change,
    so the digests are not recomputed (a whole-file read each training start)."""
    (tmp_path / "empty.jpg").write_bytes(b"")
    paths, enc = _paths(flickr_dir)[:4] + [tmp_path / "empty.jpg"], create_encoder("patches")
    store = build_features(enc, paths, root=cache, progress=False, workers=0)
    digests = store.folder / F.DIGESTS
    before = (digests.stat().st_mtime_ns, digests.stat().st_ino)
    build_features(enc, paths, root=cache, progress=False, workers=0)
    assert (digests.stat().st_mtime_ns, digests.stat().st_ino) == before
    assert capsys.readouterr().err.count("empty.jpg") == 2  # reported by both builds
