"""Preemption: a scheduler's SIGTERM (or SIGUSR1) at random points of a tiny training run; the run
ends the current step, saves ``last`` and stops (exit status 75, core.signals.EXIT_PREEMPTED);
``train --resume auto`` then ends with the checkpoints and history of a run never interrupted.
Also ``caption --jsonl`` stopped by SIGTERM mid-run: the rerun completes it, every line whole
and every image once. See docs/robustness.md, "Preemption"."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import TINY_CONFIG, write_flickr8k
from killharness import Child, Launch, _env, compare_runs

from captionkit.core.checkpoint import read_config
from captionkit.core.errors import OutputError, UserError
from captionkit.core.signals import EXIT_PREEMPTED, Preempted, StopSignals, deferred
from captionkit.inference import ray_engine
from captionkit.inference.ray_engine import ray_missing
from captionkit.training import trainer as trainer_module
from captionkit.training.run import train

# dropout on, so that the random state a resume restores matters
PREEMPT_CONFIG = TINY_CONFIG.replace("dropout = 0.0", "dropout = 0.3")


@pytest.fixture(scope="module")
def config(flickr_dir, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("preempt") / "preempt.toml"
    path.write_text(PREEMPT_CONFIG.format(dataset=flickr_dir))
    return path


@pytest.fixture(scope="module")
def whole(config, tmp_path_factory) -> Path:
    """The unbroken run."""
    out = tmp_path_factory.mktemp("whole") / "run"
    train(config, out=out, progress=False)
    return out


def signal_at_step(monkeypatch, step: int, sig: signal.Signals = signal.SIGTERM) -> None:
    """Send ``sig`` to this process as optimizer step ``step`` (0-based) begins: the step under
    way must finish, then the run stops."""
    original = trainer_module.Trainer.train_step

    def step_then_maybe_signal(self, *args, **kwargs):
        if self.state.step == step:
            os.kill(os.getpid(), sig)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module.Trainer, "train_step", step_then_maybe_signal)


def test_signals_at_random_steps_then_resume_auto_equal_an_unbroken_run(config, whole, tmp_path, monkeypatch):
    total = read_config(whole / "last")["state"]["step"]
    steps = sorted(random.Random(30).sample(range(total - 1), 3))  # three preemptions in one run
    out = tmp_path / "run"
    old = signal.getsignal(signal.SIGTERM)
    for i, step in enumerate(steps):
        with monkeypatch.context() as m:
            signal_at_step(m, step, signal.SIGUSR1 if i == 1 else signal.SIGTERM)
            with pytest.raises(Preempted) as stopped:
                train(config, out=out, resume="auto", progress=False)
        assert stopped.value.signal_name == ("SIGUSR1" if i == 1 else "SIGTERM")
        assert read_config(out / "last")["state"]["step"] == step + 1  # the step under way, then the save
        assert signal.getsignal(signal.SIGTERM) is old  # the handlers put back
    train(config, out=out, resume="auto", progress=False)
    assert compare_runs(out, whole) == []


def test_a_signal_during_validation_stops_it_and_the_resumed_run_validates_again(config, whole, tmp_path,
                                                                                   monkeypatch):
    out = tmp_path / "run"
    original = trainer_module.Trainer.validate
    calls = []

    def signal_in_second_validation(self, *args, stoppable=False, **kwargs):
        calls.append(stoppable)
        if stoppable and calls.count(True) == 2:  # epoch 2's validation, before its first chunk
            os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, stoppable=stoppable, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(trainer_module.Trainer, "validate", signal_in_second_validation)
        with pytest.raises(Preempted):
            train(config, out=out, resume="auto", progress=False)
    state = read_config(out / "last")["state"]
    assert state["epoch"] == 1 and state["batch_in_epoch"] > 0 and len(state["history"]) == 1  # epoch 2 unscored
    train(config, out=out, resume="auto", progress=False)
    assert compare_runs(out, whole) == []


def test_a_signal_during_set_up_stops_at_once_and_resume_auto_starts_afresh(config, whole, tmp_path, monkeypatch):
    out = tmp_path / "run"
    original = trainer_module.Trainer.__init__

    def signalled_init(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises here: nothing worth saving yet
        original(self, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(trainer_module.Trainer, "__init__", signalled_init)
        with pytest.raises(Preempted):
            train(config, out=out, resume="auto", progress=False)
    assert not (out / "last").exists()
    train(config, out=out, resume="auto", progress=False)  # a run folder begun and left: started again
    assert compare_runs(out, whole) == []


def test_resume_auto_leaves_a_finished_run_and_a_foreign_folder_alone(config, whole, tmp_path, capsys):
    before = {p: p.stat().st_mtime_ns for p in whole.rglob("*")}
    train(config, out=whole, resume="auto", progress=False)
    assert "the run is finished (3 epochs); nothing to do" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in whole.rglob("*")} == before
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(OutputError, match="exists and is not empty"):
        train(config, out=foreign, resume="auto", progress=False)
    with pytest.raises(OutputError, match="not both"):
        train(config, out=foreign, resume="auto", overwrite=True, progress=False)
    assert [p.name for p in foreign.iterdir()] == ["notes.txt"]


def test_stop_signals_are_checked_and_restored():
    with pytest.raises(UserError, match="SIGKILL"):
        StopSignals("SIGTERM,SIGKILL")
    assert StopSignals("none").signals == ()
    assert StopSignals("term, usr2").signals == (signal.SIGTERM, signal.SIGUSR2)
    old = signal.getsignal(signal.SIGUSR2)
    with StopSignals("SIGUSR2") as stop:
        os.kill(os.getpid(), signal.SIGUSR2)
        assert stop.requested == "SIGUSR2"
    assert signal.getsignal(signal.SIGUSR2) is old


def test_a_stop_deferred_around_compiled_code_is_raised_after_it_with_the_stop_message():
    """signals.deferred: inside, a signal only sets the flag even where the handler would raise
    (immediate); on leaving, Preempted with the message set. Without a stop, nothing changes."""
    with StopSignals("SIGUSR2", immediate=True) as stop:
        stop.message = "stopped on {signal} after 3 of 9"
        with deferred():
            pass
        assert stop.immediate and stop.requested is None
        reached = []
        with pytest.raises(Preempted, match="stopped on SIGUSR2 after 3 of 9"):
            with deferred():
                assert not stop.immediate
                os.kill(os.getpid(), signal.SIGUSR2)
                time.sleep(0.01)  # (the handler runs between bytecodes: here)
                reached.append("the end of the block")
        assert reached == ["the end of the block"] and stop.immediate


def test_the_ray_engine_waits_on_ray_with_stops_deferred_and_polls():
    """A stop signal that comes while the driver is inside ray.wait (compiled code that turns a
    handler's exception into a SystemError) is raised after the call returns, within POLL_S."""
    calls = []

    class FakeRay:
        def wait(self, refs, num_returns, timeout):
            if len(calls) == 1:
                os.kill(os.getpid(), signal.SIGUSR2)
                time.sleep(0.01)  # (a handler that raised would raise here, inside the call)
            calls.append(timeout)
            return [], refs  # nothing ready yet: _ready polls again

    with StopSignals("SIGUSR2", immediate=True) as stop:
        stop.message = "stopped on {signal} while Ray worked"
        with pytest.raises(Preempted, match="SIGUSR2 while Ray worked"):
            ray_engine._ready(FakeRay(), ["ref"], 1)
    assert calls == [ray_engine.POLL_S] * 2  # (the call with the signal returned; no third)


@pytest.mark.slow  # child processes: several seconds
def test_sigterm_from_outside_exits_75_within_the_bound_and_resumes(config, tmp_path):
    """The command line end to end: SIGTERM from another process mid-epoch, exit 75 with one
    line, the time from the signal to the exit measured; then --resume auto to the end. (The
    reference runs in a child too: one thread, as the children do.)"""
    out, whole = tmp_path / "run", tmp_path / "whole"
    reference = Launch(config, whole, resume=False)
    launch = Launch(config, out, resume=False)
    assert launch.wait_for("epoch 2/3: "), launch.err  # inside the second epoch's steps
    sent = time.monotonic()
    launch.proc.send_signal(signal.SIGTERM)
    rc = launch.finish()
    seconds = time.monotonic() - sent
    print(f"signal to exit: {seconds:.2f} s")
    assert rc == EXIT_PREEMPTED, launch.err[-3000:]
    assert seconds < 30
    last = [ln for ln in launch.err.splitlines() if ln.strip()][-1]
    assert last.startswith("captionkit train: stopped on SIGTERM after step ") and "--resume auto" in last
    cmd = [sys.executable, "-m", "captionkit.cli.main", "train", "--config", str(config), "--out", str(out),
           "--resume", "auto"]
    done = subprocess.run(cmd, env=_env({}), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resuming from" in done.stderr
    assert reference.finish() == 0, reference.err[-3000:]
    assert compare_runs(out, whole) == []


@pytest.mark.slow  # child processes: several seconds
def test_caption_jsonl_stopped_by_sigterm_then_rerun_has_every_image_once(tiny_run, flickr_dir, tmp_path):
    out = tmp_path / "caps.jsonl"
    photos = sorted((flickr_dir / "Flicker8k_Dataset").glob("*.jpg"))
    (tmp_path / "photos").mkdir()
    images = [tmp_path / "photos" / f"{i:03d}.jpg" for i in range(100)]  # long enough to stop mid-run
    for i, path in enumerate(images):
        path.write_bytes(photos[i % len(photos)].read_bytes())
    cmd = [sys.executable, "-m", "captionkit.cli.main", "caption", "--model", str(tiny_run / "best"),
           *map(str, images), "--jsonl", str(out), "--batch-size", "1"]
    proc = subprocess.Popen(cmd, env=_env({}), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    end = time.monotonic() + 120
    while time.monotonic() < end and (not out.exists() or out.read_bytes().count(b"\n") < 2):
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=60)[1].decode()
    lines = out.read_bytes().split(b"\n")
    assert proc.returncode == EXIT_PREEMPTED and 2 <= len(lines) - 1 < len(images), err[-2000:]
    assert "caption: stopped on SIGTERM after " in err and lines[-1] == b""  # the last line ends whole
    done = subprocess.run(cmd, env=_env({}), capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    records = [json.loads(ln) for ln in out.read_text().splitlines()]  # every line whole
    assert sorted(r["image"] for r in records) == sorted(p.name for p in images)
    assert all("caption" in r for r in records)


@pytest.fixture(scope="module")
def ddp_whole(tmp_path_factory) -> tuple[Path, Path]:
    """(config, run folder) of an unbroken 2-process run (train --nproc 2, gloo) of the tiny config."""
    root = tmp_path_factory.mktemp("ddp")
    config = root / "ddp.toml"
    # dropout 0: ranks > 0 draw nothing to restore
    config.write_text(TINY_CONFIG.format(dataset=write_flickr8k(root / "flickr8k")))
    reference = Child("train", "--config", str(config), "--nproc", "2", "--out", str(root / "whole"))
    assert reference.finish(600) == 0, reference.err[-3000:]
    return config, root / "whole"


def worker_pids(launcher: int) -> dict[int, int]:
    """{rank: pid} of the training processes torchrun's agent (process ``launcher``) started."""
    ranks = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            env = (stat.parent / "environ").read_bytes().split(b"\0") if ppid == launcher else []
        except (OSError, IndexError, ValueError):  # a process that ended meanwhile
            continue
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        if rank is not None:
            ranks[rank] = int(stat.parent.name)
    return ranks


@pytest.mark.slow
def test_two_gloo_processes_stop_at_one_step_and_resume_auto_equals_an_unbroken_run(ddp_whole, tmp_path):
    """train --nproc 2 (torchrun's agent, gloo): SIGTERM to the launcher, which passes it on to
    the ranks; they stop at the same step (the flag rides the figures' all-reduce), rank 0 saves,
    exit 75; --resume auto in 2 processes then ends where an unbroken 2-process run ends."""
    config, whole = ddp_whole
    out = tmp_path / "run"
    args = ["train", "--config", str(config), "--nproc", "2"]
    launch = Child(*args, "--out", str(out))
    assert launch.wait_for("epoch 2/3: ", 300), launch.err[-3000:]
    sent = time.monotonic()
    launch.proc.send_signal(signal.SIGTERM)
    rc = launch.finish(120)
    print(f"signal to exit (2 processes): {time.monotonic() - sent:.2f} s")
    assert rc == EXIT_PREEMPTED, launch.err[-3000:]
    assert launch.err.count("stopped on SIGTERM after step ") == 2  # each rank, the same step
    steps = set(re.findall(r"stopped on SIGTERM after step (\d+)", launch.err))
    assert len(steps) == 1 and read_config(out / "last")["state"]["step"] == int(steps.pop())
    resumed = Child(*args, "--out", str(out), "--resume", "auto")
    assert resumed.finish(600) == 0, resumed.err[-3000:]
    assert "resuming from" in resumed.err
    assert compare_runs(out, whole) == []


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_a_preempted_rank_without_a_human(ddp_whole, tmp_path):
    """torchrun --max-restarts 1 ... train --resume auto, as docs/robustness.md gives it: SIGUSR1
    to rank 1 alone (a node's preemption notice). Both ranks stop at one step and exit 75, the
    elastic agent restarts them, and --resume auto continues from last: the command ends 0 by
    itself, where the unbroken 2-process run ends."""
    if not hasattr(signal, "SIGUSR1"):
        pytest.skip("no SIGUSR1 on this platform")
    config, whole = ddp_whole
    out = tmp_path / "run"
    launch = Child("--standalone", "--nproc_per_node", "2", "--max-restarts", "1", "-m", "captionkit", "train",
                      "--config", str(config), "--out", str(out), "--resume", "auto",
                      module="torch.distributed.run")
    assert launch.wait_for("epoch 2/3: ", 300), launch.err[-3000:]
    ranks = worker_pids(launch.proc.pid)
    assert set(ranks) == {0, 1}, ranks
    os.kill(ranks[1], signal.SIGUSR1)
    assert launch.finish(600) == 0, launch.err[-3000:]
    assert launch.err.count("stopped on SIGUSR1 after step ") == 1  # rank 1, signalled
    assert launch.err.count("stopped on another rank's signal after step ") == 1  # rank 0, at the same step
    assert "resuming from" in launch.err  # the restarted workers, by themselves
    assert compare_runs(out, whole) == []


@pytest.mark.slow
def test_a_preempted_sweep_resumes_its_trial_from_its_checkpoint(config, tmp_path, monkeypatch):
    from captionkit.experiments import sweep as sw

    sweep = sw.define(config, ["train.lr=3e-3"], tmp_path / "s")
    (name,) = sweep.todo()
    with monkeypatch.context() as m:
        signal_at_step(m, 11)
        with pytest.raises(Preempted, match=f"trial {name}: stopped on SIGTERM"):
            sw.run_local(sweep, progress=False)
    assert sweep.status(name)["status"] == "running"
    assert read_config(sweep.run_dir(name) / "last")["state"]["step"] == 12
    sw.run_local(sweep, progress=False)
    assert sweep.status(name)["status"] == "finished"
    whole = tmp_path / "whole"
    train(sweep.config_path(name), out=whole, progress=False)
    assert compare_runs(sweep.run_dir(name), whole) == []


def test_nproc_passes_resume_auto_to_the_ranks_and_checks_it_first(config, tmp_path, monkeypatch):
    from captionkit.cli.main import main
    from captionkit.training import distributed

    launched = []
    monkeypatch.setattr(distributed, "launch", lambda nproc, args: launched.append(args) or 0)
    fresh = tmp_path / "fresh"  # nothing to resume yet: auto starts it (plain --resume is refused)
    assert main(["train", "--config", str(config), "--out", str(fresh), "--nproc", "2", "--resume", "auto"]) == 0
    assert launched[0][-2:] == ["--resume", "auto"] and "--stop-signals" in launched[0]
    assert main(["train", "--config", str(config), "--out", str(fresh), "--nproc", "2", "--resume"]) == 2


@pytest.mark.slow
def test_caption_engine_ray_stopped_by_sigterm_then_rerun_resumes(tiny_run, flickr_dir, tmp_path):
    """--engine ray: ray.init's own SIGTERM handler (sys.exit anywhere) is replaced by ours;
    stopped with exit 75, the shards done are kept and the rerun computes only the rest."""
    if ray_missing():
        pytest.skip(ray_missing())
    photos = sorted((flickr_dir / "Flicker8k_Dataset").glob("*.jpg"))
    (tmp_path / "photos").mkdir()
    for i in range(200):
        (tmp_path / "photos" / f"{i:03d}.jpg").write_bytes(photos[i % len(photos)].read_bytes())
    out = tmp_path / "caps.jsonl"
    cmd = ["caption", "--model", str(tiny_run / "best"), str(tmp_path / "photos"), "--jsonl", str(out),
           "--engine", "ray", "--shard-size", "10"]
    run = Child(*cmd)
    end = time.monotonic() + 300
    while time.monotonic() < end and (not out.exists() or out.read_bytes().count(b"\n") < 20):
        time.sleep(0.05)
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish(120) == EXIT_PREEMPTED, run.err[-3000:]
    assert "caption: stopped on SIGTERM" in run.err
    written = out.read_bytes()
    assert written.endswith(b"\n") and 20 <= written.count(b"\n") < 200
    again = Child(*cmd)
    assert again.finish(300) == 0, again.err[-3000:]
    said = re.search(r"ray: (\d+) of 20 shards to compute", again.err)
    assert said and int(said[1]) < 20, again.err[-2000:]
    records = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert sorted(r["image"] for r in records) == [f"{i:03d}.jpg" for i in range(200)]


@pytest.mark.slow
def test_two_gloo_processes_stopped_during_validation_resume_to_the_same_end(tmp_path):
    """SIGTERM while rank 0 validates (a dev split of 250 images: three chunks of 100): rank 0
    stops between chunks and tells rank 1 in the state broadcast it waits in; both exit 75;
    --resume auto validates the epoch again and ends where an unbroken run ends."""
    data = write_flickr8k(tmp_path / "data", n_dev=250, n_test=1)
    config = tmp_path / "val.toml"
    config.write_text(TINY_CONFIG.format(dataset=data).replace("epochs = 3", "epochs = 1"))
    whole, out = tmp_path / "whole", tmp_path / "run"
    args = ["train", "--config", str(config), "--nproc", "2"]
    reference = Child(*args, "--out", str(whole))
    assert reference.finish(600) == 0, reference.err[-3000:]
    launch = Child(*args, "--out", str(out))
    assert launch.wait_for("validating: ", 300), launch.err[-3000:]
    launch.proc.send_signal(signal.SIGTERM)
    assert launch.finish(120) == EXIT_PREEMPTED, launch.err[-3000:]
    assert launch.err.count("stopped on ") == 2 and "epoch 1: dev" not in launch.err
    state = read_config(out / "last")["state"]
    assert state["epoch"] == 0 and state["batch_in_epoch"] > 0
    resumed = Child(*args, "--out", str(out), "--resume", "auto")
    assert resumed.finish(600) == 0, resumed.err[-3000:]
    assert compare_runs(out, whole) == []
