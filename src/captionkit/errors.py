"""Errors a user can act on; each message names the file or field. Kept free of heavy imports
so that light commands (``captionkit score``) never load torch."""


class ImageError(ValueError):
    """A file that cannot be used as a photo; the message names the file."""


class DatasetError(ValueError):
    """A dataset that cannot be read; the message names the file (and line)."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the folder."""


class WeightsUnavailable(RuntimeError):
    """Pretrained weights were asked for but are not on this machine."""


class OutputError(ValueError):
    """A place to write that is refused (it exists, is a folder captionkit did not write, ...);
    the message names the path. See captionkit.outputs."""


class ConfigError(ValueError):
    """A run config that cannot be used; one line naming the file and the field (see
    captionkit.config)."""
