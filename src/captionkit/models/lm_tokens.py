"""captionkit token ids <-> a pretrained language model's own, for the families whose decoder is
a pretrained LM with its tokenizer (``prefix_lm``, ``vit_gpt2``).

The ``lm`` tokenizer kind (:mod:`captionkit.data.tokenizers`) numbers the LM's tokens from 4, so
that captionkit's special ids (:class:`~captionkit.data.vocab.Vocab`: <pad>, <start>, <end>, <unk>)
keep their meaning; <start> is embedded as the LM's BOS token (EOS if it has none) and <end>
is the LM's EOS.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..core.errors import UserError
from ..data.vocab import SPECIALS, Vocab
from .base import token_cross_entropy

N_SPECIAL = len(SPECIALS)  # captionkit's specials come before the LM's ids
IGNORE = -100  # a target the cross-entropy skips


def special_ids(tok) -> tuple[int, int]:
    """(the LM id <start> is embedded as, the LM id that is <end>)."""
    if tok.eos_token_id is None:
        raise UserError(f"the LM tokenizer {tok.name_or_path!r} has no end-of-sequence token")
    bos = tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
    return int(bos), int(tok.eos_token_id)


class LMTokens:
    """The id mapping, the teacher-forced ``forward`` and the training loss over the LM's
    vocabulary. ``bind_tokenizer`` sets what the mapping needs (bos_id, eos_id, n_lm); the
    family provides ``lm_logits(feats, inputs, image_index)`` and ``default_lm``. List it
    before :class:`~captionkit.models.base.CaptionModel` among the bases."""

    default_lm: ClassVar[str]  # the family's LM when its config names none

    @classmethod
    def tokenizer_source(cls, model_cfg: dict) -> str | None:
        """The ``lm`` tokenizer is the LM's own."""
        return model_cfg.get("lm", cls.default_lm)

    def bind_tokenizer(self, tok, lm: nn.Module, source: str) -> None:
        self.bos_id, self.eos_id = special_ids(tok)
        self.n_lm = len(tok)  # logits beyond the tokenizer (padded embedding rows) are never used
        if self.n_lm > lm.get_output_embeddings().out_features:
            raise UserError(f"{source!r}: the tokenizer has more tokens ({self.n_lm}) than the LM's output layer")

    def lm_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """captionkit ids -> LM ids: words shift down by 4, <start> is BOS, <end> EOS; <pad> and
        <unk> (which an LM tokenizer never produces) become EOS: they only ever pad, after the
        caption, where the causal mask keeps them from the real positions."""
        special = torch.full((N_SPECIAL,), self.eos_id, device=ids.device)
        special[Vocab.start] = self.bos_id
        return torch.where(ids >= N_SPECIAL, ids - N_SPECIAL, special[ids.clamp(max=N_SPECIAL - 1)])

    def to_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """LM logits (..., >= n_lm) -> log-probabilities over captionkit ids (..., n_lm + 4): <end>
        takes EOS's probability; <pad>, <start>, <unk> and EOS's own slot get none."""
        logp = F.log_softmax(logits[..., :self.n_lm].float(), dim=-1)  # (..., n_lm)
        never = torch.full((*logp.shape[:-1], 1), float("-inf"), device=logp.device)
        specials = [never] * N_SPECIAL
        specials[Vocab.end] = logp[..., self.eos_id:self.eos_id + 1]
        words = logp.clone()
        words[..., self.eos_id] = float("-inf")
        return torch.cat([*specials, words], -1)  # (..., n_lm + 4)

    def lm_targets(self, targets: torch.Tensor) -> torch.Tensor:
        """captionkit targets -> LM class ids for the cross-entropy; <pad>/<unk> -> IGNORE."""
        lm = torch.where(targets >= N_SPECIAL, targets - N_SPECIAL, torch.full_like(targets, IGNORE))
        return torch.where(targets == Vocab.end, torch.full_like(targets, self.eos_id), lm)

    def forward(self, feats: torch.Tensor, inputs: torch.Tensor, image_index: torch.Tensor | None = None):
        """The families' teacher-forced contract (self-critical rescoring uses it): -> log-probs
        over captionkit ids (B, T, V) and no attention (None). See the family's ``lm_logits``."""
        return self.to_vocab(self.lm_logits(feats, inputs, image_index)), None

    def training_loss(self, feats: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor, *,
                      alpha_c: float = 0.0, label_smoothing: float = 0.0,
                      image_index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean token cross-entropy over the LM's vocabulary (<end> is its EOS; <pad> targets
        ignored) -> (loss, plain cross-entropy). ``alpha_c`` does not apply here."""
        logits = self.lm_logits(feats, inputs, image_index)[..., :self.n_lm]
        return token_cross_entropy(logits, self.lm_targets(targets), ignore_index=IGNORE,
                                   label_smoothing=label_smoothing)
