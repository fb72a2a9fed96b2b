"""An image-caption matcher: a small dual encoder that says how well a caption fits a photo,
for discriminative reranking (``--rerank match``, captionkit.inference.rerank).

Why: a captioner trained to maximise CIDEr-D learns that a generic caption ("a dog runs
through the grass") is a safe bet for many photos, so different photos get the same words.
Its beam's n-best list often holds a caption that says more about *this* photo. The matcher
scores each candidate by how much better it fits this photo than photos in general,

    disc(c | x) = s cos(f(x), g(c)) - log mean_j exp(s cos(f(b_j), g(c))),

the log of the contrastive probability of x against a bank b of other photos, less log 1/K:
an estimate of the pointwise mutual information between the photo and the caption (Andreas and
Klein 2016 and Vedantam et al. 2017 rerank or decode with the same contrast; Luo et al. 2018
train on it). A generic caption fits the bank's photos as well as this one and scores near 0.

Image side f: the encoder's grid rows (B, L, D), mean-pooled, layer-normalised, dropout, a
linear map to the joint space, unit length. Text side g: the caption's words (Karpathy's
normalisation; unknown words share one id), embeddings, a bidirectional GRU, the mean of its
outputs over the words, a linear map, unit length. s is a learned inverse temperature. Trained
with the symmetric InfoNCE loss (CLIP's) on a dataset's training captions
(captionkit.training.matcher); the bank is the embeddings of training photos, kept in the
checkpoint beside the weights so a photo alone can be scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..core.checkpoint import INT8_SCALE, load_into, read_config, read_weights, resolve
from ..core.errors import CheckpointError
from ..core.fields import check_fields, field_error, spec
from ..data.items import normalize

KIND = "matcher"  # config.json's "kind": what tells a matcher's checkpoint from a captioner's
PAD, UNK = 0, 1  # word ids: padding and any word the matcher did not learn
SPECIAL = ["<pad>", "<unk>"]


@dataclass
class MatcherConfig:
    """Sizes of the matcher.

    words: its vocabulary, ``<pad>`` and ``<unk>`` first (training builds it from the captions).
    feat_dim: D of the encoder rows it reads; encoder: that encoder's cache key (a matcher reads
        one encoder's rows only: ``--rerank match`` refuses a captioner with another encoder).
    embed_dim: E, the joint space (even: the GRU has E/2 units each way).
    word_dim: the word embeddings' size. dropout: on the pooled rows and on the word embeddings
        (training only). max_words: longer captions are cut to their first max_words words.
    bank_size: how many training photos' embeddings the checkpoint keeps as the bank."""

    words: list[str] = field(default_factory=lambda: list(SPECIAL))
    feat_dim: int = spec(1280, ge=1)
    encoder: str = ""
    embed_dim: int = spec(512, ge=2)
    word_dim: int = spec(300, ge=1)
    dropout: float = spec(0.2, ge=0, lt=1)
    max_words: int = spec(24, ge=1)
    bank_size: int = spec(1000, ge=1)

    def __post_init__(self):
        check_fields(self)
        if self.embed_dim % 2:
            raise field_error(self, "embed_dim", f"must be even (E/2 GRU units each way), got {self.embed_dim}")
        if self.words[:2] != SPECIAL:
            raise field_error(self, "words", f"must start with {SPECIAL}, got {self.words[:2]}")


