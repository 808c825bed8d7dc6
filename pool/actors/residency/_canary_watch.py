"""The output canary of one model: a task of the residency owner that probes the model
after every load and wake and then every ``canary_interval_s`` while it is idle, judges
each answer (``_canary.py``) and acts: a degraded model is drained and reloaded, within
``engine.canary_reloads_per_hour``; past that it is marked failed. Every reload and
failure is a decision with its reason (docs/reliability.md, "Output canaries").

The model actor runs the probe and reports facts (a load or wake is over, the model went
idle); it never decides. A probe is skipped while the model is busy and yields to any
request that comes while it runs, so a probe is tried again when the model goes idle.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import trio

from pool.actors.residency._canary import CanaryPlan, canary_request, judge
from pool.actors.residency._watchdog import ReloadBudget
from pool.actors.values._snapshots import CanaryHealth, CanaryStatus
from pool.config import ModelDefinition
from pool.errors import PoolError

if TYPE_CHECKING:
    from pool.actors.models._model import ModelActor
    from pool.actors.models._probe import ProbeAnswer
    from pool.actors.residency._decisions import DecisionLog

log = logging.getLogger("pool.model")

_probe_ids = itertools.count(1)
# How often a due probe looks at a model that is not loaded (yet).
_NOT_LOADED_RECHECK_S = 1.0


class CanaryWatch:
    """Probes one model and keeps what its canary found (its row's ``canary``)."""

    def __init__(
        self,
        actor: ModelActor,
        plan: CanaryPlan,
        decisions: DecisionLog,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.actor = actor
        self.plan = plan
        self._decisions = decisions
        # Tells whoever shows the rows (the admin state stream) that the health changed.
        self._on_change = on_change
        self.health: CanaryHealth = "pending"
        self.reason: str | None = None
        self.answer: str | None = None
        self.checked_at: float | None = None
        # The reference and the definition whose first sound answer it is (a pinned one
        # holds for every definition).
        self.reference: str | None = plan.reference
        self._reference_tokens: int | None = None
        self._reference_for: ModelDefinition | None = None
        # The reloads it asked for, the last hour's (the watchdog's budget is the same).
        self._reloads = ReloadBudget(plan.reloads_per_hour)
        # A probe is due (a load or wake is over, or the interval passed) and when the
        # next one falls due; woken by the model's reports.
        self._due = False
        self._next_at = math.inf
        self._poke = trio.Event()

    # -- facts the model's residency record passes on --------------------------------
    def loaded(self) -> None:
        """A load or wake is over: probe now (the reference, or a check of a reload)."""
        if self.health == "ok":
            self.health = "pending"
        self._due = True
        self._wake()

    def went_idle(self) -> None:
        """The model finished its requests: a probe skipped while it was busy runs now."""
        if self._due:
            self._wake()

    def _wake(self) -> None:
        self._poke.set()
        self._poke = trio.Event()

    @property
    def status(self) -> CanaryStatus:
        now = trio.current_time()
        return CanaryStatus(
            health=self.health,
            interval_s=self.plan.interval_s,
            reason=self.reason,
            reference=self.reference,
            answer=self.answer,
            checked_at=self.checked_at,
            reloads_last_hour=self._reloads.used(now),
        )

    # -- the task --------------------------------------------------------------------
    async def run(self) -> None:
        actor = self.actor
        while True:
            poke = self._poke
            if not self._due:
                with trio.move_on_at(self._next_at) as timer:
                    await poke.wait()
                if timer.cancelled_caught:
                    self._due = True
                continue
            if actor.state != "loaded":
                # Not (or not yet) loaded: a load's or wake's report can come just before
                # its state does, so the probe stays due and the state is looked at again
                # on the next report or after a second (a state check, nothing more).
                with trio.move_on_after(_NOT_LOADED_RECHECK_S):
                    await poke.wait()
                continue
            request = canary_request(actor.name, self.plan, f"canary-{next(_probe_ids)}")
            answer = await actor.probe(request)
            if answer is None:
                self._count("skipped")
                await poke.wait()  # busy, or a request came: again once it is idle
                continue
            self._due = False
            self._next_at = trio.current_time() + self.plan.interval_s
            before = (self.health, self.reason)
            await self._judged(answer)
            if (self.health, self.reason) != before and self._on_change is not None:
                self._on_change()

    async def _judged(self, answer: ProbeAnswer) -> None:
        actor = self.actor
        self.answer = answer.text
        self.checked_at = time.time()
        definition = actor.active_definition
        first = self.plan.reference is None and self._reference_for != definition
        reason = judge(
            answer,
            None if first else self.reference,
            reference_tokens=self._reference_tokens,
            min_similarity=self.plan.min_similarity,
        )
        if reason is None:
            if first:
                # The first sound answer after a load of this definition: the reference
                # (a reload for a degraded answer keeps it, so the reloaded model is
                # held to what it answered while it was sound).
                self.reference, self._reference_tokens = answer.text, answer.output_tokens
                self._reference_for = definition
            self.health, self.reason = "ok", None
            self._count("ok")
            return
        self._count("degraded")
        self.health, self.reason = "degraded", reason
        log.warning("model=%s output canary: degraded: %s", actor.name, reason)
        now = trio.current_time()
        per_hour = self.plan.reloads_per_hour
        if self._reloads.take(now):
            self._decisions.record(
                "reload",
                actor.name,
                f"output canary: {reason}; drained and reloaded"
                f" ({self._reloads.used(now)} of {per_hour} reloads this hour)",
            )
            if actor.metrics is not None:
                actor.metrics.canary_reloads.labels(actor.name).inc()
            try:
                await actor.reload()
            except PoolError as exc:
                log.warning("model=%s reload for its canary failed: %s", actor.name, exc.message)
            return
        self.health = "failed"
        self._decisions.record(
            "fail",
            actor.name,
            f"output canary: {reason}; {per_hour} reload(s) in the last hour did not cure it"
            " (engine.canary_reloads_per_hour); marked failed",
        )
        await actor.mark_failed(f"output canary: {reason}")

    def _count(self, outcome: str) -> None:
        if self.actor.metrics is not None:
            self.actor.metrics.canary_probes.labels(self.actor.name, outcome).inc()
