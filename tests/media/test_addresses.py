"""Only public addresses are fetched from, whatever a name resolves to."""

from __future__ import annotations

import httpcore
import pytest

from pool.errors import PoolError
from pool.media import GuardedNetwork, public_address

from .helpers import LoopbackInternet, resolver_of


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1", "127.8.9.10", "::1", "0.0.0.0", "::",
        "10.1.2.3", "172.16.0.1", "192.168.1.1", "fd00::1", "fc00::1",
        "169.254.169.254", "fe80::1", "fe80::1%eth0",
        "224.0.0.1", "239.255.255.250", "ff02::1",
        "240.0.0.1", "255.255.255.255", "100.64.0.1", "192.0.0.8", "198.18.0.1",
        "192.0.2.1", "2001:db8::1",
        "::ffff:127.0.0.1", "::ffff:10.0.0.1", "64:ff9b::7f00:1", "2002:7f00:1::1",
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",
        "not an address", "",
    ],
)  # fmt: skip
def test_non_public_addresses_are_refused(address: str) -> None:
    assert not public_address(address)


@pytest.mark.parametrize(
    "address", ["93.184.215.14", "8.8.8.8", "2606:4700:4700::1111", "::ffff:8.8.8.8"]
)
def test_public_addresses_pass(address: str) -> None:
    assert public_address(address)


async def _refusal(network: GuardedNetwork, host: str) -> PoolError:
    with pytest.raises(PoolError) as info:
        await network.connect_tcp(host, 80)
    return info.value


async def test_the_check_runs_on_resolved_addresses() -> None:
    internet = LoopbackInternet({})
    network = GuardedNetwork(
        resolver_of(
            {
                "intranet.example": ["10.0.0.7"],
                "metadata.example": ["169.254.169.254"],
                "mixed.example": ["93.184.215.14", "127.0.0.1"],
                "nowhere.example": [],
            }
        ),
        internet,
    )
    for host in ("intranet.example", "metadata.example", "mixed.example", "127.0.0.1", "[::1]"):
        error = await _refusal(network, host)
        assert error.details["reason"] == "address_not_allowed", host
    assert (await _refusal(network, "unknown.example")).details["reason"] == "fetch_failed"
    assert (await _refusal(network, "nowhere.example")).details["reason"] == "fetch_failed"
    assert internet.dialled == []  # nothing was ever dialled


async def test_a_public_name_is_dialled_by_its_checked_address() -> None:
    internet = LoopbackInternet({})
    network = GuardedNetwork(resolver_of({"cdn.example": ["93.184.215.14"]}), internet)
    with pytest.raises(httpcore.ConnectError):
        await network.connect_tcp("cdn.example", 443)
    assert internet.dialled == [("93.184.215.14", 443)]
