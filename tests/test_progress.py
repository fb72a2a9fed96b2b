"""Progress bars (issue 29, item 11): one policy (captionkit.core.progress) for every long step.
A bar where stderr is a terminal (or CAPTIONKIT_PROGRESS=1 forces one), on rank 0 only; nothing
of a bar in a log or a pipe; the same outputs with bars and without."""

import fcntl
import io
import json
import os
import pty
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TINY_CONFIG, shape_image
from safetensors.torch import load_file

from captionkit.cli.main import main
from captionkit.core.progress import ENV, bars_on, lines_above_bars, progress

ROOT = Path(__file__).resolve().parents[1]
BAR = re.compile(r"\d+%\|")  # tqdm's "NN%|" before the bar itself


def bar_free(err: str) -> bool:
    """Nothing of a progress bar: no carriage return, no percentage-and-bar, no block."""
    return "\r" not in err and not BAR.search(err) and "\u2588" not in err


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def unforced(monkeypatch):
    """Bars by the terminal test alone (not forced either way, no torchrun rank)."""
    monkeypatch.delenv(ENV, raising=False)
    monkeypatch.delenv("RANK", raising=False)


@pytest.fixture
def photos(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("progress_photos")
    for k in range(2):
        shape_image(k, size=64).save(d / f"p{k}.jpg")
    return d


def _draw(stream) -> str:
    before = sys.stderr
    sys.stderr = stream
    try:
        for _ in progress(range(3), desc="work"):
            pass
    finally:
        sys.stderr = before
    return stream.getvalue()


def test_bars_are_drawn_on_a_terminal_on_rank_0_or_when_forced(unforced, monkeypatch):
    drawn = _draw(FakeTTY())
    assert "\r" in drawn and re.search(r"work: 100%\|.*\| 3/3", drawn)
    assert _draw(io.StringIO()) == ""  # a pipe, a log file: nothing
    monkeypatch.setenv(ENV, "1")
    assert re.search(r"work: 100%\|", _draw(io.StringIO()))
    monkeypatch.setenv("RANK", "1")  # another torchrun process: never, even forced, even on a terminal
    assert _draw(FakeTTY()) == "" and not bars_on()
    monkeypatch.delenv("RANK")
    monkeypatch.setenv(ENV, "0")
    assert _draw(FakeTTY()) == ""
    monkeypatch.setenv(ENV, "yes please")  # not 0 or 1: as if unset
    assert _draw(io.StringIO()) == "" and BAR.search(_draw(FakeTTY()))


def test_lines_printed_while_a_bar_is_drawn_go_above_it(unforced, monkeypatch):
    tty = FakeTTY()
    monkeypatch.setattr(sys, "stderr", tty)
    with progress(total=2, desc="sweep") as bar, lines_above_bars():
        bar.update()
        print("epoch 1: dev CIDEr 12.3", file=sys.stderr)
        bar.update()
    assert sys.stderr is tty
    # a line of its own, not glued onto the bar's text
    assert "epoch 1: dev CIDEr 12.3" in re.split(r"[\r\n]", tty.getvalue())
    pipe = io.StringIO()  # without bars: stderr untouched
    monkeypatch.setattr(sys, "stderr", pipe)
    with lines_above_bars():
        assert sys.stderr is pipe


def _caption(photos: Path, model: Path, out: Path, capsys) -> str:
    assert main(["caption", str(photos), "--model", str(model), "--beam", "2", "--jsonl", str(out)]) == 0
    return capsys.readouterr().err


def test_caption_shows_a_bar_and_writes_the_same_captions_without_one(photos, tiny_run, tmp_path, capsys,
                                                                    unforced, monkeypatch):
    plain = _caption(photos, tiny_run / "best", tmp_path / "plain.jsonl", capsys)
    assert bar_free(plain) and "2/2 images" in plain  # the summary line stays: it is the result
    monkeypatch.setenv(ENV, "1")
    shown = _caption(photos, tiny_run / "best", tmp_path / "shown.jsonl", capsys)
    assert re.search(r"caption: +\d+%\|", shown) and "2/2 images" in shown
    assert (tmp_path / "plain.jsonl").read_text() == (tmp_path / "shown.jsonl").read_text()


def _evaluate(tiny_run: Path, flickr_dir: Path, out: Path, capsys) -> tuple[str, dict]:
    assert main(["evaluate", "--model", str(tiny_run / "best"), "--dataset", str(flickr_dir), "--split", "test",
                 "--beam", "1", "--metrics", "bleu,cider", "--tokenizer", "python", "--out", str(out)]) == 0
    return capsys.readouterr().err, json.loads(out.read_text())


def test_evaluate_shows_a_bar_over_the_split(tiny_run, flickr_dir, tmp_path, capsys, unforced, monkeypatch):
    err, plain = _evaluate(tiny_run, flickr_dir, tmp_path / "plain.json", capsys)
    assert bar_free(err)
    monkeypatch.setenv(ENV, "1")
    err, shown = _evaluate(tiny_run, flickr_dir, tmp_path / "shown.json", capsys)
    assert re.search(r"evaluate test: 100%\|.*\| 3/3", err)
    assert (plain["captions"], plain["scores"]) == (shown["captions"], shown["scores"])


def test_feature_extraction_shows_a_bar_and_caches_the_same_features(photos, tmp_path, capsys, unforced,
                                                                     monkeypatch):
    from captionkit.encoders import create_encoder
    from captionkit.encoders.features import build_features

    enc = create_encoder("efficientnet_lite0", weights="random")
    paths = sorted(photos.iterdir())
    plain = build_features(enc, paths, root=tmp_path / "plain", workers=0)
    assert bar_free(capsys.readouterr().err)
    monkeypatch.setenv(ENV, "1")
    shown = build_features(enc, paths, root=tmp_path / "shown", workers=0)
    assert re.search(r"features efficientnet_lite0: 100%\|.*\| 2/2", capsys.readouterr().err)
    assert np.array_equal(plain.feats[:], shown.feats[:])
    build_features(enc, paths, root=tmp_path / "shown", workers=0)  # all cached: no bar at all
    assert capsys.readouterr().err == ""


def _train(flickr_dir: Path, out: Path, capsys) -> str:
    from captionkit.training.run import train

    config = out.parent / f"{out.name}.toml"
    config.write_text(TINY_CONFIG.format(dataset=flickr_dir).replace("epochs = 3", "epochs = 1"))
    train(config, out=out)  # its steps, its validation, the choice of length penalty
    return capsys.readouterr().err


def test_training_shows_epoch_and_validation_bars_and_trains_the_same(flickr_dir, tmp_path, capsys, unforced,
                                                                      monkeypatch):
    plain = _train(flickr_dir, tmp_path / "plain", capsys)
    assert bar_free(plain) and re.search(r"^epoch 1: dev ", plain, flags=re.M)  # the epoch's result stays
    monkeypatch.setenv(ENV, "1")
    shown = _train(flickr_dir, tmp_path / "shown", capsys)
    assert re.search(r"epoch 1/1: 100%\|.*\| 45/45 .*, loss \d", shown)  # 45 captions, the mean loss
    assert re.search(r"validating: +\d+%\|", shown)
    assert re.search(r"^epoch 1: dev ", shown.replace("\r", "\n"), flags=re.M)
    for name in ("last/model.safetensors", "last/optimizer.safetensors", "best/model.safetensors"):
        a, b = (load_file(tmp_path / run / name) for run in ("plain", "shown"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    chosen = [json.loads((tmp_path / run / "best" / "config.json").read_text())["decoding"]
              for run in ("plain", "shown")]
    assert chosen[0] == chosen[1]  # the length penalty tuned on dev
    history = [[{k: v for k, v in json.loads(line).items() if k != "seconds"}
                for line in (tmp_path / run / "history.jsonl").read_text().splitlines()] for run in ("plain", "shown")]
    assert history[0] == history[1]


def test_a_local_sweep_draws_its_bar_with_the_trials_lines_above_it(tiny_config, tmp_path, capsys, unforced,
                                                                    monkeypatch):
    import captionkit.training.run as train_module
    from captionkit.experiments import sweep as sw

    def fake_train(config, out, **kw):  # a trial's own bar and result line, without the training
        for _ in progress(range(2), desc="epoch 1/1", leave=None):
            pass
        print(f"{Path(out).name}: dev CIDEr 1.0", file=sys.stderr)

    monkeypatch.setattr(train_module, "train", fake_train)
    sweep = sw.define(tiny_config, ["train.lr=1e-2,1e-3"], tmp_path / "s")
    monkeypatch.setenv(ENV, "1")
    sw.run_local(sweep)
    err = capsys.readouterr().err
    assert re.search(r"sweep: 100%\|.*\| 2/2", err)
    shown = re.split(r"[\r\n]", err)
    for name in (t["name"] for t in sweep.trials):  # each trial's heading and result on a line of its own
        assert f"{name}: dev CIDEr 1.0" in shown and any(c.startswith(f"trial {name} (") for c in shown)
    monkeypatch.setenv(ENV, "0")
    sw.run_local(sw.define(tiny_config, ["train.lr=1e-2,1e-3"], tmp_path / "t"))
    err = capsys.readouterr().err
    assert bar_free(err) and "trial 000-lr=0.01 (1/2)" in err


@pytest.mark.slow  # two child processes
def test_a_real_terminal_gets_the_bar_and_a_pipe_gets_none(photos, tiny_run, tmp_path):
    """The terminal test itself, no forcing: the same command with stderr on a pseudo-terminal
    and on a pipe (as in CI)."""
    env = {k: v for k, v in os.environ.items() if k not in (ENV, "RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT / "src"))

    def cmd(out: str) -> list[str]:
        return [sys.executable, "-m", "captionkit", "caption", str(photos), "--model", str(tiny_run / "best"),
                "--jsonl", str(tmp_path / out)]

    piped = subprocess.run(cmd("piped.jsonl"), env=env, capture_output=True, text=True, timeout=300)
    assert piped.returncode == 0 and bar_free(piped.stderr) and "2/2 images" in piped.stderr
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a new pty is 0 columns wide
    try:
        proc = subprocess.run(cmd("tty.jsonl"), env=env, stdout=subprocess.DEVNULL, stderr=follower, timeout=300)
        os.close(follower)
        follower = -1
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # the terminal's other end is closed: all read
                break
            if not chunk:
                break
            seen += chunk
    finally:
        os.close(leader)
        if follower >= 0:
            os.close(follower)
    assert proc.returncode == 0 and re.search(r"caption: +\d+%\|", seen.decode(errors="replace"))
    assert (tmp_path / "piped.jsonl").read_text() == (tmp_path / "tty.jsonl").read_text()
