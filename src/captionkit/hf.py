"""Loading through Hugging Face ``transformers``, an optional dependency: importing it with a
one-line error naming the extra that installs it, and refusing checkpoints that lack tensors
(transformers would fill them with random numbers)."""

from __future__ import annotations

from collections.abc import Callable

from .errors import WeightsUnavailable


def require_transformers(needed_by: str, extra: str, quiet: bool = True):
    """The ``transformers`` module, or WeightsUnavailable saying who needs it and how to install
    it. ``quiet``: loading is one line of captionkit's, not transformers' warnings and progress bars."""
    try:
        import transformers
    except ImportError:
        raise WeightsUnavailable(f"{needed_by} needs the 'transformers' package "
                                 f"(pip install 'captionkit[{extra}]')") from None
    if quiet:
        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
    return transformers


def refuse_missing(info: dict, source: str, what: str, allowed: Callable[[str], bool] = lambda name: False) -> None:
    """Refuse a checkpoint whose loading info lists missing tensors, other than those ``allowed``
    (layers the caller adds and trains)."""
    missing = sorted(k for k in info.get("missing_keys", []) if not allowed(k))
    if missing:
        raise WeightsUnavailable(f"{what} {source!r}: its checkpoint lacks {len(missing)} tensors (e.g. {missing[0]})")
