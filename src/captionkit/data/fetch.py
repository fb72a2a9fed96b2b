"""Downloading a photo from an http(s) URL, with a size limit and a timeout.

The one place captionkit reads the network for images: the Python API's ``cap(url)`` and
``captionkit caption URL``. Only ``http://`` and ``https://`` are read (a redirect to any other
scheme is refused too); a download larger than the size limit, or one not finished within the
timeout, is stopped and refused. Every failure is one :class:`ImageError` naming the URL, so a
caller can report it in the image's place and go on with the others.

Limits: :data:`MAX_BYTES` (20 MiB) and :data:`TIMEOUT` (30 s), or the environment's
``CAPTIONKIT_URL_MAX_BYTES`` and ``CAPTIONKIT_URL_TIMEOUT``, or the arguments of
:func:`fetch_url`. The timeout bounds the whole download, not only each wait for the server:
a server that trickles its answer byte by byte is stopped as well.
"""

from __future__ import annotations

import os
import re
import socket
import time
import urllib.error
import urllib.request

from ..core.errors import ImageError
from ..core.version import __version__

MAX_BYTES = 20 * 2 ** 20
TIMEOUT = 30.0
MAX_BYTES_ENV, TIMEOUT_ENV = "CAPTIONKIT_URL_MAX_BYTES", "CAPTIONKIT_URL_TIMEOUT"
SCHEMES = ("http", "https")
CHUNK = 1 << 16

_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*)://", re.I)


def url_scheme(text: str) -> str | None:
    """The scheme of ``text`` when it is written as a URL (``xyz://...``), lower case; else None
    (a path; ``C:\\photos`` is a path)."""
    m = _SCHEME.match(text)
    return m[1].lower() if m else None


def is_url(text: str) -> bool:
    """Whether ``text`` is an http(s) URL captionkit downloads."""
    return url_scheme(text) in SCHEMES


def check_url(text: str) -> None:
    """A URL of a scheme captionkit does not read (ftp://, file://, s3://): one line."""
    scheme = url_scheme(text)
    if scheme is not None and scheme not in SCHEMES:
        raise ImageError(f"{text}: only http:// and https:// URLs are downloaded, not {scheme}://")


def _env_number(name: str, default: float, cast) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = cast(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise ImageError(f"{name}={raw!r}: give a positive number")
    return value


def url_limits(max_bytes: int | None = None, timeout: float | None = None) -> tuple[int, float]:
    """(size limit in bytes, timeout in seconds): the arguments, else the environment's, else
    the defaults."""
    if max_bytes is None:
        max_bytes = int(_env_number(MAX_BYTES_ENV, MAX_BYTES, int))
    if timeout is None:
        timeout = float(_env_number(TIMEOUT_ENV, TIMEOUT, float))
    return max_bytes, timeout


def _size(n: int) -> str:
    return f"{n / 2 ** 20:g} MiB" if n >= 2 ** 20 else f"{n:,} bytes"


class _HttpOnlyRedirects(urllib.request.HTTPRedirectHandler):
    """Follows redirects as urllib does, but only to http(s) (urllib would follow one to ftp)."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if url_scheme(newurl) not in SCHEMES:
            raise ImageError(f"{req.full_url}: redirected to {newurl}, which is not an http(s) URL")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


_OPENER = urllib.request.build_opener(_HttpOnlyRedirects)


def fetch_url(url: str, max_bytes: int | None = None, timeout: float | None = None) -> bytes:
    """The body of ``url`` (http or https), or an ImageError naming the URL: an HTTP error
    status, a host that cannot be reached, a body over ``max_bytes``, a download not finished
    within ``timeout`` seconds. Defaults: see :func:`url_limits`."""
    check_url(url)
    if not is_url(url):
        raise ImageError(f"{url}: not an http:// or https:// URL")
    max_bytes, timeout = url_limits(max_bytes, timeout)
    deadline = time.monotonic() + timeout
    late = ImageError(f"{url}: no complete answer within {timeout:g} s (the timeout, {TIMEOUT_ENV})")
    request = urllib.request.Request(url, headers={"User-Agent": f"captionkit/{__version__}"})
    try:
        with _OPENER.open(request, timeout=timeout) as answer:
            length = answer.headers.get("Content-Length")
            if length and length.isdigit() and int(length) > max_bytes:
                raise ImageError(f"{url}: {_size(int(length))} is over the {_size(max_bytes)} limit ({MAX_BYTES_ENV})")
            body = bytearray()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise late
                # each wait for the next bytes is bounded by what is left of the whole timeout
                sock = getattr(getattr(getattr(answer, "fp", None), "raw", None), "_sock", None)
                if sock is not None:
                    sock.settimeout(left)
                chunk = answer.read1(CHUNK) if hasattr(answer, "read1") else answer.read(CHUNK)
                if not chunk:
                    break
                body += chunk
                if len(body) > max_bytes:
                    raise ImageError(f"{url}: over the {_size(max_bytes)} limit ({MAX_BYTES_ENV})")
            return bytes(body)
    except ImageError:
        raise
    except urllib.error.HTTPError as e:
        raise ImageError(f"{url}: HTTP {e.code} {e.reason}") from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, (socket.timeout, TimeoutError)):
            raise late from None
        raise ImageError(f"{url}: cannot download ({e.reason})") from None
    except (socket.timeout, TimeoutError):
        raise late from None
    except (OSError, ValueError) as e:  # a connection reset, a malformed URL or answer
        raise ImageError(f"{url}: cannot download ({e})") from None
