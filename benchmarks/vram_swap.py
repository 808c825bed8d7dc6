"""vram-swap: whom to evict, measured on one request trace over more models than fit.

Six on-demand stub models of 3000 MiB share one virtual GPU of 10 000 MiB (three fit).
They load in 4, 2, 1, 0.5, 0.25 and 0.25 s and are asked for 4:4:3:3:2:2. One trace
(Poisson arrivals from four tenants, 10 tokens at 50 tokens/s each) is replayed under
each policy on a real pool, in virtual time (Trio's MockClock: every sleep, load and
token takes its stated time, and none of the machine's), so the figures are the
policy's alone and the same on any machine:

- the swap-cost policy (``eviction_policy: swap_cost``: the cheapest to bring back and
  least asked for goes first), with warm promotion (``min_resident_s`` 2,
  ``warm_wait_s`` 3, scaled to a trace of seconds);
- LRU with the same warm promotion (``eviction_policy: lru``): the victim choice alone;
- plain LRU (no warm promotion, no minimum residence);
- swap on every change (``max_loaded_models: 1``);
- Belady's optimum, offline: on the trace's order of models, with three resident, evict
  the model asked for again furthest in the future (the fewest loads any policy could
  make serving the requests in arrival order; a live pool may do better by serving a
  model's queued requests together).

``swap_s`` is the total load time the run spent (loads x each model's load time).
"""

from __future__ import annotations

import math
import os
import random
import tempfile
from collections.abc import Callable
from typing import Any

import trio
import trio.testing

from benchmarks.stub_bodies import stub_text

# name: (load seconds, popularity weight)
MODELS: dict[str, tuple[float, int]] = {
    "a": (4.0, 4),
    "b": (2.0, 4),
    "c": (1.0, 3),
    "d": (0.5, 3),
    "e": (0.25, 2),
    "f": (0.25, 2),
}
MODEL_MIB = 3000
BUDGET_MIB = 10_000
RESIDENT = BUDGET_MIB // MODEL_MIB
QUEUE_TIMEOUT_S = 600.0
# Arrival rates of the two traces: one where loads seldom overlap requests' arrivals, one
# where the GPU swaps nearly all the time.
RATES_PER_S = (1.0, 4.0)

POLICIES: dict[str, dict[str, Any]] = {
    "swap-cost policy": {"eviction_policy": "swap_cost", "min_resident_s": 2.0, "warm_wait_s": 3.0},
    "LRU, warm promotion": {"eviction_policy": "lru", "min_resident_s": 2.0, "warm_wait_s": 3.0},
    "swap-cost, no warm promotion": {
        "eviction_policy": "swap_cost",
        "min_resident_s": 0.0,
        "warm_wait_s": 0.0,
    },
    "plain LRU": {"eviction_policy": "lru", "min_resident_s": 0.0, "warm_wait_s": 0.0},
    "swap on every change": {
        "eviction_policy": "lru",
        "min_resident_s": 0.0,
        "warm_wait_s": 0.0,
        "max_loaded_models": 1,
    },
}

Trace = list[tuple[float, str, str]]


def make_trace(count: int, rate_per_s: float, seed: int = 13) -> Trace:
    """(arrival s, tenant, model) of ``count`` requests."""
    rng = random.Random(seed)
    names = list(MODELS)
    weights = [MODELS[n][1] for n in names]
    at = 0.0
    trace = []
    for _ in range(count):
        at += rng.expovariate(rate_per_s)
        trace.append((at, f"t{rng.randrange(4)}", rng.choices(names, weights=weights)[0]))
    return trace


def belady(order: list[str], capacity: int) -> list[str]:
    """The models Belady's rule loads serving ``order`` with ``capacity`` resident."""
    resident: set[str] = set()
    loads = []
    for i, name in enumerate(order):
        if name in resident:
            continue
        loads.append(name)
        if len(resident) == capacity:
            rest = order[i + 1 :]

            def next_use(m: str, rest: list[str] = rest) -> float:
                return rest.index(m) if m in rest else math.inf

            resident.remove(max(sorted(resident), key=next_use))
        resident.add(name)
    return loads


