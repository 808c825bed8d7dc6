"""The VRAM gate's view of the pool: the frozen records the planner (``_planner.py``)
reads (each model's ``ResidenceView``, the load's ``Target``, the GPUs' ``GpuRoom``),
the reservations of loads let through, and the dry-run preview of a load. Synchronous:
the residency owner (``_residency.py``) carries a plan out, waits and evicts; the
preview returns the same plan, so a preview and the load that follows agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import trio

from pool.actors.models._model import ModelActor
from pool.actors.residency import _planner as planner
from pool.actors.residency._eviction import eviction_candidates, warm_note
from pool.actors.residency._gpu import GpuSource
from pool.actors.residency._ledger import SharedLedger
from pool.actors.residency._plan import LoadPlan
from pool.actors.residency._planner import (
    Evict,
    GpuRoom,
    Place,
    Placements,
    ResidenceView,
    Rules,
    Target,
)
from pool.actors.residency._residence import Residence
from pool.actors.residency._vram import CudaContexts, gpu_ceilings
from pool.actors.values._snapshots import GpuReading
from pool.config import Settings


def held_mib(gpu: GpuReading) -> int:
    """What the pool holds on ``gpu``: its own processes' part where known, else all."""
    return gpu.used_mib if gpu.pool_used_mib is None else gpu.pool_used_mib


