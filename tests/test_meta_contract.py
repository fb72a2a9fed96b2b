"""Device contract tests, on CPU-only CI: every registered family (``list_models()``) and every
registered encoder (``list_encoders()``) runs with its model and inputs on ``torch.device("meta")``
-- the stand-in for a GPU -- under ``devicecheck.strict_devices()``, which fails any op that mixes
devices as CUDA would. Then the hot paths (decoding, a training step, SCST sampling) under the
factory sentinel, and the host syncs per training step and per decoding step against the
budget of issue 28: at most one of each, none per image.

Nothing here needs a GPU; a meta tensor has no values, so host reads are answered with made-up
ones (devicecheck.MetaAnswers) and the tests check devices, shapes and counts, never values."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from devicecheck import MetaAnswers, count_syncs, factory_sentinel, hot_path, strict_devices
from meta_models import (
    META,
    NoTinyModel,
    caption_ids,
    decode_syncs,
    decoding_answers,
    features,
    grid_of,
    model_train_step,
    per_step_and_image,
    tiny_model,
    tiny_tokenizer,
    train_syncs,
)

from captionkit.data.vocab import Vocab
from captionkit.encoders import create_encoder, list_encoders
from captionkit.inference.captioner import Captioner
from captionkit.inference.controls import Controls
from captionkit.inference.decoding import Caption, beam_nbest, decode_lists, greedy
from captionkit.inference.ensemble import TTA, TTA_SHARES, EnsembleDecoder, with_flip_views
from captionkit.models import create_model, list_models
from captionkit.training.scst import SelfCritical, sample

FAMILIES = list_models()
ENCODERS = list_encoders()
# the encoders without parameters (where a device bug hides) and one network run in the fast
# loop; building the large networks' random weights takes seconds each
FAST_ENCODERS = ("patches", "vit_pixels", "efficientnet_lite0")
ENCODER_PARAMS = [pytest.param(n, marks=() if n in FAST_ENCODERS else pytest.mark.slow) for n in ENCODERS]
MAX_LEN = 4


def cpu_model(family: str, request):
    """The tiny ``family`` model on the CPU (a new family fails here until it has one)."""
    try:
        return tiny_model(family, request.getfixturevalue)
    except NoTinyModel as e:
        pytest.fail(str(e))


def meta_model(family: str, request):
    """The tiny ``family`` model on the meta device."""
    return cpu_model(family, request).to(META)


def assert_on(device: torch.device, *tensors) -> None:
    for t in tensors:
        assert t.device == device, f"a tensor on {t.device}, expected {device}"


def assert_captions(caps: list[Caption], n: int) -> None:
    """Captions are CPU-side: their attention is on the CPU (word ids are Python ints)."""
    assert len(caps) == n
    for c in caps:
        assert isinstance(c.ids, list) and isinstance(c.logprob, float)
        assert_on(torch.device("cpu"), c.attention)


def test_every_family_and_encoder_is_covered():
    assert {"sat", "transformer", "prefix_lm", "vit_gpt2"} <= set(FAMILIES)
    assert {"patches", "vit_pixels", "efficientnet_lite0"} <= set(ENCODERS)


# ---- the step contract, training loss, decoding ----------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_step_contract_on_meta(family, request):
    model = meta_model(family, request)
    feats = features(model, 3)
    with strict_devices(), torch.no_grad():
        mem = model.prepare(feats)
        state = model.init_state(mem)
        tokens = torch.full((3,), Vocab.start, dtype=torch.long, device=META)
        for _ in range(3):
            logp, state, alpha = model.step(tokens, state, mem)
            assert_on(META, logp, alpha, *state)
            assert logp.shape == (3, model.cfg.vocab_size) and alpha.shape == feats.shape[:2]
            tokens = logp.argmax(1)
        rows = torch.tensor([0, 0, 2], device=META)  # beam search's reordering
        mem2, state2 = mem.index_select(rows), tuple(s.index_select(0, rows) for s in state)
        model.step(tokens, state2, mem2)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_loss_and_backward_on_meta(family, request):
    model = meta_model(family, request).train()
    feats = features(model, 3)
    ids = caption_ids(model.cfg.vocab_size)
    with strict_devices():
        loss, ce = model.training_loss(feats, ids[:, :-1], ids[:, 1:])
        assert_on(META, loss, ce)
        loss.backward()
        if model.image_batching:  # one image shared by several captions
            idx = torch.tensor([0, 0, 1], device=META)
            loss, _ = model.training_loss(feats[:2], ids[:, :-1], ids[:, 1:], image_index=idx)
            loss.backward()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    assert_on(META, *grads)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_and_beam_on_meta(family, request):
    model = meta_model(family, request)
    feats = features(model, 3)
    with strict_devices(decoding_answers(MAX_LEN)):
        assert_captions(greedy(model, feats, MAX_LEN), 3)
    with strict_devices(decoding_answers(MAX_LEN)):
        assert [len(n) for n in beam_nbest(model, feats, 2, 3, MAX_LEN)] == [2, 2, 2]


@pytest.mark.parametrize("tta", [None, *TTA])
@pytest.mark.parametrize("family", FAMILIES)
def test_captioner_decodes_on_meta(family, tta, request):
    """A captioner placed on a device knows it, and decodes features given on the CPU or there."""
    model = cpu_model(family, request)
    config = {"encoder": {"name": "patches", "grid": list(grid_of(model))}, "decoding": {"max_len": MAX_LEN}}
    cap = Captioner(model, tiny_tokenizer(model), config, tta=tta).place(META)
    assert cap.device == META
    assert all(p.device == META for p in cap.decoder.parameters())
    views = len(TTA_SHARES[tta]) if tta else 0
    for device in (torch.device("cpu"), META):
        feats = features(model, 2, device)
        feats = torch.stack([feats] * views, 1) if views else feats  # (B, V, L, D) with views
        for beam in (1, 3):
            with strict_devices(decoding_answers(MAX_LEN)):
                caps = cap.decode_features(feats, beam=beam)
            assert_captions(caps, 2)
        with strict_devices(decoding_answers(MAX_LEN)):
            assert [len(n) for n in cap.nbest_features(feats, 2, beam=3)] == [2, 2]


def test_cpu_captioner_takes_device_features(request):
    """Features on a device given to a captioner on the CPU are copied to it, and read only
    once they are there."""
    model = cpu_model("sat", request)
    config = {"encoder": {"name": "patches", "grid": list(grid_of(model))}, "decoding": {"max_len": MAX_LEN}}
    cap = Captioner(model, tiny_tokenizer(model), config).place("cpu")
    with strict_devices(decoding_answers(MAX_LEN)):
        assert_captions(cap.decode_features(features(model, 2, META), beam=1), 2)


@pytest.mark.parametrize("combine", ["loglinear", "linear"])
@pytest.mark.parametrize("family", FAMILIES)
def test_ensemble_on_meta(family, combine, request):
    a, b = meta_model(family, request), meta_model(family, request)
    ensemble = EnsembleDecoder([a, b], [0.3, 0.7], combine)
    flip = with_flip_views(a)
    feats = features(a, 2)
    views = torch.stack([feats, feats.flip(1)], 1)  # (B, 2, L, D)
    for decoder, x in ((ensemble, feats), (flip, views)):
        with strict_devices(decoding_answers(MAX_LEN)):
            assert_captions(greedy(decoder, x, MAX_LEN), 2)
        with strict_devices(decoding_answers(MAX_LEN)):
            assert [len(n) for n in beam_nbest(decoder, x, 1, 3, MAX_LEN)] == [1, 1]


@pytest.mark.parametrize("baseline", ["greedy", "mean"])
@pytest.mark.parametrize("family", FAMILIES)
def test_scst_on_meta(family, baseline, request):
    model = meta_model(family, request)
    feats = features(model, 2)
    tok = tiny_tokenizer(model)
    with strict_devices(decoding_answers(MAX_LEN)):
        seqs = sample(model, feats, 3, MAX_LEN)
    assert_on(META, seqs)
    assert seqs.shape[0] == 6 and seqs.dtype == torch.long
    scst = SelfCritical({0: [["a", "red", "circle"]], 1: [["a", "blue", "square"]]}, tok, samples=3,
                        max_len=MAX_LEN, baseline=baseline)
    with strict_devices(decoding_answers(MAX_LEN)):
        loss, stats = scst.loss(model, feats, [0, 1])
        assert_on(META, loss)
        loss.backward()
    # the figures stay on the loss's device (the trainer reads them on the host every LOG_EVERY steps)
    assert stats.sample_reward.dim() == 0
    assert_on(META, stats.sample_reward)


# ---- encoders -----------------------------------------------------------------------------------
def meta_encoder(name: str):
    return create_encoder(name, weights="random").to(META)


@pytest.mark.parametrize("name", ENCODER_PARAMS)
def test_encoder_encodes_on_meta(name):
    """An encoder moved to a device computes there and gives its features there, whether the
    pixels come from the CPU or are already on the device."""
    enc = meta_encoder(name)
    size = enc.preprocess.size
    with strict_devices():
        h, w = enc.grid()
        for device in (META, torch.device("cpu")):
            pixels = torch.rand(2, 3, size, size, device=device)
            feats = enc.encode(pixels)
            assert_on(META, feats)
            assert feats.shape == (2, h * w, enc.dim)


@pytest.mark.parametrize("name", ENCODER_PARAMS)
def test_encoder_encode_does_not_sync(name):
    """Encoding a batch on the device reads nothing back on the host."""
    enc = meta_encoder(name)
    size = enc.preprocess.size
    with strict_devices(), count_syncs() as syncs:
        enc.encode(torch.rand(2, 3, size, size, device=META))
    assert syncs.total == 0, syncs.report()


@pytest.mark.parametrize("tta", [None, *TTA])
@pytest.mark.parametrize("name", ENCODER_PARAMS)
def test_captioner_encodes_on_meta(name, tta):
    """Placement invariant: after place(), the captioner, its decoder and its encoder agree on
    the device, and encode() gives features there."""
    enc = meta_encoder(name)
    with strict_devices():
        grid = list(enc.grid())  # on meta: no forward pass to pay for
    decoder = create_model("sat", {"vocab_size": 12, "feat_dim": enc.dim, "embed_dim": 6, "hidden_dim": 10,
                                   "attn_dim": 5})
    config = {"encoder": {"name": name, "grid": grid}, "decoding": {"max_len": MAX_LEN}}
    cap = Captioner(decoder, tiny_tokenizer(decoder), config, encoder=enc, tta=tta).place(META)
    assert cap.device == META
    assert {p.device for p in cap.decoder.parameters()} == {META}
    assert {t.device for t in [*cap.encoder.parameters(), *cap.encoder.buffers()]} <= {META}
    size = enc.preprocess.size
    with strict_devices(decoding_answers(MAX_LEN)):
        for device in (torch.device("cpu"), META):
            feats = cap.encode(torch.rand(2, 3, size, size, device=device))
            assert_on(META, feats)
            L = grid[0] * grid[1]
            assert feats.shape == ((2, len(TTA_SHARES[tta]), L, enc.dim) if tta else (2, L, enc.dim))  # (B, V, L, D)
        assert_captions(cap.decode_features(feats, beam=3), 2)


# ---- the factory sentinel on the hot paths ------------------------------------------------------
@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_builds_no_host_tensors(family, request):
    model = meta_model(family, request)
    feats = features(model, 3)
    for decode in (lambda: greedy(model, feats, MAX_LEN), lambda: beam_nbest(model, feats, 2, 3, MAX_LEN)):
        # strict_data: no host data has any business in a decoding step
        with strict_devices(decoding_answers(MAX_LEN)), factory_sentinel(META, strict_data=True):
            decode()


def test_ensemble_decoding_builds_no_host_tensors(request):
    """An ensemble's steps copy nothing from the host (its weights live on the device)."""
    a, b = meta_model("sat", request), meta_model("sat", request)
    feats = features(a, 2)
    for decoder, x in ((EnsembleDecoder([a, b], [0.3, 0.7]), feats),
                       (with_flip_views(a), torch.stack([feats, feats], 1))):
        with strict_devices(decoding_answers(MAX_LEN)), factory_sentinel(META, strict_data=True):
            greedy(decoder, x, MAX_LEN)


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_builds_no_host_tensors(family, request):
    model = meta_model(family, request).train()
    feats = features(model, 3)
    ids = caption_ids(model.cfg.vocab_size)
    with strict_devices(), factory_sentinel(META):
        for _ in range(2):  # (the first step of a family may differ: a baseline's first update)
            loss, _ = model.training_loss(feats, ids[:, :-1], ids[:, 1:])
            loss.backward()


