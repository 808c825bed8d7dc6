"""Every residency decision with its reason, in a bounded in-memory log.

The residency owner records each placement, eviction, wait and refusal as it makes
it; ``GET /v1/admin/decisions`` and ``llm-pool why`` read them back, newest first.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

# place: a load was let through, onto these GPUs; evict: a model was unloaded to make
# room for another; wait: a load found no room and waits for it; yield: a busy model
# was asked to make way; refuse: a load was refused (the numbers say why); comeback: an
# evicted enabled model is loaded again because room freed; reload: a model whose output
# canary found it degraded was drained and reloaded, or a loaded copy that did not serve
# a request's load hints (num_ctx, cache types) was unloaded to load with them
# (docs/vram.md, "Load hints"), or the watchdog recycled a replica that hung or whose
# process exited (docs/faults.md); fail: it was degraded past
# engine.canary_reloads_per_hour, or faulty past engine.watchdog_recycles_per_hour, and
# marked failed (docs/reliability.md); pause: a
# model's preemptible streams were paused at a token boundary so it could be evicted
# for a load a request above low waits for (cut: ended instead, engine.preemption:
# cut); resume: a paused stream runs again (docs/vram.md, "Pause and resume").
Action = Literal[
    "place",
    "evict",
    "wait",
    "yield",
    "refuse",
    "comeback",
    "reload",
    "fail",
    "pause",
    "cut",
    "resume",
]

# How many decisions are kept (the oldest go first).
DECISIONS_KEPT = 500


@dataclass(frozen=True, slots=True)
class Decision:
    seq: int
    action: Action
    model: str
    reason: str
    at: float  # wall clock (seconds since the epoch)
    for_model: str | None = None  # the model the decision was made for (evict, yield)
    details: Mapping[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "action": self.action,
            "model": self.model,
            "for": self.for_model,
            "reason": self.reason,
            "at": self.at,
            **self.details,
        }


class DecisionLog:
    """The latest ``kept`` decisions."""

    def __init__(self, kept: int = DECISIONS_KEPT) -> None:
        self._entries: deque[Decision] = deque(maxlen=kept)
        self._seq = itertools.count(1)

    def record(
        self,
        action: Action,
        model: str,
        reason: str,
        *,
        for_model: str | None = None,
        **details: Any,
    ) -> Decision:
        decision = Decision(next(self._seq), action, model, reason, time.time(), for_model, details)
        self._entries.append(decision)
        return decision

    def recent(self, model: str | None = None, limit: int | None = None) -> list[Decision]:
        """Newest first; with ``model``, those about it (as the model or the one the
        decision was made for)."""
        chosen = [
            d
            for d in reversed(self._entries)
            if model is None or d.model == model or d.for_model == model
        ]
        return chosen if limit is None else chosen[:limit]
