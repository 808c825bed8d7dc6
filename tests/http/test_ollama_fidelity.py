"""What Ollama clients check: the root probe, /api/tags, /api/ps, /api/show, /api/copy."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import httpx
import ollama
import trio

from tests.http.conftest import start_server


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
        assert shown["capabilities"] == ["embedding", "thinking"]
        shown = (await http.post("/api/show", json={"model": "filed"})).json()
        assert "completion" in shown["capabilities"] and "tools" not in shown["capabilities"]
        assert "temperature" in shown["parameters"] and shown["template"] == "generic"
        r = await http.post("/api/copy", json={"source": "filed", "destination": "other"})
        assert r.status_code == 400 and "settings files" in r.json()["error"]
        r = await http.post("/api/copy", json={"source": "nope", "destination": "other"})
        assert r.status_code == 404