def test_hard_attention_training_step_builds_no_host_tensors():
    model = tiny_model("sat_hard", lambda _: "").to(META).train()
    feats, ids = features(model, 3), caption_ids(model.cfg.vocab_size)
    with strict_devices(), factory_sentinel(META):
        for _ in range(2):
            loss, _ = model.training_loss(feats, ids[:, :-1], ids[:, 1:])
            loss.backward()


@pytest.mark.parametrize("family", FAMILIES)
def test_scst_sampling_builds_no_host_tensors(family, request):
    model = meta_model(family, request)
    feats = features(model, 2)
    scst = SelfCritical({0: [["a", "red", "circle"]], 1: [["a", "blue", "square"]]}, tiny_tokenizer(model),
                        samples=2, max_len=MAX_LEN)
    with strict_devices(decoding_answers(MAX_LEN)), factory_sentinel(META):
        sample(model, feats, 2, MAX_LEN)
        loss, _ = scst.loss(model, feats, [0, 1])
        loss.backward()


def test_scst_discriminability_term_runs_on_the_device_and_reads_nothing_back():
    """train.scst_matcher: the matcher runs where the features are; its term adds no host tensor
    and no host sync to a self-critical step (the word ids it reads are on the host already)."""
    from captionkit.models.matcher import Matcher, MatcherConfig

    model = tiny_model("sat", lambda _: "").to(META)
    tok = tiny_tokenizer(model)
    refs = {0: [["a", "red", "circle"]], 1: [["a", "blue", "square"]]}
    m = Matcher(MatcherConfig(words=["<pad>", "<unk>", "a", "red", "circle"], feat_dim=model.cfg.feat_dim,
                              embed_dim=4, word_dim=2, bank_size=3))
    m.bank.fill_(0.5)
    objectives = {w: SelfCritical(refs, tok, samples=2, max_len=MAX_LEN, matcher=m, match_weight=w) for w in (0.0, 1.0)}
    m.to(META)  # (as the trainer places it, with the model)
    syncs = {}
    for weight, scst in objectives.items():
        with strict_devices(decoding_answers(MAX_LEN)), factory_sentinel(META), count_syncs() as counted:
            loss, stats = scst.loss(model, features(model, 2), [0, 1])
        assert_on(META, loss, stats.sample_reward)
        syncs[weight] = counted.total
    assert syncs[1.0] == syncs[0.0], f"the term's host syncs: {syncs}"


