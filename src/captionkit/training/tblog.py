"""TensorBoard event files of a training run (``captionkit train --tensorboard DIR``).

Each epoch's history entry becomes scalars at the optimizer step it ended on: ``loss/train``
and ``loss/dev`` (the teacher-forced dev loss) side by side, the dev scores x100 under ``dev/``,
and the other training figures (learning rate, self-critical rewards, seconds, captions) under
``train/``. Needs the ``tensorboard`` package (``pip install 'captionkit[tensorboard]'``);
torch writes the files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ..core.errors import UserError
from ..scoring.evaluation import METRICS

_TAGS = {"loss": "loss/train", "val_loss": "loss/dev"}
_NOT_SCALARS = ("epoch", "step")


def scalar_tags(entry: dict) -> dict[str, float]:
    """A history entry -> {TensorBoard tag: value}; scores x100, as captionkit prints them."""
    out = {}
    for k, v in entry.items():
        if k in _NOT_SCALARS or not isinstance(v, (int, float)):
            continue
        if k in METRICS:
            out[f"dev/{k}"] = 100 * v
        else:
            out[_TAGS.get(k, f"train/{k}")] = v
    return out


class TensorBoardLog:
    """Called with each epoch's history entry (a Trainer ``on_epoch`` hook). The event file is
    opened at the first entry, so a run that fails before training leaves no empty one."""

    def __init__(self, folder: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise UserError("--tensorboard / train.tensorboard needs the tensorboard package: "
                             "pip install 'captionkit[tensorboard]'") from None
        self.folder = Path(folder)
        self._writer_cls = SummaryWriter
        self.writer = None

    def __call__(self, entry: dict) -> None:
        if self.writer is None:
            self.writer = self._writer_cls(log_dir=str(self.folder))
        for tag, value in scalar_tags(entry).items():
            self.writer.add_scalar(tag, value, global_step=int(entry["step"]))
        self.writer.flush()  # TensorBoard shows each epoch as soon as it ends

    def chain(self, then: Callable[[dict], None] | None) -> Callable[[dict], None]:
        """A hook that logs the entry, then calls ``then`` (another hook) if given."""
        if then is None:
            return self

        def both(entry: dict) -> None:
            self(entry)
            then(entry)
        return both

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
