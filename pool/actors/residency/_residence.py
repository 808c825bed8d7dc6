"""One model's residency record, kept by the residency owner (``_residency.py``).

The model actor runs the model (its inbox, states, replicas, queue) and reports what
happened: its files were read, a load began, ended (measured here), was abandoned, the
replicas woke, it was used, went idle, unloaded or failed. This record turns those facts
into the numbers the owner decides with: the VRAM estimate chain, what the model holds
and would hand back, the footprints kept across restarts and the CUDA context learned
on the way, the measured load time, the request rate, the stay-warm window, the host
RAM a sleep would hold and the keep-alive expiry (whose unload the owner starts).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING

import trio

from pool.actors.residency._canary_watch import CanaryWatch
from pool.actors.residency._estimate import (
    Artifact,
    closed_form_mib,
    name_estimate_mib,
    read_artifact,
    size_estimate_mib,
)
from pool.actors.residency._footprints import FootprintStore, load_key
from pool.actors.residency._keep_alive import parse_keep_alive
from pool.actors.residency._vram import CudaContexts, LoadMeter, MeterMark, charges
from pool.actors.residency._watchdog import Fault, Watchdog
from pool.actors.values._details import ModelDetails, artifact_details
from pool.actors.values._snapshots import CanaryStatus, VramEstimate
from pool.backends import SleepingRuntime
from pool.config import ModelDefinition

if TYPE_CHECKING:
    from pool.actors.models._model import ModelActor

log = logging.getLogger("pool.model")

# How many of the latest requests the request rate is taken over, and the shortest span
# it divides by (a burst of a few requests is not a rate of thousands a second).
USES_KEPT = 16
RATE_FLOOR_S = 1.0

Spawn = Callable[[Callable[[], Awaitable[None]]], None]


class Residence:
    """The residency owner's record of ``actor`` (see the module's docstring)."""

    def __init__(
        self,
        actor: ModelActor,
        *,
        footprints: FootprintStore | None,
        meter: LoadMeter | None,
        contexts: CudaContexts | None,
        spawn: Spawn,
        watchdog: Watchdog,
    ) -> None:
        self.actor = actor
        self.name = actor.name
        self._footprints = footprints
        self._meter = meter
        self._contexts = contexts
        # Starts background work (a footprint file written) in the owner's nursery.
        self._spawn = spawn
        self.artifact: Artifact | None = None
        self.artifact_mib: int | None = None
        self.details = ModelDetails()
        # What the current load was measured to take per GPU (None: not measured), and
        # what the sleeping replicas were measured to take (their wake takes it again).
        self.observed_per_gpu: dict[int, int] | None = None
        self._asleep_per_gpu: dict[int, int] | None = None
        # GPUs whose CUDA context this (in-process) load paid at a size not known yet:
        # its measured part there includes the context until an unload tells them apart.
        self.unsplit_context: set[int] = set()
        # The CUDA context the pool process already held per GPU when the last load began.
        self._context_before: dict[int, int] = {}
        self._mark: MeterMark | None = None
        self._load_began = 0.0
        # Since when (Trio clock) the model is resident.
        self.resident_since = 0.0
        # Trio clock times of the latest requests (the eviction policy's request rate),
        # and how long the latest load took (the cost of bringing the model back).
        self._uses: deque[float] = deque(maxlen=USES_KEPT)
        self.load_seconds: float | None = None
        # Trio clock time the loaded model last finished its requests (went idle): its
        # stay-warm window runs from there (docs/vram.md, "Stay warm"); None since its load.
        self.served_at: float | None = None
        # Keep-alive (on-demand models): seconds after the last request, and the Trio
        # clock time at which an idle model unloads (None: busy, or kept forever).
        definition = actor.definition
        self.keep_alive_s = parse_keep_alive(
            definition.keep_alive
            if definition.keep_alive is not None
            else actor.settings.engine.keep_alive
        )
        self.expires_at: float | None = None
        self.keep_alive_poke = trio.Event()
        # Its output canary, where it has one (the owner starts it: Residency.run).
        self.canary: CanaryWatch | None = None
        # What becomes of a replica that hangs or whose process exits (docs/faults.md).
        self._watchdog = watchdog

    # -- facts the model actor reports -------------------------------------------------
    async def read_files(self, model_path: str | None) -> None:
        """The model's files are (now) at ``model_path``: read what they say of it."""
        self.artifact = await trio.to_thread.run_sync(
            read_artifact, model_path, self.actor.settings.base_dir
        )
        self.artifact_mib = self.artifact.size_mib if self.artifact is not None else None
        self.details = artifact_details(self.artifact)

    async def loading(self) -> None:
        """A fresh load begins (the replicas start next): measure it."""
        self.observed_per_gpu = None
        self._load_began = trio.current_time()
        self._mark = await self._meter.start() if self._meter is not None else None
        if self._contexts is not None:
            self._context_before = self._contexts.already_held(self.actor, self._mark)

    def load_abandoned(self) -> None:
        """The load failed or was cancelled: its measurement is dropped."""
        if self._meter is not None:
            self._meter.abandon(self._mark)

    async def loaded(self) -> None:
        """The replicas are up: keep the measured footprint and load time."""
        if self._meter is not None:
            self._record_footprint(await self._meter.finish(self._mark))
        self.resident_since = trio.current_time()
        self.served_at = None
        self._keep_load_time(self.resident_since - self._load_began)

    def woke(self) -> None:
        """The sleeping replicas woke as this load: their footprint is the one measured
        at their load; the load time stays the cold one."""
        self.observed_per_gpu = self._asleep_per_gpu
        self.resident_since = trio.current_time()
        self.served_at = None

    def ready(self, idle: bool) -> None:
        """A load (or wake) is over; ``idle``: nothing waits for it."""
        if self.actor.definition.on_demand and idle:
            self.arm_keep_alive()
        if self.canary is not None:
            self.canary.loaded()

    def keep_alive_for(self, asked: float | str | None) -> float | None:
        """The keep-alive a request asks for (Ollama's ``keep_alive``), or the model's
        when it asks none or its definition pins it.

        Raises:
            PoolError: ``invalid_request`` for a value that is not a duration.
        """
        if asked is not None and not self.actor.definition.keep_alive_pinned:
            return parse_keep_alive(asked)
        return self.keep_alive_s

    def used(self, keep_alive_s: float | None) -> None:
        """A request was queued; ``keep_alive_s``: what :meth:`keep_alive_for` said."""
        self._uses.append(trio.current_time())
        if self.actor.definition.on_demand:
            # Ollama semantics: the latest request's keep_alive sets the idle timer.
            self.keep_alive_s = keep_alive_s
            self.set_expiry(None)

    def went_idle(self) -> None:
        """The model finished its requests."""
        if self.canary is not None:
            self.canary.went_idle()
        if self.actor.state == "loaded":
            self.served_at = trio.current_time()
            if self.actor.definition.on_demand:
                self.arm_keep_alive()

    async def unloaded(self, *, replicas: int, slept: bool) -> None:
        """The model's ``replicas`` stopped (or went to sleep, ``slept``)."""
        if slept:
            self._asleep_per_gpu = self.observed_per_gpu
        else:
            await self._learn_context(replicas)
        self.expires_at = None

    def replica_faulty(self, fault: Fault, replica: int, reason: str) -> bool:
        """A replica hung (``hang``) or its process exited (``exit``): True when it is
        to be recycled, False when the model is to be marked failed (the decision is
        the watchdog's, and recorded)."""
        return self._watchdog.recycle(fault, replica, reason)

    def failed(self) -> None:
        """A replica failed and the others were stopped."""
        self.expires_at = None

    @property
    def canary_status(self) -> CanaryStatus | None:
        """What its output canary found; None where it has none."""
        return None if self.canary is None else self.canary.status

    # -- keep-alive (on-demand models) -------------------------------------------------
    def arm_keep_alive(self) -> None:
        # A pinned model stays resident: keep_alive never unloads it (spec: Model Pinning).
        if self.keep_alive_s is None or self.actor.definition.pinned:
            self.set_expiry(None)
        else:
            self.set_expiry(trio.current_time() + self.keep_alive_s)

    def set_expiry(self, expires_at: float | None) -> None:
        self.expires_at = expires_at
        self.keep_alive_poke.set()
        self.keep_alive_poke = trio.Event()

    @property
    def expires_in_s(self) -> float | None:
        """Seconds until an idle on-demand model unloads; None if not counting down."""
        if self.expires_at is None or self.actor.state != "loaded":
            return None
        return max(0.0, self.expires_at - trio.current_time())

    # -- what the owner decides with ---------------------------------------------------
    @property
    def observed_load_delta_mib(self) -> int | None:
        """What the current load was measured to take on the GPUs; None when not measured."""
        if not self.actor.replicas or self.observed_per_gpu is None:
            return None
        return sum(self.observed_per_gpu.values())

    def vram_estimate(
        self, *, definition: ModelDefinition | None = None, replicas: int | None = None
    ) -> VramEstimate:
        """The estimate chain (pool/actors/residency/_estimate.py): the first step that
        answers, plus its LoRA adapters' files on each replica (docs/backends.md, "LoRA
        adapters"): all of them on an estimate, those added since the load on a
        measurement of it.

        By default for the current load (or the next one with the configured
        definition); with ``definition``/``replicas``, for a load with those instead.
        """
        estimate = self._model_estimate(definition, replicas)
        if estimate.mib is None:
            return estimate
        measured = estimate.source == "observed_load_delta"
        extra = self.actor.adapter_mib_since_load() if measured else self.actor.adapter_mib()
        if not extra:
            return estimate
        return replace(estimate, mib=max(0, estimate.mib + extra * estimate.replica_count))

    def _model_estimate(
        self, definition: ModelDefinition | None, replicas: int | None
    ) -> VramEstimate:
        actor = self.actor
        current = definition is None and replicas is None
        count = replicas or len(actor.replicas) or actor.selected_replicas
        definition = definition or actor.active_definition
        if definition.vram_mb is not None:
            return VramEstimate(definition.vram_mb * count, count, "configured_vram_mb")
        observed = self.observed_load_delta_mib if current else None
        if observed is not None:
            return VramEstimate(observed, count, "observed_load_delta")
        runtimes = [r.runtime for r in actor.replicas if r.runtime is not None] if current else []
        reported = [rt.vram_mib for rt in runtimes if rt.vram_mib]
        if reported and len(reported) == len(runtimes):
            return VramEstimate(
                sum(o for o in reported if o is not None), len(runtimes), "observed_load_delta"
            )
        profile = actor.backend.memory_profile(definition)
        if self._footprints is not None:
            stored = self._footprints.lookup(self.name, self._load_key(definition), count)
            if stored is not None:
                return VramEstimate(stored, count, "observed_load_delta")
        declared = actor.backend.declared_vram_mib(definition)
        if declared is None and self.artifact is not None:
            declared = closed_form_mib(self.artifact, profile)
        if declared is not None:
            return VramEstimate(declared * count, count, "artifact_metadata")
        if self.artifact is not None:
            size = size_estimate_mib(self.artifact, profile.gpu_layers)
            return VramEstimate(size * count, count, "model_artifact_size")
        guess = name_estimate_mib(definition.model_path, self.name, gpu_layers=profile.gpu_layers)
        if guess is not None:
            return VramEstimate(guess * count, count, "name_heuristic")
        return VramEstimate(None, count, "unavailable")

    def holding(self) -> dict[int, int]:
        """MiB per GPU this model holds (loaded or unloading: as measured, else as
        estimated over its placement) or is about to hold (loading); {} otherwise."""
        actor = self.actor
        if actor.state not in ("loading", "loaded", "unloading"):
            return {}
        if actor.state != "loading" and self.observed_per_gpu is not None:
            held = dict(self.observed_per_gpu)
            # Adapters added, removed or evicted since the load was measured.
            change = actor.adapter_mib_since_load()
            if change:
                sign = 1 if change > 0 else -1
                for gpu, mib in charges(
                    actor.placement, abs(change), replicas=len(actor.replicas)
                ).items():
                    held[gpu] = max(0, held.get(gpu, 0) + sign * mib)
            return held
        per_replica = self.vram_estimate().per_replica_mib or 0
        count = actor.selected_replicas if actor.state == "loading" else len(actor.replicas)
        return charges(actor.placement, per_replica, replicas=count)

    def releases(self) -> dict[int, int]:
        """What unloading this model hands back per GPU: what it holds, less a CUDA
        context it paid for (an in-process runtime's stays with the pool process)."""
        held = self.holding()
        if self.observed_per_gpu is not None and self._contexts is not None:
            for gpu in self.unsplit_context:
                paid = self._contexts.expected_mib(gpu) - self._context_before.get(gpu, 0)
                held[gpu] = max(0, held.get(gpu, 0) - max(0, paid))
        return held

    def runtime_holdings(self) -> list[tuple[int, int]]:
        """(GPU, MiB) that each loaded replica's runtime reports holding, spread over
        the replica's GPUs as its placement says (what virtual GPUs show as used)."""
        placements = self.actor.placement
        held: list[tuple[int, int]] = []
        for index, replica in enumerate(self.actor.replicas):
            mib = replica.runtime.vram_mib if replica.runtime is not None else None
            if not mib:
                continue
            if index < len(placements):
                placement = placements[index]
                held.extend(zip(placement.gpus, placement.scaled(mib), strict=True))
            else:
                held.append((0, mib))
        return held

    def sleep_ram_mib(self) -> int | None:
        """Host RAM a sleep of every loaded replica would hold; None when one of them
        cannot sleep (not a SleepingRuntime, or started without sleep mode)."""
        runtimes = [r.runtime for r in self.actor.replicas]
        if not runtimes or not all(isinstance(rt, SleepingRuntime) for rt in runtimes):
            return None
        held = [rt.sleep_ram_mib for rt in runtimes if isinstance(rt, SleepingRuntime)]
        return None if any(mib is None for mib in held) else sum(m or 0 for m in held)

    def request_rate(self, now: float) -> float:
        """Requests per second lately: the latest requests over the time since the first
        of them until ``now`` (Trio clock), so it falls while the model sits idle."""
        if not self._uses:
            return 0.0
        return len(self._uses) / max(now - self._uses[0], RATE_FLOOR_S)

    @property
    def stay_warm_s(self) -> float:
        """This load's stay-warm window: the definition's (or load override's), else
        its kind's default (``Backend.default_stay_warm_s``)."""
        definition = self.actor.active_definition
        window = definition.stay_warm_s
        if window is None:
            return self.actor.backend.default_stay_warm_s(definition)
        return window

    def warm_until(self) -> float | None:
        """Trio clock time at which the stay-warm window of this loaded model ends, while
        it is in it; None when it is not (it has not served since its load, has no
        window, or the window is over)."""
        if self.actor.state != "loaded" or self.served_at is None:
            return None
        # The same sum as the owner's wake-up time: it wakes when this turns None.
        until = self.served_at + self.stay_warm_s
        return until if trio.current_time() < until else None

    def expected_load_s(self, definition: ModelDefinition | None = None) -> float | None:
        """How long a load of this model took last (kept across restarts beside its
        footprint, per load: files and memory settings); None before the first measured
        load."""
        definition = definition or self.actor.active_definition
        if self._footprints is not None:
            stored = self._footprints.load_time(self.name, self._load_key(definition))
            if stored is not None:
                return stored
        return self.load_seconds

    # -- footprints and CUDA contexts --------------------------------------------------
    def _keep_load_time(self, seconds: float) -> None:
        self.load_seconds = seconds
        if self._footprints is not None:
            load = self._load_key(self.actor.active_definition)
            self._footprints.record_load_time(self.name, load, seconds)
            self._spawn(self._footprints.save)

    @property
    def _in_process_gpu(self) -> bool:
        return self._contexts is not None and self.actor.backend.holds_cuda_context(
            self.actor.active_definition
        )

    def _record_footprint(self, per_gpu: dict[int, int] | None) -> None:
        """Keep a measured load's footprint for the estimate chain and the next boot.

        An in-process load's CUDA context is not the model's: where the context's size
        is known it is taken out (CudaContexts)."""
        self.unsplit_context = set()
        if self._in_process_gpu:
            assert self._contexts is not None
            if per_gpu is None:
                self._contexts.opened |= self.actor.placed_gpus()  # paid, though not measured
            else:
                per_gpu, self.unsplit_context = self._contexts.split(
                    per_gpu, self.actor.placed_gpus(), self._context_before
                )
        self.observed_per_gpu = per_gpu
        if per_gpu is None:
            return
        total = sum(per_gpu.values())
        log.info("model=%s load measured at %d MiB on the GPUs %s", self.name, total, per_gpu)
        self._keep_footprint(len(self.actor.replicas), total)

    def _load_key(self, definition: ModelDefinition) -> str:
        """What a load of ``definition`` is, for the footprint store: its settings and
        the identity of the model files as last read (at boot, or when a pull set them)."""
        return load_key(definition, self.artifact.identity if self.artifact else None)

    def _keep_footprint(self, replicas: int, mib: int) -> None:
        if self._footprints is not None:
            load = self._load_key(self.actor.active_definition)
            self._footprints.record(self.name, load, replicas, mib)
            # Written in the background: the load does not wait for a file.
            self._spawn(self._footprints.save)

    async def _learn_context(self, replicas: int) -> None:
        """An in-process model unloaded: what the pool process still holds beyond the
        other models is its CUDA context (CudaContexts.learn). A footprint that had to
        include the context (the first load, its size unknown) is corrected."""
        gpus = self.actor.placed_gpus()
        if not (self._in_process_gpu and gpus and self._meter is not None and self._meter.quiet):
            return
        assert self._contexts is not None
        learned = self._contexts.learn(self.actor, await self._meter.refresh(), gpus)
        log.info("model=%s unloaded; the pool process keeps %s MiB per GPU", self.name, learned)
        if self.unsplit_context and self.observed_per_gpu is not None:
            # Only the context that grew during the load was in its measured delta.
            own = sum(
                mib - max(0, learned.get(gpu, 0) - self._context_before.get(gpu, 0))
                if gpu in self.unsplit_context
                else mib
                for gpu, mib in self.observed_per_gpu.items()
            )
            self._keep_footprint(replicas, max(0, own))
        elif learned and self._footprints is not None:
            self._spawn(self._footprints.save)
        self.unsplit_context = set()
