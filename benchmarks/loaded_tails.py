"""Tails under load: this checkout's pool against another's, pinned and interleaved.

    python -m benchmarks.loaded_tails --ab DIR [--rounds 4] [--seconds 4]

Two pools (this checkout's ``pool`` and the one in ``DIR``: ``git archive REV pool | tar
-x -C DIR``), each serving an ``openai_remote`` model in front of one zero upstream
(``benchmarks/zero_upstream.py``) through ``pool serve``, are read in turn, the order
reversed every round, in two cells: one-token JSON answers at 16 clients and 256-token
streams at 64 clients, both on the pass-through path. The pools run on one core and the
upstream and the client on the other (``benchmarks/pass_through.py``'s pinning). Each
round prints, per cell and side: requests and tokens a second, p50, p99 and the slowest
latency, the pool's CPU per request, and the stalled requests (those slower than three
times that round's p50: a stop of the whole loop, such as a full garbage collection,
holds every request in flight at once). Then the medians over the rounds.

Built for the collector's settings (pool/cli/_heap.py), which act only under load: one
client's requests rarely have another's objects alive beside them.
"""

from __future__ import annotations

import argparse
import os
import statistics
from contextlib import ExitStack
from functools import partial
from pathlib import Path
from typing import Any

import trio

from benchmarks._http import CHAT_DELTA_MARK
from benchmarks.harness import Server, closed_loop, measure, pool_server, zero_upstream
from benchmarks.pass_through import _cpu_set, default_pinning
from benchmarks.pertoken_counts import _relay_model

# cell: (clients, tokens a request)
CELLS = {"json c=16": (16, 1), "sse c=64": (64, 256)}


def _body(tokens: int) -> dict[str, Any]:
    return {
        "model": "relay",
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": tokens,
        "stream": tokens > 1,
        "allow_remote": True,
    }


async def _cell(server: Server, clients: int, tokens: int, seconds: float) -> dict[str, float]:
    body = _body(tokens)
    summary = await measure(
        server,
        partial(
            closed_loop,
            server,
            clients,
            10_000_000,
            lambda index: (body, {}),
            max_s=seconds + 60,
            path="/v1/chat/completions",
            delta_mark=CHAT_DELTA_MARK,
            stop_after_s=seconds,
        ),
    )
    if summary["errors"]:
        raise SystemExit(f"{server.name}: {summary['errors_by_kind']}")
    latencies, p50 = summary["latencies_ms"], summary["latency_ms"]["p50"]
    return {
        "requests_per_s": summary["requests_per_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "p50_ms": p50,
        "p99_ms": summary["latency_ms"]["p99"],
        "max_ms": max(latencies),
        "cpu_ms": summary["server_cpu_ms_per_request"],
        "stalled": sum(latency > 3 * p50 for latency in latencies),
    }


def _line(label: str, figures: dict[str, float]) -> str:
    return (
        f"{label}: {figures['requests_per_s']:.0f} req/s, {figures['tokens_per_s']:.0f}"
        f" tokens/s, p50 {figures['p50_ms']:.2f} ms, p99 {figures['p99_ms']:.2f} ms,"
        f" max {figures['max_ms']:.1f} ms, pool CPU {figures['cpu_ms']:.3f} ms a request,"
        f" stalled {figures['stalled']:.0f}"
    )


async def ab(other: Path, rounds: int, seconds: float) -> None:
    pools_cpus, upstream_cpus, client_cpus = default_pinning()
    client_before = os.sched_getaffinity(0)
    with ExitStack() as stack:
        upstream = stack.enter_context(zero_upstream(upstream_cpus or None))
        model = _relay_model(upstream.url)
        sides = {
            name: stack.enter_context(
                pool_server(
                    {"relay": model},
                    name=name,
                    cpus=pools_cpus or None,
                    checkout=None if name == "this" else other,
                )
            )
            for name in ("this", "other")
        }
        if client_cpus:
            os.sched_setaffinity(0, _cpu_set(client_cpus))
        figures: dict[tuple[str, str], list[dict[str, float]]] = {}
        try:
            print(f"pinning: pools {pools_cpus}, upstream {upstream_cpus}, client {client_cpus}")
            print(f"load average before: {os.getloadavg()}")
            for round_index in range(rounds + 1):  # round 0 warms both up, uncounted
                order = list(sides.items())
                for name, server in order if round_index % 2 else order[::-1]:
                    for cell, (clients, tokens) in CELLS.items():
                        got = await _cell(server, clients, tokens, seconds if round_index else 1)
                        if round_index:
                            figures.setdefault((cell, name), []).append(got)
                            print(_line(f"round {round_index} {cell} {name}", got))
        finally:
            os.sched_setaffinity(0, client_before)
        print(f"load average after: {os.getloadavg()}")
        for (cell, name), runs in figures.items():
            medians = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
            print(_line(f"{cell} {name}: median of {len(runs)} rounds", medians))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ab", type=Path, required=True, help="the other pool package's DIR")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    trio.run(ab, args.ab, args.rounds, args.seconds)


if __name__ == "__main__":
    main()
