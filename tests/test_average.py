"""captionkit average: the weighted average of checkpoints of one model (a run's epochs, a
fine-tuning and its start, WiSE-FT's interpolation). The written weights are the average the
weights ask for, to the float32 rounding; weights 1,0 give the first model back, captions and
all; what cannot be averaged is refused in one line naming the folder, before anything is
written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import cli_captions, write_picky_decoder

from captionkit.cli.main import main
from captionkit.core.checkpoint import read_config, read_weights, save_checkpoint


@pytest.fixture(scope="module")
def pair(picky_models) -> tuple[Path, Path]:
    a, b = picky_models
    wa, wb = read_weights(a), read_weights(b)
    assert any(not torch.equal(wa[k], wb[k]) for k in wa)  # two different models of one shape
    return a, b


@pytest.mark.parametrize("weights", [None, "0.25,0.75", "-0.5,1.5"], ids=["equal", "interpolate", "extrapolate"])
def test_average_writes_the_weighted_sum(pair, tmp_path, weights):
    a, b = pair
    out = tmp_path / "avg"
    assert main(["average", str(a), str(b), "--out", str(out), *([f"--weights={weights}"] if weights else [])]) == 0
    wa, wb, got = read_weights(a), read_weights(b), read_weights(out)
    x, y = (0.5, 0.5) if weights is None else map(float, weights.split(","))
    assert got.keys() == wa.keys()
    for k in wa:
        if wa[k].is_floating_point():
            torch.testing.assert_close(got[k], x * wa[k] + y * wb[k], rtol=1e-6, atol=1e-6)
        else:
            assert torch.equal(got[k], wa[k])
    cfg = read_config(out)
    assert cfg["averaged"] == [{"checkpoint": str(a.resolve()), "weight": x}, {"checkpoint": str(b.resolve()), "weight": y}]
    assert {k: cfg[k] for k in ("family", "model", "vocab", "encoder")} == \
        {k: read_config(a)[k] for k in ("family", "model", "vocab", "encoder")}


def test_three_checkpoints_sum_one_at_a_time(pair, tmp_path):
    """The sum runs over the checkpoints one after another: a third input (here the first again)
    adds its share, 0.2 a + 0.3 b + 0.5 a = 0.7 a + 0.3 b."""
    a, b = pair
    out = tmp_path / "avg3"
    assert main(["average", str(a), str(b), str(a), "--weights", "0.2,0.3,0.5", "--out", str(out)]) == 0
    wa, wb, got = read_weights(a), read_weights(b), read_weights(out)
    for k in wa:
        want = 0.7 * wa[k] + 0.3 * wb[k] if wa[k].is_floating_point() else wa[k]
        torch.testing.assert_close(got[k], want, rtol=1e-6, atol=1e-6)
    assert [e["weight"] for e in read_config(out)["averaged"]] == [0.2, 0.3, 0.5]


def test_weights_one_and_zero_give_the_first_model_back(pair, picky_data, tmp_path):
    """The written folder is a checkpoint the captioner loads: with all the weight on one input
    it captions as that input does, and the other weighting changes the captions."""
    a, b = pair
    folder = picky_data / "Flicker8k_Dataset"
    assert main(["average", str(a), str(b), "--weights", "1,0", "--out", str(tmp_path / "first")]) == 0
    assert main(["average", str(a), str(b), "--weights", "0,1", "--out", str(tmp_path / "second")]) == 0
    first = cli_captions(tmp_path, ["caption", str(folder), "--model", str(tmp_path / "first")])
    assert first == cli_captions(tmp_path, ["caption", str(folder), "--model", str(a)])
    second = cli_captions(tmp_path, ["caption", str(folder), "--model", str(tmp_path / "second")])
    assert second == cli_captions(tmp_path, ["caption", str(folder), "--model", str(b)])
    assert first != second


def test_int8_storage_is_pack_s(pair, tmp_path):
    a, b = pair
    assert main(["average", str(a), str(b), "--out", str(tmp_path / "plain")]) == 0
    assert main(["average", str(a), str(b), "--out", str(tmp_path / "q"), "--int8"]) == 0
    assert main(["pack", str(tmp_path / "plain"), str(tmp_path / "packed"), "--int8"]) == 0
    q, packed = read_weights(tmp_path / "q"), read_weights(tmp_path / "packed")
    assert all(torch.equal(q[k], packed[k]) for k in q)
    assert (tmp_path / "q" / "model.safetensors").stat().st_size < \
        (tmp_path / "plain" / "model.safetensors").stat().st_size


def _relabelled(a: Path, folder: Path, **fields) -> Path:
    """a's weights under a config that says another thing (refused on the config alone)."""
    save_checkpoint(folder, read_weights(a), {**read_config(a), **fields})
    return folder


