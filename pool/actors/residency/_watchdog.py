"""The replica watchdog: what the residency owner does with a replica whose runtime hung
(no token within ``engine.generation_idle_timeout_s``) or whose process exited on its
own (docs/faults.md).

It recycles the replica (the model actor stops it and starts a fresh one on the same
GPUs, with the same load), at most ``engine.watchdog_recycles_per_hour`` times an hour
per model; past that the model is marked failed, as an output canary's reloads are
(``_canary_watch.py``; the hourly budget is the same :class:`ReloadBudget`). Each
recycle and each failure is a decision with its reason, and each recycle is counted in
``llm_pool_watchdog_recycles_total``.

The decision is synchronous: the model actor asks while it handles the replica's report,
so no request is dispatched to the stuck or dead replica between the fault and the
recycle.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING, Literal

import trio

from pool.actors.residency._canary import HOUR_S

if TYPE_CHECKING:
    from pool.actors.models._model import ModelActor
    from pool.actors.residency._decisions import DecisionLog

log = logging.getLogger("pool.model")

# hang: a generation produced no token within the idle timeout; exit: the runtime's
# process exited on its own.
Fault = Literal["hang", "exit"]

_SETTING = "engine.watchdog_recycles_per_hour"


class ReloadBudget:
    """At most ``per_hour`` reloads in any hour (Trio clock times)."""

    def __init__(self, per_hour: int) -> None:
        self.per_hour = per_hour
        self._at: deque[float] = deque()

    def used(self, now: float) -> int:
        """How many reloads were taken in the hour before ``now``."""
        while self._at and now - self._at[0] >= HOUR_S:
            self._at.popleft()
        return len(self._at)

    def take(self, now: float) -> bool:
        """Take one reload at ``now``; False (nothing taken) when the hour's are spent."""
        if self.used(now) >= self.per_hour:
            return False
        self._at.append(now)
        return True


class Watchdog:
    """Decides, for one model, whether a faulty replica is recycled."""

    def __init__(self, actor: ModelActor, decisions: DecisionLog, per_hour: int) -> None:
        self.actor = actor
        self._decisions = decisions
        self.budget = ReloadBudget(per_hour)

    def recycle(self, fault: Fault, replica: int, reason: str) -> bool:
        """Whether replica ``replica``, which showed ``fault``, is recycled (True) or its
        model is marked failed (False: this hour's recycles are spent). Records the
        decision either way."""
        actor = self.actor
        what = (
            "hung (no token within engine.generation_idle_timeout_s)"
            if fault == "hang"
            else "exited on its own"
        )
        if self.budget.take(trio.current_time()):
            used = self.budget.used(trio.current_time())
            self._decisions.record(
                "reload",
                actor.name,
                f"watchdog: replica {replica} {what}: {reason}; recycled"
                f" ({used} of {self.budget.per_hour} recycles this hour)",
                fault=fault,
                replica=replica,
            )
            if actor.metrics is not None:
                actor.metrics.watchdog_recycles.labels(actor.name, fault).inc()
            log.warning("model=%s replica %d %s; recycling it", actor.name, replica, what)
            return True
        self._decisions.record(
            "fail",
            actor.name,
            f"watchdog: replica {replica} {what}: {reason}; {self.budget.per_hour}"
            f" recycle(s) in the last hour did not cure it ({_SETTING}); marked failed",
            fault=fault,
            replica=replica,
        )
        return False