# ---- host syncs against the budget --------------------------------------------------------------
@pytest.mark.parametrize("beam", [1, 3])
@pytest.mark.parametrize("family", FAMILIES)
def test_decoding_syncs_at_most_once_per_step(family, beam, request):
    """At most one host sync per decoding step, none per image: the captions' one copy to the
    host at the end of a call is all the rest (slopes in max_len and in the batch)."""
    model = meta_model(family, request)
    per_step, per_image, run = per_step_and_image(model, beam)
    report = run.syncs.report(per=run.steps, unit=" per step")
    assert per_step <= 1, f"{per_step:g} host syncs per decoding step:\n{report}"
    assert per_image == 0, f"{per_image:g} host syncs per image:\n{report}"


# the caption controls' paths (issue 32): the step rules, sampling, diverse beam search
CONTROLLED = {"rules": Controls(no_repeat_ngram=2, repetition_penalty=1.2, min_words=1),
              "sample": Controls(sample=True, temperature=0.8, top_k=3, top_p=0.9, seed=1, no_repeat_ngram=2),
              "groups": Controls(num_captions=2, beam_groups=3, diversity_strength=0.5, repetition_penalty=1.2)}
CONTROLLED_BEAM = {"rules": 3, "sample": 1, "groups": 3}


@pytest.mark.parametrize("family", FAMILIES)
def test_caption_controls_build_no_host_tensors(family, request):
    """Blocking, the penalty, the minimum length, sampling's noise and filters and diverse beam
    search's groups: every tensor of a step made on the device, no host data, no op mixing
    devices (greedy and n-best with the rules too)."""
    model = meta_model(family, request)
    feats = features(model, 3)
    with strict_devices(decoding_answers(MAX_LEN)), factory_sentinel(META, strict_data=True):
        assert_captions(greedy(model, feats, MAX_LEN, CONTROLLED["rules"]), 3)
        assert [len(n) for n in beam_nbest(model, feats, 2, 3, MAX_LEN, 0.0, CONTROLLED["rules"])] == [2, 2, 2]
        for name, controls in CONTROLLED.items():
            lists = decode_lists(model, feats, CONTROLLED_BEAM[name], MAX_LEN, 0.0, controls)
            assert len(lists) == 3 and all(assert_captions(caps, len(caps)) is None for caps in lists)


