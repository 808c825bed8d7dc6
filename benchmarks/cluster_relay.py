"""``cluster-relay``: what routing through a peer adds (docs/cluster.md, "Routing").

Two pools share a Redis: B has a stub model loaded, A has no model. The same requests
go straight to B and to A, which relays them to B through its streaming relay; the
difference is the relay's cost.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import trio

from benchmarks.harness import Server, closed_loop, free_port, measure, pool_server, progress
from benchmarks.stub_bodies import stub_text


@contextmanager
def redis_server() -> Iterator[str]:
    """A private redis-server on a free loopback port; its URL."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (scripts/test installs it)")
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        process = subprocess.Popen(
            [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", folder,
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            time.sleep(0.3)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait(10)


def _body(tokens: int, stream: bool) -> Callable[[int], tuple[dict[str, Any], dict[str, str]]]:
    body = {"model": "stub", "input": "x", "stream": stream, "decoding": {"max_tokens": tokens}}
    return lambda index: (body, {})


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


async def _wait_routed(relay: Server) -> None:
    """Until A lists the model as loaded on B."""
    async with httpx.AsyncClient(base_url=relay.url, timeout=5) as client:
        with trio.fail_after(30):
            while True:
                data = (await client.get("/v1/models")).json()["data"]
                if any(m["id"] == "stub" and m.get("nodes") == ["B"] for m in data):
                    return
                await trio.sleep(0.1)


async def cluster_relay(quick: bool) -> dict[str, Any]:
    concurrencies = [1, 8] if quick else [1, 8, 32]
    rounds = 1 if quick else 3
    per_request = 30 if quick else 100
    cells = [("json", 1, False), ("sse-100", 100, True)]
    stub = {"backend": "stub", "enabled": True, "stub_reply": stub_text(100), "target_inflight": 64}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with redis_server() as url:

        def cluster(node: str) -> dict[str, Any]:
            return {"redis_url": url, "node_id": node, "gpu_host": node}

        with (
            pool_server({"stub": stub}, cluster=cluster("B")) as b,
            pool_server({}, cluster=cluster("A")) as a,
        ):
            direct = dataclasses.replace(b, name="direct")
            relay = dataclasses.replace(a, name="relay")
            await _wait_routed(relay)
            for server in (direct, relay):  # warm-up
                await closed_loop(server, 4, 50, _body(100, True))
            for round_index in range(rounds):
                for mode, tokens, stream in cells:
                    for concurrency in concurrencies:
                        key = f"{mode} c={concurrency}"
                        count = per_request * max(1, concurrency // 4)
                        for server in (direct, relay):  # interleaved
                            progress(
                                f"cluster-relay round {round_index + 1}/{rounds} {key}"
                                f" {server.name}"
                            )
                            summary = await measure(
                                server,
                                lambda s=server, c=concurrency, n=count, t=tokens, st=stream: (
                                    closed_loop(s, c, n, _body(t, st))
                                ),
                            )
                            results.setdefault(key, {}).setdefault(server.name, []).append(summary)
    rows = []
    for key, sides in results.items():
        pairs = list(zip(sides["direct"], sides["relay"], strict=True))
        rows.append(
            {
                "cell": key,
                "direct_p50_ms": _median([d["latency_ms"]["p50"] for d, _ in pairs]),
                "relay_p50_ms": _median([r["latency_ms"]["p50"] for _, r in pairs]),
                "added_p50_ms": _median(
                    [r["latency_ms"]["p50"] - d["latency_ms"]["p50"] for d, r in pairs]
                ),
                "added_p99_ms": _median(
                    [r["latency_ms"]["p99"] - d["latency_ms"]["p99"] for d, r in pairs]
                ),
                "direct_rps": _median([d["requests_per_s"] for d, _ in pairs]),
                "relay_rps": _median([r["requests_per_s"] for _, r in pairs]),
                "relay_cpu_ms_per_request": _median(
                    [r["server_cpu_ms_per_request"] for _, r in pairs]
                ),
                "relay_errors": sum(r["errors"] for _, r in pairs),
            }
        )
    return {"rows": rows, "raw": results}
