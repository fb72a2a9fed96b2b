"""Where a captioner's parts are: after any move, the captioner's device, its decoder's and its
encoder's agree (encoders without weights included), the Ray engine's replicas move through the
captioner, and no copy to the host is ever non-blocking. The meta device stands in for a GPU
(tests/devicecheck.py)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from PIL import Image
from devicecheck import MetaAnswers, count_syncs, strict_devices
from helpers import direct_captions

from captionkit.data.vocab import Vocab
from captionkit.encoders import create_encoder
from captionkit.encoders.base import module_device
from captionkit.inference import ray_engine
from captionkit.inference.captioner import Captioner
from captionkit.inference.ensemble import TTA

META, CPU = torch.device("meta"), torch.device("cpu")


def assert_placed(cap: Captioner, device: torch.device) -> None:
    """The placement invariant."""
    assert cap.device == device
    assert module_device(cap.decoder) == device
    if cap.encoder is not None:
        assert module_device(cap.encoder) == device


def non_blocking_host_copies(syncs) -> list:
    return [(site, op) for (site, op) in syncs.sites if op == "to(cpu, non_blocking)"]


@pytest.mark.parametrize("name", ["patches", "vit_pixels", "efficientnet_lite0"])
def test_an_encoder_is_where_it_was_moved_even_without_weights(name):
    encoder = create_encoder(name, weights="random")
    assert module_device(encoder) == CPU
    encoder.to(META)
    assert module_device(encoder) == META
    assert "device_anchor" not in encoder.state_dict()  # nothing new in checkpoints or feature keys
    encoder.to_empty(device=CPU)  # (meta tensors hold no data to copy back)
    assert module_device(encoder) == CPU


def test_encoding_on_the_device_makes_no_non_blocking_copy_to_the_host():
    """A parameterless encoder on the GPU encodes GPU pixels there. (It used to think itself on
    the CPU and copy them to the host with non_blocking=True, reading the buffer before the copy
    had landed: garbage rows.)"""
    encoder = create_encoder("patches", weights="random").to(META)
    pixels = torch.rand(2, 3, 128, 128, device=META)
    with strict_devices(), count_syncs() as syncs:
        rows = encoder.encode(pixels)
        encoder.encode(torch.rand(2, 3, 128, 128))  # host pixels: copied to the device
    assert rows.device == META and rows.shape == (2, 256, 192)
    assert not non_blocking_host_copies(syncs) and syncs.total == 0, syncs.report()


def test_device_features_decoded_on_the_cpu_are_copied_with_blocking(picky_models):
    """Features computed on a GPU and decoded by a CPU captioner reach the host by a blocking
    copy (Captioner._on_device)."""
    cap = Captioner.load(picky_models[0], with_encoder=False)
    feats = torch.rand(2, 256, 192, device=META)
    with strict_devices(), count_syncs() as syncs:
        moved = cap._on_device(feats)
    assert moved.device == CPU
    assert not non_blocking_host_copies(syncs) and [op for _, op in syncs.sites] == ["to(cpu)"]


@pytest.mark.parametrize("tta", [None, *TTA])
def test_a_placed_captioner_its_decoder_and_encoder_agree(picky_models, tta):
    cap = Captioner.load(picky_models[0], tta=tta)
    assert_placed(cap, CPU)
    cap.place(META)
    assert_placed(cap, META)
    both = Captioner.load_ensemble(list(picky_models), tta=tta).place(META)
    assert_placed(both, META)


def test_a_captioner_on_the_device_encodes_and_decodes_there(picky_models):
    """Captioning on the stand-in GPU: no tensor of the CPU meets one of the device, in the
    encoder, greedy or beam search."""
    cap = Captioner.load(picky_models[0]).place(META)
    pixels = torch.rand(2, 3, 128, 128)  # decoded images arrive on the host
    with strict_devices(MetaAnswers(fill=Vocab.end)):
        feats = cap.encode(pixels)
        assert feats.device == META
        for beam in (1, 3):
            assert len(cap.decode_features(feats, beam=beam)) == 2
        assert len(cap.nbest_features(feats, 2)) == 2


def test_placing_keeps_the_precision_asked_for(picky_models, monkeypatch):
    """A move re-resolves the precision that was asked for (not what it resolved to on the
    previous device), unless a new one is given."""
    from captionkit.core import precision
    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    cap = Captioner.load(picky_models[0], precision="fp32")
    assert cap.precision == "fp32"
    cap.place("cpu")
    assert cap.precision == "fp32"
    cap.place("cpu", "auto")
    assert cap.precision == "bf16"
    with pytest.raises(ValueError, match="fp16 needs a CUDA device"):
        cap.place(META, "fp16")
    assert cap.device == CPU and cap.asked_precision == "auto"  # a refused move changes nothing


# ---- the Ray engine's replicas, built without Ray ----------------------------------------------
@pytest.fixture
def replica_threads():
    """A replica sets torch's thread count (its share of the node): put it back afterwards."""
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


@pytest.fixture
def no_ray_gpus(monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])


def photo_batch(paths) -> dict:
    """A batch as the Ray engine's image list holds it."""
    return {"pos": np.arange(len(paths)), "path": np.array([os.fsencode(str(p)) for p in paths], dtype=object)}


