"""Servers on 127.0.0.1 port 0, started in the test's nursery."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio

from pool import ServerInfo, serve
from pool.actors import GpuReading, GpuSource, GpuView
from pool.config import build_settings

STUB_MODELS: dict[str, dict[str, Any]] = {
    "echo": {"backend": "stub", "enabled": True, "target_inflight": 4},
    "slow": {
        "backend": "stub",
        "enabled": True,
        "stub_reply": " ".join(f"w{i}" for i in range(40)),
        "stub_tokens_per_second": 20,
        "max_queue": 1,
    },
    "cold": {"backend": "stub"},
    # A single-turn format: the model is unloaded, yet multi-turn input is refused.
    "single": {"backend": "exllamav3", "prompt_format": "translategemma_template"},
}

# A model that loads on the first request, reporting each quarter of a 0.4 s load.
WAITING_MODELS = {
    "lazy": {
        "backend": "stub",
        "on_demand": True,
        "stub_reply": "a b c",
        "stub_load_seconds": 0.4,
    },
    "never": {
        "backend": "stub",
        "on_demand": True,
        "stub_load_seconds": 30,
        "queue_timeout_s": 0.3,
    },
}


# A stream far longer than any test waits for it: 2000 words at 20 a second (100 s; the
# server's max_tokens default is raised to let it run). A test that leaves it early and
# then sees the running count fall within STOP_WITHIN_S knows the generation was
# stopped, not finished.
ENDLESS = {
    "backend": "stub",
    "enabled": True,
    "stub_reply": " ".join(f"w{i}" for i in range(2000)),
    "stub_tokens_per_second": 20,
}
# Ten times what a stop takes on a loaded machine, and far short of the 100 s stream.
STOP_WITHIN_S = 20.0


class FakeGpus:
    """A GPU source with fixed readings, in place of the NVML monitor ``serve`` starts."""

    def __init__(self, *gpus: GpuReading, error: str | None = None) -> None:
        self._view = GpuView(tuple(gpus), error)

    def view(self) -> GpuView:
        return self._view


# What NVML reports on a two-GPU box.
TWO_GPUS = FakeGpus(
    GpuReading(0, "NVIDIA H100 80GB HBM3", used_mib=1234, total_mib=81559, utilization=0.25),
    GpuReading(1, "NVIDIA L4", used_mib=100, total_mib=23034),
)


async def start_server(
    nursery: trio.Nursery,
    models: dict[str, dict[str, Any]] | None = None,
    *,
    engine: dict[str, Any] | None = None,
    gpus: GpuSource | None = None,
    **service: Any,
) -> ServerInfo:
    """Serve ``models`` on a free port; ``gpus`` in place of the NVML monitor (a test that
    checks GPU readings passes a :class:`FakeGpus`, so the machine's driver does not matter).
    """
    settings = build_settings(
        {
            "service": {"shutdown_grace_s": 2, **service},
            "engine": {**(engine or {}), "models": models or STUB_MODELS},
        }
    )
    info: ServerInfo = await nursery.start(
        lambda task_status: serve(
            settings, host="127.0.0.1", port=0, gpus=gpus, task_status=task_status
        )
    )
    return info


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(nursery)


@pytest.fixture
def cache_asked(
    server: ServerInfo, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, str | None]]:
    """The (cache mode, cache tag) of every request ``server``'s pool admits, in order."""
    asked: list[tuple[str, str | None]] = []
    admit = server.pool.admit

    def recording_admit(request: Any, **kwargs: Any) -> Any:
        asked.append((request.cache_mode, request.cache_tag))
        return admit(request, **kwargs)

    monkeypatch.setattr(server.pool, "admit", recording_admit)
    return asked


@pytest.fixture
async def endless(nursery: trio.Nursery) -> ServerInfo:
    """A server with one model, ``endless`` (:data:`ENDLESS`), that a request without a
    ``max_tokens`` of its own lets run to its end."""
    return await start_server(
        nursery, {"endless": ENDLESS}, engine={"decoding": {"max_tokens": 4000}}
    )


async def running(client: httpx.AsyncClient, model: str) -> int:
    """The model's running count (``runtime_inflight``) as the admin row reports it."""
    row = (await client.get(f"/v1/admin/models/{model}")).json()
    return int(row["runtime_inflight"])


async def wait_stopped(client: httpx.AsyncClient, model: str) -> None:
    """Until ``model`` runs nothing (a published count, polled), within STOP_WITHIN_S."""
    with trio.fail_after(STOP_WITHIN_S):
        while await running(client, model):
            await trio.sleep(0.02)


@pytest.fixture
async def client(server: ServerInfo) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        yield c


def sse_events(text: str) -> list[tuple[str, str]]:
    events = []
    for block in text.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if ": " in line)
        events.append((lines.get("event", ""), lines.get("data", "")))
    return events