class Gate:
    """Room and placement over ``models``; ``reserved``: loads the owner let through that
    are not ``loading`` yet, with the GPUs of each replica (the owner keeps it)."""

    def __init__(
        self,
        settings: Settings,
        models: Mapping[str, ModelActor],
        residences: Mapping[str, Residence],
        gpus: GpuSource,
        *,
        contexts: CudaContexts,
        ledger: SharedLedger | None,
    ) -> None:
        self.settings = settings
        self.models = models
        self.residences = residences
        self.gpus = gpus
        self.contexts = contexts
        self.ledger = ledger
        self.reserved: dict[ModelActor, Placements] = {}

    # -- the planner's records -------------------------------------------------------------
    def view_of(self, actor: ModelActor, now: float) -> ResidenceView:
        """``actor`` as the planner sees it at ``now`` (Trio clock)."""
        reserved = self.reserved.get(actor)
        residence = self.residences[actor.name]
        return ResidenceView(
            name=actor.name,
            state=actor.state,
            priority=actor.definition.priority,
            pinned=actor.definition.pinned,
            on_demand=actor.definition.on_demand,
            idle=actor.idle,
            holding=residence.holding(),
            releases=residence.releases(),
            reserved=None if reserved is None else _planned(reserved),
            resident_since=residence.resident_since,
            last_used_at=actor.last_used_at,
            served_at=residence.served_at,
            stay_warm_s=residence.stay_warm_s,
            warm_until=residence.warm_until(),
            expected_load_s=residence.expected_load_s(),
            request_rate=residence.request_rate(now),
        )

    def views(self, now: float) -> list[ResidenceView]:
        return [self.view_of(actor, now) for actor in self.models.values()]

    def target(self, actor: ModelActor, plan: LoadPlan) -> Target:
        """A load of ``plan`` for the planner: what each replica needs, from the
        estimate chain, and how the backend spreads it over GPUs."""
        definition = plan.effective(actor.definition)
        estimate = self.residences[actor.name].vram_estimate(
            definition=definition, replicas=plan.replicas
        )
        return Target(
            name=actor.name,
            priority=actor.definition.priority,
            per_replica_mib=estimate.per_replica_mib or 0,
            source=estimate.source,
            replicas=plan.replicas,
            gpus_per_replica=actor.backend.gpus_per_replica(definition),
            even_split=actor.backend.even_gpu_split,
            holds_cuda_context=actor.backend.holds_cuda_context(definition),
        )

    def gpu_room(self) -> GpuRoom:
        view = self.gpus.view()
        engine = self.settings.engine
        return GpuRoom(
            view,
            reserve_mib=engine.gpu_reserve_mib,
            caps_mib=engine.gpu_budget_mib,
            contexts_held=self.contexts.held(),
            context_cost={g.index: self.contexts.cost_mib(g.index) for g in view.gpus},
            leased_by_others=self.ledger.others_mib() if self.ledger is not None else None,
        )

    def rules(self, now: float, **rules: Any) -> Rules:
        engine = self.settings.engine
        return Rules(
            now, policy=engine.eviction_policy, min_resident_s=engine.min_resident_s, **rules
        )

    def plan(self, target: Target, rules: Rules) -> planner.Plan:
        """The planner's answer for ``target`` now, under ``rules``."""
        return planner.plan(target, self.views(rules.now), self.gpu_room(), rules)

    def fit(self, target: Target) -> Placements | None:
        """Where ``target`` would go now with nothing evicted; ``()`` without GPUs."""
        now = trio.current_time()
        return planner.fit(target, self.views(now), self.gpu_room())

    def room(self, target: Target) -> dict[int, int] | None:
        """MiB free for ``target`` per GPU now; None: no GPU."""
        return planner.room(target, self.views(trio.current_time()), self.gpu_room())

    def room_numbers(self, target: Target) -> dict[str, Any]:
        room = self.room(target)
        return {"need_mib": target.per_replica_mib, "room_mib": None if room is None else room}

    def why_evict(self, victim: ModelActor, spared: Iterable[ModelActor] = ()) -> str:
        now = trio.current_time()
        return planner.why_evict(
            self.view_of(victim, now),
            [self.view_of(a, now) for a in spared],
            now=now,
            policy=self.settings.engine.eviction_policy,
        )

    # -- what the pool reads (virtual GPUs, the shared ledger, CUDA contexts) ----------------
    def runtime_holdings(self) -> list[tuple[int, int]]:
        """(GPU, MiB) every loaded replica's runtime holds (what virtual GPUs show)."""
        return [held for r in self.residences.values() for held in r.runtime_holdings()]

    def charges(self, exclude: Iterable[ModelActor] = ()) -> tuple[dict[int, int], dict[int, int]]:
        """MiB per GPU charged to loaded models, and to loads under way or reserved."""
        skip = set(exclude)
        now = trio.current_time()
        return planner.charges(self.view_of(a, now) for a in self.models.values() if a not in skip)

    def lease_holdings(self) -> dict[str, dict[int, int]]:
        """MiB per GPU of every model that holds or is about to hold memory."""
        held = {view.name: view.charge() for view in self.views(trio.current_time())}
        return {name: h[0] for name, h in held.items() if h is not None}

    def budgets(self) -> dict[int, int]:
        engine = self.settings.engine
        return gpu_ceilings(
            self.gpus.view(), reserve_mib=engine.gpu_reserve_mib, caps_mib=engine.gpu_budget_mib
        )

    # -- the dry run ---------------------------------------------------------------------------
    def preview(self, actor: ModelActor, plan: LoadPlan) -> dict[str, Any]:
        """What a load of ``plan`` would do now, changing nothing: whether it fits, where
        (``gpus``, ``gpu_split_mib`` per replica), whom it would evict (in order), what
        it would wait for, the expected load time (None before a measured load), and the
        refusal (``error``, ``reason``) it would answer: the planner's answer for the
        load, as :meth:`Residency.load` asks it. Run the load right after, with nothing
        changed between, and it does what this says (the shared lease ledger aside: its
        answer is only known when the lease is claimed).
        """
        name = actor.name
        target = self.target(actor, plan)
        answer: dict[str, Any] = {
            "model": name,
            "state": actor.state,
            "fits": False,
            "gpus": [],
            "gpu_split_mib": [],
            "evict": [],
            "wait_for": [],
            "spared_warm": [],
            "need_mib": target.per_replica_mib,
            "estimate_source": target.source,
            "expected_load_s": self.residences[name].expected_load_s(
                plan.effective(actor.definition)
            ),
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
        now = trio.current_time()
        views = self.views(now)
        room = self.gpu_room()
        outcome = planner.plan(target, views, room, self.rules(now))
        steps = outcome.steps if isinstance(outcome, Evict) else ()
        final = outcome.then if isinstance(outcome, Evict) else outcome
        gone = [step.victim for step in steps if step.victim is not None]
        if isinstance(final, Place):
            spared: dict[str, ResidenceView] = {}
            for step in steps:
                spared.update((m.name, m) for m in step.spared)
            warm = [v for v in gone if v.warm_until is not None]
            kept = [m for m in spared.values() if m not in gone]
            answer.update(
                fits=True,
                gpus=[list(p.gpus) for p in final.gpus],
                gpu_split_mib=[list(p.mib) for p in final.gpus],
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
        assert isinstance(final, planner.Refuse)
        busy = eviction_candidates(views, incoming=target, now=now, busy=True)
        answer.update(
            error="load_failed",
            reason=final.reason,
            wait_for=[b.name for b in busy],
            evict=[v.name for v in gone],  # a real load evicts these, then refuses
            room_mib=planner.room(target, views, room),
        )
        return answer


def _planned(placements: Placements) -> dict[int, int]:
    """MiB per GPU that reserved placements were planned with."""
    into: dict[int, int] = {}
    for placement in placements:
        for index, mib in zip(placement.gpus, placement.mib, strict=True):
            into[index] = into.get(index, 0) + mib
    return into
