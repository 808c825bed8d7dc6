"""Who may make room for a load, and which of them should (docs/vram.md, "Eviction").

The rules (who *may* be evicted) are the spec's: a loaded, unpinned model, not more
important than the one that needs the room, resident for ``engine.min_resident_s``, and
idle (an eviction never cuts a request). The choice among them (who *should* be) goes
by priority first, then, with ``engine.eviction_policy: swap_cost`` (the default), by
what evicting each would cost: the seconds its next load takes (measured, kept across
restarts; before a measurement, its size at an assumed load speed) times how often it
is asked for lately (its request rate, which falls while it sits idle). The cheapest
to bring back and least likely to be needed goes first; among models whose eviction
alone makes the room, one of them is taken rather than a bigger one. ``lru``: the
least recently used, as before.

A model in its stay-warm window (``stay_warm_s`` seconds since it last served) is
chosen only when the models out of theirs cannot make the room (``Gate.choose``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pool.actors.residency._planner import ResidenceView, Target

# The load speed assumed for a model whose load was never measured (MiB/s), and the
# least a load is assumed to take.
ASSUMED_LOAD_MIB_PER_S = 1000.0
MIN_RELOAD_S = 0.1


def eligible_victim(
    actor: ResidenceView, *, incoming: Target, now: float, min_resident_s: float
) -> bool:
    """The spec's filter, apart from being idle: loaded, unpinned, not more important
    than the model that needs the room, and resident for ``min_resident_s`` at least.

    Equal priority may be evicted: otherwise two models of the same rank could never
    take turns on a GPU that holds one of them.
    """
    return (
        actor.name != incoming.name
        and actor.state == "loaded"
        and not actor.pinned
        and actor.priority <= incoming.priority
        and now - actor.resident_since >= min_resident_s
    )


def eviction_candidates(
    actors: Iterable[ResidenceView],
    *,
    incoming: Target,
    now: float,
    min_resident_s: float = 0.0,
    busy: bool = False,
) -> list[ResidenceView]:
    """Models that may be unloaded to make room for ``incoming``, lowest priority
    first, then the least recently used.

    Idle ones only (nothing queued or running), so an eviction never cuts a request;
    with ``busy`` the on-demand ones that still have work instead (they are asked to
    drain first: their new requests wait until they are reloaded).
    """
    chosen = [
        a
        for a in actors
        if eligible_victim(a, incoming=incoming, now=now, min_resident_s=min_resident_s)
        and (not a.idle and a.on_demand if busy else a.idle)
    ]
    return sorted(chosen, key=lambda a: (a.priority, a.last_used_at))


@dataclass(frozen=True, slots=True)
class SwapCost:
    """What evicting one model would cost, as the policy sees it."""

    reload_s: float  # how long bringing it back takes
    measured: bool  # reload_s was measured (else assumed from its size)
    rate: float  # requests per second lately
    mib: int  # what its eviction hands back

    @property
    def cost(self) -> float:
        """Expected seconds of reloading per second it stays evicted."""
        return self.reload_s * self.rate

    def describe(self) -> str:
        how = "measured" if self.measured else f"assumed from {self.mib} MiB"
        return f"reloads in {self.reload_s:.2f}s ({how}), {self.rate:.3f} requests/s lately"


def reload_s(measured: float | None, mib: int) -> tuple[float, bool]:
    """How long a load (``mib`` on the GPUs) takes: ``measured`` where it was (True),
    else assumed from its size (False)."""
    seconds = measured if measured is not None else mib / ASSUMED_LOAD_MIB_PER_S
    return max(MIN_RELOAD_S, seconds), measured is not None


def swap_cost(actor: ResidenceView, now: float) -> SwapCost:
    """The cost of evicting ``actor``, with its request rate as read at ``now``."""
    mib = sum(actor.releases.values())
    seconds, measured = reload_s(actor.expected_load_s, mib)
    return SwapCost(seconds, measured, actor.request_rate, mib)


def warm_note(actor: ResidenceView, now: float) -> str:
    """Where ``actor`` stands in its stay-warm window, for decisions."""
    until = actor.warm_until
    if until is None:
        return f"{actor.name!r} is past its stay-warm window"
    served = now - (actor.served_at if actor.served_at is not None else now)
    return (
        f"{actor.name!r} served {served:.0f}s ago, in its stay-warm window"
        f" (stay_warm_s {actor.stay_warm_s:g}) for {max(0.0, until - now):.0f}s more"
    )


def choose_victim(
    candidates: list[ResidenceView],
    *,
    now: float,
    policy: str,
    suffices: Callable[[ResidenceView], bool],
) -> ResidenceView | None:
    """The model to evict first among ``candidates`` (as :func:`eviction_candidates`
    orders them); ``suffices(model)``: whether evicting that model alone makes the room.

    Only the lowest priority present is considered. ``lru``: its least recently used.
    ``swap_cost``: among the models whose eviction alone suffices, the cheapest to
    lose; when none does, the cheapest per MiB handed back.
    """
    if not candidates:
        return None
    if policy == "lru":
        return candidates[0]
    rank = candidates[0].priority
    tier = [c for c in candidates if c.priority == rank]
    costs = {c: swap_cost(c, now) for c in tier}
    enough = [c for c in tier if suffices(c)]
    if enough:
        return min(enough, key=lambda c: (costs[c].cost, c.last_used_at))
    return min(tier, key=lambda c: (costs[c].cost / max(1, costs[c].mib), c.last_used_at))
