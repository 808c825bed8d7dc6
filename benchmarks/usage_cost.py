"""What usage recording costs per request: the same pool with ``service.usage`` on and off.

Two pools run in this process, one recording usage (``usage.sqlite3`` in a temporary
state directory) and one not, each serving a zero-work stub model through
``Pool.respond`` (the path every HTTP route takes into the pool, without HTTP's own
cost, so the difference is not lost in its noise). Rounds alternate off, on, off, on;
each round sends N requests one after another and reads the process's CPU time
(``time.process_time``: every thread, so the writer's SQLite work counts) before and
after. An "on" round ends only when the writer has written all of its records, so its
batches are paid for in the round that made them.

Must hold (issue #29): recording adds no more than 0.1 ms (100 µs) of CPU per request.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from contextlib import AsyncExitStack
from typing import Any

from benchmarks.harness import progress
from pool import InferenceRequest, Pool, open_pool
from pool.config import build_settings

LIMIT_US = 100.0


def _settings(usage: bool) -> Any:
    return build_settings(
        {
            "service": {"usage": {"enabled": usage}},
            "engine": {
                "models": {
                    "stub": {
                        "backend": "stub",
                        "enabled": True,
                        "stub_reply": "one two three four",
                        "target_inflight": 1,
                    }
                }
            },
        }
    )


async def _round(pool: Pool, request: InferenceRequest, count: int) -> float:
    """CPU microseconds per request over ``count`` requests (and their usage writes)."""
    settled = (
        pool.parts_for_tests().usage.written + pool.parts_for_tests().usage.dropped
        if pool.parts_for_tests().usage is not None
        else 0
    )
    started = time.process_time()
    for index in range(count):
        await pool.respond(request, tenant=f"tenant-{index % 8}")
    if pool.parts_for_tests().usage is not None:
        await pool.parts_for_tests().usage.wait_settled(settled + count)
    return (time.process_time() - started) / count * 1e6


async def usage_cost(quick: bool) -> dict[str, Any]:
    rounds = 4 if quick else 15
    per_round = 200 if quick else 2000
    request = InferenceRequest.prompt("stub", "hello there")
    with tempfile.TemporaryDirectory(prefix="usage-cost-") as state:
        # The recording pool writes its database here, not into the user's state.
        os.environ["LLM_POOL_STATE_DIR"] = state
        async with AsyncExitStack() as stack:
            off = await stack.enter_async_context(open_pool(_settings(False)))
            on = await stack.enter_async_context(open_pool(_settings(True)))
            for pool in (off, on):  # warm-up
                await _round(pool, request, 200)
            rows = []
            for index in range(rounds):
                progress(f"usage-cost round {index + 1}/{rounds}")
                off_us = await _round(off, request, per_round)
                on_us = await _round(on, request, per_round)
                rows.append(
                    {
                        "round": index + 1,
                        "off_cpu_us_per_request": round(off_us, 1),
                        "on_cpu_us_per_request": round(on_us, 1),
                        "added_cpu_us": round(on_us - off_us, 1),
                    }
                )
            written = on.usage.written if on.usage is not None else 0
            dropped = on.usage.dropped if on.usage is not None else 0
    added = [row["added_cpu_us"] for row in rows]
    summary = {
        "rounds": rounds,
        "requests_per_round": per_round,
        "median_off_cpu_us": round(statistics.median(r["off_cpu_us_per_request"] for r in rows), 1),
        "median_on_cpu_us": round(statistics.median(r["on_cpu_us_per_request"] for r in rows), 1),
        "median_added_cpu_us": round(statistics.median(added), 1),
        "limit_us": LIMIT_US,
        "holds": statistics.median(added) <= LIMIT_US,
        "records_written": written,
        "records_dropped": dropped,
    }
    return {"rows": rows, "summary": [summary], "raw": {"added_cpu_us": added}}