def _other_vocab(a: Path, folder: Path) -> Path:
    """a's weights under a vocabulary with two words swapped: the same shapes, another model."""
    cfg = read_config(a)
    cfg["vocab"][-1], cfg["vocab"][-2] = cfg["vocab"][-2], cfg["vocab"][-1]
    save_checkpoint(folder, read_weights(a), cfg)
    return folder


def _lora(a: Path, folder: Path) -> Path:
    cfg = read_config(a)
    weights = {**read_weights(a), "lm.q_proj.lora_A.default.weight": torch.zeros(2, 2)}
    save_checkpoint(folder, weights, cfg)
    return folder


@pytest.mark.parametrize("case, message", [
    ("one", "averaging needs two checkpoints or more, got 1"),
    ("sum", "argument --weights: must sum to 1, got '0.5,0.6' (sum 1.1)"),
    ("count", "--weights: 3 weights for 2 checkpoints"),
    ("both", "give --fp16 or --int8, not both"),
    ("family", "{other}/config.json: its 'family' differs from {a}'s; only checkpoints of one model "
               "(family, sizes, encoder, vocabulary) can be averaged"),
    ("vocab", "{other}/config.json: its 'vocab' differs from {a}'s; only checkpoints of one model "
              "(family, sizes, encoder, vocabulary) can be averaged"),
    ("size", "{other}/config.json: its 'model' differs from {a}'s; only checkpoints of one model "
             "(family, sizes, encoder, vocabulary) can be averaged"),
    ("lora", "{other}: holds LoRA factors (lm.q_proj.lora_A.default.weight); averaging them is not "
             "averaging the fine-tunings (export the merged model first: captionkit export hf)"),
    ("self", "{a}: is one of the checkpoints being averaged; choose another folder"),
])
def test_what_cannot_be_averaged_is_one_line_and_nothing_written(pair, tmp_path, capsys, case, message):
    a, b = pair
    out = tmp_path / "out"
    other = tmp_path / "other"
    args = {
        "one": [str(a)],
        "sum": [str(a), str(b), "--weights", "0.5,0.6"],
        "count": [str(a), str(b), "--weights", "0.5,0.2,0.3"],
        "both": [str(a), str(b), "--fp16", "--int8"],
        "family": lambda: [str(a), str(_relabelled(a, other, family="sat"))],
        "vocab": lambda: [str(a), str(_other_vocab(a, other))],
        "size": lambda: [str(a), str(write_picky_decoder(other, seed=2, more_words=("zebra",)))],
        "lora": lambda: [str(a), str(_lora(a, other))],
        "self": [str(a), str(b)],
    }[case]
    argv = ["average", *(args() if callable(args) else args), "--out", str(a if case == "self" else out)]
    before = sorted(p.name for p in a.iterdir()), (a / "model.safetensors").read_bytes()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own refusals (the value of --weights) exit
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"captionkit average: error: {message.format(a=a, other=other)}"
    assert not out.exists()
    assert (sorted(p.name for p in a.iterdir()), (a / "model.safetensors").read_bytes()) == before


def test_tensors_that_are_not_floats_must_agree(pair, tmp_path):
    """A whole-number tensor (a count, an index) has no average: equal ones are kept, unequal
    ones refused."""
    from captionkit.core.checkpoint import average_checkpoints
    from captionkit.core.errors import CheckpointError

    a, _ = pair
    cfg = read_config(a)
    weights = read_weights(a)
    for name, steps in (("x", 3), ("y", 3), ("z", 4)):
        save_checkpoint(tmp_path / name, {**weights, "steps": torch.tensor([steps])}, cfg)
    average_checkpoints([tmp_path / "x", tmp_path / "y"], tmp_path / "xy")
    assert torch.equal(read_weights(tmp_path / "xy")["steps"], torch.tensor([3]))
    with pytest.raises(CheckpointError, match=r"z: its steps \(torch.int64\) differs from .*x's and cannot be averaged"):
        average_checkpoints([tmp_path / "x", tmp_path / "z"], tmp_path / "xz")
    assert not (tmp_path / "xz").exists()
    assert json.loads((tmp_path / "xy" / "config.json").read_text())["averaged"][1]["weight"] == 0.5
