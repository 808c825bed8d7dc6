"""The VRAM policy's arithmetic: room per GPU, placement, what placements charge, and
the measurement of a load. Everything here is synchronous except the meter's reads;
the planner (``_planner.py``) applies it to the records the gate (``_gate.py``) reads of
the pool, the residency owner (``_residency.py``) waits and evicts, and
``_eviction.py`` chooses whom to evict.

Room on one GPU for a new load::

    budget = min(gpu_budget_mib[i], total - gpu_reserve_mib - held by other processes)
    room   = budget - held by the pool - charged to loads under way

"Held by the pool" is the larger of what the GPU source reports for the pool's own
processes and what the pool's loaded models are charged; so memory that an evicted
model has not handed back yet still counts until the source shows it free. A virtual
GPU's total is its budget (no reserve: there is no driver to keep a margin for).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pool.actors.residency._footprints import FootprintStore
from pool.actors.residency._gpu import GpuSource
from pool.actors.values._snapshots import GpuReading, GpuView
from pool.backends import GpuPlacement


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


def place(
    room: Mapping[int, int],
    per_replica_mib: int,
    replicas: int,
    *,
    gpus_per_replica: int | None = None,
    even: bool = False,
    virtual: bool = False,
) -> tuple[GpuPlacement, ...] | None:
    """The GPUs of each replica, or None if one of them does not fit.

    A replica goes to the GPU with the most room. One that no GPU can hold is split
    over the fewest GPUs whose room together holds it (those with the most room), in
    proportion to each one's room, or in equal shares with ``even`` (tensor
    parallelism). ``gpus_per_replica`` fixes how many GPUs a replica spans. The room
    is what is left after the reserve of each GPU (``gpu_room``), so the margin holds
    per GPU of a split too. Placements list their GPUs in index order.
    """
    left = dict(room)
    placements = []
    for _ in range(replicas):
        placement = _place_one(left, per_replica_mib, gpus_per_replica, even, virtual)
        if placement is None:
            return None
        for index, mib in zip(placement.gpus, placement.mib, strict=True):
            left[index] -= mib
        placements.append(placement)
    return tuple(placements)


def _place_one(
    left: Mapping[int, int], need: int, count: int | None, even: bool, virtual: bool
) -> GpuPlacement | None:
    roomiest = sorted(left, key=lambda i: (-left[i], i))
    if not roomiest:
        return None
    if count is None or count == 1:
        best = roomiest[0]
        if left[best] >= need:
            return GpuPlacement((best,), (need,), virtual)
        if count == 1:
            return None
    for k in [count] if count else range(2, len(roomiest) + 1):
        chosen = sorted(roomiest[:k])
        if len(chosen) < k:
            return None
        if even:
            share = -(-need // k)
            if all(left[i] >= share for i in chosen):
                return GpuPlacement(tuple(chosen), (share,) * k, virtual)
            continue
        shares = proportional_shares(need, [max(0, left[i]) for i in chosen])
        if shares is not None:
            return GpuPlacement(tuple(chosen), shares, virtual)
    return None


def proportional_shares(need: int, rooms: Sequence[int]) -> tuple[int, ...] | None:
    """``need`` MiB split over GPUs in proportion to their ``rooms``, none past its room;
    None when the rooms together are too small."""
    total = sum(rooms)
    if total < need or total <= 0:
        return None
    shares = [need * r // total for r in rooms]
    # Rounding down left a few MiB over (fewer than GPUs): one each, most spare first.
    order = sorted(range(len(rooms)), key=lambda i: shares[i] - rooms[i])
    while sum(shares) < need:
        for i in order:
            if sum(shares) < need and shares[i] < rooms[i]:
                shares[i] += 1
    return tuple(shares)


def charges(
    placements: Sequence[GpuPlacement],
    per_replica_mib: int,
    into: dict[int, int] | None = None,
    *,
    replicas: int = 0,
) -> dict[int, int]:
    """Add ``per_replica_mib`` for each replica to ``into``, spread over its GPUs as
    its placement says. With no placement (loaded while no GPU was seen), ``replicas``
    replicas count on GPU 0."""
    into = {} if into is None else into
    if not placements:
        if replicas and per_replica_mib:
            into[0] = into.get(0, 0) + per_replica_mib * replicas
        return into
    for placement in placements:
        for index, mib in zip(placement.gpus, placement.scaled(per_replica_mib), strict=True):
            into[index] = into.get(index, 0) + mib
    return into


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

    @property
    def quiet(self) -> bool:
        """No load is being measured now (a reading then shows no load's growth)."""
        return self._loads == 0

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


# -- the CUDA context of in-process runtimes ----------------------------------------------

# What a CUDA context with its libraries' handles and the allocator's first pools takes
# before one was measured on a GPU (ExLlamaV3 left 782 MiB behind on an H100).
DEFAULT_CONTEXT_MIB = 500


class CudaContexts:
    """What in-process runtimes leave in the pool process on each GPU.

    The first in-process load on a GPU pays for the process's CUDA context (and the
    allocator's cache); later ones do not, and unloading a model leaves both behind,
    held by the pool process: not free memory. So a measured in-process load is split
    into the context and the model's own part, and only the model's part is its
    footprint. The context's size is learned when an in-process model unloads (what the
    pool process still holds beyond its other loaded models) and kept in the footprint
    store; until then the first model's footprint includes it and is corrected then.

    ``others(actor)``: MiB per GPU charged to the loaded models other than ``actor``.
    """

    def __init__(self, store: FootprintStore, others: Callable[[Any], Mapping[int, int]]) -> None:
        self._store = store
        self._others = others
        self.opened: set[int] = set()

    def expected_mib(self, gpu: int) -> int:
        known = self._store.context_mib(gpu)
        return DEFAULT_CONTEXT_MIB if known is None else known

    def cost_mib(self, gpu: int) -> int:
        """What an in-process load on ``gpu`` pays for the context beside the model."""
        return 0 if gpu in self.opened else self.expected_mib(gpu)

    def held(self) -> dict[int, int]:
        """MiB the pool process holds for contexts, per GPU, where known."""
        held = {}
        for gpu in self.opened:
            known = self._store.context_mib(gpu)
            if known:
                held[gpu] = known
        return held

    def already_held(self, actor: Any, mark: MeterMark | None) -> dict[int, int]:
        """MiB of context the pool process held on each GPU when ``actor``'s load began
        (its reading then, less the other loaded models): a runtime may open its CUDA
        context before any load (llama.cpp's CUDA build does when it starts), and a load
        that finds it open does not pay for it again."""
        if mark is None:
            return {}
        others = self._others(actor)
        return {gpu: max(0, mib - others.get(gpu, 0)) for gpu, mib in mark.held.items()}

    def split(
        self, per_gpu: Mapping[int, int], gpus: Iterable[int], held_before: Mapping[int, int]
    ) -> tuple[dict[int, int], set[int]]:
        """A measured in-process load on ``gpus``: the model's own MiB per GPU, and the
        GPUs whose context it paid at a size not known yet (its part includes it).
        ``held_before``: what the pool process already held there (already_held); only
        the context beyond it was paid by this load."""
        own: dict[int, int] = {}
        unsplit: set[int] = set()
        placed = set(gpus)
        for gpu, mib in per_gpu.items():
            known = self._store.context_mib(gpu)
            if gpu not in placed or gpu in self.opened:
                own[gpu] = mib
            elif known is None:
                own[gpu] = mib
                unsplit.add(gpu)
            else:
                own[gpu] = max(0, mib - max(0, known - held_before.get(gpu, 0)))
        self.opened |= placed
        return own, unsplit

    def learn(self, actor: Any, view: GpuView, gpus: Iterable[int]) -> dict[int, int]:
        """After ``actor`` (in-process) unloaded, with no load under way: what the pool
        process still holds on each of ``gpus`` beyond the other loaded models is its
        context. Recorded in the store; returned per GPU."""
        others = self._others(actor)
        learned = {}
        readings = {g.index: g for g in view.gpus}
        for gpu in gpus:
            reading = readings.get(gpu)
            if reading is None or reading.pool_used_mib is None:
                continue  # only a per-process reading tells the pool's part apart
            learned[gpu] = max(0, reading.pool_used_mib - others.get(gpu, 0))
            self._store.record_context(gpu, learned[gpu])
        return learned
