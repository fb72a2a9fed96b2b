"""The listening socket, checked before anything heavy is imported or loaded (no torch here)."""

from __future__ import annotations

import ipaddress
import socket


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any model loads so that a bad --host or --port fails
    at once; raises OSError (socket.gaierror for a host that does not resolve)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def exposure_warning(sock: socket.socket, api_key: str | None) -> str | None:
    """A warning when the server would answer other machines and anyone could use it."""
    if api_key is not None:
        return None
    address = sock.getsockname()[0]
    if ipaddress.ip_address(address.split("%")[0]).is_loopback:
        return None
    where = "all interfaces" if ipaddress.ip_address(address).is_unspecified else address
    return (f"warning: listening on {where} without an API key: anyone who can reach this machine can "
            "use the server (set CAPTIONKIT_API_KEY or --api-key, or listen on 127.0.0.1)")