async def _replay(settings: Any, trace: Trace) -> dict[str, Any]:
    """Replay ``trace`` on a pool (virtual time): latencies, errors, loads, evictions."""
    from pool import open_pool, request_from_responses

    latencies: list[float] = []
    errors = 0
    async with open_pool(settings) as pool:
        started = trio.current_time()

        async def one(at: float, tenant: str, model: str) -> None:
            nonlocal errors
            await trio.sleep_until(started + at)
            sent = trio.current_time()
            try:
                await pool.respond(
                    request_from_responses({"model": model, "input": "x"}), tenant=tenant
                )
            except Exception:  # noqa: BLE001 - counted, the run goes on
                errors += 1
                return
            latencies.append((trio.current_time() - sent) * 1000.0)

        async with trio.open_nursery() as nursery:
            for at, tenant, model in trace:
                nursery.start_soon(one, at, tenant, model)
        loads = {name: actor.load_count for name, actor in pool.parts_for_tests().models.items()}
        return {
            "latencies_ms": sorted(latencies),
            "errors": errors,
            "loads": loads,
            "evictions": pool.evictions,
            "wall_s": trio.current_time() - started,
        }


def _run_virtual(settings: Any, trace: Trace) -> dict[str, Any]:
    clock = trio.testing.MockClock(autojump_threshold=0)
    result: dict[str, Any] = trio.run(_replay, settings, trace, clock=clock)
    return result


def _pct(values: list[float]) -> Callable[[float], float]:
    def pct(q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0

    return pct


async def vram_swap(quick: bool) -> dict[str, Any]:
    rows = []
    raw: dict[str, Any] = {}
    cdf: dict[str, list[float]] = {}
    for rate in RATES_PER_S:
        trace = make_trace(200 if quick else 2000, rate)
        for row, run in await _policies(trace):
            rows.append({"rate_per_s": rate, **row})
            raw[f"{row['policy']} at {rate}/s"] = run
            if rate == RATES_PER_S[0] and "latencies_ms" in run:
                cdf[row["policy"]] = run["latencies_ms"]
    return {"rows": rows, "raw": raw, "cdf": {f"latency at {RATES_PER_S[0]:g} request/s": cdf}}


async def _policies(trace: Trace) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """One row (and the raw run) per policy on ``trace``, Belady's optimum last."""
    from pool.config import build_settings

    rows: list[tuple[dict[str, Any], dict[str, Any]]] = []
    for policy, engine in POLICIES.items():
        models = {
            name: {
                "backend": "stub",
                "on_demand": True,
                "keep_alive": -1,
                "stub_vram_mib": MODEL_MIB,
                "stub_load_seconds": load_s,
                "stub_reply": stub_text(10),
                "stub_tokens_per_second": 50,
                "max_queue": 1000,
            }
            for name, (load_s, _) in MODELS.items()
        }
        settings = build_settings(
            {
                "engine": {
                    "gpu_budget_mib": [BUDGET_MIB],
                    "queue_timeout_s": QUEUE_TIMEOUT_S,
                    **engine,
                    "models": models,
                }
            }
        )
        with tempfile.TemporaryDirectory() as state:
            os.environ["LLM_POOL_STATE_DIR"] = state  # footprints and load times of this run
            try:
                run = await trio.to_thread.run_sync(_run_virtual, settings, trace)
            finally:
                del os.environ["LLM_POOL_STATE_DIR"]
        latencies = run["latencies_ms"]
        pct = _pct(latencies)
        loads = run["loads"]
        row = {
            "policy": policy,
            "requests": len(trace),
            "loads": sum(loads.values()),
            "swap_s": sum(MODELS[name][0] * count for name, count in loads.items()),
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
            "max_ms": latencies[-1] if latencies else 0.0,
            "errors": run["errors"],
        }
        rows.append((row, run))
    optimum = belady([model for _, _, model in trace], RESIDENT)
    optimum_row = {
        "policy": "Belady optimum (offline)",
        "requests": len(trace),
        "loads": len(optimum),
        "swap_s": sum(MODELS[name][0] for name in optimum),
        "p50_ms": None,
        "p99_ms": None,
        "max_ms": None,
        "errors": None,
    }
    rows.append((optimum_row, {"loads": {n: optimum.count(n) for n in MODELS}}))
    return rows
