"""The VRAM gate's view of the pool: what each model holds or is about to hold, the
room left on each GPU, where a load would go, and whom to evict for it; the preview of
a load. Synchronous: the residency owner (``_residency.py``) takes the decisions, waits
and evicts; this answers its questions about the state as it is now (or as it would be
with some models gone), so a preview and the load that follows ask the same ones.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import trio

from pool.actors._eviction import choose_victim, eviction_candidates, swap_cost, warm_note
from pool.actors._gpu import GpuSource
from pool.actors._ledger import SharedLedger
from pool.actors._model import ModelActor
from pool.actors._plan import LoadPlan
from pool.actors._snapshots import GpuReading, GpuView
from pool.actors._vram import CudaContexts, gpu_ceilings, gpu_room, place
from pool.backends import GpuPlacement
from pool.config import Settings

Placements = tuple[GpuPlacement, ...]


def held_mib(gpu: GpuReading) -> int:
    """What the pool holds on ``gpu``: its own processes' part where known, else all."""
    return gpu.used_mib if gpu.pool_used_mib is None else gpu.pool_used_mib


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


@dataclass(frozen=True, slots=True)
class Choice:
    """The model to evict (None: none may go now), and the models spared because they
    are in their stay-warm windows (docs/vram.md, "Stay warm")."""

    victim: ModelActor | None
    spared: tuple[ModelActor, ...] = ()


