"""Three real ``llm-pool serve`` processes on loopback ports share one virtual GPU through
the lease ledger (a real redis-server): concurrent on-demand loads on all of them, round
after round, never lease more than the GPU's budget, and every request is served.

Each node has its own three models (names no other node has, so the cluster's routing
sends every request for one to its owner and each node does its own loads). One node may
fill the GPU by itself; the three together want three times the budget, so nodes evict
their idle models or wait for a peer's lease to go.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import trio
from prometheus_client.parser import text_string_to_metric_families

from pool.cluster import open_ledger

from .conftest import RedisServer

HOST = "shared-box"
BUDGET = 10_000
MODEL_MIB = 3_000
NODES = ("n0", "n1", "n2")
MODELS_PER_NODE = 3
ROUNDS = 6
REQUESTS_PER_ROUND = 9


def models_of(node: str) -> list[str]:
    return [f"{node}-m{i}" for i in range(MODELS_PER_NODE)]


def node_settings(tmp_path: Path, redis_url: str, node: str) -> Path:
    model = {
        "backend": "stub",
        "on_demand": True,
        "keep_alive": 0.2,
        "stub_vram_mib": MODEL_MIB,
        "stub_load_seconds": 0.05,
        "stub_reply": "ok",
    }
    settings = {
        "service": {"host": "127.0.0.1", "port": 0},
        "engine": {
            "gpu_budget_mib": [BUDGET],
            "virtual_gpus": True,
            "min_resident_s": 0,
            "warm_wait_s": 0,
            # A load may wait for peers' models to go idle and unload: rounds on a busy
            # machine can take seconds, never a minute.
            "queue_timeout_s": 60,
            "cluster": {
                "redis_url": redis_url,
                "node_id": node,
                "gpu_host": HOST,  # one gpu_host: the three share GPU 0's budget
                "lease_ttl_s": 3.0,
                "lease_renew_s": 0.3,
                "heartbeat_s": 0.3,
                "node_ttl_s": 1.5,
            },
            "models": {name: model for name in models_of(node)},
        },
    }
    path = tmp_path / f"{node}.json"
    path.write_text(json.dumps(settings))
    return path


async def wait_listening(process: trio.Process, log: Path) -> str:
    """The URL the process prints once it listens (its output goes to a file, so a
    chatty server never blocks on a full pipe)."""
    with trio.fail_after(60):
        while True:
            text = await trio.Path(log).read_text(errors="replace")
            if "listening on " in text:
                return text.split("listening on ", 1)[1].split()[0]
            assert process.poll() is None, f"the pool exited before it listened:\n{text}"
            await trio.sleep(0.05)


@asynccontextmanager
async def serve_nodes(tmp_path: Path, redis_url: str) -> AsyncIterator[dict[str, str]]:
    """Start one ``llm-pool serve`` per node at once; kill them all on the way out."""
    processes: list[trio.Process] = []
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    try:
        logs = {}
        for node in NODES:
            logs[node] = tmp_path / f"{node}.log"
            with logs[node].open("wb") as out:
                processes.append(
                    await trio.lowlevel.open_process(
                        [
                            sys.executable, "-m", "pool", "serve",
                            "--settings", str(node_settings(tmp_path, redis_url, node)),
                        ],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )  # fmt: skip
        urls = {}
        for node, process in zip(NODES, processes, strict=True):
            urls[node] = await wait_listening(process, logs[node])
        yield urls
    finally:
        for process in processes:
            if process.returncode is None:
                process.kill()
        with trio.CancelScope(shield=True):
            for process in processes:
                await process.wait()


def successful_loads(metrics: str) -> int:
    return sum(
        int(sample.value)
        for family in text_string_to_metric_families(metrics)
        if family.name == "llm_pool_model_loads"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("outcome") == "loaded"
    )


async def test_three_serve_processes_never_oversubscribe_a_shared_gpu(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    rng = random.Random(20)
    # Each sample: (MiB leased on the shared GPU, the holders of those leases), read by
    # the ledger's USAGE script: one atomic read of every live lease on the GPU.
    samples: list[tuple[int, frozenset[str]]] = []
    replies: list[tuple[str, int, str]] = []
    with trio.fail_after(50):
        async with (
            serve_nodes(tmp_path, redis_server.url) as urls,
            open_ledger(redis_server.url) as ledger,
            httpx.AsyncClient(timeout=60) as http,
        ):
            # Every node sees the other two before the rounds start.
            while True:
                rows = [(await http.get(f"{u}/v1/admin/models")).json() for u in urls.values()]
                if all({r["node"] for r in row["cluster"]} == set(NODES) - {n}
                       for n, row in zip(NODES, rows, strict=True)):  # fmt: skip
                    break
                await trio.sleep(0.05)

            async def sample(stop: trio.Event) -> None:
                while not stop.is_set():
                    usage = await ledger.usage(HOST, [0])
                    samples.append((sum(u.mib for u in usage), frozenset(u.holder for u in usage)))
                    await trio.sleep(0.005)

            async def ask(node: str, model: str) -> None:
                reply = await http.post(
                    f"{urls[node]}/v1/responses", json={"model": model, "input": "hi"}
                )
                replies.append((model, reply.status_code, reply.text))

            stop = trio.Event()
            async with trio.open_nursery() as sampling:
                sampling.start_soon(sample, stop)
                for _ in range(ROUNDS):
                    async with trio.open_nursery() as nursery:
                        for _ in range(REQUESTS_PER_ROUND):
                            node = rng.choice(NODES)
                            nursery.start_soon(ask, node, rng.choice(models_of(node)))
                stop.set()

            loads = {
                node: successful_loads((await http.get(f"{url}/metrics")).text)
                for node, url in urls.items()
            }
            # Idle models unload after keep_alive and hand their leases back.
            while await ledger.usage(HOST, [0]):
                await trio.sleep(0.05)

    assert len(replies) == ROUNDS * REQUESTS_PER_ROUND
    failed = [r for r in replies if r[1] != 200 or '"ok"' not in r[2]]
    assert failed == []
    peak = max(mib for mib, _ in samples)
    assert peak <= BUDGET, f"the nodes leased {peak} MiB of a {BUDGET} MiB GPU"
    # Not vacuous: every node loaded models (more than fit at once), and the GPU was
    # really shared: leases of several nodes at once, up to the budget's worth.
    assert all(count >= 2 for count in loads.values()), loads
    assert sum(loads.values()) > BUDGET // MODEL_MIB, loads
    holders = {h.split("#", 1)[0] for _, hs in samples for h in hs}
    assert holders == set(NODES), holders
    assert max(len({h.split("#", 1)[0] for h in hs}) for _, hs in samples) >= 2
    assert peak == (BUDGET // MODEL_MIB) * MODEL_MIB, peak
