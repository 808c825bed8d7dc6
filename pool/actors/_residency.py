"""The residency owner: the one way a model is loaded, reloaded or evicted.

Every entry point (admin, runner API, startup, on-demand requests, Ollama preload,
pulls, the cluster) hands :class:`Residency` a load request. It validates it once
(:func:`plan_load`), places it on the GPUs (the VRAM gate: ``_vram.py``), evicts what
the rules allow (``_eviction.py``), claims the shared lease, waits where a load may
wait, and hands the model actor an already validated and placed plan
(:meth:`ModelActor.load_placed`). Each placement, eviction, wait and refusal is
recorded with its reason (``_decisions.py``). docs/vram.md tells the rules.

It reads the model actors through their narrow methods only (``holding``,
``releases``, ``idle``, ``queue_depth``...), never their placement or replicas.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterable, Mapping
from typing import Any

import trio

from pool.actors._decisions import DecisionLog
from pool.actors._events import WaitReason
from pool.actors._eviction import choose_victim, eviction_candidates, swap_cost
from pool.actors._gpu import GpuSource
from pool.actors._ledger import SharedLedger
from pool.actors._model import ModelActor
from pool.actors._plan import LoadPlan, plan_load
from pool.actors._snapshots import GpuReading, GpuView, ModelSnapshot
from pool.actors._vram import CudaContexts, LoadMeter, charges, gpu_ceilings, gpu_room, place
from pool.backends import GpuPlacement, LoadRequest
from pool.config import Settings
from pool.errors import PoolError

log = logging.getLogger("pool")

# A load waiting for room re-reads the GPUs at least this often (besides every change).
RECHECK_S = 5.0
# After an eviction: how long to wait for the GPU source to show the memory back, and
# how often to look (CUDA hands memory back some time after the process lets go).
RECLAIM_WAIT_S = 10.0
RECLAIM_POLL_S = 0.25

Placements = tuple[GpuPlacement, ...]


def _held(gpu: GpuReading) -> int:
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
        ledger: SharedLedger | None,
    ) -> None:
        self.settings = settings
        self.models = models
        self.gpus = gpus
        self.contexts = contexts
        self.meter = meter
        self.ledger = ledger
        self.decisions = DecisionLog()
        self.evictions = 0
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self._was_unloading = False
        # Loads that the gate let through, with the GPUs of each replica, until they are
        # `loading`; evictions and the decisions that lead to them, one at a time;
        # models asked to make way (new requests wait at their door), with who asked.
        self._reserved: dict[ModelActor, Placements] = {}
        self._room_lock = trio.Lock()
        self._yielding: dict[ModelActor, tuple[trio.Event, ModelActor]] = {}
        # On-demand loads that found no room and wait for it (their requests wait for VRAM).
        self._waiting_for_room: set[ModelActor] = set()
        # On-demand loads under way, with the overrides their first request hinted at.
        self._on_demand: dict[ModelActor, dict[str, Any]] = {}

    def model(self, name: str) -> ModelActor:
        try:
            return self.models[name]
        except KeyError:
            raise PoolError("unknown_model", f"model {name!r} is not configured") from None

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Carry out the owner's background work: evicted ``enabled`` models come back
        when room frees."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            while True:
                await self._changed.wait()
                await self._bring_back_evicted()

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
        self, name: str, body: LoadPlan | LoadRequest | Mapping[str, Any] | None = None
    ) -> ModelSnapshot:
        """Load a configured model; its snapshot when the load has finished.

        On GPUs (real or virtual) the load must fit: idle models that may be evicted for
        it are unloaded first; if it still does not fit it fails with ``load_failed`` at
        once rather than waiting.
        """
        actor = self.model(name)
        plan = body if isinstance(body, LoadPlan) else plan_load(body, actor.definition)
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
        as on an on-demand load."""
        actor = self.model(name)
        plan = self._hinted(actor, hint) if actor.state in ("unloaded", "failed") else None
        return await self.load(name, plan)

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
        it would wait for, the expected load time (None before a measured load), and the
        refusal (``error``, ``reason``) it would answer. Run the load right after, with
        nothing changed between, and it does what this says (the shared lease ledger
        aside: its answer is only known when the lease is claimed).

        Raises:
            PoolError: ``unknown_model`` or ``invalid_load_request`` (as the load would).
        """
        actor = self.model(name)
        plan = body if isinstance(body, LoadPlan) else plan_load(body, actor.definition)
        per_replica, source = self._per_replica(actor, plan)
        answer: dict[str, Any] = {
            "model": name,
            "state": actor.state,
            "fits": False,
            "gpus": [],
            "gpu_split_mib": [],
            "evict": [],
            "wait_for": [],
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
        while True:
            gpus = self._fit(actor, plan, per_replica, gone)
            if gpus is not None:
                answer.update(
                    fits=True,
                    gpus=[list(p.gpus) for p in gpus],
                    gpu_split_mib=[list(p.mib) for p in gpus],
                    evict=[v.name for v in gone],
                    reason="fits"
                    + (
                        f" once {', '.join(v.name for v in gone)}"
                        f" {'is' if len(gone) == 1 else 'are'} evicted"
                        if gone
                        else ""
                    ),
                )
                return answer
            victim = None
            if self._could_ever_fit(actor, plan, per_replica):
                victim = self._best_victim(actor, plan, per_replica, 0, gone)
            if victim is None:
                busy = [
                    a.name
                    for a in eviction_candidates(
                        self.models.values(), incoming=actor, now=trio.current_time(), busy=True
                    )
                ]
                answer.update(
                    error="load_failed",
                    reason=self._refusal(actor, plan, per_replica, source),
                    wait_for=busy,
                    evict=[v.name for v in gone],  # a real load evicts these, then refuses
                    room_mib=self._room(actor),
                )
                return answer
            gone.append(victim)

    # -- on-demand loads (ModelActor's OnDemandLoader) ------------------------------------
    def request(self, actor: ModelActor, hint: dict[str, Any] | None) -> None:
        """A request for ``actor`` (not loaded) waits: load it unless a load is pending.

        The load belongs to the owner, not to the request that triggered it: a client
        that leaves does not cancel a load other requests may be waiting for."""
        if actor in self._on_demand or self._nursery is None:
            return
        self._on_demand[actor] = dict(hint or {})
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
                await actor.load_placed(plan, gpus)
        except PoolError as exc:
            log.warning("model=%s on-demand load failed: %s", actor.name, exc.message)
            if exc.code == "load_failed" and actor.state != "failed":
                # The gate refused it for good (it can never fit): fail the waiters now.
                actor.reject_waiting(PoolError("model_failed", exc.message))
        finally:
            self._release(actor)
            del self._on_demand[actor]
        # Requests that arrived after a failed load was answered wait for a new one.
        if actor.queue_depth and actor.state in ("unloaded", "failed"):
            self.request(actor, None)

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
        if self._on_demand or self._waiting_for_room or self._reserved:
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
            per_replica = self._per_replica(actor, plan)[0]
            if self._fit(actor, plan, per_replica) is None:
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
    def runtime_holdings(self) -> list[tuple[int, int]]:
        """(GPU, MiB) every loaded replica's runtime holds (what virtual GPUs show)."""
        return [held for actor in self.models.values() for held in actor.runtime_holdings()]

    def _holding(self, actor: ModelActor) -> tuple[dict[int, int], bool] | None:
        """MiB per GPU ``actor`` holds or is about to hold, and whether it is still a
        load under way (reserved or loading); None when it holds nothing."""
        if actor in self._reserved and actor.state in ("unloaded", "failed"):
            return _planned(self._reserved[actor]), True
        if actor.state in ("loading", "loaded", "unloading"):
            return actor.holding(), actor.state == "loading"
        return None

    def charges(self, exclude: Iterable[ModelActor] = ()) -> tuple[dict[int, int], dict[int, int]]:
        """MiB per GPU charged to loaded models, and to loads under way or reserved."""
        skip = set(exclude)
        loaded: dict[int, int] = {}
        pending: dict[int, int] = {}
        for actor in self.models.values():
            held = None if actor in skip else self._holding(actor)
            if held is not None:
                into = pending if held[1] else loaded
                for index, mib in held[0].items():
                    into[index] = into.get(index, 0) + mib
        return loaded, pending

    def lease_holdings(self) -> dict[str, dict[int, int]]:
        """MiB per GPU of every model that holds or is about to hold memory."""
        held = {a.name: self._holding(a) for a in self.models.values()}
        return {name: h[0] for name, h in held.items() if h is not None}

    def budgets(self) -> dict[int, int]:
        engine = self.settings.engine
        return gpu_ceilings(
            self.gpus.view(), reserve_mib=engine.gpu_reserve_mib, caps_mib=engine.gpu_budget_mib
        )

    def _per_replica(self, actor: ModelActor, plan: LoadPlan) -> tuple[int, str]:
        definition = plan.effective(actor.definition)
        estimate = actor.vram_estimate(definition=definition, replicas=plan.replicas)
        return estimate.per_replica_mib or 0, estimate.source

    def _place(
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

    def _room(self, actor: ModelActor, gone: Iterable[ModelActor] = ()) -> dict[int, int] | None:
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

    def _fit(
        self,
        actor: ModelActor,
        plan: LoadPlan,
        per_replica: int,
        gone: Iterable[ModelActor] = (),
    ) -> Placements | None:
        """Where ``actor``'s replicas would go now (``gone`` unloaded first); ``()`` when
        there is no GPU to gate."""
        room = self._room(actor, gone)
        if room is None:
            return ()
        return self._place(actor, plan, room, per_replica)

    def _could_ever_fit(self, actor: ModelActor, plan: LoadPlan, per_replica: int) -> bool:
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
        return self._place(actor, plan, room, per_replica) is not None

    def _loaded_count(self, exclude: ModelActor, gone: Iterable[ModelActor] = ()) -> int:
        # Reserved: loads that made room but have not reached `loading` yet.
        skip = {exclude, *gone}
        return sum(
            1
            for a in self.models.values()
            if a not in skip and (a.state in ("loaded", "loading") or a in self._reserved)
        )

    def _best_victim(
        self,
        actor: ModelActor,
        plan: LoadPlan,
        per_replica: int,
        limit: int,
        gone: list[ModelActor] | None = None,
    ) -> ModelActor | None:
        """The idle model the policy picks for ``actor``, however fresh."""
        gone = gone or []
        candidates = eviction_candidates(
            (a for a in self.models.values() if a not in gone),
            incoming=actor,
            now=trio.current_time(),
        )

        def suffices(victim: ModelActor) -> bool:
            after = [*gone, victim]
            if limit and self._loaded_count(actor, after) >= limit:
                return False
            return self._fit(actor, plan, per_replica, after) is not None

        return choose_victim(
            candidates,
            now=trio.current_time(),
            policy=self.settings.engine.eviction_policy,
            suffices=suffices,
        )

    def _is_fresh(self, victim: ModelActor) -> bool:
        # The same sum as the wake-up time below: a difference may round the other way,
        # and a load would then wake at once, again and again, without the clock moving.
        return trio.current_time() < victim.resident_since + self.settings.engine.min_resident_s

    def _why_evict(self, victim: ModelActor) -> str:
        rank = f"priority {victim.definition.priority}"
        if self.settings.engine.eviction_policy == "lru":
            return f"{rank}, least recently used of the idle models that may be evicted"
        cost = swap_cost(victim, trio.current_time())
        return f"{rank}, cheapest to lose of the idle models that may be evicted: {cost.describe()}"

    def _refusal(self, actor: ModelActor, plan: LoadPlan, per_replica: int, source: str) -> str:
        if not self._could_ever_fit(actor, plan, per_replica):
            return (
                f"model {actor.name!r} needs {per_replica} MiB per replica ({source})"
                f" x {plan.replicas}: more than the GPUs can give it"
            )
        return (
            f"model {actor.name!r} needs {per_replica} MiB per replica ({source});"
            " no GPU has room and no idle model may be evicted for it now"
        )

    def _room_numbers(self, actor: ModelActor, per_replica: int) -> dict[str, Any]:
        room = self._room(actor)
        return {"need_mib": per_replica, "room_mib": None if room is None else room}

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
        per_replica, source = self._per_replica(actor, plan)
        asked_at = trio.current_time()
        while True:
            async with self._room_lock:
                while True:
                    if wait and actor.queue_depth == 0:
                        return None
                    gpus = self._fit(actor, plan, per_replica)
                    if gpus is not None and (not limit or self._loaded_count(actor) < limit):
                        self._waiting_for_room.discard(actor)
                        if await self._claim_lease(actor, gpus, per_replica):
                            self._reserved[actor] = gpus
                            self._release_yields(actor)
                            self._record_place(actor, plan, gpus, per_replica, source)
                            return gpus
                        gpus = None  # another holder took the room: evict or wait as if full
                    if gpus is None and not self._could_ever_fit(actor, plan, per_replica):
                        reason = self._refusal(actor, plan, per_replica, source)
                        self.decisions.record(
                            "refuse", actor.name, reason, **self._room_numbers(actor, per_replica)
                        )
                        raise PoolError("load_failed", reason)
                    victim = self._best_victim(actor, plan, per_replica, limit)
                    if victim is None or (wait and self._is_fresh(victim)):
                        break
                    await self._evict(victim, actor)
            if not wait:
                reason = self._refusal(actor, plan, per_replica, source)
                self.decisions.record(
                    "refuse", actor.name, reason, **self._room_numbers(actor, per_replica)
                )
                raise PoolError("load_failed", reason)
            if actor not in self._waiting_for_room:
                self._waiting_for_room.add(actor)
                self.decisions.record(
                    "wait",
                    actor.name,
                    "no GPU has room and no idle model may be evicted for it now; waits"
                    " for a model to go idle or unload",
                    **self._room_numbers(actor, per_replica),
                )
                self.notify_change()  # its requests now know they wait for VRAM
            now = trio.current_time()
            warm_until = asked_at + engine.warm_wait_s
            if now >= warm_until:
                self._ask_to_yield(actor, now)
            wake = [now + RECHECK_S, warm_until if warm_until > now else math.inf]
            best = self._best_victim(actor, plan, per_replica, limit)
            if best is not None:
                wake.append(best.resident_since + engine.min_resident_s)
            with trio.move_on_at(min(wake)):
                await self._changed.wait()

    def _record_place(
        self, actor: ModelActor, plan: LoadPlan, gpus: Placements, per_replica: int, source: str
    ) -> None:
        where = ", ".join(
            "+".join(f"GPU {g}: {m} MiB" for g, m in zip(p.gpus, p.mib, strict=True)) for p in gpus
        )
        self.decisions.record(
            "place",
            actor.name,
            f"{plan.replicas} replica(s) of {per_replica} MiB ({source}) fit"
            + (f" on {where}" if where else " (no GPU to gate)"),
            gpus=[list(p.gpus) for p in gpus],
            gpu_split_mib=[list(p.mib) for p in gpus],
        )

    def _ask_to_yield(self, actor: ModelActor, now: float) -> None:
        """Warm promotion is over for ``actor``: the best busy model stops taking new
        requests (they wait at its door), serves what it has queued, then is evicted."""
        if any(claimant is actor for _, claimant in self._yielding.values()):
            return
        busy = eviction_candidates(
            self.models.values(),
            incoming=actor,
            now=now,
            min_resident_s=self.settings.engine.min_resident_s,
            busy=True,
        )
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
        self._reserved.pop(actor, None)
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

    async def _evict(self, victim: ModelActor, incoming: ModelActor) -> None:
        """Unload ``victim`` (idle) for ``incoming``, then wait (bounded) for its memory."""
        log.info(
            "model=%s evicting model %s (priority %d, placed on %s)",
            incoming.name,
            victim.name,
            victim.definition.priority,
            victim.placed_on,
        )
        self.decisions.record(
            "evict", victim.name, self._why_evict(victim), for_model=incoming.name
        )
        # Its door closes first: a request for it that arrives now waits for the eviction
        # to finish (and then reloads it) instead of being refused by the unload.
        self._yielding.setdefault(victim, (trio.Event(), incoming))
        view = self.gpus.view()
        expected = victim.releases()
        before = {g.index: _held(g) for g in view.gpus}
        # Loads under way may finish meanwhile: what they then hold is not the victim's.
        others_before = self.charges(exclude=[victim])[0]
        self.evictions += 1
        try:
            await victim.unload("evicted")
        except PoolError as exc:
            log.warning("model=%s eviction of %s failed: %s", incoming.name, victim.name, exc)
            return
        if not view.gpus or not any(expected.values()):
            return
        with trio.move_on_after(RECLAIM_WAIT_S):
            while True:
                now = {g.index: _held(g) for g in (await self.meter.refresh()).gpus}
                others = self.charges(exclude=[victim])[0]
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
        if actor.state == "loading" or actor in self._reserved:
            return "load"
        if self.door_closed(actor) or actor in self._waiting_for_room:
            return "vram"
        if actor in self._on_demand:
            return None
        return "load"


def _planned(placements: Placements) -> dict[int, int]:
    """MiB per GPU that reserved placements were planned with."""
    into: dict[int, int] = {}
    for placement in placements:
        for index, mib in zip(placement.gpus, placement.mib, strict=True):
            into[index] = into.get(index, 0) + mib
    return into
