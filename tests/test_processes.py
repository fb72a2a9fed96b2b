"""Captioning on a CPU in several processes (captionkit.inference.processes, caption/evaluate
--processes): the same results in the same order as one process, the batches shared by claims,
a helper's failure raised in the caller, and the option's refusals and automatic choice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import torch
from helpers import shape_image

from captionkit.cli.common import UsageError, _processes
from captionkit.cli.main import main
from captionkit.core.errors import ImageError, UserError
from captionkit.encoders.image_batches import claimed_batches
from captionkit.inference import processes
from captionkit.inference.captioner import Captioner, Result


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> list[Path]:
    d = tmp_path_factory.mktemp("processes_photos")
    paths = []
    for i in range(13):
        p = d / f"p{i:02d}.jpg"
        shape_image(i, size=64, jitter=i % 5).save(p)
        paths.append(p)
    bad = d / "broken.jpg"
    bad.write_bytes(b"not a photo")
    return paths[:5] + [bad] + paths[5:]  # 14 files, one unreadable in the second batch of 4


def _same(a: list, b: list) -> None:
    assert [p for p, _ in a] == [p for p, _ in b]
    for (_, x), (_, y) in zip(a, b):
        assert type(x) is type(y)
        if isinstance(x, Result):
            assert x.words == y.words and x.grid == y.grid
            assert torch.equal(x.attention, y.attention)
        else:
            assert str(x) == str(y)


def _one_thread(cap: Captioner, photos: list[Path]) -> list:
    """One process's results at one torch thread, as each helper runs: a matmul split over more
    threads may round otherwise on some CPUs (seen on an AVX2 AMD EPYC: attention 1e-7 apart)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return list(cap.caption_files(photos, beam=2, batch_size=4))
    finally:
        torch.set_num_threads(threads)


def test_two_processes_give_one_process_results_in_order(photos, tiny_run):
    load = partial(Captioner.load, str(tiny_run / "best"))
    cap = load()
    one = _one_thread(cap, photos)
    threads = torch.get_num_threads()
    two = list(processes.caption_in_processes(cap, load, photos, 2, batch_size=4, beam=2))
    _same(two, one)
    assert isinstance(two[5][1], ImageError) and "broken.jpg" in str(two[5][1])
    assert torch.get_num_threads() == threads  # the caller's threads restored
    # the words are the same as this process's at its own thread count
    assert [r.words for _, r in two if isinstance(r, Result)] == \
        [r.words for _, r in cap.caption_files(photos, beam=2, batch_size=4) if isinstance(r, Result)]
    # more processes than batches: as many as there are batches
    _same(list(processes.caption_in_processes(cap, load, photos[:6], 5, batch_size=4, beam=2)),
          _one_thread(cap, photos[:6]))


def test_claimed_batches_read_what_each_claim_names(photos, tiny_run):
    cap = Captioner.load(str(tiny_run / "best"))
    order = iter([3, 0, 2])
    got = list(claimed_batches(photos, cap.encoder.preprocess, 4, 2, lambda: next(order, None)))
    assert [k for k, _ in got] == [3, 0, 2]
    assert [b.paths for _, b in got] == [photos[12:14], photos[0:4], photos[8:12]]
    assert got[1][1].good == [0, 1, 2, 3] and got[1][1].pixels.shape[0] == 4


class _FailsOnItsFirstBatch:
    """A helper's captioner that claims a batch, says so in ``marker``, and then fails as
    ``kind`` says, holding that batch."""

    def __init__(self, cap: Captioner, kind: str, marker: Path):
        self.cap, self.kind, self.marker = cap, kind, marker
        self.encoder, self.device = cap.encoder, cap.device

    def caption_batches(self, batches, **options):
        for _ in batches:
            self.marker.write_text("claimed")
            if self.kind == "user":
                raise UserError("model.safetensors: a user's mistake, said in one line")
            if self.kind == "dies":
                os._exit(7)
            raise KeyError("an internal bug")
        yield from ()


class _WaitsForTheHelper:
    """The caller's captioner, which starts its first batch only once the helper holds one."""

    def __init__(self, cap: Captioner, marker: Path):
        self.cap, self.marker = cap, marker
        self.encoder, self.device = cap.encoder, cap.device

    def caption_batches(self, batches, **options):
        for _ in range(600):
            if self.marker.exists():
                break
            time.sleep(0.1)
        yield from self.cap.caption_batches(batches, **options)


def _fails_in_helpers(path: str, kind: str, marker: Path):
    return _FailsOnItsFirstBatch(Captioner.load(path), kind, marker)