@pytest.mark.parametrize("name", sorted(CONTROLLED))
@pytest.mark.parametrize("family", ["sat", "transformer"])
def test_caption_controls_sync_at_most_once_per_step(family, name, request):
    """The controls add no host sync: still at most one per decoding step, none per image."""
    model = meta_model(family, request)
    per_step, per_image, run = per_step_and_image(model, CONTROLLED_BEAM[name], controls=CONTROLLED[name])
    report = run.syncs.report(per=run.steps, unit=" per step")
    assert per_step <= 1, f"{per_step:g} host syncs per decoding step:\n{report}"
    assert per_image == 0, f"{per_image:g} host syncs per image:\n{report}"


@pytest.mark.parametrize("family", [*FAMILIES, "sat_hard"])
def test_model_training_step_does_not_sync(family, request):
    """The model's part of a training step (loss, backward, optimizer step) reads nothing on the
    host: the step's one sync is the trainer's (the loss it reports)."""
    if family == "sat_hard":
        model = tiny_model("sat_hard", lambda _: "").to(META)
    else:
        model = meta_model(family, request)
    with strict_devices():
        model_train_step(model.train())  # the first step (optimizer state, a baseline's start) aside
    run = train_syncs(model, steps=2)
    assert run.syncs.total == 0, "host syncs in the model's training step:\n" + run.syncs.report(per=2)


