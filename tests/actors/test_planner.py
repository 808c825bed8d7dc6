"""The VRAM planner as a table of cases: frozen records of the models and one GPU in,
place / evict / wait / refuse out. No Trio, no actors: ``plan`` is a pure function."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from pool.actors import GpuReading, GpuView
from pool.actors.residency._planner import (
    Evict,
    GpuRoom,
    Place,
    Plan,
    Refuse,
    ResidenceView,
    Rules,
    Target,
    Wait,
    plan,
)

NOW = 1000.0


def loaded(name: str, mib: int, **fields: Any) -> ResidenceView:
    """A loaded, idle model holding ``mib`` on GPU 0, resident for 100 s."""
    values: dict[str, Any] = {
        "state": "loaded",
        "priority": 0,
        "holding": {0: mib},
        "releases": {0: mib},
        "resident_since": NOW - 100,
        "last_used_at": NOW - 50,
    }
    values.update(fields)
    return ResidenceView(name=name, **values)


def target(mib: int, **fields: Any) -> Target:
    values: dict[str, Any] = {
        "name": "new",
        "priority": 0,
        "per_replica_mib": mib,
        "source": "configured_vram_mb",
        "replicas": 1,
    }
    values.update(fields)
    return Target(**values)


@dataclass
class Case:
    target: Target
    residences: list[ResidenceView]
    expected: tuple[Any, ...]
    total_mib: int = 1000
    rules: dict[str, Any] = field(default_factory=dict)
    room: dict[str, Any] = field(default_factory=dict)


def gpu_room(case: Case) -> GpuRoom:
    """One GPU of ``total_mib`` whose reading shows what the models hold."""
    if not case.total_mib:
        return GpuRoom(GpuView((), None), **case.room)
    used = sum(sum(r.holding.values()) for r in case.residences if r.state != "unloaded")
    gpu = GpuReading(0, "gpu0", used_mib=used, total_mib=case.total_mib)
    return GpuRoom(GpuView((gpu,), None), **case.room)


def summary(outcome: Plan) -> tuple[Any, ...]:
    """``outcome`` as names and numbers (the views are compared by identity)."""
    if isinstance(outcome, Place):
        return ("place", [list(p.mib) for p in outcome.gpus])
    if isinstance(outcome, Refuse):
        return ("refuse", outcome.reason)
    if isinstance(outcome, Wait):
        fresh = outcome.fresh.name if outcome.fresh is not None else None
        return ("wait", [m.name for m in outcome.spared], fresh)
    assert isinstance(outcome, Evict)
    steps = [
        (step.victim.name if step.victim else None, [m.name for m in step.spared])
        for step in outcome.steps
    ]
    return ("evict", steps, summary(outcome.then) if outcome.then is not None else None)


NEVER = (
    "model 'new' needs {mib} MiB per replica (configured_vram_mb) x 1: more than the GPUs"
    " can give it"
)
NOT_NOW = (
    "model 'new' needs {mib} MiB per replica (configured_vram_mb); no GPU has room and no"
    " idle model may be evicted for it now"
)


def slow_and_quick() -> list[ResidenceView]:
    """Two models asked for as often: ``slow`` takes 20 s to load and was used first."""
    return [
        loaded("slow", 600, expected_load_s=20.0, request_rate=1.0, last_used_at=1.0),
        loaded("quick", 600, expected_load_s=0.5, request_rate=1.0, last_used_at=2.0),
    ]


CASES = {
    "fits on a free GPU": Case(target(600), [], ("place", [[600]])),
    "no GPU to gate": Case(target(600), [], ("place", []), total_mib=0),
    "bigger than the GPU": Case(target(1200), [], ("refuse", NEVER.format(mib=1200))),
    "evicts an idle model, then places": Case(
        target(600), [loaded("a", 600)], ("evict", [("a", [])], ("place", [[600]]))
    ),
    "a busy model is not evicted": Case(
        target(600), [loaded("a", 600, idle=False)], ("refuse", NOT_NOW.format(mib=600))
    ),
    "a more important model is not evicted": Case(
        target(600), [loaded("a", 600, priority=5)], ("refuse", NOT_NOW.format(mib=600))
    ),
    "a pinned model stays for good": Case(
        target(600), [loaded("a", 600, pinned=True)], ("refuse", NEVER.format(mib=600))
    ),
    "a reserved load counts as held": Case(
        target(600),
        [loaded("a", 0, state="unloaded", holding={}, releases={}, reserved={0: 600})],
        ("refuse", NOT_NOW.format(mib=600)),
    ),
    "evicts two, lowest priority first": Case(
        target(800, priority=2),
        [loaded("a", 400, priority=1), loaded("b", 400, priority=0)],
        ("evict", [("b", []), ("a", [])], ("place", [[800]])),
    ),
    "a real load evicts what it can, then refuses": Case(
        target(900, priority=1),
        [loaded("a", 400, priority=0), loaded("b", 500, priority=2)],
        ("evict", [("a", [])], ("refuse", NOT_NOW.format(mib=900))),
    ),
    "swap_cost spares the model that is slow to bring back": Case(
        target(600),
        slow_and_quick(),
        ("evict", [("quick", [])], ("place", [[600]])),
        total_mib=1200,
    ),
    "lru takes the least recently used": Case(
        target(600),
        slow_and_quick(),
        ("evict", [("slow", [])], ("place", [[600]])),
        total_mib=1200,
        rules={"policy": "lru"},
    ),
    "a warm model is spared when a cold one makes the room": Case(
        target(600),
        [
            loaded("warm", 600, warm_until=NOW + 30, served_at=NOW - 10, last_used_at=1.0),
            loaded("cold", 600, last_used_at=2.0),
        ],
        ("evict", [("cold", ["warm"])], ("place", [[600]])),
        total_mib=1200,
    ),
    "a warm model goes when only it makes the room": Case(
        target(600),
        [loaded("warm", 600, warm_until=NOW + 30, served_at=NOW - 10)],
        ("evict", [("warm", [])], ("place", [[600]])),
    ),
    "an on-demand load waits for a stay-warm window": Case(
        target(600),
        [loaded("warm", 600, warm_until=NOW + 30, served_at=NOW - 10)],
        ("wait", ["warm"], None),
        rules={"wait": True, "evict_warm": False},
    ),
    "an on-demand load waits for a fresh model": Case(
        target(600),
        [loaded("a", 600, resident_since=NOW - 1)],
        ("wait", [], "a"),
        rules={"wait": True, "min_resident_s": 5.0},
    ),
    "an on-demand load evicts one model, then plans again": Case(
        target(800, priority=2),
        [loaded("a", 400, priority=1), loaded("b", 400, priority=0)],
        ("evict", [("b", [])], None),
        rules={"wait": True},
    ),
    "max_loaded_models evicts though the GPU has room": Case(
        target(100),
        [loaded("a", 100)],
        ("evict", [("a", [])], None),
        rules={"wait": True, "limit": 1},
    ),
    "room taken by another lease holder: as if full": Case(
        target(100),
        [loaded("a", 100)],
        ("evict", [("a", [])], ("place", [[100]])),
        rules={"room_taken": True},
    ),
    "an in-process load pays the CUDA context": Case(
        target(600, holds_cuda_context=True),
        [],
        ("refuse", NEVER.format(mib=600)),
        room={"context_cost": {0: 500}},
    ),
    "the context already open costs nothing more": Case(
        target(600, holds_cuda_context=True),
        [],
        ("place", [[600]]),
        room={"context_cost": {0: 0}},
    ),
}


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_plan(case: Case) -> None:
    rules = Rules(NOW, **case.rules)
    assert summary(plan(case.target, case.residences, gpu_room(case), rules)) == case.expected
