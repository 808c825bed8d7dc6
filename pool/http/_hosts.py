"""Which ``Host`` and ``Origin`` values the service answers: the DNS-rebinding defence.

A web page can make a victim's browser talk to a pool on loopback by rebinding its own
DNS name to 127.0.0.1 (Ollama's CVE-2024-28224). The browser still sends the page's name
in ``Host`` (and its origin in ``Origin``), so refusing names the operator did not list
closes the hole whether or not tokens are configured.

Accepted by default: the bound address, ``localhost``, ``127.0.0.1`` and ``[::1]``, with
the bound port or with no port. A wildcard bind (``0.0.0.0``, ``::``) also accepts any IP
address literal and the machine's host name: a rebinding page can only send its own DNS
name, never an address. ``service.allowed_hosts`` adds names (``name`` with any port,
``name:port`` with that one); ``"*"`` turns the check off.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterable
from urllib.parse import urlsplit

from pool.errors import PoolError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
_WILDCARD_BINDS = ("", "0.0.0.0", "::", "[::]")
_SHOWN_CHARS = 100  # of a refused header value, in the error message


def split_authority(value: str) -> tuple[str, int | None] | None:
    """``host[:port]`` as (lower-case host, port or None); None when malformed.

    IPv6 addresses keep their brackets (``[::1]``), as they appear in ``Host``.
    """
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        host, rest = (value[: end + 1], value[end + 1 :]) if end > 0 else ("", "")
    else:
        host, colon, port = value.partition(":")
        rest = colon + port
    host = host.removesuffix(".")  # "localhost." names the same host
    if not host or (rest and not rest.startswith(":")):
        return None
    digits = rest[1:]
    if not digits:
        return host, None
    if not (digits.isascii() and digits.isdigit() and len(digits) <= 5):
        return None
    return host, int(digits)


def _bracketed(host: str) -> str:
    host = host.strip().lower()
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _is_address(host: str) -> bool:
    try:
        ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))
    except ValueError:
        return False
    return True


class HostAllowList:
    """The ``Host``/``Origin`` policy of one server.

    Args:
        allowed: ``service.allowed_hosts``.
        bound_host: the address the server binds.
        port: the bound port; 0 until :meth:`listening_on` tells it (a ``Host`` that
            names a port is refused until then).
    """

    def __init__(self, allowed: Iterable[str], *, bound_host: str, port: int) -> None:
        entries = [e.strip().lower() for e in allowed]
        self.open = "*" in entries
        self._port = port or None
        bound = _bracketed(bound_host)
        self._wildcard = bound in _WILDCARD_BINDS
        self._defaults = set(LOOPBACK_NAMES) | ({bound} if not self._wildcard else set())
        if self._wildcard:
            self._defaults.add(socket.gethostname().lower())
        self._any_port: set[str] = set()
        self._with_port: set[tuple[str, int | None]] = set()
        for entry in entries:
            split = split_authority(entry) if entry != "*" else None
            if split is None:
                continue
            host, entry_port = split
            if entry_port is None:
                self._any_port.add(host)
            else:
                self._with_port.add((host, entry_port))

    def listening_on(self, port: int) -> None:
        """The port the server bound (known only after binding when asked for port 0)."""
        self._port = port

    def allows(self, host: str, port: int | None) -> bool:
        """Whether ``host`` (lower case, IPv6 in brackets) with ``port`` is accepted."""
        if self.open:
            return True
        if host in self._defaults or (self._wildcard and _is_address(host)):
            return port is None or port == self._port
        return host in self._any_port or (host, port) in self._with_port

    def host_allowed(self, value: str) -> bool:
        """Whether a ``Host`` header passes; a request without one cannot come from a browser."""
        if self.open or not value:
            return True
        split = split_authority(value)
        return split is not None and self.allows(*split)

    def origin_allowed(self, value: str) -> bool:
        """Whether an ``Origin`` header (``scheme://host[:port]``) passes; ``null`` does not."""
        if self.open:
            return True
        try:
            parts = urlsplit(value.strip())
        except ValueError:
            return False
        if parts.scheme not in ("http", "https") or "@" in parts.netloc:
            return False
        split = split_authority(parts.netloc)
        return split is not None and self.allows(*split)

    def check(self, host: str, origin: str | None) -> None:
        """Refuse a request or WebSocket handshake whose ``Host`` or ``Origin`` is not listed.

        Args:
            host: the ``Host`` header ("" when absent).
            origin: the ``Origin`` header (None when absent: not a browser's request).

        Raises:
            PoolError: ``host_not_allowed`` or ``origin_not_allowed`` (403).
        """
        if self.open:
            return
        if not self.host_allowed(host):
            raise PoolError(
                "host_not_allowed",
                f"Host {host[:_SHOWN_CHARS]!r} is not served here; an operator may add it"
                " to service.allowed_hosts",
            )
        if origin is not None and not self.origin_allowed(origin):
            raise PoolError(
                "origin_not_allowed",
                f"requests from the web origin {origin[:_SHOWN_CHARS]!r} are refused; an"
                " operator may add its host to service.allowed_hosts",
            )
