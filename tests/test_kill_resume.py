"""Kill it anywhere: a tiny training run killed with SIGKILL inside an epoch, during
validation and inside checkpoint writes, resumed with ``captionkit train --resume`` each time,
ends with the checkpoints and history of a run never interrupted (see tests/killharness.py;
benchmarks/kill_resume.py runs many more random kills)."""

import pytest
from helpers import TINY_CONFIG
from killharness import HOOKS, Launch, compare_runs, kill_and_resume, kill_config

# one kill of each kind; the timer first, early in the first epoch (before its first checkpoint
# on a loaded machine: then the run starts afresh)
PLANS = [("timer", 0.3), ("save:files", 2), ("save:swap", 1), ("save:done", 1), ("save:model", 3), ("validate", 1)]


@pytest.mark.slow
def test_a_run_killed_anywhere_and_resumed_equals_an_unbroken_one(flickr_dir, tmp_path):
    config = tmp_path / "kill.toml"
    config.write_text(kill_config(TINY_CONFIG.format(dataset=flickr_dir)))
    reference = Launch(config, tmp_path / "whole", resume=False)  # runs beside the kills
    report = kill_and_resume(config, tmp_path / "resumed", PLANS)
    assert reference.finish() == 0, reference.err
    print(report.summary())
    assert sum(report.kills.values()) == len(PLANS)
    assert {k.split()[1] for k in report.kills if k.startswith("hook:")} == set(HOOKS)
    assert report.resumes >= len(PLANS) - 1
    assert compare_runs(tmp_path / "resumed", tmp_path / "whole") == []
