"""A trained captioner: encoder + decoder + vocabulary, loaded from a checkpoint folder.

It uses the decoder only through the model contract (:mod:`captionkit.models.base`), so it
captions with any registered family."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from ..core.checkpoint import CheckpointError, load_into, read_config, read_weights, split_weights
from ..core.devices import resolve_device, to_device, use_device
from ..core.errors import UserError
from ..core.precision import autocast, resolve_precision
from ..data.images import ImageError, to_tensor
from ..data.inputs import input_label, read_input
from ..data.tokenizers import Tokenizer, load_tokenizer
from ..encoders import Encoder, create_encoder, load_finetuned
from ..encoders.image_batches import PixelBatch, image_batches
from ..models import CaptionModel, create_model
from ..models.base import pack_products, view_attention
from .controls import MODEL_DEFAULTS, RANKED_TOKENS, Controls, model_controls
from .decoding import Caption, beam_nbest, decode_lists
from .ensemble import (
    COMBINE,
    ENSEMBLE_FILE,
    HF_MEMBER_REFUSAL,
    TTA,
    TTA_OFF,
    EnsembleDecoder,
    check_member_configs,
    check_member_encoders,
    is_ensemble_folder,
    normalised_weights,
    read_ensemble,
    tta_pixels,
    with_tta_views,
)
from .hf_models import hf_parts, hf_source
from .rerank import RERANK_OFF, RERANKERS, FolderRerank, match_choice, mbr_choice, rare_word_gains
from .shaping import image_keys
from .shipped import SHIPPED, existing_model_folder


@dataclass
class Member:
    """A checkpoint's decoder, vocabulary and config, loaded without its encoder."""

    path: Path
    config: dict
    decoder: torch.nn.Module
    vocab: Tokenizer
    encoder_tuned: dict[str, torch.Tensor]  # fine-tuned encoder tensors ({} for none)


def load_member(path: Path) -> Member:
    """Read a checkpoint folder's decoder and vocabulary; one CheckpointError naming the folder
    for anything that does not fit."""
    cfg = read_config(path)
    try:
        family, words, _ = cfg["family"], cfg["vocab"], cfg["encoder"]
        decoder = create_model(family, cfg["model"])
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}/config.json: incompatible config ({e})") from None
    try:
        vocab = load_tokenizer(words)
    except (KeyError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path}/config.json: unusable vocabulary ({e})") from None
    if len(vocab) != decoder.cfg.vocab_size:
        raise CheckpointError(f"{path}: vocabulary has {len(vocab)} words, model expects {decoder.cfg.vocab_size}")
    decoder_weights, encoder_tuned = split_weights(read_weights(path))
    load_into(decoder, decoder_weights, path)
    pack_products(decoder)  # read for captioning: its float32 CPU products may use packed weights
    return Member(path, cfg, decoder, vocab, encoder_tuned)


@dataclass
class Result:
    words: list[str]
    attention: torch.Tensor  # (len(words), L)
    grid: tuple[int, int]
    candidates: list[str] | None = None  # the n-best list it was chosen from, best beam first
    captions: list[str] | None = None  # with num_captions K > 1: the K captions (text: the first)

    @property
    def text(self) -> str:
        return " ".join(self.words)


