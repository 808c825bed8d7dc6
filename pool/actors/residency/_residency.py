"""The residency owner: the one way a model is loaded, reloaded or evicted.

Every entry point (admin, runner API, startup, on-demand requests, Ollama preload,
pulls, the cluster) hands :class:`Residency` a load request. It validates it once
(:func:`plan_load`), asks the planner (``_planner.py``, a pure function; the gate,
``_gate.py``, gives it its records) where it goes, carries the plan out (evicts, one
model at a time, what the rules allow and the policy chooses: ``_eviction.py``),
claims the shared lease, waits where a load may wait, and hands the model actor an
already validated and placed plan (:meth:`ModelActor.load_placed`). Each placement,
eviction, wait and refusal is recorded with its reason (``_decisions.py``).
docs/vram.md tells the rules.

It keeps one record per model (:class:`Residence`, ``_residence.py``): the model actor
reports facts to it (loaded, used, idle, unloaded), and the numbers the owner decides
with are the record's. Every unload the pool decides on (an eviction, a keep-alive that
ran out) is started here.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, NoReturn

import trio

from pool.actors.models._model import ModelActor
from pool.actors.models._ticket import Ticket
from pool.actors.residency._canary import canary_plan
from pool.actors.residency._canary_watch import CanaryWatch
from pool.actors.residency._decisions import DecisionLog
from pool.actors.residency._eviction import (
    eligible_victim,
    eviction_candidates,
    reload_s,
    warm_note,
)
from pool.actors.residency._footprints import FootprintStore
from pool.actors.residency._gate import Gate, held_mib
from pool.actors.residency._gpu import GpuSource
from pool.actors.residency._ledger import SharedLedger
from pool.actors.residency._plan import LoadPlan, plan_load
from pool.actors.residency._planner import (
    Evict,
    Place,
    Placements,
    Refuse,
    ResidenceView,
    Rules,
    Target,
    Wait,
)
from pool.actors.residency._planner import room as planner_room
from pool.actors.residency._residence import Residence
from pool.actors.residency._sleep import read_host_ram, sleep_verdict
from pool.actors.residency._vram import CudaContexts, LoadMeter, charges
from pool.actors.residency._watchdog import Watchdog
from pool.actors.values._events import WaitReason
from pool.actors.values._snapshots import ModelSnapshot
from pool.backends import LoadRequest, unmet_load_hint
from pool.config import LoraAdapter, Settings
from pool.errors import PoolError

log = logging.getLogger("pool")

# A load waiting for room re-reads the GPUs at least this often (besides every change).
RECHECK_S = 5.0
# After an eviction: how long to wait for the GPU source to show the memory back, and
# how often to look (CUDA hands memory back some time after the process lets go).
RECLAIM_WAIT_S = 10.0
RECLAIM_POLL_S = 0.25


class Residency:
    """Owns which model is where: the gate, the reservations, eviction and leases."""

    def __init__(
        self,
        settings: Settings,
        models: Mapping[str, ModelActor],
        gpus: GpuSource,
        *,
        contexts: CudaContexts,
        meter: LoadMeter,
        footprints: FootprintStore | None,
        ledger: SharedLedger | None,
    ) -> None:
        self.settings = settings
        self.models = models
        self.footprints = footprints
        # The record of each model: its numbers, its keep-alive (residence_for).
        self.residences: dict[str, Residence] = {}
        self.gpus = gpus
        self.contexts = contexts
        self.meter = meter
        self.ledger = ledger
        self.decisions = DecisionLog()
        self.evictions = 0
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self._was_unloading = False
        # The gate keeps the loads it let through, with the GPUs of each replica, until
        # they are `loading` (gate.reserved).
        self.gate = Gate(settings, models, self.residences, gpus, contexts=contexts, ledger=ledger)
        # Evictions and the decisions that lead to them, one at a time; models asked to
        # make way (new requests wait at their door), with who asked.
        self._room_lock = trio.Lock()
        self._yielding: dict[ModelActor, tuple[trio.Event, ModelActor]] = {}
        # On-demand loads that found no room and wait for it (their requests wait for VRAM).
        self._waiting_for_room: set[ModelActor] = set()
        # On-demand loads under way, with the overrides their first request hinted at.
        self._on_demand: dict[ModelActor, dict[str, Any]] = {}
        # The request that started each on-demand load (charged with its seconds).
        self._load_causes: dict[ModelActor, Ticket] = {}
        # Who is told of a load a request caused: (model, that request, seconds); the
        # serving side charges it to the request's tenant and key (docs/operations.md).
        self.on_load_charged: Callable[[ModelActor, Ticket, float], None] | None = None
        # Told of each preemption: (the model whose streams stopped, how many, cut).
        self.on_pause: Callable[[ModelActor, int, bool], None] | None = None
        # Loaded copies unloaded because a request's hint was not met, with that hint:
        # the next on-demand load of the model takes it, whichever request starts it.
        self._hint_reloads: dict[ModelActor, dict[str, Any]] = {}

    def model(self, name: str) -> ModelActor:
        try:
            return self.models[name]
        except KeyError:
            raise PoolError("unknown_model", f"model {name!r} is not configured") from None

    def serving(self, name: str) -> tuple[ModelActor, LoraAdapter | None]:
        """The model that serves requests for ``name``, the one place model names
        resolve for requests: a configured model serves itself; the name of a LoRA
        adapter resolves to its base model and the adapter.

        Raises:
            PoolError: ``unknown_model`` for any other name.
        """
        actor = self.models.get(name)
        if actor is not None:
            return actor, None
        for actor in self.models.values():
            adapter = actor.adapters.get(name)
            if adapter is not None:
                return actor, adapter
        raise PoolError("unknown_model", f"model {name!r} is not configured")

    def residence_for(self, actor: ModelActor) -> Residence:
        """Open the record of ``actor`` (ModelActor calls this as it is built)."""
        residence = Residence(
            actor,
            footprints=self.footprints,
            meter=self.meter,
            contexts=self.contexts,
            spawn=self._spawn,
            watchdog=Watchdog(
                actor, self.decisions, self.settings.engine.watchdog_recycles_per_hour
            ),
        )
        self.residences[actor.name] = residence
        return residence

    def residence(self, name: str) -> Residence:
        """The record of model ``name``."""
        self.model(name)  # unknown_model
        return self.residences[name]

    def expected_load_s(self, name: str) -> float | None:
        """How long the last measured load of ``name`` took (its current definition;
        kept across restarts); None before one was measured."""
        return self.residence(name).expected_load_s()

    def load_eta_s(self, name: str) -> float | None:
        """Seconds the load of ``name`` under way still needs, by its last measured load
        like it; None when not loading or never measured (no guess)."""
        actor = self.residence(name).actor
        expected = self.expected_load_s(name) if actor.state == "loading" else None
        if expected is None:
            return None
        return max(0.0, expected - (trio.current_time() - actor.loading_since))

    def _spawn(self, work: Callable[[], Awaitable[None]]) -> None:
        """Run ``work`` in the background (a footprint file written): the load or unload
        that asked for it does not wait."""
        if self._nursery is not None:
            self._nursery.start_soon(work)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Carry out the owner's background work: evicted ``enabled`` models come back
        when room frees, idle on-demand models unload when their keep-alive ends, and
        output canaries probe the models that have one (``_canary_watch.py``)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for residence in self.residences.values():
                actor = residence.actor
                if actor.definition.on_demand:
                    nursery.start_soon(self._keep_alive, residence)
                plan = canary_plan(actor.definition, self.settings.engine, actor.capabilities)
                if plan is not None:
                    residence.canary = CanaryWatch(
                        actor, plan, self.decisions, on_change=self.notify_change
                    )
                    nursery.start_soon(residence.canary.run)
            task_status.started()
            while True:
                await self._changed.wait()
                await self._bring_back_evicted()

    async def _keep_alive(self, residence: Residence) -> None:
        """Unload ``residence``'s model once its keep-alive expires while it is idle."""
        actor = residence.actor
        while True:
            poke = residence.keep_alive_poke
            if residence.expires_at is None:
                await poke.wait()
                continue
            with trio.move_on_at(residence.expires_at):
                await poke.wait()
                continue
            if actor.state == "loaded" and actor.idle and residence.expires_at is not None:
                log.info("model=%s keep_alive expired; unloading", actor.name)
                residence.expires_at = None
                try:
                    await actor.unload("keep_alive")
                except PoolError as exc:  # e.g. shutting down under us
                    log.warning("model=%s keep-alive unload failed: %s", actor.name, exc.message)

    # -- change notices ------------------------------------------------------------------
    def notify_change(self) -> None:
        """A model changed state or went idle: waiting loads and requests look again."""
        # Memory let go while a load is measured makes its delta low: an unload that
        # starts or ends (it is "unloading" at one of the two changes) disturbs it.
        unloading = any(a.state == "unloading" for a in self.models.values())
        if unloading or self._was_unloading:
            self.meter.disturb()
        self._was_unloading = unloading
        if self.ledger is not None:
            self.ledger.poke()
        self._changed.set()
        self._changed = trio.Event()

    @property
    def changed(self) -> trio.Event:
        """Set at the next change (take it anew after each wait)."""
        return self._changed

    # -- the entry points ----------------------------------------------------------------
    def plan(self, name: str, body: LoadRequest | Mapping[str, Any] | None) -> LoadPlan:
        """Validate a load body for ``name`` (once; the plan is what is loaded).

        Raises:
            PoolError: ``unknown_model`` or ``invalid_load_request``.
            pydantic.ValidationError: a mapping that fails the load schema.
        """
        return plan_load(body, self.model(name).definition)

    async def load(
        self,
        name: str,
        body: LoadPlan | LoadRequest | Mapping[str, Any] | None = None,
        *,
        reuse: bool = False,
    ) -> ModelSnapshot:
        """Load a configured model; its snapshot when the load has finished.

        On GPUs (real or virtual) the load must fit: idle models that may be evicted for
        it are unloaded first; if it still does not fit it fails with ``load_failed`` at
        once rather than waiting.

        ``reuse`` (a runner load, Ollama's preload): a loaded copy that already serves
        the body's overrides answers it as it is; one that cannot is reloaded with them
        (a ``reload`` decision says why) instead of the body being refused.
        """
        actor = self.model(name)
        plan = body if isinstance(body, LoadPlan) else plan_load(body, actor.definition)
        if reuse and plan.explicit and actor.state == "loaded":
            covered = await self.reload_unless_covered(actor, plan)
            if covered is not None:
                return covered
        while True:
            if actor.state == "unloading":
                raise PoolError("model_unloading", f"model {name!r} is unloading; retry after")
            resident = actor.resident_row(plan.explicit)
            if resident is None:
                break
            if actor.state == "loaded":
                return resident
            await actor.wait_state_change()  # loading: answer once that load is over
        try:
            gpus = await self._make_room(actor, plan, wait=False)
            assert gpus is not None
            return await actor.load_placed(plan, gpus)
        finally:
            self._release(actor)

    async def unload(self, name: str) -> ModelSnapshot:
        """Unload as asked (admin, runner, Ollama): the model stays unloaded."""
        return await self.model(name).unload()

    async def preload(self, name: str, hint: Mapping[str, Any] | None = None) -> ModelSnapshot:
        """Load ``name`` as a request to it would (Ollama's empty request): as
        :meth:`load`, with ``hint`` (load overrides a client asked for) applied if this
        call starts the load and the backend accepts it; an unsuitable hint is ignored,
        as on an on-demand load. A loaded copy that does not serve the hint is reloaded
        with it (``reload_unless_covered``)."""
        actor = self.model(name)
        plan = self._hinted(actor, hint)
        return await self.load(name, plan, reuse=True)

    async def startup(self) -> None:
        """Load every ``enabled`` model (a failed one is logged and left ``failed``)."""

        async def one(actor: ModelActor) -> None:
            try:
                await self.load(actor.name)
            except PoolError as exc:
                log.warning("model=%s startup load failed: %s", actor.name, exc.message)

        async with trio.open_nursery() as loads:
            for actor in self.models.values():
                if actor.definition.enabled:
                    loads.start_soon(one, actor)

    def preview(
        self, name: str, body: LoadPlan | LoadRequest | Mapping[str, Any] | None = None
    ) -> dict[str, Any]:
        """What :meth:`load` would do now, changing nothing: whether it fits, where
        (``gpus``, ``gpu_split_mib`` per replica), whom it would evict (in order), what
        it would wait for, the expected load time (None before a measured load), the
        refusal (``error``, ``reason``) it would answer (see Gate.preview), and ``pause``:
        the preemptible streams a request above low for it would pause for its room
        (request ids; docs/vram.md, "Pause and resume").

        Raises:
            PoolError: ``unknown_model`` or ``invalid_load_request`` (as the load would).
        """
        actor = self.model(name)
        plan = body if isinstance(body, LoadPlan) else plan_load(body, actor.definition)
        answer = self.gate.preview(actor, plan)
        answer["pause"] = []
        if not answer["fits"] and answer["error"] in (None, "load_failed"):
            now = trio.current_time()
            victim = self.pausable_victim(actor, self.gate.target(actor, plan), now, asked=True)
            if victim is not None:
                answer["pause"] = [getattr(t.request, "request_id", "") for t in victim.pausable]
        return answer

    # -- gate views the pool passes on (virtual GPUs, the shared ledger, CUDA contexts)
    def runtime_holdings(self) -> list[tuple[int, int]]:
        return self.gate.runtime_holdings()

    def charges(
        self, exclude: list[ModelActor] | None = None
    ) -> tuple[dict[int, int], dict[int, int]]:
        return self.gate.charges(exclude or [])

    def lease_holdings(self) -> dict[str, dict[int, int]]:
        return self.gate.lease_holdings()

    def budgets(self) -> dict[int, int]:
        return self.gate.budgets()

    # -- on-demand loads (ModelActor's OnDemandLoader) ------------------------------------
    def request(
        self, actor: ModelActor, hint: dict[str, Any] | None, cause: Ticket | None = None
    ) -> None:
        """A request for ``actor`` (not loaded) waits: load it unless a load is pending.

        The load belongs to the owner, not to the request that triggered it: a client
        that leaves does not cancel a load other requests may be waiting for. The load's
        seconds are charged to ``cause``, the request that started it (an on-demand
        model, or an evicted one coming back for it)."""
        if actor in self._on_demand or self._nursery is None:
            return
        if cause is not None:
            self._load_causes[actor] = cause
        reloaded = self._hint_reloads.pop(actor, None)
        self._on_demand[actor] = dict(hint or reloaded or {})
        self._nursery.start_soon(self._on_demand_load, actor)

    def pending(self, actor: ModelActor) -> bool:
        return actor in self._on_demand

    async def _on_demand_load(self, actor: ModelActor) -> None:
        try:
            plan = self._hinted(actor, self._on_demand.get(actor)) or plan_load(
                None, actor.definition
            )
            gpus = await self._make_room(actor, plan, wait=True)
            if gpus is not None:
                started = trio.current_time()
                await actor.load_placed(plan, gpus)
                self._charge_load(actor, trio.current_time() - started)
        except PoolError as exc:
            log.warning("model=%s on-demand load failed: %s", actor.name, exc.message)
            if exc.code == "load_failed" and actor.state != "failed":
                # The gate refused it for good (it can never fit): fail the waiters now.
                actor.reject_waiting(PoolError("model_failed", exc.message))
        finally:
            self._release(actor)
            del self._on_demand[actor]
            self._load_causes.pop(actor, None)
        # Requests that arrived after a failed load was answered wait for a new one.
        if actor.queue_depth and actor.state in ("unloaded", "failed"):
            self.request(actor, None)

    # -- load hints a loaded copy may already serve (pool/backends/_load_hints.py) ------
    def unmet_hint(self, actor: ModelActor, hint: Mapping[str, Any] | None) -> str | None:
        """Why ``actor``'s loaded copy cannot serve a request hinting ``hint``; None when
        it can, or when there is nothing to decide (not loaded, no valid hint, a model
        that loads as configured whatever a request hints: not ``on_demand``)."""
        if actor.state != "loaded" or not actor.definition.on_demand:
            return None
        plan = self._hinted(actor, hint)
        return None if plan is None else self._unmet(actor, plan)

    @staticmethod
    def _unmet(actor: ModelActor, plan: LoadPlan) -> str | None:
        loaded = actor.active_definition or actor.definition
        if plan.replicas_asked and plan.replicas != len(actor.replicas):
            return f"replicas {plan.replicas} asked; {len(actor.replicas)} loaded"
        known = actor.residence.details.context_length
        return unmet_load_hint(loaded, plan.patch, context_length=known)

    async def reload_for_hint(self, actor: ModelActor, hint: Mapping[str, Any] | None) -> None:
        """Before a request with load hints is queued: a loaded copy that cannot serve
        them is drained and unloaded (decision ``reload``), so the request's own
        on-demand load brings the model back with them. A copy that serves them is left
        alone: the pool does not reload on every ``num_ctx`` change as Ollama does."""
        reason = self.unmet_hint(actor, hint)
        if reason is None or actor in self._hint_reloads:
            return
        plan = self._hinted(actor, hint)
        assert plan is not None
        self._hint_reloads[actor] = dict(plan.patch)
        self.decisions.record("reload", actor.name, f"a request's load hint is not met: {reason}")
        log.info("model=%s reloads for a load hint: %s", actor.name, reason)
        try:
            await actor.unload()
        except PoolError:
            self._hint_reloads.pop(actor, None)
            raise

    async def reload_unless_covered(
        self, actor: ModelActor, plan: LoadPlan
    ) -> ModelSnapshot | None:
        """A load of a loaded ``actor``: its row when the loaded copy serves ``plan``;
        else it is unloaded (decision ``reload``, with why) and None: load it anew."""
        reason = self._unmet(actor, plan)
        if reason is None:
            return actor.snapshot()
        self.decisions.record("reload", actor.name, f"the load asks for more: {reason}")
        await actor.unload()
        return None

    def _charge_load(self, actor: ModelActor, seconds: float) -> None:
        """The load of ``actor`` that a request started took ``seconds``: charge it."""
        cause = self._load_causes.pop(actor, None)
        if cause is not None and self.on_load_charged is not None:
            self.on_load_charged(actor, cause, seconds)

    @staticmethod
    def _hinted(actor: ModelActor, hint: Mapping[str, Any] | None) -> LoadPlan | None:
        """``hint`` as a plan for ``actor``; None (logged) if it does not suit it."""
        if not hint:
            return None
        try:
            return plan_load(hint, actor.definition)
        except (ValueError, PoolError) as exc:
            log.info("model=%s ignoring load hint %s: %s", actor.name, dict(hint), exc)
            return None

    async def _bring_back_evicted(self) -> None:
        """An ``enabled`` model the pool evicted loads again once it fits with nothing
        evicted for it, no other load waits for room and no request waits for it."""
        if self._on_demand or self._waiting_for_room or self.gate.reserved:
            return
        for actor in self.models.values():
            if not (
                actor.definition.enabled
                and not actor.definition.on_demand
                and actor.state == "unloaded"
                and actor.unload_reason == "evicted"
                and actor.queue_depth == 0
            ):
                continue
            plan = self._hinted(actor, actor.comeback) or plan_load(None, actor.definition)
            if self.gate.fit(self.gate.target(actor, plan)) is None:
                continue
            self.decisions.record(
                "comeback", actor.name, "evicted earlier; room freed and nothing waits for it"
            )
            assert self._nursery is not None
            self._nursery.start_soon(self._comeback, actor, plan)
            return  # one at a time: the next looks again after this one is placed

    async def _comeback(self, actor: ModelActor, plan: LoadPlan) -> None:
        try:
            await self.load(actor.name, plan)
        except PoolError as exc:
            log.info("model=%s did not come back: %s", actor.name, exc.message)

    # -- the VRAM gate (docs/vram.md) -----------------------------------------------------
    async def _make_room(
        self, actor: ModelActor, plan: LoadPlan, *, wait: bool
    ) -> Placements | None:
        """Find room for ``plan``: the GPUs of each replica (``()`` without GPUs).

        The reservation is taken under one lock, for every GPU of every replica at once
        (all or nothing, in GPU index order): two loads that each need a split cannot
        each hold half of what the other needs.

        Evicts idle models that the rules allow, one at a time, each followed by a
        bounded wait for the GPU source to show its memory back. ``wait`` (on-demand
        loads): while nothing may be evicted, wait for a change (an unload, a model going
        idle, every ``RECHECK_S``); after ``engine.warm_wait_s`` ask the best busy model
        to make way; give up (None) once no request waits for ``actor`` any more. Without
        ``wait`` (admin and startup loads) a load that does not fit fails.
        ``engine.max_loaded_models`` binds on-demand loads too.

        Raises:
            PoolError: ``load_failed`` when it cannot fit, even with every model gone
                that could be evicted for it (or, without ``wait``, now).
        """
        engine = self.settings.engine
        limit = engine.max_loaded_models if wait else 0
        target = self.gate.target(actor, plan)
        asked_at = trio.current_time()
        # How long this load leaves models in their stay-warm windows alone when only
        # they could make the room. No starvation: never past engine.warm_wait_s, nor past
        # half of what its first request's queue_timeout_s leaves after its own load.
        own_load_s, _ = reload_s(
            self.residences[actor.name].expected_load_s(), target.per_replica_mib * plan.replicas
        )
        spare_warm_until = asked_at + min(
            engine.warm_wait_s, max(0.0, actor.queue_timeout_s - own_load_s) / 2
        )

        def rules(*, taken: bool = False, evict_warm: bool | None = None) -> Rules:
            now = trio.current_time()
            if evict_warm is None:
                evict_warm = not (wait and now < spare_warm_until)
            return self.gate.rules(
                now, limit=limit, wait=wait, evict_warm=evict_warm, room_taken=taken
            )

        while True:
            async with self._room_lock:
                while True:
                    if wait and actor.queue_depth == 0:
                        return None
                    taken = False
                    outcome = self.gate.plan(target, rules())
                    if isinstance(outcome, Place):
                        self._waiting_for_room.discard(actor)
                        if await self._claim_lease(actor, outcome.gpus, target.per_replica_mib):
                            self.gate.reserved[actor] = outcome.gpus
                            self._release_yields(actor)
                            self._record_place(actor, plan, outcome.gpus, target)
                            return outcome.gpus
                        # Another holder took the room: evict or wait as if full.
                        taken = True
                        outcome = self.gate.plan(target, rules(taken=True))
                    if isinstance(outcome, Refuse):
                        self._refuse(actor, target, outcome.reason)
                    if isinstance(outcome, Evict) and outcome.steps:
                        step = outcome.steps[0]
                        assert step.victim is not None
                        if await self._evict_adapter(self.models[step.victim.name], actor):
                            continue  # re-planned without it: the base may stay
                        await self._evict(
                            self.models[step.victim.name],
                            actor,
                            tuple(self.models[m.name] for m in step.spared),
                        )
                        continue
                    if wait and isinstance(outcome, Wait):
                        victim = self.pausable_victim(actor, target, trio.current_time())
                        if victim is not None:
                            await self._preempt(victim, actor)
                            continue
                    break
            assert isinstance(outcome, Wait)  # a load that does not wait is placed or refused
            now = trio.current_time()
            held_warm = outcome.spared
            if actor not in self._waiting_for_room:
                self._waiting_for_room.add(actor)
                self.decisions.record(
                    "wait",
                    actor.name,
                    self._why_wait(held_warm, now, spare_warm_until),
                    **self.gate.room_numbers(target),
                )
                self.notify_change()  # its requests now know they wait for VRAM
            yield_at = asked_at + engine.warm_wait_s
            if now >= yield_at:
                self._ask_to_yield(actor, target, now)
            wake = [now + RECHECK_S, yield_at if yield_at > now else math.inf]
            if held_warm:
                ends = [until for m in held_warm if (until := m.warm_until) is not None]
                wake.append(min([spare_warm_until, *ends]))
            best = self.gate.plan(target, rules(taken=taken, evict_warm=True))
            if isinstance(best, Wait) and best.fresh is not None:
                wake.append(best.fresh.resident_since + engine.min_resident_s)
            with trio.move_on_at(min(wake)):
                await self._changed.wait()

    # -- pause and resume across a swap (docs/vram.md, "Pause and resume") ---------------
    def pausable_victim(
        self, actor: ModelActor, target: Target, now: float, *, asked: bool = False
    ) -> ModelActor | None:
        """The busy model whose room a load of ``actor`` takes by pausing its streams,
        when ``engine.preemption`` is not ``drain``, a request above ``low`` waits for
        ``actor`` (or, ``asked``, would: the preview), and a model that the rules let it
        evict runs only preemptible streams (``ModelActor.pausable``); the lowest
        priority, least recently used first."""
        engine = self.settings.engine
        if engine.preemption == "drain":
            return None
        if not asked and not actor.scheduler.queued_above("low"):
            return None
        views = [
            v
            for v in self.gate.views(now)
            if not v.idle
            and eligible_victim(v, incoming=target, now=now, min_resident_s=engine.min_resident_s)
        ]
        for view in sorted(views, key=lambda v: (v.priority, v.last_used_at)):
            victim = self.models[view.name]
            if victim not in self._yielding and victim.pausable:
                return victim
        return None

    async def _preempt(self, victim: ModelActor, incoming: ModelActor) -> None:
        """Pause (or, with ``engine.preemption: cut``, end) ``victim``'s streams for
        ``incoming``, then evict it. Its door closes first: a paused stream that comes
        back to it waits there until ``incoming`` is placed, then reloads it."""
        self._yielding.setdefault(victim, (trio.Event(), incoming))
        cut = self.settings.engine.preemption == "cut"
        if cut:
            streams = victim.pausable
            for ticket in streams:
                ticket.error = PoolError(
                    "preempted",
                    f"model {victim.name!r} was evicted for {incoming.name!r}, which a"
                    " request of a higher priority waits for (engine.preemption: cut)",
                )
                ticket.scope.cancel()
        else:
            streams = victim.pause_streams()
        ids = [getattr(t.request, "request_id", "") for t in streams]
        self.decisions.record(
            "cut" if cut else "pause",
            victim.name,
            f"{len(streams)} preemptible stream(s) {'cut' if cut else 'paused'} at a token"
            f" boundary: a request above low waits for {incoming.name!r} and only their"
            " model holds the room",
            for_model=incoming.name,
            requests=ids,
        )
        log.info(
            "model=%s %s %d stream(s) for model %s",
            victim.name,
            "cut" if cut else "paused",
            len(streams),
            incoming.name,
        )
        if self.on_pause is not None:
            self.on_pause(victim, len(streams), cut)
        await self._evict(victim, incoming)

    def _refuse(self, actor: ModelActor, target: Target, reason: str) -> NoReturn:
        self.decisions.record("refuse", actor.name, reason, **self.gate.room_numbers(target))
        raise PoolError("load_failed", reason)

    @staticmethod
    def _why_wait(held_warm: tuple[ResidenceView, ...], now: float, spare_until: float) -> str:
        if not held_warm:
            return (
                "no GPU has room and no idle model may be evicted for it now; waits"
                " for a model to go idle or unload"
            )
        return (
            "only models in their stay-warm windows could make the room; waits for a window"
            f" to end, {max(0.0, spare_until - now):.0f}s at most, then evicts: "
            + "; ".join(warm_note(m, now) for m in held_warm)
        )

    def _record_place(
        self, actor: ModelActor, plan: LoadPlan, gpus: Placements, target: Target
    ) -> None:
        where = ", ".join(
            "+".join(f"GPU {g}: {m} MiB" for g, m in zip(p.gpus, p.mib, strict=True)) for p in gpus
        )
        self.decisions.record(
            "place",
            actor.name,
            f"{plan.replicas} replica(s) of {target.per_replica_mib} MiB ({target.source}) fit"
            + (f" on {where}" if where else " (no GPU to gate)"),
            gpus=[list(p.gpus) for p in gpus],
            gpu_split_mib=[list(p.mib) for p in gpus],
        )

    def _ask_to_yield(self, actor: ModelActor, target: Target, now: float) -> None:
        """Warm promotion is over for ``actor``: the best busy model stops taking new
        requests (they wait at its door), serves what it has queued, then is evicted."""
        if any(claimant is actor for _, claimant in self._yielding.values()):
            return
        busy = [
            self.models[b.name]
            for b in eviction_candidates(
                self.gate.views(now),
                incoming=target,
                now=now,
                min_resident_s=self.settings.engine.min_resident_s,
                busy=True,
            )
        ]
        busy = [b for b in busy if b not in self._yielding]
        if busy:
            log.info("model=%s asks busy model %s to make way", actor.name, busy[0].name)
            self.decisions.record(
                "yield",
                busy[0].name,
                f"{actor.name!r} waited engine.warm_wait_s for room; the busy model stops"
                " taking new requests, serves its queue, then is evicted",
                for_model=actor.name,
            )
            self._yielding[busy[0]] = (trio.Event(), actor)

    def _release_yields(self, actor: ModelActor) -> None:
        for victim, (door, claimant) in list(self._yielding.items()):
            if claimant is actor:
                del self._yielding[victim]
                door.set()

    def _release(self, actor: ModelActor) -> None:
        self.gate.reserved.pop(actor, None)
        self._waiting_for_room.discard(actor)
        self._release_yields(actor)
        if self.ledger is not None:
            self.ledger.poke()

    async def _claim_lease(self, actor: ModelActor, gpus: Placements, per_replica: int) -> bool:
        """Take the shared ledger's lease for a load the local gate let through."""
        wanted = {i: mib for i, mib in charges(gpus, per_replica).items() if mib > 0}
        if self.ledger is None or not wanted:
            return True
        reserve = self.settings.engine.gpu_reserve_mib
        free = {
            g.index: g.total_mib - g.used_mib - reserve
            for g in self.gpus.view().gpus
            if not g.virtual
        }
        refused = await self.ledger.claim(actor.name, wanted, free)
        if refused is not None:
            log.info("model=%s the shared lease ledger refused: %s", actor.name, refused)
        return refused is None

    async def _evict_adapter(self, victim: ModelActor, incoming: ModelActor) -> bool:
        """Before the planner's ``victim`` goes, evict the least recently used LoRA adapter
        held on its GPUs alone (docs/backends.md, "LoRA adapters"); False when none is."""
        gpus = victim.placed_gpus()
        held = [
            (actor.adapter_last_used(name), actor, name)
            for actor in self.models.values()
            if actor.placed_gpus() & gpus or actor is victim
            for name in actor.resident_adapters
        ]
        if not held:
            return False
        last_used, base, name = min(held, key=lambda entry: entry[0])
        idle = (
            "never used" if not last_used else f"last used {time.monotonic() - last_used:.0f} s ago"
        )
        self.decisions.record(
            "evict",
            name,
            f"least recently used LoRA adapter on GPU(s) {sorted(gpus)} ({idle}), evicted alone"
            f" before its base {base.name!r} or any model is considered",
            for_model=incoming.name,
        )
        await base.evict_adapter(name)
        return True

    def preview_adapter(self, base: str, adapter: LoraAdapter) -> dict[str, Any]:
        """What adding ``adapter`` to ``base`` would do now, changing nothing, in the
        shape of a load preview: whether it fits on the base's GPUs (its file on each
        replica's), and the refusal it would answer."""
        actor = self.model(base)
        answer: dict[str, Any] = {
            "model": base,
            "state": actor.state,
            "fits": False,
            "gpus": [],
            "gpu_split_mib": [],
            "evict": [],
            "wait_for": [],
            "spared_warm": [],
            "need_mib": 0,
            "estimate_source": "adapter_file_size",
            "expected_load_s": None,
            "error": None,
        }
        try:
            need = actor.check_adapter(adapter)
        except PoolError as exc:
            answer.update(error=exc.code, reason=exc.message)
            return answer
        answer["need_mib"] = need
        fits, reason = self.adapter_room(actor, need)
        placement = actor.placement if actor.state == "loaded" else ()
        answer.update(
            fits=fits,
            reason=reason,
            gpus=[list(p.gpus) for p in placement],
            gpu_split_mib=[
                [round(need * share) for share in p.split] if p.split else [need] * len(p.gpus)
                for p in placement
            ],
            error=None if fits else "load_failed",
        )
        return answer

    def adapter_room(self, actor: ModelActor, need: int) -> tuple[bool, str]:
        """Whether ``need`` MiB more per replica fits on the loaded ``actor``'s GPUs."""
        if actor.state != "loaded":
            return True, (
                f"the base is {actor.state}: the adapter loads with it, adding {need} MiB per"
                " replica to its estimate"
            )
        if not actor.placement or not self.gpus.view().gpus:
            return True, "the base holds no GPU: the adapter loads into it now"
        views = self.gate.views(trio.current_time())
        # Named apart from the base, so the room counts what the base holds now.
        target = Target(
            name=f"{actor.name}#adapter",
            priority=actor.definition.priority,
            per_replica_mib=need,
            source="adapter_file_size",
            replicas=len(actor.replicas),
        )
        free = planner_room(target, views, self.gate.gpu_room()) or {}
        wanted = charges(actor.placement, need, replicas=len(actor.replicas))
        short = {gpu: mib for gpu, mib in wanted.items() if free.get(gpu, 0) < mib}
        if short:
            return False, f"no room for {need} MiB per replica on GPU(s) {sorted(short)}"
        return True, f"{need} MiB per replica on the base's GPUs; it loads without a reload"

    async def _evict(
        self, victim: ModelActor, incoming: ModelActor, spared: tuple[ModelActor, ...] = ()
    ) -> None:
        """Unload ``victim`` (idle) for ``incoming``, then wait (bounded) for its memory."""
        log.info(
            "model=%s evicting model %s (priority %d, larger is kept longer; placed on %s)",
            incoming.name,
            victim.name,
            victim.definition.priority,
            victim.placed_on,
        )
        # Its door closes first, before anything here waits: a request for it that
        # arrives now waits for the eviction to finish (and then reloads it) instead of
        # joining a model about to unload, whose unload would refuse it if still queued.
        self._yielding.setdefault(victim, (trio.Event(), incoming))
        # A model that can sleep keeps its weights in host RAM where the host has it.
        residence = self.residences[victim.name]
        need = residence.sleep_ram_mib()
        ram = await trio.to_thread.run_sync(read_host_ram) if need is not None else None
        sleep, how = sleep_verdict(need, ram)
        why = self.gate.why_evict(victim, spared) + (f"; {how}" if how else "")
        self.decisions.record("evict", victim.name, why, for_model=incoming.name, sleep=sleep)
        view = self.gpus.view()
        expected = residence.releases()
        before = {g.index: held_mib(g) for g in view.gpus}
        # Loads under way may finish meanwhile: what they then hold is not the victim's.
        others_before = self.gate.charges(exclude=[victim])[0]
        self.evictions += 1
        try:
            await victim.unload("evicted", sleep=sleep)
        except PoolError as exc:
            log.warning("model=%s eviction of %s failed: %s", incoming.name, victim.name, exc)
            return
        if not view.gpus or not any(expected.values()):
            return
        with trio.move_on_after(RECLAIM_WAIT_S):
            while True:
                now = {g.index: held_mib(g) for g in (await self.meter.refresh()).gpus}
                others = self.gate.charges(exclude=[victim])[0]
                if all(
                    now.get(i, 0) - max(0, others.get(i, 0) - others_before.get(i, 0))
                    <= before.get(i, 0) - mib // 2
                    for i, mib in expected.items()
                ):
                    return
                await trio.sleep(RECLAIM_POLL_S)
        log.warning(
            "model=%s memory of evicted model %s not back after %.0fs; going on",
            incoming.name,
            victim.name,
            RECLAIM_WAIT_S,
        )

    # -- what a waiting request waits for (docs/vram.md, "The client sees the wait") -----
    def door(self, actor: ModelActor) -> trio.Event | None:
        """Set when ``actor`` stops making way for another model; None: it does not."""
        held = self._yielding.get(actor)
        return None if held is None else held[0]

    def door_closed(self, actor: ModelActor) -> bool:
        """Whether new requests for ``actor`` wait at its door (it makes way for another
        model, or an on-demand model is unloading)."""
        unloading = actor.definition.on_demand and actor.state == "unloading"
        return actor in self._yielding or unloading

    def wait_reason(self, actor: ModelActor) -> WaitReason | None:
        """What a queued request of ``actor`` waits for now; None while its on-demand
        load has not been through the VRAM gate yet (room or not is not known)."""
        if actor.state == "loaded":
            return "replica"
        if actor.state == "loading" or actor in self.gate.reserved:
            return "load"
        if self.door_closed(actor) or actor in self._waiting_for_room:
            return "vram"
        if actor in self._on_demand:
            return None
        return "load"
