"""The model actor: one per configured model, alive for the life of the pool.

It owns the model's runtime state, its scheduler and its replicas. Load and unload
arrive as commands in a bounded inbox and are carried out one at a time, so no two
lifecycle changes ever interleave. Status is read straight from the actor's fields:
Trio runs every task on one thread, and the actor only changes them between awaits.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

import trio

from pool.actors.models._metrics import PoolMetrics
from pool.actors.models._probe import ProbeAnswer, run_probe
from pool.actors.models._replica import Replica
from pool.actors.models._scheduler import Scheduler
from pool.actors.models._stats import RecentStats
from pool.actors.models._ticket import Ticket
from pool.actors.values._details import ModelDetails
from pool.actors.values._snapshots import (
    AdapterView,
    CanaryStatus,
    ModelSnapshot,
    OutOfMemory,
    RuntimeState,
    UnloadReason,
    VramEstimate,
)
from pool.backends import (
    AdapterRuntime,
    AdapterUse,
    Backend,
    Capabilities,
    EmbeddingJob,
    GenerationRequest,
    GpuPlacement,
    LoadContext,
    SleepingRuntime,
    TaskJob,
    get_backend,
    out_of_memory,
)
from pool.config import (
    EngineSettings,
    LoraAdapter,
    ModelDefinition,
    Settings,
    resolve_model_path,
)
from pool.errors import BackendError, PoolError

log = logging.getLogger("pool.model")

STATE_DESCRIPTIONS: dict[str, str] = {
    "unloaded": (
        "Known from config, no runtime; requests are rejected (an on_demand model, or one"
        " the pool evicted, loads on its next request instead); may be loaded."
    ),
    "loading": "A load is under way; requests are rejected; a second load returns this row.",
    "loaded": "Replicas are up and serving requests.",
    "unloading": (
        "No new requests; queued ones were cancelled; running ones finish first"
        " (within engine.unload_drain_s)."
    ),
    "failed": "The last load failed (see last_error); requests are rejected; may be loaded again.",
}


class PlacedLoad(Protocol):
    """A load the residency owner validated and placed (its LoadPlan): what the actor
    needs of it to carry it out."""

    @property
    def replicas(self) -> int: ...
    @property
    def patch(self) -> Mapping[str, Any]: ...
    @property
    def explicit(self) -> bool: ...
    def effective(self, current: ModelDefinition) -> ModelDefinition: ...


class ResidenceFacts(Protocol):
    """The residency owner's record of this model (pool/actors/residency/_residence.py): the
    actor reports what happened to it, and reads back what its snapshot shows. The
    numbers (estimates, footprints, load times, keep-alive) are the record's."""

    async def read_files(self, model_path: str | None) -> None: ...
    async def loading(self) -> None: ...
    def load_abandoned(self) -> None: ...
    async def loaded(self) -> None: ...
    def woke(self) -> None: ...
    def ready(self, idle: bool) -> None: ...
    def keep_alive_for(self, asked: float | str | None) -> float | None: ...
    def used(self, keep_alive_s: float | None) -> None: ...
    def went_idle(self) -> None: ...
    async def unloaded(self, *, replicas: int, slept: bool) -> None: ...
    def replica_faulty(self, fault: Literal["hang", "exit"], replica: int, reason: str) -> bool: ...
    def failed(self) -> None: ...
    def vram_estimate(
        self, *, definition: ModelDefinition | None = None, replicas: int | None = None
    ) -> VramEstimate: ...
    @property
    def keep_alive_s(self) -> float | None: ...
    @property
    def expires_in_s(self) -> float | None: ...
    @property
    def observed_load_delta_mib(self) -> int | None: ...
    @property
    def artifact_mib(self) -> int | None: ...
    @property
    def details(self) -> ModelDetails: ...
    @property
    def canary_status(self) -> CanaryStatus | None: ...


@dataclass(slots=True)
class _Command:
    kind: Literal[
        "load",
        "unload",
        "replica_failed",
        "replica_hung",
        "set_model_path",
        "reload",
        "fail",
        "add_adapter",
        "remove_adapter",
        "evict_adapter",
    ]
    plan: PlacedLoad | None = None
    adapter: LoraAdapter | None = None
    reason: str = ""
    unload_reason: UnloadReason = "requested"
    # An eviction that puts the replicas to sleep instead of closing them.
    sleep: bool = False
    replica: Replica | None = None
    model_path: str | None = None
    # The GPUs of each replica, chosen by the pool's VRAM gate.
    gpus: tuple[GpuPlacement, ...] = ()
    reply: trio.MemorySendChannel[ModelSnapshot | PoolError] | None = None


@dataclass(frozen=True, slots=True)
class Sleepers:
    """Replicas an eviction put to sleep: their GPU memory is free (the pool counts the
    model as unloaded there), their weights are in host RAM (``ram_mib``). A load of
    the same definition and replica count placed on the same GPUs wakes them; any
    other load closes them first."""

    replicas: list[Replica]
    definition: ModelDefinition
    placement: tuple[GpuPlacement, ...]
    ram_mib: int

    def fits(
        self, definition: ModelDefinition, replicas: int, gpus: tuple[GpuPlacement, ...]
    ) -> bool:
        return (
            definition == self.definition
            and replicas == len(self.replicas)
            and [p.gpus for p in gpus] == [p.gpus for p in self.placement]
        )


@dataclass(frozen=True, slots=True)
class _SameLoad:
    """The load the model has, again (a reload): its replicas, overrides, definition."""

    replicas: int
    patch: Mapping[str, Any]
    definition: ModelDefinition
    explicit: bool = False

    def effective(self, current: ModelDefinition) -> ModelDefinition:
        return self.definition


class OnDemandLoader(Protocol):
    """Who carries out on-demand loads (the pool: a load outlives its first request)."""

    def request(
        self, actor: ModelActor, hint: dict[str, Any] | None, cause: Ticket | None = None
    ) -> None:
        """Start loading ``actor`` unless a load is pending; ``hint``: load overrides;
        ``cause``: the request that found it unloaded (charged with the load's seconds)."""

    def pending(self, actor: ModelActor) -> bool: ...