@dataclass
class CaptionResult:
    """One input's outcome in :meth:`Captioner.__call__`: its caption, or why there is none.

    ``source``: the input as named (a path or URL as given; ``images[i]``, or ``image`` for a
    single one, for a PIL image, an array or bytes). ``ok``: whether it was captioned; if not,
    ``error`` is the one-line reason (naming ``source``) and the caption fields are None.
    ``text``: the caption; ``words``: its words; ``logprob``: the sum of its tokens'
    log-probabilities, <end> included (an ensemble's combined one), whatever length penalty
    ranked the beams. ``attention`` (len(words), L) and ``grid`` (rows, columns of the L
    locations): only when asked for (``attention=True``), else None. ``captions`` and
    ``logprobs``: with ``num_captions`` K > 1, the image's K distinct captions (fewer when
    sampling finds fewer) and their log-probabilities, ``text`` being the first; else None."""

    source: str
    text: str | None = None
    words: list[str] | None = None
    logprob: float | None = None
    attention: torch.Tensor | None = None
    grid: tuple[int, int] | None = None
    error: str | None = None
    captions: list[str] | None = None
    logprobs: list[float] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class Captioner:
    def __init__(self, decoder: CaptionModel, vocab: Tokenizer, config: dict, encoder: Encoder | None = None,
                 tta: str | None = None):
        """``tta="flip"``: test-time flip averaging -- every image is encoded twice, as it is and
        mirrored, and the decoder decodes both views as one ensemble (ensemble.with_flip_views);
        features given to ``decode_features`` are then (B, 2, L, D). ``"flip-zoom"``: four views,
        those two and a centre crop and its mirror image (ensemble.tta_pixels), (B, 4, L, D).
        ``"none"``: none (what ``--tta none`` asks for over an ensemble folder's own)."""
        tta = None if tta == TTA_OFF else tta
        if tta not in (None, *TTA):
            raise ValueError(f"unknown test-time augmentation {tta!r} (known: {', '.join(TTA)})")
        self.tta = tta
        if tta is not None:
            decoder = with_tta_views(decoder, tta)
            config = {**config, "tta": tta}
        self.decoder = decoder.eval()
        self.vocab = vocab
        self.config = config
        self.encoder = encoder
        self.grid = tuple(config["encoder"]["grid"])
        decoding = config.get("decoding", {})
        self.max_len = int(decoding.get("max_len", 20))
        # the length normalisation the model was tuned with on its dev split (0: none)
        self.length_penalty = float(decoding.get("length_penalty", 0.0))
        # the caption controls the model decodes with unless told otherwise (its config may set the rules)
        self.controls = model_controls(decoding, "the model's config")
        if self.controls.rare_word_bonus > 0:  # a rule that needs the tokenizer's kind
            try:
                self.controls.fit_tokens(vocab.kind)
            except UserError as e:
                raise UserError(f"the model's config: decoding: {e}") from None
        # where the decoder and encoder are as given (the CPU: checkpoints are read there, and the
        # ONNX runtime's stand-ins are not modules to move); see place()
        self.device = torch.device("cpu")
        self.asked_precision = "auto"  # as asked, re-resolved for each device placed on
        self.precision = resolve_precision(self.asked_precision, self.device)
        self.matcher, self.match_weight, self._matcher_folder = None, 0.0, None  # --rerank match's (use_matcher)
        self.match_rare_weight = 0.0
        self.own_rerank: FolderRerank | None = None  # an ensemble folder's own reranker (load, rerank_plan)

    def place(self, device: str | torch.device = "cpu", precision: str | None = None) -> "Captioner":
        """Move the decoder and encoder to ``device`` (a name as ``--device`` takes it, or a
        torch.device) and decode under ``precision`` resolved for it (captionkit.core.precision:
        "auto" is bf16 autocast on a GPU that has it and on a CPU that multiplies bf16
        natively, else float32; None: what was asked before, at first "auto"). Checkpoints are
        read on the CPU and moved here. The one way a captioner moves: afterwards ``device`` is
        where the decoder and the encoder are (captionkit.encoders.module_device)."""
        where = resolve_device(device) if isinstance(device, str) else use_device(torch.device(device))
        asked = self.asked_precision if precision is None else precision
        self.precision = resolve_precision(asked, where)
        self.device, self.asked_precision = where, asked
        self.decoder.to(self.device)
        if self.encoder is not None:
            self.encoder.to(self.device)
        return self

    @classmethod
    def load(cls, path: str | Path | None = None, with_encoder: bool = True,
             encoder_weights: str | None = None, tta: str | None = None, device: str | torch.device = "auto",
             precision: str = "auto", prompt: str | None = None) -> "Captioner":
        """Load a checkpoint folder, an ensemble folder (captionkit.inference.ensemble), or a shipped model
        by name (the default one when ``path`` is None), onto ``device`` (see :meth:`place`; "auto",
        as the command line's --device: the first CUDA GPU, else MPS, else the CPU).
        ``tta``: see :class:`Captioner` (default: none, or what the ensemble folder says;
        "none" switches the folder's off). A Hugging Face model (``hf:ORG/NAME``, or a folder
        ``save_pretrained`` wrote) captions as it is, its captions following ``prompt`` (None: the
        model's own; captionkit.inference.hf_models)."""
        source = hf_source(path)
        if source is not None:
            decoder, vocab, config, encoder = hf_parts(source, prompt, with_encoder)
            return cls(decoder, vocab, config, encoder, tta).place(device, precision)
        path = existing_model_folder(path)
        if is_ensemble_folder(path):
            spec = read_ensemble(path)
            cap = cls.load_ensemble(spec.member_folders(SHIPPED), spec.weights, length_penalty=spec.length_penalty,
                                    max_len=spec.max_len, rules=spec.rules, combine=spec.combine,
                                    with_encoder=with_encoder,
                                    encoder_weights=encoder_weights, source=path, tta=tta or spec.tta,
                                    device=device, precision=precision)
            if spec.rerank:  # the folder's own reranker: its captions unless told otherwise (rerank_plan)
                r = spec.rerank
                cap.use_matcher(r.matcher, r.weight, r.rare_weight).own_rerank = r
            return cap
        member = load_member(path)
        cap = cls._with_encoder(member.decoder, member, member.config, with_encoder, encoder_weights, tta)
        return cap.place(device, precision)

    @classmethod
    def from_pretrained(cls, repo_id: str, revision: str | None = None, *, cache_dir: str | Path | None = None,
                        local_files_only: bool = False, **load_options) -> "Captioner":
        """A model ``captionkit push`` put on the Hugging Face Hub (``"ORG/NAME"``), at ``revision``
        (a branch, tag or commit; default main), downloaded into huggingface_hub's cache
        (``cache_dir``, or HF_HUB_CACHE / HF_HOME; the cache alone with ``local_files_only`` or
        HF_HUB_OFFLINE=1), every file checked against the digest pushed with it
        (captionkit.inference.hub), then loaded as :meth:`load` loads a folder (``load_options``:
        its ``device``, ``precision``, ``tta``...)."""
        from .hub import HUB_PREFIX, hub_folder, parse_hub_ref

        name, at = parse_hub_ref(repo_id.removeprefix(HUB_PREFIX))
        if at and revision and at != revision:
            raise UserError(f"{repo_id}: names revision {at!r}, and revision={revision!r} another")
        folder = hub_folder(name, revision or at, cache_dir=cache_dir, local_files_only=local_files_only)
        return cls.load(folder, **load_options)

    @classmethod
    def load_ensemble(cls, paths: Sequence[str | Path], weights: Sequence[float] | None = None, *,
                      length_penalty: float | None = None, max_len: int | None = None,
                      rules: dict | None = None, combine: str = "loglinear", with_encoder: bool = True,
                      encoder_weights: str | None = None, source: Path | None = None,
                      tta: str | None = None, device: str | torch.device = "auto",
                      precision: str = "auto") -> "Captioner":
        """Several checkpoints (folders or shipped names) of one tokenizer and encoder, decoded
        as one model (captionkit.inference.ensemble). ``weights``: one per member (default equal);
        ``length_penalty`` and ``max_len``: the ensemble's (default the first member's); so are
        ``rules``, the caption controls' rules it decodes with unless told otherwise
        (controls.MODEL_DEFAULTS, e.g. ``{"no_repeat_ngram": 2}``; a rule not given: the first
        member's).
        ``source``: the ensemble folder they were named in, if any (for its errors).
        ``device``, ``precision``: see :meth:`load`."""
        normalised_weights(weights, len(paths))  # a wrong weight is refused before anything loads
        unknown = sorted(set(rules or {}) - set(MODEL_DEFAULTS))
        if unknown:  # so is a wrong rule
            raise UserError(f"the ensemble's rules: {unknown[0]!r} is not one of {', '.join(MODEL_DEFAULTS)}")
        model_controls(rules or {}, "the ensemble's rules")
        if combine not in COMBINE:
            raise UserError(f"unknown combine {combine!r} (known: {', '.join(COMBINE)})")
        folders = []
        for p in paths:
            if hf_source(p) is not None:
                raise UserError(f"{p}: a Hugging Face model captions alone, not as an ensemble's member: "
                                f"{HF_MEMBER_REFUSAL}" + (f" (named in {source / ENSEMBLE_FILE})" if source else ""))
            folder = existing_model_folder(p)
            if is_ensemble_folder(folder):
                raise CheckpointError(f"{folder}: is an ensemble; an ensemble's members are checkpoints"
                                      + (f" (named in {source / ENSEMBLE_FILE})" if source else ""))
            folders.append(folder)
        check_member_configs([(f, read_config(f)) for f in folders])  # before any weights load
        members = [load_member(f) for f in folders]
        check_member_encoders([(m.path, m.encoder_tuned) for m in members])
        decoder = EnsembleDecoder([m.decoder for m in members], weights, combine)
        first = members[0]
        decoding = dict(first.config.get("decoding", {}))
        if length_penalty is not None:
            decoding["length_penalty"] = length_penalty
        if max_len is not None:
            decoding["max_len"] = max_len
        decoding.update(rules or {})
        # "model" stays the first member's: the attention shown is the first member's
        config = {**{k: first.config[k] for k in ("model", "encoder", "vocab")}, "family": "ensemble",
                  "decoding": decoding,
                  "ensemble": {"members": [str(m.path) for m in members], "weights": decoder.weights,
                               "combine": combine, "families": [m.config["family"] for m in members],
                               **({"folder": str(source)} if source else {})}}
        cap = cls._with_encoder(decoder, first, config, with_encoder, encoder_weights, tta)
        return cap.place(device, precision)

    @classmethod
    def _with_encoder(cls, decoder: torch.nn.Module, member: "Member", config: dict, with_encoder: bool,
                      encoder_weights: str | None, tta: str | None = None) -> "Captioner":
        """The captioner of ``decoder``, with the encoder ``member``'s checkpoint names (and its
        fine-tuned blocks) unless ``with_encoder`` is False."""
        encoder = None
        if with_encoder:
            path, enc_cfg = member.path, member.config["encoder"]
            encoder = create_encoder(enc_cfg["name"], weights=encoder_weights or enc_cfg.get("weights"))
            if member.encoder_tuned:  # the blocks fine-tuned with this decoder
                load_finetuned(encoder, member.encoder_tuned, str(path))
            grid = list(encoder.grid())
            if encoder.dim != decoder.cfg.feat_dim or grid != list(enc_cfg["grid"]):
                raise CheckpointError(
                    f"{path}: trained on {enc_cfg['name']} features {enc_cfg['grid']} x {decoder.cfg.feat_dim}, "
                    f"but the encoder gives {grid} x {encoder.dim}")
        return cls(decoder, member.vocab, config, encoder, tta)

    @torch.no_grad()
    def decode_features(self, feats: torch.Tensor, beam: int | None = None, length_penalty: float | None = None,
                        controls: Controls | None = None, keys: torch.Tensor | None = None) -> list[Caption]:
        """feats (B, L, D) on any device -> one Caption per image (beam None: 3, or 1 when
        sampling; length_penalty None: the model's own; controls None: the model's own,
        captionkit.inference.controls), decoded on this captioner's device and precision;
        Captions are CPU-side. ``keys`` (B,): the images' sampling keys (default: their
        features' hash; :meth:`encode_keys` gives their pixels')."""
        return [caps[0] for caps in self.decode_lists(feats, beam, length_penalty, controls, keys)]

    @torch.no_grad()
    def decode_lists(self, feats: torch.Tensor, beam: int | None = None, length_penalty: float | None = None,
                     controls: Controls | None = None, keys: torch.Tensor | None = None) -> list[list[Caption]]:
        """As :meth:`decode_features`, each image's ``controls.num_captions`` captions
        (captionkit.inference.decoding.decode_lists; beam search steps the open images' rows
        only: ``prune``)."""
        c = self.controls_for(controls, beam)
        with autocast(self.device, self.precision):
            return decode_lists(self.decoder, self._on_device(feats), beam=c.beam(beam), max_len=self.max_len,
                                length_penalty=self.length_penalty_or(length_penalty), controls=c,
                                keys=None if keys is None else to_device(keys, self.device), prune=True)

    def controls_for(self, controls: Controls | None = None, beam: int | None = None, **options) -> Controls:
        """``controls`` (None: the model's own) with ``options`` (Controls fields) replacing
        theirs, checked against ``beam`` (one UserError line for a value that does not fit)."""
        return (self.controls if controls is None else controls).with_options(**options).check(beam) \
            .fit_tokens(self.vocab.kind)

    def _on_device(self, feats: torch.Tensor) -> torch.Tensor:
        return to_device(feats, self.device).float()

    def mbr(self, lists: list[list[Caption]]) -> list[Caption]:
        """Each n-best list's consensus caption (captionkit.inference.rerank; document frequencies from
        these lists' images)."""
        choice = mbr_choice({i: [self.text(c) for c in caps] for i, caps in enumerate(lists)})
        return [caps[choice[i]] for i, caps in enumerate(lists)]

    def use_matcher(self, folder: str | Path, weight: float, rare_weight: float = 0.0) -> "Captioner":
        """Rerank n-best lists with the matcher checkpoint ``folder`` (``rerank="match"``,
        captionkit.inference.rerank.match_choice) at ``weight``, and the captions' rare-word gain
        at ``rare_weight`` (a word vocabulary's only: its ids are frequency ranks). The matcher
        must read this captioner's encoder rows (one line naming the folder otherwise); it stays
        on the CPU (a few small matmuls a photo), whatever device the captioner is on."""
        from ..models.matcher import load_matcher

        for name, w in (("matcher's weight", weight), ("rare-word gain's weight", rare_weight)):
            if not (w >= 0 and w < float("inf")):
                raise UserError(f"the {name} must be a finite number >= 0, got {w}")
        if rare_weight and self.vocab.kind not in RANKED_TOKENS:
            raise UserError(f"--match-rare-weight ranks words by their frequency in a word vocabulary; this "
                            f"model's tokens are {self.vocab.kind!r} tokens, in no such order")
        # (the matcher in use already when it is this folder's: an ensemble folder's own, which
        # the command line names again to set its weights)
        same = self._matcher_folder is not None and Path(self._matcher_folder).resolve() == Path(folder).resolve()
        m = self.matcher if same else load_matcher(folder)
        if self.encoder is not None and m.cfg.encoder != self.encoder.cache_key():
            raise UserError(f"{folder}: a matcher of {m.cfg.encoder} rows, but this captioner's encoder is "
                            f"{self.encoder.cache_key()}")
        self.matcher, self.match_weight, self._matcher_folder = m, float(weight), folder
        self.match_rare_weight = float(rare_weight)
        return self

    def _need_matcher(self) -> None:
        if self.matcher is None:
            raise UserError("--rerank match needs a matcher: --matcher DIR (captionkit matcher trains one)")

    @torch.no_grad()
    def match(self, lists: list[list[Caption]], feats: torch.Tensor,
              length_penalty: float | None = None) -> list[Caption]:
        """Each n-best list's choice by the matcher (:meth:`use_matcher`), its log-probabilities
        normalised by ``length_penalty`` (None: the model's own) as the beam ranked them; feats:
        the photos' rows as :meth:`encode` gives them, (B, L, D), or (B, V, L, D) with views (the
        photo's view is scored)."""
        self._need_matcher()
        photo = feats[:, 0] if feats.dim() == 4 else feats  # (B, L, D)
        if photo.shape[-1] != self.matcher.cfg.feat_dim:
            raise UserError(f"{self._matcher_folder}: a matcher of {self.matcher.cfg.feat_dim}-wide rows, but this "
                            f"captioner's are {photo.shape[-1]} wide")
        images = self.matcher.image(photo.float().cpu())  # (B, E)
        parts = self.matcher.list_discriminability(images, [[self.text(c) for c in caps] for caps in lists])
        gains = rare_word_gains([[c.ids for c in caps] for caps in lists], len(self.vocab)) \
            if self.match_rare_weight else None
        choice = match_choice([[c.logprob for c in caps] for caps in lists],
                              [[len(c.ids) for c in caps] for caps in lists],  # tokens: as the beam normalised
                              parts, self.match_weight, self.length_penalty_or(length_penalty),
                              gains, self.match_rare_weight)
        return [caps[i] for caps, i in zip(lists, choice)]

    @torch.no_grad()
    def nbest_features(self, feats: torch.Tensor, n: int, beam: int | None = None,
                       length_penalty: float | None = None, controls: Controls | None = None) -> list[list[Caption]]:
        """feats (B, L, D) -> each image's ``n`` best beams, best first (beam width
        max(beam, n)), under ``controls``' step rules (None: the model's own)."""
        c = self.controls_for(controls, max(beam or n, n))  # (checked as every other path checks them)
        with autocast(self.device, self.precision):
            return beam_nbest(self.decoder, self._on_device(feats), n, max(beam or n, n), c.max_len(self.max_len),
                              self.length_penalty_or(length_penalty), c, prune=True)

    def text(self, cap: Caption) -> str:
        """A caption's words as one string (what scoring and reranking compare)."""
        return " ".join(self.vocab.decode(cap.ids))

    def length_penalty_or(self, length_penalty: float | None) -> float:
        """The given length normalisation, or the model's own when None."""
        return self.length_penalty if length_penalty is None else length_penalty

    def result(self, cap: Caption) -> Result:
        """A caption as words, with one attention row per word: a word spelt by several tokens
        (characters, subwords) gets the mean of its tokens' attention."""
        attention = view_attention(cap.attention, self.decoder.attention_view)
        spans = self.vocab.spans(cap.ids)
        if spans:
            attention = torch.stack([attention[pos].mean(0) for _, pos in spans])  # (words, L)
        else:
            attention = attention[:0]
        return Result([w for w, _ in spans], attention, self.grid)

    def encode_batch(self, images: list[torch.Tensor]) -> torch.Tensor:
        """Preprocessed images, each (3, S, S) -> the encoder's rows (B, L, D), without autograd
        (with test-time augmentation (B, V, L, D), see :meth:`encode`)."""
        return self.encode(torch.stack(images))

    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """Preprocessed pixels (B, 3, S, S) on any device -> the encoder's rows (B, L, D) on this
        captioner's device, computed under its precision, without autograd; with test-time
        augmentation (B, V, L, D): the views of ensemble.tta_pixels, view 0 the images' own rows
        (flip: and their mirror images', a second encoder pass; flip-zoom: four passes).
        float32 whatever the precision (the decoders take float32 features; bf16 autocast
        would otherwise hand back bf16 rows on some CPUs and float32 on others)."""
        if self.encoder is None:
            raise RuntimeError("this Captioner was loaded without its encoder")
        with autocast(self.device, self.precision):
            if self.tta is None:
                return self.encoder.encode(pixels).float()
            # every view in one encoder call (one call per layer for V times the images), image-
            # major: rows V b .. V b + V - 1 are image b's views, so the result is (B, V, L, D)
            # without a copy (an image's rows do not depend on the other images of its batch, up
            # to float32 rounding: bit for bit the same with two threads here)
            views = tta_pixels(pixels, self.tta)  # (B, V, 3, S, S)
            feats = self.encoder.encode(views.flatten(0, 1))  # (B V, L, D)
        return feats.unflatten(0, views.shape[:2]).float()  # (B, V, L, D)

    def encode_keys(self, pixels: torch.Tensor) -> torch.Tensor | None:
        """Preprocessed pixels (B, 3, S, S) -> the images' sampling keys (B,) on this captioner's
        device: a hash of the pixels, so an image's sampled captions depend on the image, the
        seed and the options only, not on its batch or its place there."""
        return image_keys(to_device(pixels, self.device))

    def rerank_plan(self, rerank: str | None, nbest: int | None, c: Controls,
                    beam: int | None) -> tuple[str | None, int | None]:
        """The reranker and n-best size a decode under controls ``c`` uses, checked (one
        UserError line): as asked (``rerank="none"``: none); when none is asked, the model's own
        (an ensemble folder's ``rerank``, at its n-best size unless ``nbest`` says) wherever the
        decoding is the beam's one caption -- not greedy, sampling, several captions or beam
        groups, which ask for other captions than the reranker chooses among."""
        if rerank not in (None, RERANK_OFF, *RERANKERS):
            raise UserError(f"unknown reranker {rerank!r} (known: {', '.join(RERANKERS)}, {RERANK_OFF})")
        if rerank is None and self.own_rerank is not None and c.gives_the_beams_best(beam):
            rerank, nbest = self.own_rerank.method, nbest or self.own_rerank.nbest
        rerank = None if rerank == RERANK_OFF else rerank
        if rerank and not nbest:
            raise UserError("reranking chooses among the n best beams: give nbest")
        if rerank == "match":
            self._need_matcher()  # before any photo is decoded
        if nbest and (c.num_captions > 1 or c.sample or c.beam_groups > 1):
            raise UserError("n-best lists and reranking take the beam's best: not with num_captions, sampling "
                            "or beam groups")
        return rerank, nbest

    def caption_pixels(self, pixels: torch.Tensor, beam: int | None, length_penalty: float | None, c: Controls,
                       rerank: str | None, nbest: int | None) -> tuple[list[Caption], list[list[Caption]]]:
        """Preprocessed pixels (B, 3, S, S) -> each image's caption and its list
        (:meth:`decode_chosen` of their rows, every view, with their sampling keys when ``c``
        samples): what caption_files, ``cap()`` and the server's worker decode a batch with."""
        keys = self.encode_keys(pixels) if c.sample else None
        return self.decode_chosen(self.encode(pixels), beam, length_penalty, c, keys, rerank, nbest)

    def decode_chosen(self, feats: torch.Tensor, beam: int | None, length_penalty: float | None, c: Controls,
                      keys: torch.Tensor | None, rerank: str | None,
                      nbest: int | None) -> tuple[list[Caption], list[list[Caption]]]:
        """A batch's rows as :meth:`encode` gives them -> each image's caption and its list: the
        n best beams when ``nbest`` (the caption: the reranker's choice among them, else the
        best), else the controls' captions (the caption: the first); as :meth:`rerank_plan` planned."""
        if nbest:
            found = self.nbest_features(feats, nbest, c.beam(beam), length_penalty, c)
            if rerank == "mbr":
                return self.mbr(found), found
            if rerank == "match":
                return self.match(found, feats, length_penalty), found
            return [best[0] for best in found], found
        found = self.decode_lists(feats, beam, length_penalty, c, keys)
        return [caps[0] for caps in found], found

    def caption_files(self, paths: list[Path], beam: int | None = None, batch_size: int = 16,
                      length_penalty: float | None = None, workers: int = 1, nbest: int | None = None,
                      rerank: str | None = None,
                      controls: Controls | None = None) -> Iterator[tuple[Path, Result | ImageError]]:
        """Caption image files in order; a bad file yields its ImageError and the rest go on.
        ``workers`` processes decode the next batches' images while this batch is captioned
        (0: in this process; captionkit.encoders.image_batches), pinned and copied without blocking
        when the device is a GPU.
        ``nbest``: keep each image's ``nbest`` best beams as the Result's ``candidates``;
        ``rerank="mbr"``: choose the caption among them by consensus (:meth:`mbr`), batch by
        batch; ``"match"``: by the matcher (:meth:`use_matcher`); None: the model's own reranker
        if it has one (:meth:`rerank_plan`), ``"none"``: none. ``controls``: the caption
        controls (None: the model's own); with ``num_captions`` K > 1 each Result's
        ``captions`` holds the K."""
        if self.encoder is None:
            raise RuntimeError("this Captioner was loaded without its encoder")
        yield from self.caption_batches(image_batches(paths, self.encoder.preprocess, batch_size, workers, self.device),
                                        beam, length_penalty, nbest, rerank, controls)

    def caption_batches(self, batches: Iterable[PixelBatch], beam: int | None = None,
                        length_penalty: float | None = None, nbest: int | None = None, rerank: str | None = None,
                        controls: Controls | None = None) -> Iterator[tuple[Path, Result | ImageError]]:
        """:meth:`caption_files` of batches already read (captionkit.encoders.image_batches: this
        captioner's preprocessing, on its device): each batch's images in order."""
        c = self.controls_for(controls, beam)
        rerank, nbest = self.rerank_plan(rerank, nbest, c, beam)
        for batch in batches:
            caps: dict[int, Caption] = {}
            lists: dict[int, list[Caption]] = {}
            several: dict[int, list[Caption]] = {}
            if batch.good:
                chosen, found = self.caption_pixels(batch.pixels, beam, length_penalty, c, rerank, nbest)
                caps = dict(zip(batch.good, chosen))
                lists = dict(zip(batch.good, found)) if nbest else {}
                several = dict(zip(batch.good, found))
            for i, p in enumerate(batch.paths):
                if i not in caps:
                    yield p, batch.errors[i]
                    continue
                res = self.result(caps[i])
                if i in lists:
                    res.candidates = [self.text(cand) for cand in lists[i]]
                if c.num_captions > 1:
                    res.captions = [self.text(cap) for cap in several[i]]
                yield p, res

    def __call__(self, images, *, beam: int | None = None, batch_size: int = 16, attention: bool = False,
                 length_penalty: float | None = None, workers: int = 2, url_max_bytes: int | None = None,
                 url_timeout: float | None = None, controls: Controls | None = None, rerank: str | None = None,
                 nbest: int | None = None, **options) -> CaptionResult | list[CaptionResult]:
        """Caption ``images``: one input, or a list (or tuple) of them. An input is a path (str
        or Path), an http(s) URL, a PIL image, a numpy array (H, W, 3) of uint8 (also (H, W)
        grey, (H, W, 4) RGBA) or the bytes of an image file (captionkit.data.inputs). One input
        gives one :class:`CaptionResult`, a list a list of them in its order. An input that
        cannot be read (a missing file, bytes that are no image, a URL that fails, an array of
        the wrong shape) gives a result with ``ok`` False and ``error`` its one-line reason;
        the others are captioned as usual. ``batch_size`` inputs are read (by ``workers``
        threads, so downloads overlap, while the batch before is captioned) and captioned
        together on this captioner's device;
        ``attention=True`` keeps each word's attention. ``url_max_bytes``, ``url_timeout``:
        a URL's limits (default 20 MiB and 30 s; captionkit.data.fetch).
        ``beam``: the beam width (default 3; 1: greedy). The caption controls
        (docs/decoding-controls.md) as keywords -- ``num_captions``, ``sample``, ``temperature``,
        ``top_k``, ``top_p``, ``seed``, ``no_repeat_ngram``, ``repetition_penalty``,
        ``rare_word_bonus``, ``min_words``, ``max_words``, ``beam_groups``, ``diversity_strength`` -- or as a
        :class:`~captionkit.inference.controls.Controls` (``controls``; the keywords replace its
        values); a value that does not fit is one UserError before anything is read.
        ``rerank``, ``nbest``: as :meth:`caption_files` (None: the model's own reranker, if
        its ensemble folder has one; "none": none)."""
        if self.encoder is None:
            raise RuntimeError("this Captioner was loaded without its encoder")
        if batch_size < 1 or workers < 1:
            raise UserError(f"batch_size and workers must be at least 1, not {batch_size} and {workers}")
        c = self.controls_for(controls, beam, **options)
        rerank, nbest = self.rerank_plan(rerank, nbest, c, beam)
        single = not isinstance(images, (list, tuple))
        items = [images] if single else list(images)
        labels = [input_label(x, None if single else i) for i, x in enumerate(items)]
        pre = self.encoder.preprocess

        def pixels(k: int) -> torch.Tensor | ImageError:  # (3, S, S), or why not
            try:
                return to_tensor(read_input(items[k], labels[k], url_max_bytes, url_timeout), pre)
            except ImageError as e:
                return e

        out: list[CaptionResult] = []
        starts = range(0, len(items), batch_size)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            def reading(start: int) -> list:  # a batch's reads, under way
                return [pool.submit(pixels, k) for k in range(start, min(start + batch_size, len(items)))]

            ahead = reading(starts[0]) if starts else []
            for n, start in enumerate(starts):
                read = [f.result() for f in ahead]
                if n + 1 < len(starts):  # the next batch is read while this one is captioned
                    ahead = reading(starts[n + 1])
                good = [k for k, x in enumerate(read) if isinstance(x, torch.Tensor)]
                caps = {}
                if good:
                    x = torch.stack([read[k] for k in good])  # (G, 3, S, S)
                    chosen, found = self.caption_pixels(x, beam, length_penalty, c, rerank, nbest)
                    # (the chosen caption first: with a reranker it may be any of the list's)
                    caps = dict(zip(good, ([a, *(b for b in f if b is not a)] for a, f in zip(chosen, found))))
                for k, x in enumerate(read):
                    out.append(self._call_result(labels[start + k], caps.get(k), x, attention, c.num_captions > 1))
        return out[0] if single else out

    def _call_result(self, source: str, caps: list[Caption] | None, read, attention: bool,
                     several: bool) -> CaptionResult:
        if caps is None:
            return CaptionResult(source, error=str(read))
        cap = caps[0]
        res = self.result(cap)
        return CaptionResult(source, text=res.text, words=res.words, logprob=float(cap.logprob),
                             attention=res.attention if attention else None, grid=res.grid if attention else None,
                             captions=[self.text(c) for c in caps] if several else None,
                             logprobs=[float(c.logprob) for c in caps] if several else None)
