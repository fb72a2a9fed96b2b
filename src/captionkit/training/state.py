"""What a training run has done: :class:`TrainState` (with the current epoch's
:class:`EpochProgress`), saved as JSON under "state" in every checkpoint's config.json and read
back on resume (see :mod:`captionkit.training.trainer`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from ..core.checkpoint import CheckpointError


@dataclass
class EpochProgress:
    """The current epoch's figures so far, saved with the state so that an epoch resumed from
    a checkpoint reports its whole time, count and mean figures."""

    seconds: float = 0.0
    seen: int = 0
    batches: int = 0
    sums: dict[str, float] = field(default_factory=dict)


@dataclass
class TrainState:
    """Where a run stands; saved as JSON under "state" in every checkpoint's config.json.

    lr: the base learning rate after the plateau schedule's decays (the warm-up and cosine
    factors are functions of ``step`` and ``epoch``, see
    :func:`captionkit.training.schedule.lr_factor`); every group's rate is this times its own
    scale. best_score is on the scorers' scale (CIDEr 0..10)."""

    lr: float
    epoch: int = 0
    step: int = 0
    batch_in_epoch: int = 0
    best_score: float | None = None
    best_epoch: int = 0
    bad_epochs: int = 0
    lr_bad_epochs: int = 0
    history: list[dict] = field(default_factory=list)
    epoch_progress: EpochProgress | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict, where: str | Path) -> TrainState:
        """A checkpoint's "state" (runs written before this class hold the same keys; a key
        they lack takes its default)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown or "lr" not in d:
            raise CheckpointError(f"{where}: not a training state ({'unknown key ' + unknown[0] if unknown else 'no lr'})")
        progress = d.get("epoch_progress")
        return cls(**{**d, "epoch_progress": EpochProgress(**progress) if progress else None})
