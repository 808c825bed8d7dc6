"""The pool's side of a lease ledger shared with other GPU users (``pool.cluster``).

The VRAM gate counts other holders' leases as memory taken on each GPU, and before a
load it claims a lease for what the load will take; the ledger refuses when another
holder got there first. The ledger itself (Redis, renewals, releases) lives in
``pool.cluster``; the pool only tells it what it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class LedgerBinding:
    """What the ledger may ask the pool, set once by the pool at construction."""

    # Call when other holders' leases changed: loads that wait for room look again.
    changed: Callable[[], None]
    # What the pool holds or is about to hold: model -> MiB per GPU index.
    holdings: Callable[[], Mapping[str, Mapping[int, int]]]
    # The MiB each GPU may lease out in all (the pool's budget per GPU).
    budgets: Callable[[], Mapping[int, int]]


class SharedLedger(Protocol):
    def bind(self, pool: LedgerBinding) -> None: ...

    def others_mib(self) -> Mapping[int, int]:
        """MiB per GPU index leased by other holders (as last read)."""
        ...

    async def claim(
        self, model: str, mib_per_gpu: Mapping[int, int], free: Mapping[int, int]
    ) -> str | None:
        """Take a lease for a load of ``model``; None when granted (or when the ledger
        cannot be reached: the pool then goes by its own gate), else why not."""
        ...

    def poke(self) -> None:
        """The pool's holdings changed: release what it no longer holds."""
        ...

    def status(self) -> Mapping[str, Any]:
        """The ledger's state as JSON (``/health`` and the capabilities show it): at
        least ``redis``, "ok" or "unreachable"."""
        ...