class Gate:
    """Room and placement over ``models``; ``reserved``: loads the owner let through that
    are not ``loading`` yet, with the GPUs of each replica (the owner keeps it)."""

    def __init__(
        self,
        settings: Settings,
        models: Mapping[str, ModelActor],
        gpus: GpuSource,
        *,
        contexts: CudaContexts,
        ledger: SharedLedger | None,
    ) -> None:
        self.settings = settings
        self.models = models
        self.gpus = gpus
        self.contexts = contexts
        self.ledger = ledger
        self.reserved: dict[ModelActor, Placements] = {}

    def runtime_holdings(self) -> list[tuple[int, int]]:
        """(GPU, MiB) every loaded replica's runtime holds (what virtual GPUs show)."""
        return [held for actor in self.models.values() for held in actor.runtime_holdings()]

    def holding(self, actor: ModelActor) -> tuple[dict[int, int], bool] | None:
        """MiB per GPU ``actor`` holds or is about to hold, and whether it is still a
        load under way (reserved or loading); None when it holds nothing."""
        if actor in self.reserved and actor.state in ("unloaded", "failed"):
            return _planned(self.reserved[actor]), True
        if actor.state in ("loading", "loaded", "unloading"):
            return actor.holding(), actor.state == "loading"
        return None

    def charges(self, exclude: Iterable[ModelActor] = ()) -> tuple[dict[int, int], dict[int, int]]:
        """MiB per GPU charged to loaded models, and to loads under way or reserved."""
        skip = set(exclude)
        loaded: dict[int, int] = {}
        pending: dict[int, int] = {}
        for actor in self.models.values():
            held = None if actor in skip else self.holding(actor)
            if held is not None:
                into = pending if held[1] else loaded
                for index, mib in held[0].items():
                    into[index] = into.get(index, 0) + mib
        return loaded, pending

    def lease_holdings(self) -> dict[str, dict[int, int]]:
        """MiB per GPU of every model that holds or is about to hold memory."""
        held = {a.name: self.holding(a) for a in self.models.values()}
        return {name: h[0] for name, h in held.items() if h is not None}

    def budgets(self) -> dict[int, int]:
        engine = self.settings.engine
        return gpu_ceilings(
            self.gpus.view(), reserve_mib=engine.gpu_reserve_mib, caps_mib=engine.gpu_budget_mib
        )

    def per_replica(self, actor: ModelActor, plan: LoadPlan) -> tuple[int, str]:
        definition = plan.effective(actor.definition)
        estimate = actor.vram_estimate(definition=definition, replicas=plan.replicas)
        return estimate.per_replica_mib or 0, estimate.source

    def place_plan(
        self, actor: ModelActor, plan: LoadPlan, room: dict[int, int], per_replica: int
    ) -> Placements | None:
        """``place`` with the backend's way of splitting a replica over GPUs. An
        in-process runtime also pays the pool process's CUDA context on each GPU that has
        none yet (CudaContexts)."""
        definition = plan.effective(actor.definition)
        if actor.backend.holds_cuda_context(definition):
            room = {gpu: mib - self.contexts.cost_mib(gpu) for gpu, mib in room.items()}
        return place(
            room,
            per_replica,
            plan.replicas,
            gpus_per_replica=actor.backend.gpus_per_replica(definition),
            even=actor.backend.even_gpu_split,
            virtual=all(g.virtual for g in self.gpus.view().gpus),
        )

    def room(self, actor: ModelActor, gone: Iterable[ModelActor] = ()) -> dict[int, int] | None:
        """MiB free for ``actor`` per GPU, as if ``gone`` were unloaded; None: no GPU."""
        gone = list(gone)
        view = self.gpus.view()
        if not view.gpus:
            return None
        handed_back: dict[int, int] = {}
        for victim in gone:
            for index, mib in victim.releases().items():
                handed_back[index] = handed_back.get(index, 0) + mib
        loaded, pending = self.charges(exclude=[actor, *gone])
        # What in-process runtimes left in the pool process is held, not free.
        for gpu, mib in self.contexts.held().items():
            loaded[gpu] = loaded.get(gpu, 0) + mib
        engine = self.settings.engine
        return gpu_room(
            _without(view, handed_back),
            reserve_mib=engine.gpu_reserve_mib,
            caps_mib=engine.gpu_budget_mib,
            loaded=loaded,
            pending=pending,
            leased_by_others=self.ledger.others_mib() if self.ledger is not None else None,
        )

    def fit(
        self,
        actor: ModelActor,
        plan: LoadPlan,
        per_replica: int,
        gone: Iterable[ModelActor] = (),
    ) -> Placements | None:
        """Where ``actor``'s replicas would go now (``gone`` unloaded first); ``()`` when
        there is no GPU to gate."""
        room = self.room(actor, gone)
        if room is None:
            return ()
        return self.place_plan(actor, plan, room, per_replica)

    def could_ever_fit(self, actor: ModelActor, plan: LoadPlan, per_replica: int) -> bool:
        """Whether the load would fit with every unpinned model gone and no other
        process on the GPUs (those may leave: a load waits for them)."""
        room = self.budgets()
        for gpu, mib in self.contexts.held().items():
            room[gpu] = room.get(gpu, 0) - mib  # the pool process keeps its contexts
        for other in self.models.values():
            # Only pinned models stay for good; a more important one may still leave by
            # keep_alive or an admin unload, so a load behind it waits.
            if other is not actor and other.definition.pinned:
                for index, mib in other.holding().items():
                    room[index] = room.get(index, 0) - mib
        return self.place_plan(actor, plan, room, per_replica) is not None

    def loaded_count(self, exclude: ModelActor, gone: Iterable[ModelActor] = ()) -> int:
        # Reserved: loads that made room but have not reached `loading` yet.
        skip = {exclude, *gone}
        return sum(
            1
            for a in self.models.values()
            if a not in skip and (a.state in ("loaded", "loading") or a in self.reserved)
        )

    def choose(
        self,
        actor: ModelActor,
        plan: LoadPlan,
        per_replica: int,
        limit: int,
        gone: list[ModelActor] | None = None,
        *,
        evict_warm: bool = True,
    ) -> Choice:
        """The idle model the policy picks for ``actor`` (``gone`` evicted already),
        however fresh, and the models spared for their stay-warm windows.

        A model in its stay-warm window is picked only when the models out of theirs
        cannot make the room together; then, with ``evict_warm`` False, none is picked
        (the load waits for a window to end) and ``spared`` names the warm ones.
        """
        gone = gone or []
        now = trio.current_time()
        candidates = eviction_candidates(
            (a for a in self.models.values() if a not in gone), incoming=actor, now=now
        )

        def fits_after(after: list[ModelActor]) -> bool:
            if limit and self.loaded_count(actor, after) >= limit:
                return False
            return self.fit(actor, plan, per_replica, after) is not None

        warm = [c for c in candidates if c.warm_until() is not None]
        spared: tuple[ModelActor, ...] = ()
        if warm:
            cold = [c for c in candidates if c.warm_until() is None]
            if cold and fits_after([*gone, *cold]):
                candidates, spared = cold, tuple(warm)
            elif not evict_warm:
                return Choice(None, tuple(warm))
        victim = choose_victim(
            candidates,
            now=now,
            policy=self.settings.engine.eviction_policy,
            suffices=lambda victim: fits_after([*gone, victim]),
        )
        return Choice(victim, spared)

    def is_fresh(self, victim: ModelActor) -> bool:
        # The same sum as the wake-up time below: a difference may round the other way,
        # and a load would then wake at once, again and again, without the clock moving.
        return trio.current_time() < victim.resident_since + self.settings.engine.min_resident_s

    def why_evict(self, victim: ModelActor, spared: Iterable[ModelActor] = ()) -> str:
        now = trio.current_time()
        # Larger is more important: the inverse of the coordinator spec (docs/vram.md).
        rank = f"priority {victim.definition.priority} (larger is kept longer)"
        if self.settings.engine.eviction_policy == "lru":
            why = f"{rank}, least recently used of the idle models that may be evicted"
        else:
            cost = swap_cost(victim, now)
            why = (
                f"{rank}, cheapest to lose of the idle models that may be evicted:"
                f" {cost.describe()}"
            )
        if victim.warm_until() is not None:
            why += (
                f"; {warm_note(victim, now)}, but the models out of their stay-warm windows"
                " cannot make the room"
            )
        kept = [warm_note(a, now) for a in spared]
        if kept:
            why += "; spared: " + "; ".join(kept)
        return why

    def refusal(self, actor: ModelActor, plan: LoadPlan, per_replica: int, source: str) -> str:
        if not self.could_ever_fit(actor, plan, per_replica):
            return (
                f"model {actor.name!r} needs {per_replica} MiB per replica ({source})"
                f" x {plan.replicas}: more than the GPUs can give it"
            )
        return (
            f"model {actor.name!r} needs {per_replica} MiB per replica ({source});"
            " no GPU has room and no idle model may be evicted for it now"
        )

    def room_numbers(self, actor: ModelActor, per_replica: int) -> dict[str, Any]:
        room = self.room(actor)
        return {"need_mib": per_replica, "room_mib": None if room is None else room}

    def preview(self, actor: ModelActor, plan: LoadPlan) -> dict[str, Any]:
        """What a load of ``plan`` would do now, changing nothing: whether it fits, where
        (``gpus``, ``gpu_split_mib`` per replica), whom it would evict (in order), what
        it would wait for, the expected load time (None before a measured load), and the
        refusal (``error``, ``reason``) it would answer. Run the load right after, with
        nothing changed between, and it does what this says (the shared lease ledger
        aside: its answer is only known when the lease is claimed).
        """
        name = actor.name
        per_replica, source = self.per_replica(actor, plan)
        answer: dict[str, Any] = {
            "model": name,
            "state": actor.state,
            "fits": False,
            "gpus": [],
            "gpu_split_mib": [],
            "evict": [],
            "wait_for": [],
            "spared_warm": [],
            "need_mib": per_replica,
            "estimate_source": source,
            "expected_load_s": actor.expected_load_s(plan.effective(actor.definition)),
            "error": None,
        }
        if actor.state == "unloading":
            answer["error"] = "model_unloading"
            answer["reason"] = "the model is unloading; a load now is refused, retry after"
            return answer
        if actor.state in ("loaded", "loading"):
            if plan.explicit:
                answer["error"] = "invalid_load_request"
                answer["reason"] = (
                    f"the model is {actor.state}; unload it before loading with replicas"
                    " or overrides"
                )
                return answer
            placement = actor.snapshot().placement
            answer.update(
                fits=True,
                gpus=[list(p.gpus) for p in placement],
                gpu_split_mib=[list(p.mib) for p in placement],
                wait_for=[name] if actor.state == "loading" else [],
                reason=f"already {actor.state}: the load answers its row"
                + (" once the load under way is over" if actor.state == "loading" else ""),
            )
            return answer
        gone: list[ModelActor] = []
        spared: dict[str, ModelActor] = {}
        while True:
            gpus = self.fit(actor, plan, per_replica, gone)
            if gpus is not None:
                now = trio.current_time()
                warm = [v for v in gone if v.warm_until() is not None]
                kept = [m for name, m in spared.items() if m not in gone]
                answer.update(
                    fits=True,
                    gpus=[list(p.gpus) for p in gpus],
                    gpu_split_mib=[list(p.mib) for p in gpus],
                    evict=[v.name for v in gone],
                    spared_warm=[m.name for m in kept],
                    reason="fits"
                    + (
                        f" once {', '.join(v.name for v in gone)}"
                        f" {'is' if len(gone) == 1 else 'are'} evicted"
                        if gone
                        else ""
                    )
                    + "".join(f"; evicts {warm_note(v, now)}" for v in warm)
                    + "".join(f"; spares {warm_note(m, now)}" for m in kept),
                )
                return answer
            victim = None
            if self.could_ever_fit(actor, plan, per_replica):
                choice = self.choose(actor, plan, per_replica, 0, gone)
                victim = choice.victim
                spared.update((m.name, m) for m in choice.spared)
            if victim is None:
                busy = [
                    a.name
                    for a in eviction_candidates(
                        self.models.values(), incoming=actor, now=trio.current_time(), busy=True
                    )
                ]
                answer.update(
                    error="load_failed",
                    reason=self.refusal(actor, plan, per_replica, source),
                    wait_for=busy,
                    evict=[v.name for v in gone],  # a real load evicts these, then refuses
                    room_mib=self.room(actor),
                )
                return answer
            gone.append(victim)


def _planned(placements: Placements) -> dict[int, int]:
    """MiB per GPU that reserved placements were planned with."""
    into: dict[int, int] = {}
    for placement in placements:
        for index, mib in zip(placement.gpus, placement.mib, strict=True):
            into[index] = into.get(index, 0) + mib
    return into
