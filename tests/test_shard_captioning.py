"""captionkit caption of WebDataset tar shards (captionkit.data.shard_images,
captionkit.inference.shard_inputs): each image member is captioned as its file would be and
written under its sample key, with resume, a damaged member or shard as one error line, and the
Ray engine giving the local engine's lines."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import pytest
from helpers import local_ray, shape_image

from captionkit.cli.main import main

SHARDS, PER_SHARD = 4, 3
BAD_KEY = "s1-001"  # its .jpg member is not a JPEG


def key_of(s: int, j: int) -> str:
    return f"s{s}-{j:03d}"


def jpeg(k: int) -> bytes:
    buf = io.BytesIO()
    shape_image(k, size=64, jitter=k % 5).save(buf, "JPEG", quality=95)
    return buf.getvalue()


def write_shard(path: Path, members: list[tuple[str, bytes]]) -> Path:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> tuple[Path, Path]:
    """(a folder of SHARDS shards of PER_SHARD samples, .jpg + .txt (+ .cls), one member not a
    JPEG; a folder of the same images as files, KEY.jpg)."""
    root = tmp_path_factory.mktemp("shards")
    folder, files = root / "shards", root / "files"
    folder.mkdir()
    files.mkdir()
    for s in range(SHARDS):
        members = []
        for j in range(PER_SHARD):
            key = key_of(s, j)
            data = b"not a jpeg" if key == BAD_KEY else jpeg(s * PER_SHARD + j)
            members += [(f"{key}.jpg", data), (f"{key}.txt", b"a caption"), (f"{key}.cls", b"3")]
            (files / f"{key}.jpg").write_bytes(data)
        write_shard(folder / f"shard-{s:03d}.tar", members)
    return folder, files


def jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def caption(model: Path, *args: str) -> int:
    return main(["caption", "--model", str(model), "--beam", "2", "--batch-size", "4", *args])


def test_shards_are_captioned_as_their_images_under_their_keys(shards, tiny_run, tmp_path, capsys):
    folder, files = shards
    out, from_files = tmp_path / "shards.jsonl", tmp_path / "files.jsonl"
    named = [str(folder / f"shard-{s:03d}.tar") for s in range(SHARDS)]
    assert caption(tiny_run / "best", *named, "--jsonl", str(out)) == 1  # 1: the member that is not a JPEG
    assert caption(tiny_run / "best", str(files), "--jsonl", str(from_files)) == 1
    got, expected = jsonl(out), jsonl(from_files)
    assert [r["image"] for r in got] == [key_of(s, j) for s in range(SHARDS) for j in range(PER_SHARD)]
    assert {r["image"] + ".jpg": r.get("caption") for r in got} == {r["image"]: r.get("caption") for r in expected}
    error = next(r["error"] for r in got if r["image"] == BAD_KEY)
    assert error.startswith(f"{folder / 'shard-001.tar'}: {BAD_KEY}.jpg: cannot read image") and "\n" not in error
    assert "shard-images" not in error  # (the file it was unpacked into is not named)
    assert "1 unreadable" in capsys.readouterr().err
    assert not list(tmp_path.glob(".*shard-images"))  # the unpacked members are removed
    # a folder of shards is its shards; stdout lines are KEY<TAB>caption
    capsys.readouterr()
    assert caption(tiny_run / "best", str(folder)) == 1
    lines = dict(line.split("\t") for line in capsys.readouterr().out.splitlines())
    assert lines == {r["image"]: r["caption"] for r in got if "caption" in r}


def test_a_shard_run_resumes_and_retries_what_failed(shards, tiny_run, tmp_path, capsys):
    folder, _ = shards
    whole, part = tmp_path / "whole.jsonl", tmp_path / "part.jsonl"
    caption(tiny_run / "best", str(folder), "--jsonl", str(whole))
    caption(tiny_run / "best", str(folder / "shard-000.tar"), str(folder / "shard-001.tar"), "--jsonl", str(part))
    capsys.readouterr()
    caption(tiny_run / "best", str(folder), "--jsonl", str(part))
    assert f"{PER_SHARD * (SHARDS - 2)}/{PER_SHARD * (SHARDS - 2)} images" in capsys.readouterr().err
    assert part.read_text() == whole.read_text()
    # the member that failed is tried again with --retry-failed (and fails again, in its place)
    assert caption(tiny_run / "best", str(folder), "--jsonl", str(part), "--retry-failed") == 1
    assert "1/1 images" in capsys.readouterr().err
    assert sorted(jsonl(part), key=lambda r: r["image"]) == sorted(jsonl(whole), key=lambda r: r["image"])


def test_a_damaged_shard_captions_what_it_can_and_says_where_it_broke(tiny_run, tmp_path, capsys):
    """A shard cut off inside a member: the members before it are captioned, the cut one is its
    error line, and the shard has one saying it is cut short. A shard whose third header is
    damaged: the two members before it are captioned, and the shard has one error line saying
    where it broke (tarfile alone ends there silently). A key that two shards share is written
    as SHARD/MEMBER."""
    members = [(f"k{j}.jpg", jpeg(j)) for j in range(4)]
    whole = write_shard(tmp_path / "whole.tar", members).read_bytes()
    with tarfile.open(tmp_path / "whole.tar") as tar:
        offsets = [m.offset for m in tar]  # each member's header
    cut = tmp_path / "cut.tar"
    cut.write_bytes(whole[:offsets[1] + 512 + 300])  # k0, k1's header and 300 bytes of its data
    damaged = bytearray(whole)
    damaged[offsets[2] + 5] ^= 0xFF  # k2's header: its checksum no longer matches
    (tmp_path / "damaged.tar").write_bytes(bytes(damaged))
    out = tmp_path / "out.jsonl"
    assert caption(tiny_run / "best", str(cut), str(tmp_path / "damaged.tar"), "--jsonl", str(out)) == 1
    recs = {r["image"]: r for r in jsonl(out)}
    assert set(recs) == {f"{cut}/k0.jpg", f"{cut}/k1.jpg", f"{tmp_path / 'damaged.tar'}/k0.jpg",
                         f"{tmp_path / 'damaged.tar'}/k1.jpg", "cut.tar", "damaged.tar"}
    assert "caption" in recs[f"{cut}/k0.jpg"]
    assert recs["cut.tar"]["error"] == f"{cut}: the file ends inside member k1.jpg: the shard is cut short, and " \
                                      "what followed is lost"
    assert recs[f"{cut}/k1.jpg"]["error"].startswith(f"{cut}: k1.jpg: cannot read the member (")
    assert all("caption" in recs[f"{tmp_path / 'damaged.tar'}/k{j}.jpg"] for j in range(2))
    assert recs["damaged.tar"]["error"] == (f"{tmp_path / 'damaged.tar'}: a damaged tar header at byte {offsets[2]}, "
                                            "after member k1.jpg: the rest of the shard cannot be read")
    assert "3 unreadable" in capsys.readouterr().err
    # a file that is no tar at all, named with a shard's name
    (tmp_path / "not.tar").write_bytes(b"hello" * 200)
    assert caption(tiny_run / "best", str(tmp_path / "not.tar"), "--jsonl", str(tmp_path / "not.jsonl")) == 1
    (rec,) = jsonl(tmp_path / "not.jsonl")
    assert rec["image"] == "not.tar" and "not a readable tar file" in rec["error"]


@pytest.mark.slow  # a local Ray
def test_engine_ray_captions_shards_as_the_local_engine(shards, tiny_run, tmp_path):
    folder, _ = shards
    with local_ray():
        common = [str(folder), "--shard-size", "5"]
        caption(tiny_run / "best", str(folder), "--jsonl", str(tmp_path / "local.jsonl"))
        assert caption(tiny_run / "best", *common, "--jsonl", str(tmp_path / "ray.jsonl"), "--engine", "ray") == 1
        assert (tmp_path / "ray.jsonl").read_text() == (tmp_path / "local.jsonl").read_text()
        # resumed under Ray after the local engine captioned two shards
        part = tmp_path / "part.jsonl"
        caption(tiny_run / "best", str(folder / "shard-000.tar"), str(folder / "shard-001.tar"), "--jsonl", str(part))
        caption(tiny_run / "best", *common, "--jsonl", str(part), "--engine", "ray")
        assert part.read_text() == (tmp_path / "local.jsonl").read_text()
        assert not list(tmp_path.glob(".*shard-images"))
