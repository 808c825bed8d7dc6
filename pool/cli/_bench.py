"""``bench``: a quick latency and tokens-per-second check of one model.

Not the benchmark harness (``benchmarks/``): N streamed requests, one after another,
timed from the client's side; the pool's own figures ride along for comparison.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

from rich.table import Table

from pool.cli._client import EXIT_OK, EXIT_REFUSED, CliError, Io, PoolClient


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1), nearest rank; ``nan`` for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


async def _one(client: PoolClient, body: dict[str, Any]) -> dict[str, float]:
    start = time.perf_counter()
    first: float | None = None
    completed: dict[str, Any] | None = None
    async with client.stream("POST", "/v1/responses", body) as response:
        event = ""
        async for line in response.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                if event == "response.output_text.delta" and first is None:
                    first = time.perf_counter()
                elif event == "response.completed":
                    completed = json.loads(line[6:])["response"]
                elif event == "error":
                    error = json.loads(line[6:])["error"]
                    raise CliError(
                        f"{error.get('code')}: {error.get('message')}",
                        EXIT_REFUSED,
                        body={"error": error},
                    )
    end = time.perf_counter()
    if completed is None:
        raise CliError("the stream ended without response.completed", EXIT_REFUSED)
    metrics = completed.get("metrics") or {}
    tokens = float(metrics.get("engine_output_tokens") or 0)
    latency = end - start
    ttft = (first or end) - start
    decode = latency - ttft
    return {
        "latency_s": latency,
        "ttft_s": ttft,
        "output_tokens": tokens,
        "tokens_per_s": (tokens - 1) / decode if tokens > 1 and decode > 0 else math.nan,
    }


async def bench(
    client: PoolClient, io: Io, model: str, requests: int, prompt: str, max_tokens: int
) -> int:
    body = {
        "model": model,
        "input": prompt,
        "stream": True,
        "decoding": {"max_tokens": max_tokens, "temperature": 0.0},
    }
    runs = []
    for i in range(requests):
        run = await _one(client, body)
        runs.append(run)
        if not io.json:
            io.err.print(
                f"request {i + 1}/{requests}: {run['latency_s'] * 1000:.0f} ms, "
                f"{run['output_tokens']:.0f} tokens"
            )

    def pick(key: str) -> list[float]:
        return [r[key] for r in runs if not math.isnan(r[key])]

    summary = {
        "model": model,
        "requests": requests,
        "latency_p50_ms": percentile(pick("latency_s"), 0.5) * 1000,
        "latency_p90_ms": percentile(pick("latency_s"), 0.9) * 1000,
        "ttft_p50_ms": percentile(pick("ttft_s"), 0.5) * 1000,
        "ttft_p90_ms": percentile(pick("ttft_s"), 0.9) * 1000,
        "tokens_per_s_p50": percentile(pick("tokens_per_s"), 0.5),
        "output_tokens_mean": sum(pick("output_tokens")) / max(1, len(runs)),
    }
    summary = {k: round(v, 2) if isinstance(v, float) else v for k, v in summary.items()}
    if io.json:
        io.emit({**summary, "runs": runs})
        return EXIT_OK
    table = Table(title=f"{model}: {requests} request(s), one at a time", box=None)
    table.add_column("")
    table.add_column("p50", justify="right")
    table.add_column("p90", justify="right")
    table.add_row("latency (ms)", f"{summary['latency_p50_ms']}", f"{summary['latency_p90_ms']}")
    table.add_row(
        "time to first token (ms)", f"{summary['ttft_p50_ms']}", f"{summary['ttft_p90_ms']}"
    )
    table.add_row("decode tokens/s", f"{summary['tokens_per_s_p50']}", "")
    table.add_row("output tokens (mean)", f"{summary['output_tokens_mean']}", "")
    io.out.print(table)
    return EXIT_OK
