"""Does a burst overflow the pool's accept queue? The fault soak's steady traffic at its
burst rate (80 requests/s for 20 s through httpx with up to 1,000 connections, half of
them streamed, one stream in ten left after its first bytes) against two pools that
differ only in ``service.listen_backlog`` (100, Hypercorn's own default, and 2048),
interleaved, with CPU-bound processes beside them as the soak's other traffic is.

Per run: how each request ended, and the kernel's TCP counters over it (``nstat``,
machine-wide): ``TcpExtListenOverflows`` counts connections the accept queue had no room
for (their handshake is dropped and retried, or ends in a reset).

    PYTHONPATH=. python -m benchmarks.listen_backlog [--hogs 2] [--rounds 2] --out DIR
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path

import httpx
import trio

from benchmarks.harness import Server, pool_server, progress
from benchmarks.soak_faults import BURST_FACTOR, STEADY, STEADY_RATE

BACKLOGS = (100, 2048)
COUNTERS = ("TcpExtListenOverflows", "TcpExtSyncookiesFailed", "TcpOutRsts")


def kernel_counters() -> dict[str, int]:
    out = subprocess.run(["nstat", "-az"], capture_output=True, text=True, check=True).stdout
    fields = (line.split() for line in out.splitlines())
    return {f[0]: int(f[1]) for f in fields if len(f) > 1 and f[0] in COUNTERS}


async def _one(client: httpx.AsyncClient, stream: bool, leave: bool, tally: Counter[str]) -> None:
    body = {"model": "steady", "input": "x", "stream": stream}
    try:
        async with client.stream("POST", "/v1/responses", json=body) as reply:
            if leave:
                async for _ in reply.aiter_bytes():
                    break
                tally["client_left"] += 1
                return
            await reply.aread()
            tally[str(reply.status_code)] += 1
    except httpx.HTTPError as exc:
        tally[f"{type(exc).__name__}: {exc}"[:100]] += 1


async def burst(server: Server, seconds: float) -> Counter[str]:
    tally: Counter[str] = Counter()
    rng = random.Random(1)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with (
        httpx.AsyncClient(base_url=server.url, timeout=None, limits=limits) as client,
        trio.open_nursery() as nursery,
    ):
        arrival = trio.current_time()
        end = arrival + seconds
        while arrival < end:
            stream = rng.random() < 0.5
            nursery.start_soon(_one, client, stream, stream and rng.random() < 0.1, tally)
            arrival += rng.expovariate(STEADY_RATE * BURST_FACTOR)
            await trio.sleep_until(arrival)
    return tally


async def run(rounds: int) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    with ExitStack() as stack:
        pools = {
            backlog: stack.enter_context(
                pool_server(
                    {"steady": STEADY},
                    service={"listen_backlog": backlog},
                    name=f"backlog-{backlog}",
                )
            )
            for backlog in BACKLOGS
        }
        for index in range(rounds):
            order = list(pools.items())
            for backlog, server in order if index % 2 == 0 else reversed(order):
                progress(f"listen-backlog round {index + 1}/{rounds} backlog {backlog}")
                before = kernel_counters()
                endings = await burst(server, 20.0)
                after = kernel_counters()
                rows.append(
                    {
                        "round": index + 1,
                        "backlog": backlog,
                        "endings": dict(sorted(endings.items())),
                        **{name: after[name] - before[name] for name in COUNTERS},
                    }
                )
                await trio.sleep(3)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hogs)]
    try:
        rows = trio.run(run, args.rounds)
    finally:
        for process in busy:
            process.kill()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["| round | backlog | endings | " + " | ".join(COUNTERS) + " |"]
    lines.append("|---" * (3 + len(COUNTERS)) + "|")
    for row in rows:
        endings = ", ".join(f"{k} {v}" for k, v in row["endings"].items())  # type: ignore[attr-defined]
        counts = " | ".join(str(row[name]) for name in COUNTERS)
        lines.append(f"| {row['round']} | {row['backlog']} | {endings} | {counts} |")
    (args.out / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
