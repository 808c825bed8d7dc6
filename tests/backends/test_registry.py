"""A new backend needs its module and one registry line, nothing else.

``toy_backend.py`` is such a module, defined in the tests; registering it under a new
name is the one line. Then a settings file naming it validates, its row shows its
tables, its load overrides go through the same 422/400 checks, its context field
serves the runner API, and it loads and generates through the pool over HTTP.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import trio

from pool import ServerInfo, serve
from pool.backends import backend_names, get_backend, register_backend, unregister_backend
from pool.config import load_settings
from pool.errors import ConfigError

from . import toy_backend

TOY_MODULE = toy_backend.__name__


@pytest.fixture
def toy() -> Iterator[None]:
    register_backend("toy", TOY_MODULE)
    try:
        yield
    finally:
        unregister_backend("toy")


def _settings_file(tmp_path: Path, **model: object) -> Path:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"engine": {"models": {"t": {"backend": "toy", **model}}}}))
    return path


def test_a_settings_file_naming_it_validates(toy: None, tmp_path: Path) -> None:
    assert "toy" in backend_names()
    loaded = load_settings(_settings_file(tmp_path, toy_reply="hello", toy_ctx=256))
    model = loaded.engine.models["t"]
    assert isinstance(model, toy_backend.ToyModel)
    assert (model.toy_reply, model.toy_ctx) == ("hello", 256)
    path = _settings_file(tmp_path, toy_ctx=0, toy_colour="red")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert len(info.value.problems) == 2
    assert all(p.startswith(f"{path}: engine.models.t.toy_") for p in info.value.problems)


def test_unregistered_it_is_an_unknown_backend(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(_settings_file(tmp_path))
    assert info.value.problems == [
        f"{tmp_path / 'settings.json'}: engine.models.t.backend: unknown backend 'toy'"
        f" (known: {', '.join(backend_names())})"
    ]


def test_a_module_must_declare_the_name_it_is_registered_as() -> None:
    with pytest.raises(TypeError, match=r"registered as backend 'toy2'.*says backend 'toy'"):
        register_backend("toy2", TOY_MODULE)
    assert "toy2" not in backend_names()
    with pytest.raises(ValueError, match="already registered"):
        register_backend("stub", TOY_MODULE)


async def _serve(nursery: trio.Nursery, settings_path: Path) -> ServerInfo:
    settings = load_settings(settings_path)
    info: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, host="127.0.0.1", port=0, task_status=task_status)
    )
    return info


async def _ask(client: httpx.AsyncClient) -> str:
    answer = await client.post("/v1/responses", json={"model": "t", "input": "hi"})
    assert answer.status_code == 200, answer.text
    text: str = answer.json()["output_text"]
    return text


async def test_its_row_load_body_and_generation_over_http(
    toy: None, nursery: trio.Nursery, tmp_path: Path
) -> None:
    info = await _serve(nursery, _settings_file(tmp_path))
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        row = (await client.get("/v1/admin/models/t")).json()
        assert row["resolved_backend"] == "toy"
        assert row["load_constraints"] == toy_backend.LOAD_CONSTRAINTS
        assert row["load_recommendations"] == toy_backend.LOAD_RECOMMENDATIONS
        assert row["capabilities"] == {
            "modalities": ["text"],
            "multi_turn": True,
            "thinking_modes": ["default"],
        }
        schema = (await client.get("/openapi.json")).json()["components"]["schemas"]
        assert "toy_ctx" in schema["LoadRequest"]["properties"]

        load = "/v1/admin/models/t/load"
        assert (await client.post(load, json={"toy_ctx": 0})).status_code == 422
        assert (await client.post(load, json={"toy_colour": "red"})).status_code == 422
        for body, field in (({"toy_ctx": 100}, "toy_ctx"), ({"gguf_n_ctx": 4096}, "gguf_n_ctx")):
            refused = await client.post(load, json=body)
            assert refused.status_code == 400, refused.text
            error = refused.json()["error"]
            assert error["code"] == "invalid_load_request" and field in error["message"]

        loaded = await client.post(load, json={"toy_ctx": 256})
        assert loaded.status_code == 200, loaded.text
        assert loaded.json()["load_override"] == {"toy_ctx": 256}
        assert await _ask(client) == "toy says hi (ctx 256)"
        assert (await client.post("/v1/admin/models/t/unload")).status_code == 200

        # The runner API's maxContextLength becomes the backend's context field.
        task = await client.post("/v1/models/load", json={"modelId": "t", "maxContextLength": 512})
        assert task.status_code == 202, task.text
        with trio.fail_after(5):
            while (status := (await client.get(f"/v1/models/load/{task.json()['taskId']}")).json())[
                "status"
            ] == "loading":
                await trio.sleep(0.01)
        assert status["status"] == "completed", status
        assert await _ask(client) == "toy says hi (ctx 512)"
    assert get_backend("toy") is toy_backend.BACKEND
