"""Loading through Hugging Face ``transformers``, an optional dependency: importing it with a
one-line error naming the extra that installs it, loading from a folder or the local cache
before the hub, and refusing checkpoints that lack tensors (transformers would fill them with
random numbers)."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

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


def folder_or_hub_name(source: str, what: str) -> str:
    """``source`` as ``from_pretrained`` takes it: an existing folder, or else a hub name. A path
    that names no folder is an error here, not a failed download later."""
    path = Path(source).expanduser()
    if path.is_dir():
        return str(path)
    if path.is_absolute() or source.startswith((".", "~")) or path.exists():
        raise WeightsUnavailable(f"{what} {source!r}: no such folder")
    return source


def load_pretrained(loader, source: str, what: str,
                    resolve: Callable[[str, str], str] = folder_or_hub_name, **kwargs):
    """``loader.from_pretrained`` from the local folder or the local Hugging Face cache first,
    then the hub; never returns random weights. ``what`` names the model in errors; ``resolve``
    turns ``source`` into what ``from_pretrained`` takes (a family's built-in names, say)."""
    where = resolve(source, what)
    try:
        return loader.from_pretrained(where, local_files_only=True, **kwargs)
    except (OSError, ValueError) as local_error:  # a folder without (usable) files gives either
        if Path(where).is_dir():
            raise WeightsUnavailable(f"{what} {source!r}: {where} holds no loadable "
                                     f"model ({str(local_error).splitlines()[0]})") from None
    host = _hub_host()
    try:  # a host that does not resolve fails here at once, not after the hub client's retries
        socket.getaddrinfo(host, 443)
        return loader.from_pretrained(where, **kwargs)
    except Exception:
        raise WeightsUnavailable(f"{what} {source!r} is neither a folder nor in the local Hugging Face "
                                 f"cache, and could not be downloaded from {host}") from None


def _hub_host() -> str:
    from urllib.parse import urlparse

    from huggingface_hub import constants
    return urlparse(constants.ENDPOINT).hostname or constants.ENDPOINT