@pytest.mark.parametrize("kind, error, said", [("user", UserError, "said in one line"),
                                               ("bug", RuntimeError, "KeyError: 'an internal bug'"),
                                               ("dies", RuntimeError, "exit code 7")])
def test_a_helpers_failure_is_raised_in_the_caller(photos, tiny_run, tmp_path, kind, error, said):
    marker = tmp_path / "claimed"
    cap = _WaitsForTheHelper(Captioner.load(str(tiny_run / "best")), marker)
    load = partial(_fails_in_helpers, str(tiny_run / "best"), kind, marker)
    with pytest.raises(error, match=said):
        list(processes.caption_in_processes(cap, load, photos, 2, batch_size=4, beam=2))


def test_the_command_captions_the_same_in_two_processes(photos, tiny_run, tmp_path, capsys):
    folder = photos[0].parent
    outs = {}
    for n in ("1", "2"):
        outs[n] = tmp_path / f"p{n}.jsonl"
        main(["caption", str(folder), "--model", str(tiny_run / "best"), "--beam", "2", "--batch-size", "4",
              "--processes", n, "--jsonl", str(outs[n])])
        err = capsys.readouterr().err
        assert ("captioning in 2 processes of 1 torch thread each" in err) == (n == "2")
    rows = [json.loads(line) for line in outs["2"].read_text().splitlines()]
    assert len(rows) == 14 and sum("error" in r for r in rows) == 1
    assert outs["2"].read_text() == outs["1"].read_text()


def test_processes_refusals(capsys):
    with pytest.raises(UsageError, match="--processes 2 splits the work of a CPU"):
        _processes(2, torch.device("cuda"), 1000, 16)
    assert _processes(1, torch.device("cuda"), 1000, 16) == 1
    assert _processes(None, torch.device("cuda"), 1000, 16) == 1  # auto: one process feeds a GPU
    with pytest.raises(SystemExit):
        main(["caption", "x.jpg", "--processes", "0"])
    assert main(["caption", "x.jpg", "--onnx", "somewhere", "--processes", "2"]) == 2
    assert "--processes runs PyTorch models" in capsys.readouterr().err


def test_auto_processes(monkeypatch):
    from captionkit.core import process_count

    monkeypatch.setattr(process_count, "available_memory", lambda: 64 * 2**30)
    assert processes.auto_processes("cpu", 8, 10_000, 16) == 8  # one a thread
    assert processes.auto_processes("cpu", 1, 10_000, 16) == 1
    assert processes.auto_processes("cpu", 2, 64, 16) == 1  # 4 batches: not worth a helper's start
    assert processes.auto_processes("cpu", 2, 128, 16) == 2
    assert processes.auto_processes("cuda", 8, 10_000, 16) == 1
    monkeypatch.setattr(process_count, "available_memory", lambda: 5 * 2**30)
    assert processes.auto_processes("cpu", 8, 10_000, 16) == 2  # half of 5 GiB holds two


class _Slow:
    """A captioner that takes half a second a batch (a caller stays busy long enough to be killed)."""

    def __init__(self, cap: Captioner):
        self.cap, self.encoder, self.device = cap, cap.encoder, cap.device

    def caption_batches(self, batches, **options):
        for batch in batches:
            time.sleep(0.5)
            yield from self.cap.caption_batches([batch], **options)


def _slow_load(path: str) -> _Slow:
    return _Slow(Captioner.load(path))


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # (a zombie is dead)
    except (OSError, IndexError):
        return False


@pytest.mark.slow  # child processes: several seconds
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_helpers_end_when_the_caller_is_killed(photos, tiny_run, tmp_path):
    caller = tmp_path / "caller.py"
    caller.write_text(f"""
import multiprocessing, sys, time
from functools import partial
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_processes import _slow_load
from captionkit.inference import processes

if __name__ == "__main__":
    load = partial(_slow_load, {str(tiny_run / "best")!r})
    photos = {[str(p) for p in photos if p.name != "broken.jpg"]!r} * 20
    results = processes.caption_in_processes(load(), load, photos, 2, batch_size=1, beam=2)
    next(results)
    print(*[p.pid for p in multiprocessing.active_children()], flush=True)
    time.sleep(600)
""")
    proc = subprocess.Popen([sys.executable, str(caller)], stdout=subprocess.PIPE, text=True)
    try:
        helper = int(proc.stdout.readline())
        assert _alive(helper)
    finally:
        proc.kill()
        proc.wait()
    for _ in range(100):  # the kernel ends it (PR_SET_PDEATHSIG) as the caller dies
        if not _alive(helper):
            break
        time.sleep(0.1)
    assert not _alive(helper)
