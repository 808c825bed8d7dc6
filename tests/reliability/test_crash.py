"""A backend that dies mid-stream: the client gets an error event, the model goes
``failed`` with the reason, nothing is left running, and the next load works.

Two kinds of death: ``kill -9`` of a managed server process (the fake llama-server of
tests/backends), and an in-process engine thread that raises (the scripted backend).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pool import ServerInfo
from tests.backends.test_process import FAKE

from .conftest import exists, live_in_group, sse_payloads, start_server, wait_for


@pytest.fixture
def fake_binary(tmp_path: Path) -> Path:
    script = tmp_path / "fake-llama-server"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    script.chmod(0o755)
    return script


async def _stream(
    client: httpx.AsyncClient, model: str, text: str, on_delta: Any = None, max_tokens: int = 30
) -> list[dict[str, Any]]:
    """One SSE request; ``on_delta(n)`` runs after the n-th delta."""
    lines: list[str] = []
    deltas = 0
    body = {"model": model, "input": text, "stream": True, "decoding": {"max_tokens": max_tokens}}
    async with client.stream("POST", "/v1/responses", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            lines.append(line)
            if line == "event: response.output_text.delta":
                deltas += 1
                if on_delta is not None:
                    on_delta(deltas)
    return sse_payloads(lines)


async def _failed_with(info: ServerInfo, model: str, within_s: float = 5.0) -> str:
    await wait_for(lambda: info.pool.snapshot(model).state == "failed", within_s)
    return info.pool.snapshot(model).last_error or ""


async def test_kill_9_of_a_managed_server_mid_stream(
    nursery: trio.Nursery, fake_binary: Path, tmp_path: Path
) -> None:
    model_file = tmp_path / "model.gguf"
    model_file.write_bytes(b"GGUF")
    srv = {
        "backend": "llama_server",
        "enabled": True,
        "model_path": str(model_file),
        "llama_server_binary": str(fake_binary),
        "llama_server_start_timeout_s": 20,
        "llama_server_extra_args": ["--mode", "slow", "--spawn-child"],
    }
    info = await start_server(nursery, {"srv": srv})
    assert info.pool.snapshot("srv").state == "loaded"
    pid = info.pool.model("srv").replicas[0].runtime.process.pid  # type: ignore[union-attr]
    assert len(live_in_group(pid)) == 2  # the server and the grandchild it started

    def kill_at_second_delta(n: int) -> None:
        if n == 2:
            os.kill(pid, signal.SIGKILL)

    async with httpx.AsyncClient(base_url=info.url, timeout=15) as client:
        events = await _stream(client, "srv", "hi", kill_at_second_delta)
        assert events[-1]["type"] == "error", events[-1]
        assert events[-1]["error"]["code"] == "backend_error"
        assert "Traceback" not in str(events)
        reason = await _failed_with(info, "srv")
        assert "exited with status -9" in reason
        row = (await client.get("/v1/admin/models/srv")).json()
        assert row["runtime_state"] == "failed" and row["last_error"] == reason
        # Reaped by the pool (no zombie), and the whole group went with it (no orphan).
        await wait_for(lambda: not exists(pid) and not live_in_group(pid), 5.0)
        # The next load starts a fresh server that serves.
        loaded = await client.post("/v1/admin/models/srv/load", json={})
        assert loaded.status_code == 200 and loaded.json()["runtime_state"] == "loaded"
        events = await _stream(client, "srv", "hi again", max_tokens=3)
        assert events[-1]["type"] == "response.completed"
        new_pid = info.pool.model("srv").replicas[0].runtime.process.pid  # type: ignore[union-attr]
        assert new_pid != pid
        unloaded = await client.post("/v1/admin/models/srv/unload", json={})
        assert unloaded.json()["runtime_state"] == "unloaded"
        await wait_for(lambda: not exists(new_pid) and not live_in_group(new_pid), 5.0)


def _engine_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("scripted-engine-")]


async def test_an_in_process_engine_thread_that_raises(
    nursery: trio.Nursery, scripted: None
) -> None:
    info = await start_server(nursery, {"eng": {"backend": "scripted", "scripted_mode": "thread"}})
    async with httpx.AsyncClient(base_url=info.url, timeout=15) as client:
        assert (await client.post("/v1/admin/models/eng/load", json={})).status_code == 200
        assert len(_engine_threads()) == 1
        events = await _stream(client, "eng", "this prompt will crash the engine now")
        deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
        assert deltas == ["this", " prompt"]  # scripted_crash_after = 2
        assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "backend_error"
        assert "simulated device fault" in events[-1]["error"]["message"]
        reason = await _failed_with(info, "eng")
        assert reason == (
            "engine thread died: RuntimeError: simulated device fault in the engine thread"
        )
        assert _engine_threads() == []  # the dead thread was joined; nothing left behind
        refused = await client.post("/v1/responses", json={"model": "eng", "input": "x"})
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "model_failed"
        # The next load starts a fresh engine thread that serves.
        assert (await client.post("/v1/admin/models/eng/load", json={})).status_code == 200
        events = await _stream(client, "eng", "a healthy prompt")
        assert events[-1]["type"] == "response.completed"
        assert events[-1]["response"]["output_text"] == "a healthy prompt"
        assert len(_engine_threads()) == 1