def test_scst_sampling_syncs_at_most_once_per_step(request):
    model = meta_model("sat", request)
    totals = {}
    for n in (3, 7):
        with strict_devices(decoding_answers(n)), count_syncs() as syncs:
            sample(model, features(model, 2), 3, n)
        totals[n] = syncs
    per_step = (totals[7].total - totals[3].total) / 4
    assert per_step <= 1, totals[7].report()


def meta_trainer(config: Path, out: Path):
    """A Trainer of ``config`` training on the meta device (data prepared on the CPU, as the
    feature store is), ready for train_step."""
    from captionkit.training.config import RunConfig
    from captionkit.training.run import build_trainer
    from captionkit.training.stages import prepare_data
    from captionkit.training.trainer import EpochProgress

    cfg = RunConfig.load(config, None)
    trainer = build_trainer(cfg, out, data=prepare_data(cfg), device=META)
    for group in trainer.opt.param_groups:  # meta has no fused kernels: the per-tensor loop, same maths
        group["fused"] = False
    trainer.state.epoch_progress = EpochProgress()  # (fit starts an epoch so)
    return trainer


@pytest.fixture(params=["soft", "hard"])
def attention_config(request, tiny_config, tmp_path) -> Path:
    if request.param == "soft":
        return tiny_config
    path = tmp_path / "hard.toml"
    path.write_text(tiny_config.read_text().replace("dropout = 0.0", 'dropout = 0.0\nattention = "hard"'))
    return path


def first_step(trainer):
    """The batches of epoch 0, after its first step (optimizer state, a baseline's start)."""
    batches = trainer.epoch_batches(0)
    with strict_devices(MetaAnswers(fill=1.0)):
        trainer.train_step(batches[0], 0, len(batches))
    return batches


@pytest.mark.slow  # a Trainer built from the tiny run config (dataset, features)
def test_trainer_step_syncs_at_most_once(attention_config, tmp_path):
    """Trainer.train_step on a meta model: at most one host sync per training step (the loss
    it reports, which may come every N steps)."""
    trainer = meta_trainer(attention_config, tmp_path / "run")
    batches, steps = first_step(trainer), 3
    with strict_devices(MetaAnswers(fill=1.0)), count_syncs() as syncs:
        for bi in range(1, 1 + steps):
            trainer.train_step(batches[bi], bi, len(batches))
    assert syncs.total <= steps, "host syncs per training step:\n" + syncs.report(per=steps)


@pytest.mark.slow  # a Trainer built from the tiny run config (dataset, features)
def test_trainer_step_builds_no_host_tensors(attention_config, tmp_path):
    """Inside the model's loss of Trainer.train_step, every tensor is made on the device."""
    trainer = meta_trainer(attention_config, tmp_path / "run")
    batches = first_step(trainer)
    with strict_devices(MetaAnswers(fill=1.0)), \
            hot_path(trainer.model, "training_loss", lambda: factory_sentinel(META)):
        for bi in range(1, 3):
            trainer.train_step(batches[bi], bi, len(batches))


def test_decode_syncs_counts_what_it_should(request):
    """The measurement itself: greedy decoding today reads ``alive.any()`` once per step, and a
    meta model's steps are counted."""
    model = meta_model("sat", request)
    run = decode_syncs(model, 2, 5, beam=1)
    assert run.steps == 6  # max_len words and the forced <end>
    assert any(op == "__bool__" for _, op in run.syncs.sites)

