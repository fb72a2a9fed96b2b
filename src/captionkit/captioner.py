"""A trained captioner: encoder + decoder + vocabulary, loaded from a checkpoint folder.

It uses the decoder only through the model contract (:mod:`captionkit.models.base`), so it
captions with any registered family."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from .checkpoint import CheckpointError, load_into, read_config, read_weights, split_weights
from .decoding import Caption, decode
from .encoders import Encoder, create_encoder, load_finetuned
from .images import ImageError, load_rgb, to_tensor
from .models import CaptionModel, create_model
from .models.base import view_attention
from .tokenizers import Tokenizer, load_tokenizer

SHIPPED = Path(__file__).parent / "pretrained"
# the best Flickr8k model we have (README, "The shipped model"); the Show, Attend and Tell LSTM
# that was the default before it ships too, as --model sat-lite2-flickr8k
DEFAULT_MODEL = SHIPPED / "transformer-lite2-flickr8k"


def model_folder(path: str | Path | None) -> Path:
    """A checkpoint folder from what a user typed: a path, the name of a shipped model, or
    nothing (the default model). A folder of that name in the working directory wins."""
    if path is None:
        return DEFAULT_MODEL
    path = Path(path)
    if not path.exists() and len(path.parts) == 1 and (SHIPPED / path).is_dir():
        return SHIPPED / path
    return path


@dataclass
class Result:
    words: list[str]
    attention: torch.Tensor  # (len(words), L)
    grid: tuple[int, int]

    @property
    def text(self) -> str:
        return " ".join(self.words)


class Captioner:
    def __init__(self, decoder: CaptionModel, vocab: Tokenizer, config: dict, encoder: Encoder | None = None):
        self.decoder = decoder.eval()
        self.vocab = vocab
        self.config = config
        self.encoder = encoder
        self.grid = tuple(config["encoder"]["grid"])
        decoding = config.get("decoding", {})
        self.max_len = int(decoding.get("max_len", 20))
        # the length normalisation the model was tuned with on its dev split (0: none)
        self.length_penalty = float(decoding.get("length_penalty", 0.0))

    @classmethod
    def load(cls, path: str | Path | None = None, with_encoder: bool = True,
             encoder_weights: str | None = None) -> "Captioner":
        """Load a checkpoint folder, or a shipped model by name (the default one when ``path``
        is None)."""
        path = model_folder(path)
        if not path.exists():
            shipped = ", ".join(sorted(p.name for p in SHIPPED.iterdir() if p.is_dir()))
            raise CheckpointError(f"{path}: no such model folder (shipped models: {shipped})")
        cfg = read_config(path)
        try:
            family, enc_cfg, words = cfg["family"], cfg["encoder"], cfg["vocab"]
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
        encoder = None
        if with_encoder:
            encoder = create_encoder(enc_cfg["name"], weights=encoder_weights or enc_cfg.get("weights"))
            if encoder_tuned:  # the blocks fine-tuned with this decoder
                load_finetuned(encoder, encoder_tuned, str(path))
            grid = list(encoder.grid())
            if encoder.dim != decoder.cfg.feat_dim or grid != list(enc_cfg["grid"]):
                raise CheckpointError(
                    f"{path}: trained on {enc_cfg['name']} features {enc_cfg['grid']} x {decoder.cfg.feat_dim}, "
                    f"but the encoder gives {grid} x {encoder.dim}")
        return cls(decoder, vocab, cfg, encoder)

    @torch.no_grad()
    def decode_features(self, feats: torch.Tensor, beam: int = 3,
                        length_penalty: float | None = None) -> list[Caption]:
        """feats (B, L, D) -> one Caption per image (length_penalty None: the model's own)."""
        return decode(self.decoder, feats.float(), beam=beam, max_len=self.max_len,
                      length_penalty=self.length_penalty_or(length_penalty))

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
        """Preprocessed images, each (3, S, S) -> the encoder's rows (B, L, D), without autograd."""
        if self.encoder is None:
            raise RuntimeError("this Captioner was loaded without its encoder")
        return self.encoder.encode_batch(images)

    def caption_files(self, paths: list[Path], beam: int = 3, batch_size: int = 16,
                      length_penalty: float | None = None,
                      workers: int = 1) -> Iterator[tuple[Path, Result | ImageError]]:
        """Caption image files in order; a bad file yields its ImageError and the rest go on.
        ``workers`` threads decode the next batch's images while this batch is captioned."""
        if self.encoder is None:
            raise RuntimeError("this Captioner was loaded without its encoder")
        pre = self.encoder.preprocess

        def load(p: Path):
            try:
                return to_tensor(load_rgb(p), pre)
            except ImageError as e:
                return e

        batches = [paths[i:i + batch_size] for i in range(0, len(paths), batch_size)]
        with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
            # reader threads decode the next batch while this one is encoded: one batch
            # ahead, so memory stays flat however large the folder
            read = (lambda b: [pool.submit(load, p) for p in b])
            nxt = read(batches[0]) if batches else None
            for bi, batch in enumerate(batches):
                loaded = [f.result() for f in nxt]
                if bi + 1 < len(batches):
                    nxt = read(batches[bi + 1])
                good = [i for i, x in enumerate(loaded) if isinstance(x, torch.Tensor)]
                caps: dict[int, Caption] = {}
                if good:
                    feats = self.encode_batch([loaded[i] for i in good])  # (B, L, D)
                    caps = dict(zip(good, self.decode_features(feats, beam, length_penalty)))
                for i, p in enumerate(batch):
                    yield p, (self.result(caps[i]) if i in caps else loaded[i])
