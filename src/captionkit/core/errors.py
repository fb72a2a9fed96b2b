"""Errors a user can act on; each message names the file or field. Kept free of heavy imports
so that light commands (``captionkit score``) never load torch.

The command line prints a :class:`UserError` (and :class:`WeightsUnavailable`) as one line;
anything else is an internal error and shows its traceback. Raise a :class:`UserError` (or one
of its kinds) for what the user gave -- a file, a field, an option -- and a plain ``ValueError``
or ``RuntimeError`` for a state the code itself should never reach."""


class UserError(ValueError):
    """A mistake the user can fix (a file, a field, an option); the message names it. A
    ``ValueError`` so that library callers catching ``ValueError`` keep working."""


class TrainingDiverged(UserError, FloatingPointError):
    """A training loss that stopped being finite: too high a learning rate, or fp16 overflowing,
    not a bug to trace. A ``FloatingPointError`` too, for callers that catch that."""


class ImageError(UserError):
    """A file that cannot be used as a photo; the message names the file."""


class DatasetError(UserError):
    """A dataset that cannot be read; the message names the file (and line)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be used; the message names the folder."""


class WeightsUnavailable(RuntimeError):
    """Pretrained weights were asked for but are not on this machine."""


class OutputError(UserError):
    """A place to write that is refused (it exists, is a folder captionkit did not write, ...);
    the message names the path. See captionkit.core.outputs."""


class ConfigError(UserError):
    """A run config that cannot be used; one line naming the file and the field (see
    captionkit.training.config)."""