def replica_photos(folder, good: int = 2) -> list:
    """``good`` small photos and an unreadable file between them (the Ray engine's replicas read
    their images themselves)."""
    paths = []
    for i in range(good):
        paths.append(folder / f"p{i}.png")
        Image.new("RGB", (64, 64), (40 * i, 90, 200)).save(paths[-1])
        if i == 0:
            paths.append(folder / "broken.png")
            paths[-1].write_bytes(b"not a png")
    return paths


def test_a_caption_replica_on_a_gpu_moves_its_captioner(picky_models, monkeypatch, replica_threads, tmp_path):
    monkeypatch.setattr(ray_engine, "replica_device", lambda: META, raising=False)
    replica = ray_engine.CaptionReplica(lambda: Captioner.load(picky_models[0]), replica_threads, beam=2,
                                        length_penalty=None, workers=0)
    assert_placed(replica.model, META)
    with strict_devices(MetaAnswers(fill=Vocab.end)):
        out = replica(photo_batch(replica_photos(tmp_path)))
    assert list(out["pos"]) == [0, 1, 2] and out["caption"][1] == "" and "broken.png" in out["error"][1]
    assert out["error"][0] == out["error"][2] == ""


@pytest.mark.parametrize("asked, expected", [(None, "bf16"), ("auto", "bf16"), ("fp32", "fp32")])
def test_a_caption_replica_decodes_in_the_precision_the_user_asked_for(picky_models, monkeypatch, replica_threads,
                                                                        asked, expected):
    """caption --engine ray --precision P: each replica resolves P for its own device (it
    decoded under auto whatever --precision said)."""
    from captionkit.core import precision
    monkeypatch.setattr(precision, "native_bf16", lambda: True)  # auto: bf16 here
    monkeypatch.setattr(ray_engine, "replica_device", lambda: CPU, raising=False)
    replica = ray_engine.CaptionReplica(lambda: Captioner.load(picky_models[0], device="cpu"), replica_threads,
                                        beam=2, length_penalty=None, precision=asked)
    assert replica.model.precision == expected and replica.model.device == CPU


def test_caption_engine_ray_hands_the_replicas_the_precision_as_typed(picky_models, tmp_path, monkeypatch):
    """The command line gives the replicas --precision as typed (not as resolved on the driver,
    nor nothing)."""
    from captionkit.cli.main import main
    pytest.importorskip("ray")
    seen = {}

    def fake_ray(readable, todo, *args, precision=None, **kwargs):
        seen["precision"] = precision
        return iter(())

    monkeypatch.setattr(ray_engine, "caption_with_ray", fake_ray)
    photo = tmp_path / "a.jpg"
    Image.new("RGB", (64, 64), (200, 30, 30)).save(photo)
    for typed in ("fp32", "auto"):
        main(["caption", str(photo), "--model", str(picky_models[0]), "--engine", "ray", "--precision", typed,
              "--jsonl", str(tmp_path / f"{typed}.jsonl")])
        assert seen.pop("precision") == typed


def test_a_feature_replica_on_a_gpu_moves_its_encoder(monkeypatch, replica_threads, tmp_path):
    monkeypatch.setattr(ray_engine, "replica_device", lambda: META, raising=False)
    replica = ray_engine.FeatureReplica(lambda: create_encoder("patches", weights="random"), replica_threads,
                                        shape=(256, 192), workers=0)
    assert module_device(replica.model) == META
    with strict_devices():
        out = replica(photo_batch(replica_photos(tmp_path)))
    assert out["feats"].shape == (3, 256, 192) and "broken.png" in out["error"][1]
    assert not out["feats"][1].any()  # an unreadable image's rows stay zero


def test_a_replica_takes_the_gpu_ray_gave_it(monkeypatch):
    """Ray shows a replica only its own GPU(s): that is "cuda" to the replica, made current."""
    ray = pytest.importorskip("ray")
    from test_hardware_fakes import A100, FakeGPUs

    gpus = FakeGPUs(monkeypatch, A100)
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [3])  # Ray's id; CUDA_VISIBLE_DEVICES makes it 0
    assert ray_engine.replica_device() == torch.device("cuda", 0) and gpus.set_calls == [0]
    monkeypatch.setattr(ray, "get_gpu_ids", lambda: [])
    assert ray_engine.replica_device() == CPU


def test_a_caption_replica_encodes_through_its_captioner(picky_models, picky_data, no_ray_gpus, replica_threads):
    """--tta flip (here from an ensemble folder's or the loader's setting) reaches the Ray
    engine: the replica encodes each photo and its mirror image, as the local engine does."""
    paths = sorted((picky_data / "Flicker8k_Dataset").glob("*.png"))[:6]
    cap = Captioner.load(picky_models[0], tta="flip")
    replica = ray_engine.CaptionReplica(lambda: Captioner.load(picky_models[0], tta="flip"), replica_threads,
                                        beam=3, length_penalty=None)
    out = replica(photo_batch(paths))
    assert list(out["caption"]) == list(direct_captions(cap, paths, beam=3).values())
    plain = direct_captions(Captioner.load(picky_models[0]), paths, beam=3)
    assert list(out["caption"]) != list(plain.values())  # the flip changes some of these captions
