"""Soak: bounded traffic with load/unload churn against a pool process, sampling what a
leak would make grow (RSS, open file descriptors, Trio tasks, threads).

The pool runs in its own process. Clients: steady requests (plain and streamed) on a
loaded model, requests on two models that are loaded and unloaded over and over (they
meet every state), and clients that leave mid-stream (the cancel path). Every few
seconds the sampler reads the process's RSS, fds and threads from /proc and its Trio
task count from ``llm_pool_trio_tasks`` on /metrics.

A least-squares line is fitted per series over the samples after the warm-up (the first
fifth of the run), and its growth over that window is checked against a bound that
scales with the work done: a leak tied to requests grows with them, noise does not.
"""

from __future__ import annotations

import os
import random
import re
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks.harness import Server, pool_server, progress

STEADY = {
    "backend": "stub",
    "enabled": True,
    "target_inflight": 8,
    "stub_reply": " ".join(f"w{i}" for i in range(16)),
    "stub_tokens_per_second": 400,
}
CHURN = {
    "backend": "stub",
    "target_inflight": 2,
    "stub_reply": "a b c d",
    "stub_tokens_per_second": 200,
    "stub_load_seconds": 0.05,
    "stub_unload_seconds": 0.05,
}
# Bounds on the fitted growth over the measured window (see the module doc).
RSS_BYTES_PER_REQUEST = 64  # a leak of one small object per request exceeds it
RSS_FLOOR_MIB = 4.0  # allocator noise: arenas are kept, not returned at once
COUNT_PER_REQUESTS = 1000  # tasks, fds: at most one per this many requests
THREADS_FLOOR = 1.0  # the thread count must not grow at all
LIFECYCLE_LIMIT_S = 15.0  # a stub load or unload takes 50 ms plus a drain of ~20 ms
REQUEST_LIMIT_S = 15.0


@dataclass
class Tally:
    requests: int = 0
    completed: int = 0
    refused_4xx_503: int = 0
    server_errors: int = 0
    abandoned: int = 0
    loads: int = 0
    unloads: int = 0
    timed_out: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    wedged: dict[str, str] = field(default_factory=dict)


