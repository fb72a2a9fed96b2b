"""Checkpoint digests: config.json records the sha256 of each tensor file, checked on load, so a
truncated or bit-flipped file is one line naming it; checkpoints from before digests still load."""

import json
import shutil

import pytest
import torch
from helpers import shape_image
from safetensors.torch import load_file

from captionkit.cli.main import main
from captionkit.core.checkpoint import (
    DIGESTS,
    CheckpointError,
    file_sha256,
    read_config,
    read_weights,
    remove_leftovers,
    resolve,
    save_checkpoint,
    verify,
)
from captionkit.inference.captioner import Captioner
from captionkit.inference.shipped import SHIPPED

TENSOR_FILES = ("model.safetensors", "optimizer.safetensors")


def test_a_training_checkpoint_records_the_digest_of_each_tensor_file(tiny_run):
    cfg = read_config(tiny_run / "last")
    assert set(cfg[DIGESTS]) == set(TENSOR_FILES)
    for name in TENSOR_FILES:
        assert cfg[DIGESTS][name] == file_sha256(tiny_run / "last" / name)
    assert set(read_config(tiny_run / "best")[DIGESTS]) == {"model.safetensors"}  # no optimizer kept there


def test_a_bit_flip_or_a_truncation_is_one_line_naming_the_file(tiny_run, tmp_path, capsys):
    ck = shutil.copytree(tiny_run / "last", tmp_path / "ck")
    model = ck / "model.safetensors"
    data = bytearray(model.read_bytes())
    data[-100] ^= 0x01  # one bit of one weight: safetensors alone would load it without a word
    model.write_bytes(bytes(data))
    assert load_file(model)  # (the silent wrong model the digest is there to catch)
    with pytest.raises(CheckpointError, match=r"ck/model.safetensors: corrupted or truncated \(.* bytes; its "
                                              r"sha256 differs from the one .*ck/config.json records\)"):
        read_weights(ck)
    shutil.copy(tiny_run / "last" / "model.safetensors", model)
    read_weights(ck)  # repaired
    optimizer = ck / "optimizer.safetensors"
    optimizer.write_bytes(optimizer.read_bytes()[: optimizer.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"ck/optimizer.safetensors: corrupted or truncated"):
        read_weights(ck, "optimizer.safetensors")
    # from the command line: one line
    model.write_bytes(bytes(data))
    shape_image(0).save(tmp_path / "photo.jpg")
    assert main(["caption", "--model", str(ck), str(tmp_path / "photo.jpg")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "ck/model.safetensors: corrupted or truncated" in err[0]


def test_a_checkpoint_from_before_digests_loads_unchecked(tiny_run, tmp_path):
    ck = shutil.copytree(tiny_run / "best", tmp_path / "old")
    cfg = json.loads((ck / "config.json").read_text())
    del cfg[DIGESTS]
    (ck / "config.json").write_text(json.dumps(cfg, indent=1))
    verify(ck, "model.safetensors")  # nothing to check against: accepted
    cap = Captioner.load(ck, with_encoder=False)
    feats = torch.randn(2, 49, 1280).abs()
    want = Captioner.load(tiny_run / "best", with_encoder=False).decode_features(feats, beam=2)
    assert [c.ids for c in cap.decode_features(feats, beam=2)] == [c.ids for c in want]


def test_a_resaved_config_gets_the_digests_of_the_new_files(tiny_run, tmp_path):
    """cmd_pack and tune_decoding re-save a checkpoint's own config with other tensors: the
    digests it carries are replaced, never copied."""
    cfg = read_config(tiny_run / "best")
    weights = {k: v.half() for k, v in read_weights(tiny_run / "best").items()}
    save_checkpoint(tmp_path / "half", weights, cfg)
    saved = read_config(tmp_path / "half")[DIGESTS]
    assert saved["model.safetensors"] == file_sha256(tmp_path / "half" / "model.safetensors")
    assert saved["model.safetensors"] != cfg[DIGESTS]["model.safetensors"]
    read_weights(tmp_path / "half")


def shipped_checkpoints() -> list[str]:
    """Every shipped checkpoint folder, relative to SHIPPED: an ensemble's are its members."""
    from captionkit.inference.ensemble import is_ensemble_folder, read_ensemble
    out = []
    for p in sorted(p for p in SHIPPED.iterdir() if p.is_dir()):
        folders = read_ensemble(p).member_folders(SHIPPED) if is_ensemble_folder(p) else [p]
        out += [str(f.relative_to(SHIPPED)) for f in folders]
    return out


@pytest.mark.parametrize("name", shipped_checkpoints())
def test_the_shipped_models_carry_digests_that_match(name):
    folder = SHIPPED / name
    assert set(read_config(folder)[DIGESTS]) == {"model.safetensors"}
    verify(folder, "model.safetensors")


def test_leftovers_of_killed_saves_go_and_the_fallback_stays_while_needed(tmp_path):
    for name in ("last", ".last.old", ".last.k3x_9abc", ".best.zzzzzzzz", "other"):
        (tmp_path / name).mkdir()
    remove_leftovers(tmp_path / "last")  # last in place: its .old and temporaries are stale
    assert sorted(p.name for p in tmp_path.iterdir()) == [".best.zzzzzzzz", "last", "other"]
    (tmp_path / "last").rename(tmp_path / ".last.old")  # killed between the renames
    remove_leftovers(tmp_path / "last")
    assert resolve(tmp_path / "last") == tmp_path / ".last.old"
