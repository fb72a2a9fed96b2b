"""Tiny instances of every registered model family, moved to the meta device (the stand-in for a
GPU, see devicecheck.py), and the host-sync measurements made of them: shared by
test_meta_contract.py and benchmarks/sync_counts.py.

A new family fails here (``tiny_model``) until it has a tiny configuration below: that is how
the device tests come to cover every registered family."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from devicecheck import META, MetaAnswers, SyncCounter, count_syncs, strict_devices
from torch import nn

from captionkit.data.vocab import SPECIALS, Vocab
from captionkit.inference.decoding import beam_nbest, decode_lists, greedy
from captionkit.models import CaptionModel, create_model

FEAT, GRID = 8, (2, 3)
# the pretrained folders each LM family is built from (conftest fixtures / helpers.write_tiny_*)
LM_FOLDERS = {"prefix_lm": ("tiny_lm",), "vit_gpt2": ("tiny_vit", "tiny_gpt2")}
# the Hugging Face captioner families and the tiny model of each (conftest's tiny_hf, hf_tiny.py)
HF_FAMILIES = {"hf_blip": "blip", "hf_git": "git", "hf_ved": "ved", "hf_idefics3": "idefics3"}
HF_PROMPT = "Describe this image briefly."  # the instruction of the tiny Idefics3 (its tokenizer knows the words)


class NoTinyModel(LookupError):
    """A registered family this module cannot build yet."""


def tiny_model(family: str, folder: Callable[[str], str]) -> CaptionModel:
    """A tiny ``family`` model on the CPU, eval mode, dropout off. ``folder(name)``: the path of
    the pretrained folder ``name`` (one of LM_FOLDERS)."""
    torch.manual_seed(0)
    if family == "sat":
        model = create_model("sat", {"vocab_size": 12, "feat_dim": FEAT, "embed_dim": 6, "hidden_dim": 10,
                                     "attn_dim": 5, "dropout": 0.0})
    elif family == "sat_hard":  # hard attention: a different training loss (REINFORCE) and state
        model = create_model("sat", {"vocab_size": 12, "feat_dim": FEAT, "embed_dim": 6, "hidden_dim": 10,
                                     "attn_dim": 5, "dropout": 0.0, "attention": "hard"})
    elif family == "transformer":
        model = create_model("transformer", {"vocab_size": 12, "feat_dim": FEAT, "grid": list(GRID), "width": 16,
                                             "heads": 2, "encoder_layers": 1, "decoder_layers": 2, "dropout": 0.0,
                                             "max_positions": 16})
    elif family == "prefix_lm":
        lm = folder("tiny_lm")
        model = create_model("prefix_lm", {"vocab_size": lm_vocab_size(lm), "feat_dim": FEAT, "grid": list(GRID),
                                           "lm": lm, "pool": [1, 2], "lora_rank": 2, "lora_dropout": 0.0})
    elif family == "vit_gpt2":
        vit, lm = folder("tiny_vit"), folder("tiny_gpt2")
        model = create_model("vit_gpt2", {"vocab_size": lm_vocab_size(lm), "feat_dim": 3 * 8 * 8, "grid": [4, 4],
                                          "vit": vit, "lm": lm, "freeze_encoder_blocks": 1,
                                          "freeze_decoder_blocks": 1})
    elif family in HF_FAMILIES:
        model = tiny_hf_model(family, folder("tiny_hf"))
    else:
        raise NoTinyModel(f"no tiny {family!r} model: add one to tiny_model() in {__file__}")
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    return model.eval()


def tiny_hf_model(family: str, folders: dict[str, str], training: str = "lora") -> CaptionModel:
    """The tiny Hugging Face model of an hf_* family, LoRA adapters on its language side (so a
    training step has something to train), no dropout in them."""
    from captionkit.models.hf_captioner import reference_config

    arch = HF_FAMILIES[family]
    cfg = reference_config(folders[arch], HF_PROMPT if arch == "idefics3" else "")
    return create_model(family, {**cfg, "training": training, "lora_rank": 2, "lora_dropout": 0.0})


def lm_vocab_size(source: str) -> int:
    from captionkit.data.tokenizers import LMTokenizer
    return len(LMTokenizer.build(source))


def tiny_tokenizer(model: CaptionModel):
    """The tokenizer a tiny model's ids mean (the LM's own for the LM families)."""
    source = getattr(model.cfg, "lm", None) or getattr(model.cfg, "source", None)
    if source:
        from captionkit.data.tokenizers import LMTokenizer
        return LMTokenizer.build(source)
    return Vocab(list(SPECIALS) + [f"w{i}" for i in range(model.cfg.vocab_size - len(SPECIALS))])


def grid_of(model) -> tuple[int, int]:
    return tuple(getattr(model.cfg, "grid", GRID))


def features(model, batch: int, device: torch.device = META) -> torch.Tensor:
    """Features of ``batch`` images for ``model``: (B, L, D) on ``device``."""
    h, w = grid_of(model)
    return torch.rand(batch, h * w, model.cfg.feat_dim, device=device)


def caption_ids(vocab_size: int, lengths=(6, 4, 5), device: torch.device = META) -> torch.Tensor:
    """(len(lengths), T): <start> words <end>, <pad> after, of the given lengths."""
    g = torch.Generator().manual_seed(0)
    ids = torch.full((len(lengths), max(lengths)), Vocab.pad)
    for b, n in enumerate(lengths):
        ids[b, 0], ids[b, n - 1] = Vocab.start, Vocab.end
        ids[b, 1:n - 1] = torch.randint(len(SPECIALS), vocab_size, (n - 2,), generator=g)
    return ids.to(device)


def decoding_answers(max_len: int) -> MetaAnswers:
    """Made-up host reads for decoding on meta: every word read is <end> (so greedy's word lists
    end), loops run to ``max_len``, and ``nonzero`` (beam search's finished candidates) finds
    none until the last step, where every candidate is an <end> -- as on a real run, where only
    <end> may follow at the last step."""
    return MetaAnswers(fill=Vocab.end, truth=True, nonzero=lambda call, t: "all" if call >= max_len else "empty")


# ---- host syncs ------------------------------------------------------------------------------
@dataclass
class Measured:
    syncs: SyncCounter
    steps: int  # decoding steps (model.step calls), or training steps


def count_steps(model) -> list[int]:
    """Counts ``model.step`` calls from now on into the returned one-element list."""
    calls = [0]
    step = model.step

    def counted(*args, **kwargs):
        calls[0] += 1
        return step(*args, **kwargs)

    model.step = counted
    return calls


def decode_syncs(model, batch: int, max_len: int, beam: int, controls=None) -> Measured:
    """Host syncs of one greedy (beam 1) or beam search of ``batch`` images on a meta ``model``
    (with caption ``controls``: whatever decode_lists decodes for them)."""
    feats = features(model, batch)
    calls = count_steps(model)
    try:
        with strict_devices(decoding_answers(max_len)), count_syncs() as syncs:
            if controls is not None:
                decode_lists(model, feats, beam, max_len, 0.0, controls)
            elif beam == 1:
                greedy(model, feats, max_len)
            else:
                beam_nbest(model, feats, 1, beam, max_len)
    finally:
        del model.step
    return Measured(syncs, calls[0])


def per_step_and_image(model, beam: int, lens=(3, 7), batches=(2, 4), controls=None) -> tuple[float, float, Measured]:
    """(host syncs per extra decoding step, per extra image, the larger run): the slopes of
    the sync count in max_len and in the batch, so the one copy of the result at the end of a
    call is not counted against a step."""
    a, b = (decode_syncs(model, batches[0], n, beam, controls) for n in lens)
    per_step = (b.syncs.total - a.syncs.total) / (b.steps - a.steps)
    c = decode_syncs(model, batches[1], lens[0], beam, controls)
    per_image = (c.syncs.total - a.syncs.total) / (batches[1] - batches[0])
    return per_step, per_image, b


def model_train_step(model, batch: int = 3) -> None:
    """One training step of the model's part, as the trainer takes it: the family's
    training_loss, backward, an Adam step (not fused: meta has no fused kernels; the maths is
    the same)."""
    feats = features(model, batch)
    ids = caption_ids(model.cfg.vocab_size, lengths=(6, 4, 5)[:batch] if batch <= 3 else (5,) * batch)
    opt = getattr(model, "_meta_opt", None)
    if opt is None:
        opt = model._meta_opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3,
                                                 fused=False)
    loss, ce = model.training_loss(feats, ids[:, :-1], ids[:, 1:])
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def train_syncs(model, steps: int = 3) -> Measured:
    """Host syncs of ``steps`` model training steps (train mode) on a meta ``model``."""
    model.train()
    try:
        with strict_devices(), count_syncs() as syncs:
            for _ in range(steps):
                model_train_step(model)
    finally:
        model.eval()
    return Measured(syncs, steps)