def _collapse(exc: BaseException) -> BaseException:
    """The single leaf of nested one-exception groups (nursery.start may wrap)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


class ModelActor:
    def __init__(
        self,
        name: str,
        definition: ModelDefinition,
        settings: Settings,
        *,
        metrics: PoolMetrics | None = None,
        on_change: Callable[[], None] | None = None,
        loader: OnDemandLoader | None = None,
        residence: Callable[[ModelActor], ResidenceFacts],
        on_recent_prompts: Callable[[], None] | None = None,
    ) -> None:
        self.name = name
        self.definition = definition
        self.settings = settings
        self.engine: EngineSettings = settings.engine
        self.backend: Backend = get_backend(definition.backend)
        self.state: RuntimeState = "unloaded"
        self.last_error: str | None = None
        # The latest GPU out-of-memory its runtime reported (a load, a request, a crash);
        # /health reports it for service.health_oom_window_s.
        self.out_of_memory: OutOfMemory | None = None
        # Why the model was last unloaded, until it loads again (docs/vram.md): a model
        # the pool evicted comes back on its next request, with the load it had.
        self.unload_reason: UnloadReason | None = None
        self._comeback: dict[str, Any] | None = None
        self.load_override: dict[str, Any] = {}
        self.active_definition: ModelDefinition = definition
        self.selected_replicas = definition.replicas
        self.replicas: list[Replica] = []
        max_queue = (
            definition.max_queue if definition.max_queue is not None else self.engine.max_queue
        )
        # The LoRA adapters served on this model (settings, then the admin API); every
        # load takes the current set, so they come back with the model.
        self.adapters: dict[str, LoraAdapter] = {a.name: a for a in definition.lora_adapters}
        self._adapter_sizes: dict[str, float] = {}
        # The adapters the running replicas were loaded with: a measurement of that load
        # includes them; one added since is counted by its file size on top.
        self._sizes_at_load: dict[str, float] = {}
        self._adapter_uses: dict[str, tuple[int, float]] = {}
        # Adapters the pool evicted alone (their runtimes gave them back); each comes back
        # with its next request. Their files, resolved once.
        self.evicted_adapters: set[str] = set()
        self._adapter_files: dict[str, Path] = {}
        group_wait_ms = (
            definition.adapter_group_wait_ms
            if definition.adapter_group_wait_ms is not None
            else self.engine.adapter_group_wait_ms
        )
        # None where the backend applies any adapter to any request (nothing to group).
        self.adapter_group_wait_ms = group_wait_ms if self.backend.groups_adapters else None
        self.scheduler = Scheduler(
            max_queue,
            on_idle=self._on_idle,
            stats=RecentStats(settings.service.stats_window),
            affinity=self.engine.prefix_affinity,
            # Told to peers only where there are peers (engine.cluster).
            recent_prompts=self.engine.cluster.affinity_keys
            if self.engine.cluster.redis_url
            else 0,
            on_recent_prompts=on_recent_prompts,
            adapter_group_wait_s=(self.adapter_group_wait_ms or 0.0) / 1000.0,
        )
        self.metrics = metrics
        self.queue_timeout_s = (
            definition.queue_timeout_s
            if definition.queue_timeout_s is not None
            else self.engine.queue_timeout_s
        )
        self._idle = trio.Event()
        self._idle.set()
        self._state_changed = trio.Event()
        self._inbox_send, self._inbox_recv = trio.open_memory_channel[_Command](
            self.engine.command_inbox_size
        )
        self._nursery: trio.Nursery | None = None
        # The GPUs of each replica (from the pool's gate).
        self.placement: tuple[GpuPlacement, ...] = ()
        # How far the load under way has come (0..1), per replica, where reported.
        self._progress: dict[int, float] = {}
        # Trio clock time the state last became "loading" (a load's ETA counts from here).
        self.loading_since = 0.0
        self.loaded_at: float | None = None
        self.loaded_at_wall: float | None = None
        # When the latest load ended (perf_counter): a request's trace ends its load wait
        # there (pool/tracing).
        self.ready_at: float | None = None
        self.last_used_at: float = time.monotonic()
        self.load_count = 0
        self.unload_count = 0
        # Replicas asleep since an eviction (their GPU memory handed back, weights in
        # host RAM), woken by the next load of the same plan; how often that happened.
        self._asleep: Sleepers | None = None
        self.wake_count = 0
        # The replica the next output canary runs on (they take turns).
        self._probe_turn = 0
        # Pool-level hooks: ``on_change`` wakes whoever waits for room (eviction);
        # ``loader`` starts on-demand loads, which the pool owns.
        self._on_change = on_change
        self._loader = loader
        # The residency owner's record of this model: what happens here is reported to
        # it; the numbers (estimates, footprints, load times, keep-alive) are its own.
        self.residence = residence(self)

    # -- lifecycle of the actor itself -------------------------------------------
    async def run(
        self, *, task_status: trio.TaskStatus[ModelActor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await self.residence.read_files(self.definition.model_path)
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                task_status.started(self)
                with self._inbox_recv:
                    async for command in self._inbox_recv:
                        await self._handle(command)
        finally:
            # Pool shutdown: nobody may stay parked in the queue of a dead model.
            self.scheduler.fail_queued(PoolError("shutting_down", "the pool is shutting down"))
            self._set_state("unloaded" if self.state != "failed" else "failed")

    # -- facade: called from other tasks -----------------------------------------
    @property
    def capabilities(self) -> Capabilities:
        return self.backend.capabilities(self.active_definition)

    @property
    def load_pending(self) -> bool:
        """Whether an on-demand load was asked for and has not ended yet."""
        return self._loader is not None and self._loader.pending(self)

    @property
    def effective_target_inflight(self) -> int:
        return max(1, self.backend.effective_target_inflight(self.active_definition))

    async def load_placed(self, plan: PlacedLoad, gpus: tuple[GpuPlacement, ...]) -> ModelSnapshot:
        """Carry out a load the residency owner let through (or return the row of a
        model that is loaded or loading).

        Only the owner calls this (pool/actors/residency/_residency.py): it has validated the
        body into ``plan`` and placed every replica (``gpus``), and it holds the
        reservation until this returns. Nothing else may load a model, or the budget
        would not hold.

        Raises:
            PoolError: ``invalid_load_request`` for overrides while loaded or loading,
                ``model_unloading``, or ``load_failed``.
        """
        return await self._call(_Command("load", plan, gpus=gpus))

    async def unload(
        self, reason: UnloadReason = "requested", *, sleep: bool = False
    ) -> ModelSnapshot:
        """Unload gracefully; returns the snapshot once the model is ``unloaded``.

        ``reason``: ``evicted`` only from the pool's VRAM gate (the model then loads
        again on its next request); an asked-for unload of an evicted model makes it
        stay unloaded; ``keep_alive`` (the idle timer) is called off if a request came
        in since the timer found the model idle. ``sleep`` (an eviction, runtimes that
        can sleep): the replicas sleep instead of closing, and a load of the same plan
        on the same GPUs wakes them (see :class:`Sleepers`); a replica that will not
        sleep closes them all.
        """
        return await self._call(_Command("unload", unload_reason=reason, sleep=sleep))

    async def reload(self) -> ModelSnapshot:
        """Drain and reload the model as it is loaded (same replicas, overrides, files
        and GPUs); only the residency owner calls this, when its output canary found it
        degraded. A model that is not loaded any more is left as it is.

        Raises:
            PoolError: ``load_failed`` (the model is then ``failed``).
        """
        return await self._call(_Command("reload"))

    async def mark_failed(self, reason: str) -> ModelSnapshot:
        """Drain and unload the model and leave it ``failed`` with ``reason`` as its
        ``last_error`` (the residency owner: reloads did not cure its output canary). A
        model that is not loaded any more is left as it is."""
        return await self._call(_Command("fail", reason=reason))

    async def probe(self, request: GenerationRequest) -> ProbeAnswer | None:
        """Run an output canary on the next replica in turn (pool/actors/models/_probe.py);
        None, skipped, when the model is not loaded or not idle, or when a request came
        and cancelled it."""
        if self.state != "loaded" or not self.idle or not self.replicas:
            return None
        replica = self.replicas[self._probe_turn % len(self.replicas)]
        self._probe_turn += 1
        return await run_probe(replica, request)

    @property
    def loads_on_request(self) -> bool:
        """Whether a request for this model, not loaded, loads it (and waits for it in
        the queue) instead of being refused: an ``on_demand`` model, or one the pool
        evicted until it is loaded again."""
        return self.definition.on_demand or self.unload_reason == "evicted"

    async def set_model_path(self, path: str | None) -> None:
        """Point the model at ``path`` (a pull placed its files there, or removed them).

        The actor applies it between commands. A loaded model keeps serving the file
        it loaded (its ``active_definition``) and picks ``path`` up at its next load.
        """
        await self._call(_Command("set_model_path", model_path=path))

    async def _call(self, command: _Command) -> ModelSnapshot:
        if self.state == "unloading" and command.kind == "load":
            raise PoolError("model_unloading", f"model {self.name!r} is unloading; retry after")
        # Size 1: the actor must never block on a caller that has gone away.
        reply_send, reply_recv = trio.open_memory_channel[ModelSnapshot | PoolError](1)
        command.reply = reply_send
        with reply_recv:
            await self._inbox_send.send(command)
            result = await reply_recv.receive()
        if isinstance(result, PoolError):
            raise result
        return result

    def admit(
        self,
        request: GenerationRequest | EmbeddingJob | TaskJob,
        *,
        tenant: str,
        priority: str,
        buffer: int,
        keep_alive: float | str | None = None,
        load_hint: dict[str, Any] | None = None,
        prefix_keys: tuple[bytes, ...] | None = None,
    ) -> Ticket:
        """Queue a request if the state allows it; raises the state's error otherwise.

        An ``on_demand`` model that is not loaded starts loading and the request waits
        in the queue (bounded by ``queue_timeout_s``) instead of failing.
        ``prefix_keys``: the prompt's keys where the cluster's router already hashed them.
        """
        on_demand_wait = self.loads_on_request and self.state in (
            "unloaded",
            "loading",
            "failed",
        )
        if self.state != "loaded" and not on_demand_wait:
            raise self._state_error()
        keep_alive_s = self.residence.keep_alive_for(keep_alive)
        ticket = Ticket(request, tenant=tenant, priority=priority, buffer=buffer)  # type: ignore[arg-type]
        ticket.prefix_keys = prefix_keys
        ticket.waits_for_load = on_demand_wait
        log.debug(
            "request_id=%s model=%s queued tenant=%s priority=%s state=%s ahead=%d",
            request.request_id,
            self.name,
            tenant,
            priority,
            self.state,
            self.scheduler.queue_depth,
        )
        self.scheduler.enqueue(ticket)  # (which may start it at once)
        ticket.waited = ticket.dispatched_at is None
        self._idle = trio.Event() if self._idle.is_set() else self._idle
        self.last_used_at = time.monotonic()
        self.residence.used(keep_alive_s)
        if on_demand_wait and self._loader is not None:
            # An evicted model comes back with the load it had, whatever the request hints.
            self._loader.request(
                self, load_hint if self.definition.on_demand else self._comeback, ticket
            )
        return ticket

    def reject_waiting(self, error: PoolError) -> None:
        """Fail every queued request with ``error`` (the pool's gate refused the load)."""
        self.scheduler.fail_queued(error)

    def _state_error(self) -> PoolError:
        if self.state == "loading":
            return PoolError("model_loading", f"model {self.name!r} is loading", retry_after_s=1.0)
        if self.state == "unloading":
            return PoolError("model_unloading", f"model {self.name!r} is unloading")
        if self.state == "failed":
            return PoolError(
                "model_failed",
                f"model {self.name!r} failed to load: {self.last_error}",
            )
        return PoolError("model_not_loaded", f"model {self.name!r} is not loaded")

    async def wait_state_change(self) -> None:
        await self._state_changed.wait()

    # -- what the residency owner reads of the model (pool/actors/residency/_residency.py) ------
    @property
    def idle(self) -> bool:
        """Nothing queued and nothing running."""
        return self.scheduler.queue_depth == 0 and self.scheduler.running == 0

    @property
    def queue_depth(self) -> int:
        return self.scheduler.queue_depth

    # -- pause and resume across a swap (docs/vram.md, "Pause and resume") -------------
    @property
    def pausable(self) -> list[Ticket]:
        """The running streams a swap may pause now: every request running here is
        a preemptible generation, none waits in its queue, and the backend resumes
        through the prompt. Empty when any of that does not hold."""
        if self.state != "loaded" or self.scheduler.queue_depth or not self.replicas:
            return []
        if not self.backend.resumes_through_prompt:
            return []
        running = [t for r in self.replicas for t in r.running_tickets]
        if not running or not all(
            t.preemptible
            and isinstance(t.request, GenerationRequest)
            and self.backend.resumes(t.request)
            for t in running
        ):
            return []
        return running

    def pause_streams(self) -> list[Ticket]:
        """Pause every stream :attr:`pausable` names (each stops at a token boundary;
        the model is idle once their jobs have ended); the paused tickets."""
        paused = self.pausable
        for ticket in paused:
            ticket.pause()
        return paused

    def withdraw(self, ticket: Ticket) -> None:
        """Take a queued ``ticket`` out of the queue (its caller stopped waiting)."""
        self.scheduler.remove(ticket)

    def forget_prefixes(self) -> None:
        """The replicas' prompt caches were flushed: routing forgets what they held."""
        self.scheduler.forget_prefixes()

    def recent_prompts(self) -> list[bytes]:
        """The last keys of the prompts the model was given lately, newest first (what
        the cluster's registry record says of it; pool/actors/models/_affinity.py)."""
        recent = self.scheduler.recent_prompts
        return recent.newest() if recent is not None and self.state == "loaded" else []

    @property
    def asleep_ram_mib(self) -> int | None:
        """Host RAM the sleeping replicas hold; None when none sleeps."""
        return None if self._asleep is None else self._asleep.ram_mib

    @property
    def comeback(self) -> dict[str, Any] | None:
        """The load body an evicted model comes back with (the load it had)."""
        return self._comeback

    @property
    def placed_on(self) -> list[list[int]]:
        """The GPUs of each replica (for logs and decisions)."""
        return [list(p.gpus) for p in self.placement]

    # -- command handling (inside the actor task) ---------------------------------
    async def _handle(self, command: _Command) -> None:
        try:
            if command.kind == "load":
                result: ModelSnapshot | PoolError = await self._do_load(command)
            elif command.kind == "unload":
                result = await self._do_unload(command.unload_reason, sleep=command.sleep)
            elif command.kind == "set_model_path":
                result = await self._do_set_model_path(command)
            elif command.kind == "reload":
                result = await self._do_reload()
            elif command.kind == "fail":
                result = await self._do_fail(command.reason)
            elif command.kind == "add_adapter":
                assert command.adapter is not None
                result = await self._do_add_adapter(command.adapter)
            elif command.kind == "remove_adapter":
                result = await self._do_remove_adapter(command.reason)
            elif command.kind == "evict_adapter":
                result = await self._do_evict_adapter(command.reason)
            else:
                await self._do_replica_fault(command)
                return
        except PoolError as exc:
            result = exc
        assert command.reply is not None
        try:
            command.reply.send_nowait(result)
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.WouldBlock):
            pass  # the caller left; the command still took effect
        finally:
            command.reply.close()

    def _set_state(self, state: RuntimeState) -> None:
        if state != self.state:
            log.info("model=%s state %s -> %s", self.name, self.state, state)
        if state == "loading" and self.state != "loading":
            self.loading_since = trio.current_time()
        self.state = state
        self._state_changed.set()
        self._state_changed = trio.Event()
        if self._on_change is not None:
            self._on_change()

    def resident_row(self, explicit: bool) -> ModelSnapshot | None:
        """A load of a model that is loaded or loading: its row (a load of a loading
        model answers once that load is over); None when a load would have to start.

        Raises:
            PoolError: ``invalid_load_request`` for a body with replicas or overrides.
        """
        if self.state not in ("loaded", "loading"):
            return None
        if explicit:
            raise PoolError(
                "invalid_load_request",
                f"model {self.name!r} is {self.state}; unload it before loading with"
                " replicas or overrides",
            )
        return self.snapshot()

    async def _do_load(self, command: _Command) -> ModelSnapshot:
        plan = command.plan
        assert plan is not None
        resident = self.resident_row(plan.explicit)
        if resident is not None:
            return resident
        assert self._nursery is not None
        effective = plan.effective(self.definition).model_copy(
            update={"lora_adapters": list(self.adapters.values())}
        )
        self.backend.check_adapters(effective)
        asleep, self._asleep = self._asleep, None
        if asleep is not None:
            if asleep.fits(effective, plan.replicas, command.gpus):
                woken = await self._wake(asleep, plan)
                if woken is not None:
                    return woken
            else:
                log.info("model=%s loads anew: the sleeping replicas do not match", self.name)
                await self._stop_replicas(asleep.replicas)
        self.load_override = dict(plan.patch)
        self.active_definition = effective
        self.selected_replicas = plan.replicas
        self.placement = command.gpus
        self._progress = {}
        self._set_state("loading")
        started_at = time.perf_counter()
        await self.residence.loading()
        capacity = max(1, self.backend.effective_target_inflight(effective))
        replicas: list[Replica] = []
        try:
            for index in range(plan.replicas):
                replica = self._new_replica(
                    effective,
                    LoadContext(
                        model_name=self.name,
                        replica_index=index,
                        settings_dir=self.settings.base_dir,
                        placement=(command.gpus[index] if index < len(command.gpus) else None),
                        report_progress=self._progress_reporter(index),
                    ),
                    capacity,
                )
                await self._nursery.start(replica.run)
                replicas.append(replica)
        except trio.Cancelled:
            self.residence.load_abandoned()
            await self._stop_replicas(replicas)
            raise
        except BaseException as exc:
            self.residence.load_abandoned()
            leaf = _collapse(exc)
            if not isinstance(leaf, Exception):
                raise
            # All-or-nothing: release the replicas that did come up.
            await self._stop_replicas(replicas)
            self.last_error = str(leaf) if str(leaf) else type(leaf).__name__
            log.warning("model=%s load failed: %s", self.name, self.last_error)
            if out_of_memory(leaf):
                self._note_out_of_memory(self.placed_gpus(), self.last_error)
            self.unload_reason, self._comeback = None, None
            self._set_state("failed")
            if self.metrics is not None:
                self.metrics.loads.labels(self.name, "failed").inc()
            self.scheduler.fail_queued(
                PoolError("model_failed", f"model {self.name!r} failed to load: {self.last_error}")
            )
            if isinstance(leaf, PoolError) and leaf.status < 500:
                # The backend's runtime refused a value of this load (vLLM validates
                # its engine arguments itself): the caller's error, with its own code.
                raise leaf from None
            raise PoolError(
                "load_failed",
                f"loading model {self.name!r} failed: {self.last_error}",
                details={"last_error": self.last_error},
            ) from leaf
        self.replicas = replicas
        self.evicted_adapters.clear()
        self._sizes_at_load = {a.name: self._adapter_size(a) for a in self.adapters.values()}
        await self.residence.loaded()
        self.last_error = None
        self.unload_reason, self._comeback = None, None
        self.loaded_at = time.monotonic()
        self.loaded_at_wall = time.time()
        self.ready_at = time.perf_counter()
        self.last_used_at = self.loaded_at
        self.load_count += 1
        if self.metrics is not None:
            self.metrics.loads.labels(self.name, "loaded").inc()
            self.metrics.load_duration.labels(self.name).observe(time.perf_counter() - started_at)
        self._set_state("loaded")
        self.scheduler.set_replicas(replicas)
        self.residence.ready(self._idle.is_set())
        log.info(
            "model=%s loaded %d replica(s) in %.1f ms",
            self.name,
            len(replicas),
            (time.perf_counter() - started_at) * 1000.0,
        )
        return self.snapshot()

    def _new_replica(
        self, definition: ModelDefinition, context: LoadContext, capacity: int
    ) -> Replica:
        return Replica(
            backend=self.backend,
            definition=definition,
            context=context,
            capacity=capacity,
            unload_timeout_s=self.engine.unload_timeout_s,
            idle_timeout_s=self.engine.generation_idle_timeout_s,
            on_job_done=self.scheduler.job_finished,
            on_failure=self._replica_failed,
            on_hang=self._replica_hung,
            on_out_of_memory=self._replica_out_of_memory,
        )

    async def _wake(self, asleep: Sleepers, plan: PlacedLoad) -> ModelSnapshot | None:
        """Wake the sleeping replicas as this load; None when one would not wake (they
        are closed then, and the load goes on as a fresh one)."""
        self.load_override = dict(plan.patch)
        self.active_definition = asleep.definition
        self.selected_replicas = len(asleep.replicas)
        self.placement = asleep.placement
        self._progress = {}
        self._set_state("loading")
        began = trio.current_time()
        try:
            with trio.fail_after(self.engine.unload_timeout_s):
                for replica in asleep.replicas:
                    assert isinstance(replica.runtime, SleepingRuntime)
                    await replica.runtime.wake()
        except (Exception, trio.TooSlowError) as exc:  # noqa: BLE001 - a fresh load follows
            log.warning("model=%s did not wake (%s); loading it anew", self.name, exc)
            await self._stop_replicas(asleep.replicas)
            return None
        self.replicas = asleep.replicas
        self.residence.woke()
        self.last_error = None
        self.unload_reason, self._comeback = None, None
        self.loaded_at = time.monotonic()
        self.loaded_at_wall = time.time()
        self.last_used_at = self.loaded_at
        self.load_count += 1
        self.wake_count += 1
        if self.metrics is not None:
            self.metrics.loads.labels(self.name, "loaded").inc()
        self._set_state("loaded")
        self.scheduler.set_replicas(self.replicas)
        self.residence.ready(self._idle.is_set())
        log.info(
            "model=%s woke %d replica(s) in %.2f s",
            self.name,
            len(self.replicas),
            trio.current_time() - began,
        )
        return self.snapshot()

    async def _put_to_sleep(self, replicas: list[Replica]) -> bool:
        """Put every replica to sleep (bounded by ``engine.unload_timeout_s``); False
        (logged) when one would not: the caller then closes them all."""
        try:
            with trio.fail_after(self.engine.unload_timeout_s):
                for replica in replicas:
                    runtime = replica.runtime
                    if not isinstance(runtime, SleepingRuntime):
                        raise BackendError("its runtime cannot sleep")
                    await runtime.sleep()
        except (Exception, trio.TooSlowError) as exc:  # noqa: BLE001 - it unloads instead
            log.warning("model=%s did not go to sleep (%s); unloading it", self.name, exc)
            return False
        ram = self.sleep_ram_mib_of(replicas)
        self._asleep = Sleepers(replicas, self.active_definition, self.placement, ram)
        log.info(
            "model=%s asleep: %d replica(s), %s MiB in host RAM", self.name, len(replicas), ram
        )
        return True

    @staticmethod
    def sleep_ram_mib_of(replicas: list[Replica]) -> int:
        return sum(
            r.runtime.sleep_ram_mib or 0 for r in replicas if isinstance(r.runtime, SleepingRuntime)
        )

    async def _drop_sleepers(self) -> None:
        """Close the sleeping replicas (an operator's unload, new files, shutdown)."""
        asleep, self._asleep = self._asleep, None
        if asleep is not None:
            log.info("model=%s closing its sleeping replicas", self.name)
            await self._stop_replicas(asleep.replicas)
            if self._on_change is not None:
                self._on_change()

    def _progress_reporter(self, index: int) -> Callable[[float], None]:
        def report(fraction: float) -> None:
            if self.state == "loading":
                self._progress[index] = min(1.0, max(0.0, fraction))
                if self._on_change is not None:
                    self._on_change()  # wakes the requests that show it to their clients

        return report

    @property
    def load_progress(self) -> float | None:
        """How far the load under way has come (0..1): the mean over its replicas, the
        ones not started yet at 0; None while loading when no replica reports, or when
        not loading."""
        if self.state != "loading" or not self._progress:
            return None
        return sum(self._progress.values()) / max(1, self.selected_replicas)

    async def _do_unload(self, reason: UnloadReason, *, sleep: bool = False) -> ModelSnapshot:
        if self.state in ("unloaded", "failed"):
            if self.state == "unloaded" and reason == "requested":
                await self._drop_sleepers()
                self._forget_unload(reason)  # an evicted model asked to stay unloaded
            return self.snapshot()
        if reason == "keep_alive" and not self.idle:
            # The keep-alive expired on an idle model, and a request came in before this
            # command ran: it is served, and the timer starts again when it is done.
            log.info("model=%s keep_alive unload called off: a request came in", self.name)
            return self.snapshot()
        self._set_state("unloading")
        unload_started = time.perf_counter()
        cancelled = self.scheduler.fail_queued(
            PoolError("model_unloading", f"model {self.name!r} is unloading")
        )
        if cancelled:
            log.info("model=%s cancelled %d queued request(s)", self.name, cancelled)
        await self._drain()
        replicas, self.replicas = self.replicas, []
        self.scheduler.set_replicas(())
        slept = sleep and reason == "evicted" and await self._put_to_sleep(replicas)
        if not slept:
            await self._stop_replicas(replicas)
        await self.residence.unloaded(replicas=len(replicas), slept=slept)
        self._forget_unload(reason)
        if reason == "evicted":
            body = {**self.load_override}
            if self.selected_replicas != self.definition.replicas:
                body["replicas"] = self.selected_replicas
            self._comeback = body or None
        self.load_override = {}
        self.active_definition = self.definition
        self.selected_replicas = self.definition.replicas
        self.loaded_at = None
        self.unload_count += 1
        if self.metrics is not None:
            self.metrics.unloads.labels(self.name).inc()
            self.metrics.unload_duration.labels(self.name).observe(
                time.perf_counter() - unload_started
            )
        self._set_state("unloaded")
        return self.snapshot()

    async def _do_reload(self) -> ModelSnapshot:
        if self.state != "loaded":
            return self.snapshot()
        again = _SameLoad(self.selected_replicas, dict(self.load_override), self.active_definition)
        gpus = self.placement
        await self._do_unload("canary")
        # No checkpoint between "unloaded" and "loading": the GPUs stay this model's.
        return await self._do_load(_Command("load", again, gpus=gpus))

    async def _do_fail(self, reason: str) -> ModelSnapshot:
        if self.state != "loaded":
            return self.snapshot()
        await self._do_unload("canary")
        self.last_error = reason
        log.warning("model=%s marked failed: %s", self.name, reason)
        self._set_state("failed")
        self.residence.failed()
        return self.snapshot()

    def _forget_unload(self, reason: UnloadReason | None) -> None:
        self.unload_reason = reason
        self._comeback = None
        if self._on_change is not None:
            self._on_change()

    async def _drain(self) -> None:
        """Let running requests finish, for at most ``engine.unload_drain_s``.

        Past the deadline the ones still running end with ``model_unloading`` (stopping
        the replicas cancels them), so a stream that never ends cannot hold an unload.
        """
        drain_s = self.engine.unload_drain_s
        with trio.move_on_after(drain_s):
            await self._idle.wait()
        if self._idle.is_set():
            return
        error = PoolError(
            "model_unloading",
            f"model {self.name!r} was unloaded before the response completed"
            f" (engine.unload_drain_s: {drain_s:g}s)",
        )
        cut = 0
        for replica in self.replicas:
            for ticket in replica.running_tickets:
                ticket.error = ticket.error or error
                cut += 1
        log.warning(
            "model=%s unload drain deadline of %gs passed; ending %d running request(s)",
            self.name,
            drain_s,
            cut,
        )

    def end_running(self, error: PoolError) -> int:
        """End every request of this model, queued or running, with ``error``: a stream
        renders it as its last event instead of being cut mid-air. Returns how many."""
        ended = self.scheduler.fail_queued(error)
        for replica in self.replicas:
            for ticket in replica.running_tickets:
                ticket.error = ticket.error or error
                ticket.scope.cancel()
                ended += 1
        return ended

    # -- LoRA adapters (docs/backends.md, "LoRA adapters") ----------------------------
    async def add_adapter(self, adapter: LoraAdapter) -> ModelSnapshot:
        """Serve ``adapter`` on this model: loaded into every replica now if the model
        is loaded (no reload, running requests untouched), else with its next load.

        Raises:
            PoolError: ``invalid_load_request`` where the backend cannot add one to a
                loaded model, ``invalid_request`` for a file it cannot load.
        """
        return await self._call(_Command("add_adapter", adapter=adapter))

    async def remove_adapter(self, name: str) -> ModelSnapshot:
        """Stop serving adapter ``name``; a request running with it finishes first."""
        return await self._call(_Command("remove_adapter", reason=name))

    def adapter_used(self, name: str) -> AdapterUse:
        """A request for adapter ``name`` was admitted: its LRU position, and what the
        job carries (an evicted adapter comes back with it).

        Raises:
            PoolError: ``invalid_request`` when its file is gone.
        """
        adapter = self.adapters[name]
        count, _ = self._adapter_uses.get(name, (0, 0.0))
        self._adapter_uses[name] = (count + 1, time.monotonic())
        self.evicted_adapters.discard(name)
        path = self._adapter_files.get(name)
        if path is None:
            path = self._adapter_files[name] = self.adapter_path(adapter)
        return AdapterUse(name, adapter.scale, str(path))

    def adapter_last_used(self, name: str) -> float:
        """When adapter ``name`` last served (monotonic; 0: never)."""
        return self._adapter_uses.get(name, (0, 0.0))[1]

    @property
    def resident_adapters(self) -> list[str]:
        """Adapters the loaded replicas hold that the pool may evict alone (backends that
        add and remove adapters while loaded)."""
        if self.state != "loaded" or self.backend.adapter_support != "runtime":
            return []
        return [name for name in self.adapters if name not in self.evicted_adapters]

    async def evict_adapter(self, name: str) -> ModelSnapshot:
        """Give back adapter ``name``'s memory on every replica; it stays served and
        comes back with its next request (pool/actors/residency/_residency.py)."""
        return await self._call(_Command("evict_adapter", reason=name))

    async def _do_evict_adapter(self, name: str) -> ModelSnapshot:
        if name in self.adapters and self.state == "loaded":
            self.evicted_adapters.add(name)
            for replica in self.replicas:
                runtime = replica.runtime
                if isinstance(runtime, AdapterRuntime):
                    await runtime.remove_adapter(name)
            log.info("model=%s adapter %s evicted alone", self.name, name)
        return self.snapshot()

    def adapter_path(self, adapter: LoraAdapter) -> Path:
        """The adapter's file, resolved as model paths are.

        Raises:
            PoolError: ``invalid_request`` when it does not exist.
        """
        try:
            path = resolve_model_path(adapter.path, self.settings.base_dir)
        except FileNotFoundError as exc:
            raise PoolError("invalid_request", f"adapter {adapter.name!r}: {exc}") from None
        if not path.exists():
            raise PoolError("invalid_request", f"adapter {adapter.name!r}: {path} does not exist")
        return path

    def adapter_mib(self) -> int:
        """MiB the served adapters add to each replica (their files' sizes), those the
        pool evicted alone left out."""
        return math.ceil(
            sum(
                self._adapter_size(a)
                for a in self.adapters.values()
                if a.name not in self.evicted_adapters
            )
        )

    def adapter_mib_since_load(self) -> int:
        """How the adapters changed each replica's memory since its load was measured:
        those added since, less those loaded with it and since removed or evicted."""
        held = {
            a.name: self._adapter_size(a)
            for a in self.adapters.values()
            if a.name not in self.evicted_adapters
        }
        added = sum(mib for name, mib in held.items() if name not in self._sizes_at_load)
        gone = sum(mib for name, mib in self._sizes_at_load.items() if name not in held)
        return round(added - gone)

    def _adapter_size(self, adapter: LoraAdapter) -> float:
        size = self._adapter_sizes.get(adapter.name)
        if size is None:
            try:
                path = resolve_model_path(adapter.path, self.settings.base_dir)
                size = _size_mib(path)
            except (FileNotFoundError, OSError):
                size = 0.0
            self._adapter_sizes[adapter.name] = size
        return size

    def check_adapter(self, adapter: LoraAdapter) -> int:
        """Whether ``adapter`` may be added now; the MiB it adds to each replica.

        Raises:
            PoolError: as :meth:`add_adapter`, before anything is loaded.
        """
        with_it = [*(a for a in self.adapters.values() if a.name != adapter.name), adapter]
        self.backend.check_adapters(self.definition.model_copy(update={"lora_adapters": with_it}))
        if self.state == "loaded":
            # What the running replicas were started with decides what they can take.
            self.backend.check_adapters(self.active_definition, at_runtime=True)
        return math.ceil(_size_mib(self.adapter_path(adapter)))

    async def _do_add_adapter(self, adapter: LoraAdapter) -> ModelSnapshot:
        self.check_adapter(adapter)
        path = self.adapter_path(adapter)
        if adapter.name in self.adapters:
            await self._do_remove_adapter(adapter.name)
        if self.state == "loaded":
            added: list[AdapterRuntime] = []
            try:
                for replica in self.replicas:
                    runtime = replica.runtime
                    if not isinstance(runtime, AdapterRuntime):
                        raise BackendError("a replica's runtime takes no adapters")
                    await runtime.add_adapter(adapter.name, path, adapter.scale)
                    added.append(runtime)
            except BackendError as exc:
                for runtime in added:
                    await runtime.remove_adapter(adapter.name)
                raise PoolError("invalid_request", f"adapter {adapter.name!r}: {exc}") from exc
        else:
            await self._drop_sleepers()  # they were loaded without it
        self.adapters[adapter.name] = adapter
        self._adapter_files[adapter.name] = path
        self._adapter_sizes.pop(adapter.name, None)
        self._adapter_uses.pop(adapter.name, None)
        log.info("model=%s adapter %s added (%s)", self.name, adapter.name, path)
        if self._on_change is not None:
            self._on_change()
        return self.snapshot()

    async def _do_remove_adapter(self, name: str) -> ModelSnapshot:
        if self.adapters.pop(name, None) is None:
            raise PoolError("unknown_model", f"model {self.name!r} has no adapter {name!r}")
        self._adapter_sizes.pop(name, None)
        self._adapter_uses.pop(name, None)
        self._adapter_files.pop(name, None)
        self.evicted_adapters.discard(name)
        if self.state == "loaded":
            for replica in self.replicas:
                runtime = replica.runtime
                if isinstance(runtime, AdapterRuntime):
                    await runtime.remove_adapter(name)
        else:
            await self._drop_sleepers()
        log.info("model=%s adapter %s removed", self.name, name)
        if self._on_change is not None:
            self._on_change()
        return self.snapshot()

    def adapter_views(self) -> tuple[AdapterView, ...]:
        views = []
        for adapter in self.adapters.values():
            count, last = self._adapter_uses.get(adapter.name, (0, None))
            views.append(
                AdapterView(
                    name=adapter.name,
                    path=adapter.path,
                    scale=adapter.scale,
                    size_mib=round(self._adapter_size(adapter), 3),
                    requests=count,
                    last_used_at=last,
                    evicted=adapter.name in self.evicted_adapters,
                )
            )
        return tuple(views)

    async def _do_set_model_path(self, command: _Command) -> ModelSnapshot:
        await self._drop_sleepers()  # they hold the old files' weights
        await self.residence.read_files(command.model_path)
        self.definition = self.definition.model_copy(update={"model_path": command.model_path})
        log.info("model=%s model_path=%s", self.name, command.model_path)
        return self.snapshot()

    def _replica_out_of_memory(self, replica: Replica, message: str) -> None:
        placement = replica.context.placement
        self._note_out_of_memory(set(placement.gpus) if placement else set(), message)

    def _note_out_of_memory(self, gpus: set[int], message: str) -> None:
        log.warning("model=%s GPU out of memory on %s: %s", self.name, sorted(gpus), message)
        self.out_of_memory = OutOfMemory(
            tuple(sorted(gpus)), time.time(), trio.current_time(), message
        )

    def _replica_failed(self, replica: Replica, reason: str) -> None:
        self._report_fault(_Command("replica_failed", reason=reason, replica=replica))

    def _replica_hung(self, replica: Replica, reason: str) -> None:
        self._report_fault(_Command("replica_hung", reason=reason, replica=replica))

    def _report_fault(self, command: _Command) -> None:
        try:
            self._inbox_send.send_nowait(command)
        except trio.WouldBlock:
            assert self._nursery is not None
            self._nursery.start_soon(self._inbox_send.send, command)

    async def _do_replica_fault(self, command: _Command) -> None:
        """A replica hung or its process exited: the residency owner's watchdog decides
        whether it is recycled or the model is marked failed (docs/faults.md)."""
        replica = command.replica
        if self.state != "loaded" or replica is None or replica not in self.replicas:
            return  # already unloaded, recycled or reloaded since: nothing to do
        fault: Literal["hang", "exit"] = "hang" if command.kind == "replica_hung" else "exit"
        reason = command.reason
        log.warning("model=%s replica %d %s: %s", self.name, replica.index, fault, reason)
        if out_of_memory(reason):
            self._replica_out_of_memory(replica, reason)
        if self.residence.replica_faulty(fault, replica.index, reason):
            try:
                await self._recycle(replica, fault, reason)
                return
            except PoolError as exc:
                reason = exc.message
        await self._fail_replicas(reason)

    async def _recycle(self, old: Replica, fault: Literal["hang", "exit"], reason: str) -> None:
        """Stop ``old`` and start a fresh replica in its place, with the same load on the
        same GPUs (which stay this model's throughout). The other replicas serve on;
        queued requests wait for the fresh one, within their queue timeout.

        Raises:
            PoolError: ``load_failed``: the fresh replica did not load.
        """
        assert self._nursery is not None
        others = [r for r in self.replicas if r is not old]
        self.replicas = others
        self.scheduler.set_replicas(others)
        # Its requests end now with what went wrong (a hung runtime's would otherwise
        # wait for their own idle deadlines); a stream gets an error event.
        if fault == "hang":
            error = PoolError(
                "backend_timeout",
                f"model {self.name!r}: replica {old.index} hung and is recycled: {reason}",
            )
        else:
            error = PoolError("backend_error", f"model {self.name!r} failed: {reason}")
        for ticket in old.running_tickets:
            ticket.error = ticket.error or error
        await self._stop_replicas([old])
        capacity = max(1, self.backend.effective_target_inflight(self.active_definition))
        fresh = self._new_replica(self.active_definition, old.context, capacity)
        try:
            await self._nursery.start(fresh.run)
        except BaseException as exc:
            leaf = _collapse(exc)
            if not isinstance(leaf, Exception):
                raise
            message = str(leaf) or type(leaf).__name__
            log.warning("model=%s replica %d did not load again: %s", self.name, old.index, message)
            raise PoolError(
                "load_failed",
                f"recycling replica {old.index} of model {self.name!r} failed: {message}",
            ) from leaf
        self.replicas = sorted([*others, fresh], key=lambda r: r.index)
        self.scheduler.set_replicas(self.replicas)
        self.ready_at = time.perf_counter()
        log.info("model=%s replica %d recycled", self.name, fresh.index)
        # A fresh runtime: its output canary checks it, as after any load.
        self.residence.ready(self._idle.is_set())

    async def _fail_replicas(self, reason: str) -> None:
        """Stop every replica and leave the model ``failed`` with ``reason``."""
        log.warning("model=%s replica failed: %s", self.name, reason)
        self.last_error = reason
        self._set_state("failed")
        self.scheduler.fail_queued(
            PoolError("model_failed", f"model {self.name!r} failed: {reason}")
        )
        error = PoolError("backend_error", f"model {self.name!r} failed: {reason}")
        for replica in self.replicas:
            for ticket in replica.running_tickets:
                ticket.error = ticket.error or error
        replicas, self.replicas = self.replicas, []
        self.scheduler.set_replicas(())
        await self._stop_replicas(replicas)
        self.load_override = {}
        self.active_definition = self.definition
        self.loaded_at = None
        self.residence.failed()

    async def _stop_replicas(self, replicas: list[Replica]) -> None:
        for replica in replicas:
            replica.stop()
        with trio.move_on_after(self.engine.unload_timeout_s + 1.0, shield=True):
            for replica in replicas:
                await replica.stopped.wait()

    def _on_idle(self) -> None:
        self._idle.set()
        self.residence.went_idle()
        if self._on_change is not None:
            self._on_change()

    def placed_gpus(self) -> set[int]:
        """Every GPU a replica of this model is placed on."""
        return {gpu for placement in self.placement for gpu in placement.gpus}

    # -- what the HTTP layer and the cluster read of the residency record -------------
    def vram_estimate(self) -> VramEstimate:
        """The current load's VRAM estimate (the residency record's chain)."""
        return self.residence.vram_estimate()

    @property
    def keep_alive_s(self) -> float | None:
        """Seconds an idle on-demand model stays loaded (None: forever)."""
        return self.residence.keep_alive_s

    def snapshot(self) -> ModelSnapshot:
        """This model's configuration and live state, taken in one step."""
        context_field = self.backend.context_field
        return ModelSnapshot(
            name=self.name,
            state=self.state,
            definition=self.definition,
            active_definition=self.active_definition,
            replicas=len(self.replicas) if self.replicas else self.selected_replicas,
            loaded_replicas=len(self.replicas),
            queue_depth=self.scheduler.queue_depth,
            running=self.scheduler.running,
            max_queue=self.scheduler.max_queue,
            effective_target_inflight=self.effective_target_inflight,
            last_error=self.last_error,
            vram=self.residence.vram_estimate(),
            load_override=dict(self.load_override),
            load_constraints=self.backend.load_constraints,
            load_recommendations=self.backend.load_recommendations,
            capabilities=self.capabilities,
            context_length=(
                getattr(self.active_definition, context_field, None) if context_field else None
            ),
            artifact_mib=self.residence.artifact_mib,
            details=self.residence.details,
            loaded_at_wall=self.loaded_at_wall,
            expires_in_s=self.residence.expires_in_s,
            observed_load_delta_mib=self.residence.observed_load_delta_mib,
            placement=(self.placement if self.state in ("loading", "loaded", "unloading") else ()),
            unload_reason=self.unload_reason,
            asleep_ram_mib=self.asleep_ram_mib,
            canary=self.residence.canary_status,
            adapters=self.adapter_views(),
            adapter_group_wait_ms=self.adapter_group_wait_ms if self.adapters else None,
        )


def _size_mib(path: Path) -> float:
    """A file's size, or a folder's files' (a PEFT adapter), in MiB."""
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) / (1024 * 1024)
    return path.stat().st_size / (1024 * 1024)
