"""The VRAM planner: where a load goes, or whom it evicts, waits for, or why it is
refused (docs/vram.md). Pure: it reads frozen records of the models (``ResidenceView``),
of the load (``Target``) and of the GPUs (``GpuRoom``) and calls no actor, so the
residency owner's load (``Residency._make_room``) and the dry-run preview
(``Gate.preview``) ask the same function and a table of cases tests it without Trio.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from pool.actors.residency._eviction import choose_victim, eviction_candidates, swap_cost, warm_note
from pool.actors.residency._vram import gpu_ceilings, gpu_room, place
from pool.actors.values._snapshots import GpuView, RuntimeState
from pool.backends import GpuPlacement

Placements = tuple[GpuPlacement, ...]


@dataclass(frozen=True, slots=True, eq=False)
class ResidenceView:
    """One model as the planner sees it, read at ``Rules.now`` (compared by identity)."""

    name: str
    state: RuntimeState
    priority: int
    pinned: bool = False
    on_demand: bool = False
    # Nothing queued and nothing running.
    idle: bool = True
    # MiB per GPU the model holds or is about to hold as a load under way (loading,
    # loaded, unloading), and what its unload would hand back.
    holding: Mapping[int, int] = field(default_factory=dict)
    releases: Mapping[int, int] = field(default_factory=dict)
    # A load the owner let through that is not ``loading`` yet: the MiB per GPU it was
    # placed with (the gate's reservation); None when there is none.
    reserved: Mapping[int, int] | None = None
    resident_since: float = 0.0
    last_used_at: float = 0.0
    served_at: float | None = None
    stay_warm_s: float = 0.0
    # The end of the stay-warm window it is in; None when it is in none.
    warm_until: float | None = None
    # How long its last load took (None: never measured), and its requests per second.
    expected_load_s: float | None = None
    request_rate: float = 0.0

    def charge(self) -> tuple[dict[int, int], bool] | None:
        """MiB per GPU it holds or is about to hold, and whether that is still a load
        under way (reserved or loading); None when it holds nothing."""
        if self.reserved is not None and self.state in ("unloaded", "failed"):
            return dict(self.reserved), True
        if self.state in ("loading", "loaded", "unloading"):
            return dict(self.holding), self.state == "loading"
        return None


@dataclass(frozen=True, slots=True)
class Target:
    """The load to place: its model, what one replica needs (and where that figure
    comes from) and how its backend spreads a replica over GPUs."""

    name: str
    priority: int
    per_replica_mib: int
    source: str
    replicas: int
    gpus_per_replica: int | None = None
    even_split: bool = False
    # An in-process runtime also pays the pool process's CUDA context on a GPU that has
    # none yet (CudaContexts).
    holds_cuda_context: bool = False


@dataclass(frozen=True, slots=True)
class GpuRoom:
    """The GPUs as the planner sees them: the reading, the budget rules, what the pool
    process keeps for CUDA contexts, and what other holders of a shared lease hold."""

    view: GpuView
    reserve_mib: int = 0
    caps_mib: Sequence[int] | None = None
    contexts_held: Mapping[int, int] = field(default_factory=dict)
    # What an in-process load pays for the context on each GPU (0 where it is open).
    context_cost: Mapping[int, int] = field(default_factory=dict)
    leased_by_others: Mapping[int, int] | None = None


@dataclass(frozen=True, slots=True)
class Rules:
    """How this load may make room, at ``now`` (Trio clock)."""

    now: float
    policy: str = "swap_cost"
    min_resident_s: float = 0.0
    # engine.max_loaded_models where it binds (on-demand loads); 0: no limit.
    limit: int = 0
    # An on-demand load: it waits (for a fresh victim, or a stay-warm window) rather
    # than being refused when nothing may be evicted now.
    wait: bool = False
    # Whether a model in its stay-warm window may be evicted when only such models can
    # make the room.
    evict_warm: bool = True
    # The room was taken by another holder of the shared lease: plan as if full.
    room_taken: bool = False


@dataclass(frozen=True, slots=True)
class Choice:
    """The model to evict (None: none may go now), and the models spared because they
    are in their stay-warm windows (docs/vram.md, "Stay warm")."""

    victim: ResidenceView | None
    spared: tuple[ResidenceView, ...] = ()


@dataclass(frozen=True, slots=True)
class Place:
    """It fits now: the GPUs of each replica (``()`` without GPUs to gate)."""

    gpus: Placements


@dataclass(frozen=True, slots=True)
class Refuse:
    """It cannot load: ``reason`` for the decision and the error."""

    reason: str


@dataclass(frozen=True, slots=True)
class Evict:
    """Evict ``steps`` in order (each with the warm models its choice spared); ``then``:
    what follows once they are gone (None where the plan stops at the first eviction,
    an on-demand load re-plans after each)."""

    steps: tuple[Choice, ...]
    then: Place | Refuse | None = None


@dataclass(frozen=True, slots=True)
class Wait:
    """An on-demand load waits for a change: ``spared``, the warm models only whose
    eviction could make the room; ``fresh``, the model it would evict once resident
    for ``engine.min_resident_s``."""

    spared: tuple[ResidenceView, ...] = ()
    fresh: ResidenceView | None = None


Plan = Place | Evict | Wait | Refuse


def plan(
    target: Target, residences: Sequence[ResidenceView], gpu_view: GpuRoom, rules: Rules
) -> Plan:
    """What a load of ``target`` should do now.

    It places where it fits (within ``rules.limit``). Otherwise it evicts the idle
    model the policy picks, one after another, as long as the load could fit with
    every unpinned model gone; without ``rules.wait`` it goes on, as if each were gone,
    until it fits or no model may go (then it is refused). With ``rules.wait`` it stops
    at the first eviction, and waits where no model may go now or the pick is too fresh.
    """
    steps: list[Choice] = []
    gone: list[ResidenceView] = []
    while True:
        gpus = None if rules.room_taken and not gone else fit(target, residences, gpu_view, gone)
        if gpus is not None and (
            not rules.limit or loaded_count(target, residences, gone) < rules.limit
        ):
            return Evict(tuple(steps), Place(gpus)) if steps else Place(gpus)
        if gpus is None and not could_ever_fit(target, residences, gpu_view):
            refused = Refuse(refusal(target, residences, gpu_view))
            return Evict(tuple(steps), refused) if steps else refused
        choice = choose(target, residences, gpu_view, rules, gone)
        victim = choice.victim
        if rules.wait:
            if victim is None:
                return Wait(choice.spared)
            if is_fresh(victim, rules):
                return Wait(fresh=victim)
            return Evict((choice,))
        if victim is None:
            refused = Refuse(refusal(target, residences, gpu_view))
            return Evict(tuple(steps), refused) if steps else refused
        steps.append(choice)
        gone.append(victim)


def _without(view: GpuView, gone: Mapping[int, int]) -> GpuView:
    """``view`` as it would read with ``gone`` MiB per GPU handed back by the pool."""
    if not gone:
        return view
    gpus = []
    for gpu in view.gpus:
        mib = gone.get(gpu.index, 0)
        pool_used = None if gpu.pool_used_mib is None else max(0, gpu.pool_used_mib - mib)
        used = max(0, gpu.used_mib - mib)
        gpus.append(dataclasses.replace(gpu, used_mib=used, pool_used_mib=pool_used))
    return dataclasses.replace(view, gpus=tuple(gpus))


def charges(
    residences: Iterable[ResidenceView], exclude: Iterable[ResidenceView] = ()
) -> tuple[dict[int, int], dict[int, int]]:
    """MiB per GPU charged to loaded models, and to loads under way or reserved."""
    skip = set(exclude)
    loaded: dict[int, int] = {}
    pending: dict[int, int] = {}
    for residence in residences:
        held = None if residence in skip else residence.charge()
        if held is not None:
            into = pending if held[1] else loaded
            for index, mib in held[0].items():
                into[index] = into.get(index, 0) + mib
    return loaded, pending


def room(
    target: Target,
    residences: Sequence[ResidenceView],
    gpu_view: GpuRoom,
    gone: Iterable[ResidenceView] = (),
) -> dict[int, int] | None:
    """MiB free for ``target`` per GPU, as if ``gone`` were unloaded; None: no GPU."""
    gone = list(gone)
    view = gpu_view.view
    if not view.gpus:
        return None
    handed_back: dict[int, int] = {}
    for victim in gone:
        for index, mib in victim.releases.items():
            handed_back[index] = handed_back.get(index, 0) + mib
    itself = [r for r in residences if r.name == target.name]
    loaded, pending = charges(residences, exclude=[*itself, *gone])
    # What in-process runtimes left in the pool process is held, not free.
    for gpu, mib in gpu_view.contexts_held.items():
        loaded[gpu] = loaded.get(gpu, 0) + mib
    return gpu_room(
        _without(view, handed_back),
        reserve_mib=gpu_view.reserve_mib,
        caps_mib=gpu_view.caps_mib,
        loaded=loaded,
        pending=pending,
        leased_by_others=gpu_view.leased_by_others,
    )


def place_target(target: Target, gpu_view: GpuRoom, room: Mapping[int, int]) -> Placements | None:
    """``place`` with the backend's way of splitting a replica over GPUs, less the CUDA
    context an in-process runtime pays where it has none yet."""
    if target.holds_cuda_context:
        room = {gpu: mib - gpu_view.context_cost.get(gpu, 0) for gpu, mib in room.items()}
    return place(
        room,
        target.per_replica_mib,
        target.replicas,
        gpus_per_replica=target.gpus_per_replica,
        even=target.even_split,
        virtual=all(g.virtual for g in gpu_view.view.gpus),
    )


def fit(
    target: Target,
    residences: Sequence[ResidenceView],
    gpu_view: GpuRoom,
    gone: Iterable[ResidenceView] = (),
) -> Placements | None:
    """Where ``target``'s replicas would go now (``gone`` unloaded first); ``()`` when
    there is no GPU to gate."""
    free = room(target, residences, gpu_view, gone)
    if free is None:
        return ()
    return place_target(target, gpu_view, free)


def could_ever_fit(target: Target, residences: Sequence[ResidenceView], gpu_view: GpuRoom) -> bool:
    """Whether the load would fit with every unpinned model gone and no other process
    on the GPUs (those may leave: a load waits for them)."""
    free = gpu_ceilings(gpu_view.view, reserve_mib=gpu_view.reserve_mib, caps_mib=gpu_view.caps_mib)
    for gpu, mib in gpu_view.contexts_held.items():
        free[gpu] = free.get(gpu, 0) - mib  # the pool process keeps its contexts
    for other in residences:
        # Only pinned models stay for good; a more important one may still leave by
        # keep_alive or an admin unload, so a load behind it waits.
        if other.name != target.name and other.pinned:
            for index, mib in other.holding.items():
                free[index] = free.get(index, 0) - mib
    return place_target(target, gpu_view, free) is not None


def loaded_count(
    target: Target, residences: Iterable[ResidenceView], gone: Iterable[ResidenceView] = ()
) -> int:
    """Models loaded, loading or reserved, besides ``target`` and ``gone``."""
    skip = set(gone)
    return sum(
        1
        for r in residences
        if r.name != target.name
        and r not in skip
        and (r.state in ("loaded", "loading") or r.reserved is not None)
    )


def choose(
    target: Target,
    residences: Sequence[ResidenceView],
    gpu_view: GpuRoom,
    rules: Rules,
    gone: Sequence[ResidenceView] = (),
) -> Choice:
    """The idle model the policy picks for ``target`` (``gone`` evicted already),
    however fresh, and the models spared for their stay-warm windows.

    A model in its stay-warm window is picked only when the models out of theirs
    cannot make the room together; then, without ``rules.evict_warm``, none is picked
    (the load waits for a window to end) and ``spared`` names the warm ones.
    """
    gone = list(gone)
    candidates = eviction_candidates(
        (r for r in residences if r not in gone), incoming=target, now=rules.now
    )

    def fits_after(after: list[ResidenceView]) -> bool:
        if rules.limit and loaded_count(target, residences, after) >= rules.limit:
            return False
        return fit(target, residences, gpu_view, after) is not None

    warm = [c for c in candidates if c.warm_until is not None]
    spared: tuple[ResidenceView, ...] = ()
    if warm:
        cold = [c for c in candidates if c.warm_until is None]
        if cold and fits_after([*gone, *cold]):
            candidates, spared = cold, tuple(warm)
        elif not rules.evict_warm:
            return Choice(None, tuple(warm))
    victim = choose_victim(
        candidates,
        now=rules.now,
        policy=rules.policy,
        suffices=lambda victim: fits_after([*gone, victim]),
    )
    return Choice(victim, spared)


def is_fresh(victim: ResidenceView, rules: Rules) -> bool:
    # The same sum as the owner's wake-up time: a difference may round the other way,
    # and a load would then wake at once, again and again, without the clock moving.
    return rules.now < victim.resident_since + rules.min_resident_s


def refusal(target: Target, residences: Sequence[ResidenceView], gpu_view: GpuRoom) -> str:
    """Why a load that cannot be placed is refused."""
    need = f"model {target.name!r} needs {target.per_replica_mib} MiB per replica"
    if not could_ever_fit(target, residences, gpu_view):
        return f"{need} ({target.source}) x {target.replicas}: more than the GPUs can give it"
    return f"{need} ({target.source}); no GPU has room and no idle model may be evicted for it now"


def why_evict(
    victim: ResidenceView, spared: Iterable[ResidenceView], *, now: float, policy: str
) -> str:
    """The decision's explanation of an eviction."""
    # Larger is more important: the inverse of the coordinator spec (docs/vram.md).
    rank = f"priority {victim.priority} (larger is kept longer)"
    if policy == "lru":
        why = f"{rank}, least recently used of the idle models that may be evicted"
    else:
        cost = swap_cost(victim, now)
        why = f"{rank}, cheapest to lose of the idle models that may be evicted: {cost.describe()}"
    if victim.warm_until is not None:
        why += (
            f"; {warm_note(victim, now)}, but the models out of their stay-warm windows"
            " cannot make the room"
        )
    kept = [warm_note(r, now) for r in spared]
    if kept:
        why += "; spared: " + "; ".join(kept)
    return why