class Matcher(nn.Module):
    def __init__(self, cfg: MatcherConfig):
        super().__init__()
        self.cfg = cfg
        D, E, W = cfg.feat_dim, cfg.embed_dim, cfg.word_dim
        self.img_norm = nn.LayerNorm(D)
        self.img_proj = nn.Linear(D, E)
        self.embed = nn.Embedding(len(cfg.words), W, padding_idx=PAD)
        self.gru = nn.GRU(W, E // 2, batch_first=True, bidirectional=True)
        self.txt_proj = nn.Linear(E, E)
        self.drop = nn.Dropout(cfg.dropout)
        self.log_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))  # CLIP's starting temperature
        self.register_buffer("bank", torch.zeros(cfg.bank_size, E))  # (K, E): training photos, unit length
        self._ids = {w: i for i, w in enumerate(cfg.words)}

    @property
    def scale(self) -> torch.Tensor:
        return self.log_scale.exp().clamp(max=100.0)  # as CLIP, so the logits cannot run away

    def pooled_image(self, pooled: torch.Tensor) -> torch.Tensor:
        """Mean-pooled rows (B, D) -> (B, E), unit length."""
        return F.normalize(self.img_proj(self.drop(self.img_norm(pooled.float()))), dim=-1)

    def image(self, feats: torch.Tensor) -> torch.Tensor:
        """The encoder's rows (B, L, D) -> (B, E), unit length."""
        return self.pooled_image(feats.float().mean(1))

    def word_ids(self, caption: str) -> list[int]:
        """A caption as text -> its word ids, at most max_words (an empty caption is one <unk>)."""
        return [self._ids.get(w, UNK) for w in normalize(caption)][:self.cfg.max_words] or [UNK]

    def ids(self, captions: list[str]) -> torch.Tensor:
        """Captions as text -> (N, T) word ids, padded with 0."""
        return pad_ids([self.word_ids(c) for c in captions])

    def text_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """(N, T) word ids, 0-padded -> (N, E), unit length."""
        ids = ids.to(self.embed.weight.device)
        lengths = (ids != PAD).sum(1).clamp(min=1)  # (N,)
        x = self.drop(self.embed(ids))  # (N, T, W)
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        h, _ = nn.utils.rnn.pad_packed_sequence(self.gru(packed)[0], batch_first=True, total_length=ids.shape[1])
        mask = (ids != PAD).unsqueeze(-1).to(h.dtype)  # (N, T, 1)
        return F.normalize(self.txt_proj((h * mask).sum(1) / lengths.unsqueeze(-1)), dim=-1)  # (N, E)

    def text_on_device(self, ids: torch.Tensor) -> torch.Tensor:
        """:meth:`text_ids` without packing, for ids already on the matcher's device (self-critical
        training's term): torch's packed RNN takes its lengths on the host and reads its order back
        (a host sync), this reads nothing. The GRU runs twice on padded rows: with the words
        first (its forward half is exact at the words: it has seen none of the padding yet) and
        with them last (its backward half is exact there), each half taken from its run. Equal
        to text_ids up to float rounding (tests/test_scst_match.py); no dropout (eval only)."""
        H, T = self.cfg.embed_dim // 2, ids.shape[1]
        mask = ids != PAD  # (N, T)
        shift = (T - mask.sum(1).clamp(min=1)).unsqueeze(1)  # (N, 1): padding in front of the words-last rows
        pos = torch.arange(T, device=ids.device).unsqueeze(0)  # (1, T)
        words_last = torch.where(pos >= shift, ids.gather(1, (pos - shift).clamp(min=0)), PAD)  # (N, T)
        forward = self.gru(self.embed(ids))[0][..., :H]  # (N, T, H)
        backward = self.gru(self.embed(words_last))[0][..., H:]  # (N, T, H), words at t + shift
        backward = backward.gather(1, (pos + shift).clamp(max=T - 1).unsqueeze(-1).expand(-1, -1, H))
        h = torch.cat([forward, backward], -1) * mask.unsqueeze(-1)  # (N, T, E), 0 at the padding
        count = mask.sum(1, keepdim=True).clamp(min=1).to(h.dtype)  # (N, 1)
        return F.normalize(self.txt_proj(h.sum(1) / count), dim=-1)  # (N, E)

    def text(self, captions: list[str]) -> torch.Tensor:
        """Captions as text -> (N, E), unit length."""
        return self.text_ids(self.ids(captions))

    def contrastive_loss(self, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
        """Symmetric InfoNCE of (B, E) image and caption embeddings, pair i matching pair i."""
        return info_nce(self.scale, images, texts)

    def check_bank(self) -> None:
        """Refuse a matcher whose bank was never filled (a read of the bank: once, not per call
        in a loop that must not read back from its device)."""
        if not bool(self.bank.any()):
            raise RuntimeError("this matcher's bank of photos is empty (it was never trained)")

    def discriminability(self, images: torch.Tensor, texts: torch.Tensor, checked: bool = False) -> torch.Tensor:
        """disc (module docstring) of caption n for its photo n: images, texts (N, E) -> (N,).
        ``checked``: :meth:`check_bank` was called already (no read of the bank here)."""
        if not checked:
            self.check_bank()
        return contrast(self.scale, images, texts, self.bank)

    def list_discriminability(self, images: torch.Tensor, captions: list[list[str]]) -> list[list[float]]:
        """disc of each photo's captions (an n-best list each, as text) for that photo: images
        (B, E) from :meth:`image`, ``captions`` B lists -> B lists of floats, in one pass."""
        owner = torch.tensor([b for b, caps in enumerate(captions) for _ in caps], dtype=torch.long)
        values = self.discriminability(images[owner], self.text([c for caps in captions for c in caps]))  # (sum n,)
        return [part.tolist() for part in values.split([len(caps) for caps in captions])]


def info_nce(scale: torch.Tensor, images: torch.Tensor, texts: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE (CLIP's loss) of (B, E) unit image and caption embeddings at inverse
    temperature ``scale``, pair i matching pair i."""
    logits = scale * texts @ images.t()  # (B, B)
    target = torch.arange(len(logits), device=logits.device)
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.t(), target)) / 2


def contrast(scale: torch.Tensor, images: torch.Tensor, texts: torch.Tensor, bank: torch.Tensor) -> torch.Tensor:
    """disc (module docstring) of caption n for photo n: (N, E) unit embeddings, at inverse
    temperature ``scale``, against the (K, E) ``bank`` of other photos -> (N,)."""
    own = scale * (images * texts).sum(-1)  # (N,)
    others = torch.logsumexp(scale * texts @ bank.t(), dim=1) - math.log(len(bank))  # (N,)
    return own - others


def pad_ids(seqs: list[list[int]]) -> torch.Tensor:
    """Word id lists -> (N, T) ids, padded with PAD to the longest."""
    out = torch.full((len(seqs), max(map(len, seqs), default=1)), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = torch.tensor(s)
    return out


def check_matcher_folder(folder: str | Path) -> MatcherConfig:
    """A matcher checkpoint's sizes, from its config alone (cheap: before any work that needs
    it); one line naming the folder when it is not a matcher checkpoint."""
    folder = resolve(folder)
    config = read_config(folder)
    if config.get("kind") != KIND or not isinstance(config.get("matcher"), dict):
        raise CheckpointError(f"{folder}: not a matcher checkpoint (captionkit matcher writes one)")
    return MatcherConfig(**config["matcher"])


def load_matcher(folder: str | Path) -> Matcher:
    """A matcher checkpoint (``captionkit matcher``) in eval mode; one line naming the folder
    when it is something else or its weights do not fit. Draws nothing from torch's global
    generator (a training run that loads one samples what it would without it)."""
    folder = resolve(folder)
    cfg = check_matcher_folder(folder)
    with torch.random.fork_rng(devices=[]):  # (the weights' random start is replaced: the caller's draws stay theirs)
        m = Matcher(cfg)
    load_into(m, read_weights(folder), folder)
    return m.eval()


def matcher_of_words(folder: str | Path, words: set[str]) -> tuple[dict[str, torch.Tensor], dict]:
    """The matcher checkpoint ``folder`` narrowed to the words of ``words`` it knows (and its
    specials): (its weights, its config) as save_checkpoint takes them. Every caption written in
    those words gets the scores it got before (a word outside the matcher was <unk>, and is),
    from a smaller embedding table: an ensemble folder keeps its matcher so (its captions are in
    its members' words). int8 matrices (``captionkit pack --int8``) stay int8, bit for bit."""
    folder = resolve(folder)
    cfg = check_matcher_folder(folder)
    doc = read_config(folder)
    keep = [i for i, w in enumerate(cfg.words) if i < len(SPECIAL) or w in words]
    weights = read_weights(folder, as_stored=True)  # (verified; an int8 matrix stays int8, with its scales)
    for k in ("embed.weight", "embed.weight" + INT8_SCALE):
        if k in weights:
            weights[k] = weights[k][keep]  # (V', W) rows, or their (V', 1) scales
    return weights, {**doc, "matcher": {**doc["matcher"], "words": [cfg.words[i] for i in keep]}}
