"""The VRAM policy's arithmetic: room per GPU, placement, who may be evicted, and
the measurement of a load. Everything here is synchronous except the meter's reads;
the supervisor (``_supervisor.py``) runs the waiting and the evicting.

Room on one GPU for a new load::

    budget = min(gpu_budget_mib[i], total - gpu_reserve_mib - held by other processes)
    room   = budget - held by the pool - charged to loads under way

"Held by the pool" is the larger of what the GPU source reports for the pool's own
processes and what the pool's loaded models are charged; so memory that an evicted
model has not handed back yet still counts until the source shows it free. A virtual
GPU's total is its budget (no reserve: there is no driver to keep a margin for).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pool.actors._gpu import GpuSource
from pool.actors._snapshots import GpuReading, GpuView

if TYPE_CHECKING:
    from pool.actors._model import ModelActor


def gpu_room(
    view: GpuView,
    *,
    reserve_mib: int,
    caps_mib: Sequence[int] | None,
    loaded: Mapping[int, int],
    pending: Mapping[int, int],
    leased_by_others: Mapping[int, int] | None = None,
) -> dict[int, int]:
    """MiB free for a new load on each GPU (may be negative: over budget).

    ``leased_by_others``: MiB per GPU that other holders have leased in a shared ledger
    (pool.cluster); they count as held by other processes, the larger of the lease and
    the reading (a lease not yet allocated, or memory allocated and also leased).
    """
    room: dict[int, int] = {}
    for gpu in view.gpus:
        charged = loaded.get(gpu.index, 0)
        ours = max(gpu.pool_used_mib or 0, charged)
        others = max(0, gpu.used_mib - ours, (leased_by_others or {}).get(gpu.index, 0))
        budget = gpu.total_mib - others - (0 if gpu.virtual else reserve_mib)
        if caps_mib and gpu.index < len(caps_mib):
            budget = min(budget, caps_mib[gpu.index])
        room[gpu.index] = budget - ours - pending.get(gpu.index, 0)
    return room


def gpu_ceilings(
    view: GpuView, *, reserve_mib: int, caps_mib: Sequence[int] | None
) -> dict[int, int]:
    """The most each GPU could ever give the pool: its budget with no other process on it."""
    ceilings = {}
    for gpu in view.gpus:
        ceiling = gpu.total_mib - (0 if gpu.virtual else reserve_mib)
        if caps_mib and gpu.index < len(caps_mib):
            ceiling = min(ceiling, caps_mib[gpu.index])
        ceilings[gpu.index] = ceiling
    return ceilings


def place(room: Mapping[int, int], per_replica_mib: int, replicas: int) -> tuple[int, ...] | None:
    """A GPU for each replica, the one with most room first; None if one does not fit.

    A model is never split across GPUs here (multi-GPU splits come later)."""
    left = dict(room)
    placement = []
    for _ in range(replicas):
        if not left:
            return None
        best = max(left, key=lambda i: (left[i], -i))
        if left[best] < per_replica_mib:
            return None
        placement.append(best)
        left[best] -= per_replica_mib
    return tuple(placement)


def charges(
    placement: Sequence[int], per_replica_mib: int, into: dict[int, int] | None = None
) -> dict[int, int]:
    """Add ``per_replica_mib`` on each replica's GPU to ``into``."""
    into = {} if into is None else into
    for index in placement:
        into[index] = into.get(index, 0) + per_replica_mib
    return into


def eligible_victim(
    actor: ModelActor, *, incoming: ModelActor, now: float, min_resident_s: float
) -> bool:
    """The spec's filter, apart from being idle: loaded, unpinned, not more important
    than the model that needs the room, and resident for ``min_resident_s`` at least.

    Equal priority may be evicted: otherwise two models of the same rank could never
    take turns on a GPU that holds one of them.
    """
    return (
        actor is not incoming
        and actor.state == "loaded"
        and not actor.definition.pinned
        and actor.definition.priority <= incoming.definition.priority
        and now - actor.resident_since >= min_resident_s
    )


def is_idle(actor: ModelActor) -> bool:
    return actor.scheduler.queue_depth == 0 and actor.scheduler.running == 0


def eviction_order(actors: Iterable[ModelActor]) -> list[ModelActor]:
    """Lowest priority first, then the least recently used."""
    return sorted(actors, key=lambda a: (a.definition.priority, a.last_used_at))


def eviction_candidates(
    actors: Iterable[ModelActor],
    *,
    incoming: ModelActor,
    now: float,
    min_resident_s: float = 0.0,
    busy: bool = False,
) -> list[ModelActor]:
    """Models that may be unloaded to make room for ``incoming``, best victim first.

    Idle ones only (nothing queued or running), so an eviction never cuts a request;
    with ``busy`` the on-demand ones that still have work instead (they are asked to
    drain first: their new requests wait until they are reloaded).
    """
    chosen = [
        a
        for a in actors
        if eligible_victim(a, incoming=incoming, now=now, min_resident_s=min_resident_s)
        and (not is_idle(a) and a.definition.on_demand if busy else is_idle(a))
    ]
    return eviction_order(chosen)


# -- measuring a load ------------------------------------------------------------------


def _held(gpu: GpuReading) -> int:
    return gpu.used_mib if gpu.pool_used_mib is None else gpu.pool_used_mib


@dataclass(frozen=True, slots=True)
class MeterMark:
    epoch: int
    alone: bool
    held: Mapping[int, int]


class LoadMeter:
    """Reads the GPU source around each load; the difference is the load's footprint.

    A load that overlaps another load of the pool is not measured (its delta would
    include the other one's); per-process readings keep other programs out of it.
    """

    def __init__(self, gpus: GpuSource) -> None:
        self._gpus = gpus
        self._loads = 0
        self._epoch = 0

    async def refresh(self) -> GpuView:
        refresh = getattr(self._gpus, "refresh", None)
        if refresh is not None:
            await refresh()
        return self._gpus.view()

    async def start(self) -> MeterMark | None:
        """Take the reading before a load; None when there is no GPU to read."""
        view = await self.refresh()
        if not view.gpus:
            return None
        self._loads += 1
        self._epoch += 1
        return MeterMark(self._epoch, self._loads == 1, {g.index: _held(g) for g in view.gpus})

    async def finish(self, mark: MeterMark | None) -> dict[int, int] | None:
        """MiB the load took per GPU, or None when it could not be measured cleanly."""
        if mark is None:
            return None
        try:
            view = await self.refresh()
        finally:
            self._loads -= 1
            clean = mark.alone and self._epoch == mark.epoch
            self._epoch += 1
        if not clean:
            return None
        return {g.index: max(0, _held(g) - mark.held.get(g.index, 0)) for g in view.gpus}

    def disturb(self) -> None:
        """The pool let memory go (a model unloading) while loads may be measured: their
        deltas would come out low (found as a 0 MiB footprint), so they are not measured."""
        self._epoch += 1

    def abandon(self, mark: MeterMark | None) -> None:
        """A load that failed: it counts as an overlap for loads measured beside it."""
        if mark is not None:
            self._loads -= 1
            self._epoch += 1
