"""One output canary on one replica: a short greedy request that is no traffic.

The residency owner decides when a model is probed and what its answer means
(pool/actors/residency/_canary.py); the model actor runs the probe here and reports the
answer as it came. A probe is a ticket that never enters the scheduler: it takes no
slot, is charged to no tenant, writes no usage row and counts in no request metric, and
the first request dispatched to its replica cancels it (``Replica.start_probe``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from pool.actors.models._ticket import JobFailed, JobFinished, Ticket
from pool.actors.values._events import Delta

if TYPE_CHECKING:
    from pool.actors.models._replica import Replica
    from pool.backends import FinishReason, GenerationRequest


@dataclass(frozen=True, slots=True)
class ProbeAnswer:
    """What the runtime answered a canary (``error``: the failure it ended with)."""

    text: str
    output_tokens: int | None
    finish_reason: FinishReason | None
    error: str | None = None


async def run_probe(replica: Replica, request: GenerationRequest) -> ProbeAnswer | None:
    """Run ``request`` on ``replica`` as a canary; None when it did not run to its end
    (a request came and cancelled it, the replica is stopping, or it hung)."""
    # Room for every piece the canary asks for: its job never waits for this reader.
    ticket = Ticket(request, tenant="", priority="low", buffer=request.decoding.max_tokens + 1)
    replica.start_probe(ticket)
    pieces: list[str] = []
    try:
        async for item in ticket.receive_channel:
            if isinstance(item, Delta):
                pieces.append(item.text)
            elif isinstance(item, JobFinished):
                stats = item.stats
                return ProbeAnswer("".join(pieces), stats.output_tokens, stats.finish_reason)
            elif isinstance(item, JobFailed):
                error = item.error
                if error.code == "backend_timeout":
                    # A hung runtime is the watchdog's: it recycles the replica, and the
                    # canary probes the fresh one (docs/faults.md), not reload it twice.
                    return None
                return ProbeAnswer("".join(pieces), None, None, f"{error.code}: {error.message}")
        return None
    finally:
        ticket.abandon()