def _proc(pid: int) -> tuple[float, int, int]:
    """RSS in MiB, open fds and threads of ``pid``."""
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))  # type: ignore[union-attr]
    return rss_kib / 1024.0, len(os.listdir(f"/proc/{pid}/fd")), threads


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope (per second) of (t, value) points."""
    if len(points) < 2:
        return 0.0
    ts = [t for t, _ in points]
    vs = [v for _, v in points]
    mt, mv = statistics.fmean(ts), statistics.fmean(vs)
    var = sum((t - mt) ** 2 for t in ts)
    return sum((t - mt) * (v - mv) for t, v in zip(ts, vs, strict=True)) / var if var else 0.0


async def _steady_client(url: str, rng: random.Random, tally: Tally, stop: trio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            stream = rng.random() < 0.5
            body = {"model": "steady", "input": "x", "stream": stream}
            tally.requests += 1
            if not stream:
                reply = await client.post("/v1/responses", json=body)
                _count(tally, reply.status_code)
                continue
            async with client.stream("POST", "/v1/responses", json=body) as response:
                if rng.random() < 0.1:
                    tally.abandoned += 1  # leave mid-stream: the cancel path
                    continue
                async for _ in response.aiter_lines():
                    pass
                _count(tally, response.status_code)


async def _churn_client(url: str, rng: random.Random, tally: Tally, stop: trio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            model = rng.choice(["churn-a", "churn-b"])
            tally.requests += 1
            try:
                reply = await client.post(
                    "/v1/responses", json={"model": model, "input": "x"}, timeout=REQUEST_LIMIT_S
                )
            except httpx.TimeoutException:
                tally.timed_out += 1
                continue
            _count(tally, reply.status_code)
            await trio.sleep(0.01)


async def _lifecycle(url: str, rng: random.Random, tally: Tally, stop: trio.Event) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        while not stop.is_set():
            models = [m for m in ("churn-a", "churn-b") if m not in tally.wedged]
            if not models:
                return  # both wedged: the figures below still show what that cost
            model = rng.choice(models)
            verb = rng.choice(["load", "unload"])
            with trio.move_on_after(LIFECYCLE_LIMIT_S) as stuck:
                reply = await client.post(f"/v1/admin/models/{model}/{verb}", json={})
            if stuck.cancelled_caught:
                # A lifecycle call that never returns: record it, leave that model alone.
                tally.wedged[model] = f"{verb} never returned"
                progress(f"soak: {verb} of {model} did not return within {LIFECYCLE_LIMIT_S}s")
                continue
            if reply.status_code >= 500:
                tally.server_errors += 1
            elif reply.status_code == 200:
                if verb == "load":
                    tally.loads += 1
                else:
                    tally.unloads += 1
            await trio.sleep(rng.uniform(0.05, 0.4))


def _count(tally: Tally, status: int) -> None:
    tally.statuses[status] = tally.statuses.get(status, 0) + 1
    if status == 200:
        tally.completed += 1
    elif status >= 500 and status != 503:
        tally.server_errors += 1
    else:
        tally.refused_4xx_503 += 1


async def _trio_tasks(client: httpx.AsyncClient) -> int:
    text = (await client.get("/metrics")).text
    match = re.search(r"^llm_pool_trio_tasks (\S+)$", text, re.M)
    return int(float(match.group(1))) if match else -1


async def _sample(server: Server, samples: list[dict[str, float]], started: float) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        rss, fds, threads = _proc(server.process.pid)
        tasks = await _trio_tasks(client)
    samples.append(
        {
            "t_s": round(time.monotonic() - started, 2),
            "rss_mib": round(rss, 2),
            "fds": fds,
            "threads": threads,
            "trio_tasks": tasks,
        }
    )


async def soak(quick: bool) -> dict[str, Any]:
    """Ten minutes (``--quick``: one) of traffic with churn; leak figures per series."""
    duration = 60.0 if quick else 600.0
    interval = 2.0 if quick else 5.0
    tally = Tally()
    samples: list[dict[str, float]] = []
    models = {"steady": STEADY, "churn-a": CHURN, "churn-b": CHURN}
    with pool_server(models) as server:
        stop = trio.Event()
        started = time.monotonic()
        async with trio.open_nursery() as nursery:
            for seed in range(6):
                nursery.start_soon(_steady_client, server.url, random.Random(seed), tally, stop)
            for seed in range(2):
                nursery.start_soon(
                    _churn_client, server.url, random.Random(100 + seed), tally, stop
                )
            nursery.start_soon(_lifecycle, server.url, random.Random(200), tally, stop)
            await _sample(server, samples, started)
            while time.monotonic() - started < duration:
                await trio.sleep(interval)
                await _sample(server, samples, started)
                last = samples[-1]
                progress(
                    f"soak t={last['t_s']:.0f}s requests={tally.requests}"
                    f" rss={last['rss_mib']:.1f}MiB fds={last['fds']:.0f}"
                    f" tasks={last['trio_tasks']:.0f} threads={last['threads']:.0f}"
                )
            stop.set()
        # Quiet again: the end state, after every client has gone.
        await trio.sleep(1.0)
        await _sample(server, samples, started)
    return _report(samples, tally, duration)


def _report(samples: list[dict[str, float]], tally: Tally, duration: float) -> dict[str, Any]:
    warm = duration / 5
    measured = [s for s in samples[:-1] if s["t_s"] >= warm]
    window = measured[-1]["t_s"] - measured[0]["t_s"] if len(measured) > 1 else 0.0
    # Requests served in the window, assuming the steady rate the tally shows.
    requests_in_window = tally.requests * window / duration
    bounds = {
        "rss_mib": max(RSS_FLOOR_MIB, RSS_BYTES_PER_REQUEST * requests_in_window / 2**20),
        "fds": max(1.0, requests_in_window / COUNT_PER_REQUESTS),
        "trio_tasks": max(1.0, requests_in_window / COUNT_PER_REQUESTS),
        "threads": THREADS_FLOOR,
    }
    rows = []
    for key, bound in bounds.items():
        slope = _slope([(s["t_s"], s[key]) for s in measured])
        values = [s[key] for s in measured]
        growth = slope * window
        rows.append(
            {
                "series": key,
                "first": samples[0][key],
                "after_warmup_min": min(values),
                "after_warmup_max": max(values),
                "end_quiet": samples[-1][key],
                "slope_per_hour": round(slope * 3600, 3),
                "fitted_growth_over_window": round(growth, 3),
                "bound": round(bound, 3),
                "within_bound": abs(growth) <= bound if key != "threads" else growth < bound,
            }
        )
    traffic = [
        {
            "duration_s": duration,
            "requests": tally.requests,
            "completed_200": tally.completed,
            "refused_4xx_or_503": tally.refused_4xx_503,
            "server_errors_5xx": tally.server_errors,
            "abandoned_mid_stream": tally.abandoned,
            "timed_out_15s": tally.timed_out,
            "loads": tally.loads,
            "unloads": tally.unloads,
            "wedged_models": ", ".join(f"{m} ({why})" for m, why in tally.wedged.items()) or "none",
            "requests_per_s": round(tally.requests / duration, 1),
        }
    ]
    return {
        "rows": rows,
        "traffic": traffic,
        "series": samples,
        "raw": {"statuses": tally.statuses, "window_s": window, "warmup_s": warm},
    }
