"""Where the pool may fetch from: public addresses only, checked after DNS resolution.

The fetcher never lets its HTTP library resolve a name: :class:`GuardedNetwork` resolves
it here, refuses the whole name if any answer is not public, and connects to an address
it checked. A name that resolves to a public address for the check and to 127.0.0.1 for
the connection (DNS rebinding, vLLM's CVE-2025-6242 class) therefore cannot reach
loopback. TLS still verifies the certificate against the name, not the address.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

import httpcore
import trio

from pool.media._refusal import refused

Resolver = Callable[[str, int], Awaitable[Sequence[str]]]
"""``(host, port) -> addresses`` (text): how names are resolved; tests inject their own."""

_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
# IANA special-purpose blocks that this Python's ``is_global`` may still call global.
_SPECIAL = (ipaddress.IPv4Network("192.0.0.0/24"), ipaddress.IPv6Network("2001::/23"))


async def system_resolver(host: str, port: int) -> list[str]:
    """The system resolver (``getaddrinfo`` in a worker thread, as trio runs it)."""
    infos = await trio.socket.getaddrinfo(host, port, type=trio.socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def public_address(address: str) -> bool:
    """True for a globally routable unicast address; False for private, loopback,
    link-local, multicast, reserved, unspecified and shared (CGNAT) ones.

    IPv6 forms that carry an IPv4 address (mapped, 6to4, NAT64) are judged by it; Teredo
    is refused outright.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.teredo is not None:
            return False
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            ip = embedded
    return ip.is_global and not (
        any(ip in block for block in _SPECIAL)
        or ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def _literal(host: str) -> str | None:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return None


class GuardedNetwork(httpcore.AsyncNetworkBackend):
    """An httpcore network backend that connects to public addresses only.

    Args:
        resolver: turns a name into addresses.
        inner: the backend that opens connections to checked addresses.
    """

    def __init__(self, resolver: Resolver, inner: httpcore.AsyncNetworkBackend) -> None:
        self._resolver = resolver
        self._inner = inner

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        literal = _literal(host)
        if literal is not None:
            addresses: Sequence[str] = [literal]
        else:
            try:
                addresses = await self._resolver(host, port)
            except OSError as exc:
                raise refused("fetch_failed", f"cannot resolve {host!r}: {exc}") from None
        if not addresses:
            raise refused("fetch_failed", f"{host!r} resolves to no address")
        blocked = [a for a in addresses if not public_address(a)]
        if blocked:
            raise refused(
                "address_not_allowed",
                f"{host!r} resolves to {blocked[0]}, which is not a public address",
            )
        error: httpcore.ConnectError | None = None
        for address in addresses:
            try:
                return await self._inner.connect_tcp(
                    address,
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except httpcore.ConnectError as exc:
                error = exc
        assert error is not None
        raise error

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 - httpcore's interface
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise refused("address_not_allowed", "images are never fetched over a unix socket")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)
