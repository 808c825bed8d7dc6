"""``llm-pool lease``: a job takes a lease from the command line and the pool waits for it."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from pool.actors import Queued
from pool.cli import run_command
from pool.cluster import open_ledger

from ..actors.helpers import ask
from .conftest import RedisServer, wait_renewals
from .test_pool_leases import BUDGET, HOST, cluster_settings, clustered_pool, on_demand


async def lease_cli(*argv: str) -> tuple[int, Any, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await run_command(["lease", *argv, "--json"], stdout=out, stderr=err)
    text = out.getvalue().strip()
    return code, json.loads(text) if text else None, err.getvalue()


async def test_acquire_list_release(redis_server: RedisServer) -> None:
    url = ["--redis-url", redis_server.url]
    async with open_ledger(redis_server.url) as ledger:
        await ledger.set_budgets(HOST, {0: BUDGET, 1: BUDGET})
    code, lease, _ = await lease_cli(
        "acquire", *url, "--host", HOST, "--gpu", "1:3000", "--gpu", "0:2000",
        "--holder", "trainer", "--purpose", "fine-tune",
    )  # fmt: skip
    assert code == 0
    assert lease["gpus"] == [{"index": 0, "mib": 2000}, {"index": 1, "mib": 3000}]
    code, listed, _ = await lease_cli("list", *url)
    assert code == 0
    [row] = listed["leases"]
    assert (row["id"], row["holder"], row["purpose"]) == (lease["id"], "trainer", "fine-tune")
    assert 500_000 < row["expires_in_ms"] <= 600_000  # the default ttl of a lease that exits

    code, _, err = await lease_cli("acquire", *url, "--host", HOST, "--gpu", "1:8000")
    assert code == 1 and "budget" in err
    code, _, err = await lease_cli("acquire", *url, "--gpu", "zero:1")
    assert code == 2 and "INDEX:MIB" in err

    code, _, _ = await lease_cli("release", *url, lease["id"])
    assert code == 0
    code, _, err = await lease_cli("release", *url, lease["id"])
    assert code == 1 and "no lease" in err
    code, listed, _ = await lease_cli("list", *url)
    assert listed == {"leases": []}


async def test_no_redis_is_exit_3() -> None:
    code, _, err = await lease_cli("list", "--redis-url", "redis://127.0.0.1:1/0")
    assert code == 3 and "no Redis" in err


async def test_a_cli_lease_makes_the_pool_queue_until_it_is_released(
    redis_server: RedisServer,
) -> None:
    settings = cluster_settings(redis_server.url, {"a": on_demand(4000)}, "n1")
    url = ["--redis-url", redis_server.url]
    async with clustered_pool(settings) as (pool, node):
        await node.leases.sync()  # the pool stores its GPU budgets for acquirers like the CLI
        code, lease, _ = await lease_cli("acquire", *url, "--host", HOST, "--gpu", "0:7000")
        assert code == 0
        async with pool.admit(ask("a"), report_waits=True) as admission:
            waits = []
            async for wait in admission.waits():
                waits.append(wait)
                if len(waits) == 1:
                    # Reported as it queued: it waits for the room the CLI's lease holds.
                    assert wait == Queued(1, "vram")
                    assert pool.model("a").scheduler.queue_depth == 1
                    assert (await lease_cli("release", *url, lease["id"]))[0] == 0
            with trio.fail_after(30):
                await admission.collect()
        assert waits  # it did wait (the checks above ran)


async def test_a_held_lease_is_released_on_sigterm(redis_server: RedisServer) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pool", "lease", "acquire", "--redis-url", redis_server.url,
         "--host", HOST, "--gpu", "0:1000", "--hold", "--ttl", "3", "--json"],
        stdout=subprocess.PIPE,
        env=env,
    )  # fmt: skip
    assert process.stdout is not None
    with trio.fail_after(60):
        line = b""
        while not line.endswith(b"\n"):
            line += await process.stdout.receive_some(4096)
    lease = json.loads(line)
    async with open_ledger(redis_server.url) as ledger:
        # Past its ttl, renewed by the holder (every third of it: four renewals outlive
        # it). Renewing runs once the holder waits for signals: SIGTERM is caught then.
        await wait_renewals(ledger, lease["id"], 4)
        assert [held.id for held in await ledger.list_leases()] == [lease["id"]]
        process.send_signal(signal.SIGTERM)
        with trio.fail_after(30):
            assert await process.wait() == 0
        assert await ledger.list_leases() == []


async def test_defaults_come_from_the_environment_then_the_settings(
    redis_server: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With no option a job finds the ledger the pool uses: its settings' engine.cluster,
    overridden by $LLM_POOL_REDIS_URL / $LLM_POOL_KEY_PREFIX / $LLM_POOL_GPU_HOST."""
    settings = tmp_path / "settings.json"
    cluster = {"redis_url": redis_server.url, "key_prefix": "team-a", "gpu_host": HOST}
    settings.write_text(json.dumps({"engine": {"cluster": cluster}}))
    monkeypatch.setenv("LLM_POOL_SETTINGS_PATH", str(settings))
    for name in ("LLM_POOL_REDIS_URL", "LLM_POOL_KEY_PREFIX", "LLM_POOL_GPU_HOST"):
        monkeypatch.delenv(name, raising=False)
    async with open_ledger(redis_server.url, prefix="team-a") as ledger:
        await ledger.set_budgets(HOST, {0: BUDGET})
    code, lease, err = await lease_cli("acquire", "--gpu", "0:1000")
    assert code == 0, err
    assert lease["host"] == HOST
    async with open_ledger(redis_server.url, prefix="team-a") as ledger:
        assert [held.id for held in await ledger.list_leases()] == [lease["id"]]
    code, listed, _ = await lease_cli("list")
    assert [row["id"] for row in listed["leases"]] == [lease["id"]]
    # The environment wins over the settings; an option over both.
    monkeypatch.setenv("LLM_POOL_KEY_PREFIX", "team-b")
    code, listed, _ = await lease_cli("list")
    assert code == 0 and listed == {"leases": []}
    code, listed, _ = await lease_cli("list", "--prefix", "team-a")
    assert [row["id"] for row in listed["leases"]] == [lease["id"]]
    monkeypatch.setenv("LLM_POOL_REDIS_URL", "redis://127.0.0.1:1/0")
    code, _, err = await lease_cli("list", "--prefix", "team-a")
    assert code == 3 and "redis://127.0.0.1:1/0" in err
