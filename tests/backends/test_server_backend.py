"""Backend ``server``: any OpenAI-compatible server started by its command.

The server here is tests/backends/image_server.py, a real HTTP server run as a
subprocess by the model's ``command``: images through ``/v1/images/generations``
(whole and streamed), a multipart form forwarded by the forward job, keys, tenants,
usage rows, the kind check, and the process's life tied to the pool's.
"""

from __future__ import annotations

import base64
import json
import re
import sqlite3
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from pool import PoolError, ServerInfo, open_pool, serve
from pool.actors import USAGE_FILE_NAME, TaskRequest
from pool.backends import Forwarded, TaskUsage, forward_job
from pool.backends._forward import usage_of
from pool.backends._process import group_alive
from pool.backends.server import ServerModel
from pool.config import build_settings
from pool.errors import ConfigError
from tests.actors.helpers import wait_until
from tests.backends.test_process import assert_killed_pool_leaves_no_server

SERVER = Path(__file__).with_name("image_server.py")


def _image_model(tmp_path: Path, **fields: Any) -> dict[str, Any]:
    model_file = tmp_path / "painter.bin"
    model_file.write_bytes(b"weights")
    return {
        "backend": "server",
        "kind": "image",
        "command": [
            sys.executable,
            str(SERVER),
            "--port",
            "${PORT}",
            "--model-file",
            "${MODEL_PATH}",
        ],
        "env": {"SERVER_TAG": "tag-${PORT}"},
        "model_path": str(model_file),
        "served_model": "painter-v1",
        "api_key": "secret-upstream",
        "vram_mib": 700,
        "ready_timeout_s": 30,
        "enabled": True,
        **fields,
    }


def _settings(tmp_path: Path, **service: Any) -> Any:
    return build_settings(
        {
            "service": {"usage": {"flush_ms": 10}, "shutdown_grace_s": 2, **service},
            "engine": {
                "models": {
                    "painter": _image_model(tmp_path),
                    "chat": {"backend": "stub", "enabled": True},
                    "scribe": {
                        "backend": "server",
                        "kind": "transcription",
                        "command": [sys.executable, str(SERVER), "--port", "${PORT}"],
                        "routes": ["/v1/audio/transcriptions"],
                        "enabled": True,
                    },
                }
            },
        }
    )


def _rows(state: Path) -> list[tuple[object, ...]]:
    with sqlite3.connect(state / USAGE_FILE_NAME) as db:
        return db.execute(
            "SELECT key, tenant, model, prompt_tokens, output_tokens, status FROM usage"
            " ORDER BY rowid"
        ).fetchall()


async def _serve(nursery: trio.Nursery, settings: Any) -> ServerInfo:
    info: ServerInfo = await nursery.start(
        lambda task_status: serve(settings, host="127.0.0.1", port=0, task_status=task_status)
    )
    return info


# -- settings ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"command": ["srv", "--port", "${PORT}", "${WEIGHTS}"]}, "unknown placeholder ${WEIGHTS}"),
        ({"command": ["srv"]}, "the server's port is unknown"),
        ({"command": ["srv", "${PORT}", "${MODEL_PATH}"]}, "model_path is not set"),
        ({"command": []}, "at least 1 item"),
        ({"command": ["srv", "${PORT}"], "kind": "image", "routes": ["/v1/rerank"]}, "not one of"),
        ({"command": ["srv", "${PORT}"], "health_path": "health"}, "should match pattern"),
        ({"command": ["srv", "${PORT}"], "kind": "rerank", "routes": {"/v1/rerank": "rr"}}, "/"),
        ({"command": ["srv", "${PORT}"], "ready_timeout_s": 0}, "greater than 0"),
    ],
)
def test_settings_are_checked_with_clear_errors(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_settings({"engine": {"models": {"s": {"backend": "server", **fields}}}})


def test_routes_default_to_the_kinds_and_map_to_the_servers_paths() -> None:
    settings = build_settings(
        {
            "engine": {
                "models": {
                    "r": {"backend": "server", "kind": "rerank", "port": 9000, "command": ["x"]},
                    "m": {
                        "backend": "server",
                        "kind": "rerank",
                        "command": ["x", "${PORT}"],
                        "routes": {"/v1/rerank": "/rerank"},
                    },
                    "c": {"backend": "server", "command": ["x", "${PORT}"], "vram_mib": 512},
                }
            }
        }
    )
    models = settings.engine.models
    assert isinstance(models["r"], ServerModel) and isinstance(models["m"], ServerModel)
    assert models["r"].route_map() == {"/v1/rerank": "/v1/rerank", "/v1/score": "/v1/score"}
    assert models["m"].route_map() == {"/v1/rerank": "/rerank"}
    assert models["c"].kind == "chat"
    from pool.backends import get_backend

    backend = get_backend("server")
    assert backend.capabilities(models["m"]).forwards == {"/v1/rerank"}
    # Chat is the pool's own client's, not forwarded.
    assert backend.capabilities(models["c"]).forwards == frozenset()
    assert backend.declared_vram_mib(models["c"]) == 512


def test_usage_is_read_in_each_spelling() -> None:
    assert usage_of({"usage": {"prompt_tokens": 3, "completion_tokens": 4}}) == TaskUsage(3, 4)
    assert usage_of({"usage": {"input_tokens": 2, "output_tokens": 9}}) == TaskUsage(2, 9)
    assert usage_of({"usage": {"total_tokens": 7}}) == TaskUsage(7, 0)
    assert usage_of({"usage": {"seconds": 2.5}}).audio_seconds == 2.5
    assert usage_of({"data": []}) == TaskUsage() == usage_of([1, 2])


# -- a real server process -------------------------------------------------------------


async def test_images_whole_and_streamed_through_the_pool(
    nursery: trio.Nursery, tmp_path: Path, private_state: Path
) -> None:
    info = await _serve(nursery, _settings(tmp_path))
    pool = info.pool
    assert pool.snapshot("painter").state == "loaded", pool.snapshot("painter").last_error
    assert pool.snapshot("painter").capabilities.kind == "image"
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        r = await http.post(
            "/v1/images/generations", json={"model": "painter", "prompt": "a red fox", "n": 2}
        )
        assert r.status_code == 200, r.text
        reply = r.json()
        assert [base64.b64decode(d["b64_json"]) for d in reply["data"]] == [
            b"a red fox #0",
            b"a red fox #1",
        ]
        # The body reached the server with its own name of the model.
        assert reply["data"][0]["revised_prompt"] == "painter-v1: a red fox"
        assert r.headers["x-queue-wait-ms"].isdigit()

        # Streamed: the server's events come through as it sends them.
        async with http.stream(
            "POST",
            "/openai/v1/images/generations",
            json={"model": "painter", "prompt": "two owls", "n": 3, "stream": True},
        ) as streamed:
            assert streamed.status_code == 200
            assert streamed.headers["content-type"].startswith("text/event-stream")
            events = [
                json.loads(line[6:])
                async for line in streamed.aiter_lines()
                if line.startswith("data: ")
            ]
        assert [e["type"] for e in events] == [
            "image_generation.partial_image",
            "image_generation.partial_image",
            "image_generation.partial_image",
            "image_generation.completed",
        ]
        assert base64.b64decode(events[2]["b64_json"]) == b"two owls #2"

        # A stream the server breaks off ends with an error event after what it sent.
        async with http.stream(
            "POST",
            "/v1/images/generations",
            json={"model": "painter", "prompt": "break", "n": 2, "stream": True},
        ) as broken:
            assert broken.status_code == 200
            sent = [
                json.loads(line[6:])
                async for line in broken.aiter_lines()
                if line.startswith("data: ")
            ]
        assert sent[0]["type"] == "image_generation.partial_image"
        assert len(sent) == 2 and sent[1]["error"]["code"] == "backend_error"

        # The server's refusal is the client's error, quoted.
        r = await http.post("/v1/images/generations", json={"model": "painter", "prompt": "refuse"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
        assert "this prompt is refused" in r.json()["error"]["message"]

        # A model of another kind: refused before anything is forwarded.
        r = await http.post("/v1/images/generations", json={"model": "chat", "prompt": "x"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["code"] == "wrong_model_kind" and "chat" in error["message"]
        # An image model answers no chat.
        r = await http.post(
            "/v1/chat/completions",
            json={"model": "painter", "messages": [{"role": "user", "content": "hi"}]},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind"
        r = await http.post("/v1/images/generations", json={"model": "painter"})
        assert r.status_code == 422

        # What the process was started with: the substituted command and environment,
        # and the upstream key as its bearer token.
        runtime = pool.model("painter").replicas[0].runtime
        who = (await http.get(f"{runtime.base_url}/whoami")).json()  # type: ignore[union-attr]
    port = runtime.base_url.rsplit(":", 1)[1]  # type: ignore[union-attr]
    assert who["model_file"] == str(tmp_path / "painter.bin")
    assert who["tag"] == f"tag-{port}"
    assert who["authorization"] == "Bearer secret-upstream"
    await wait_until(lambda: pool.parts_for_tests().usage.written == 6)  # type: ignore[union-attr]
    # Usage from the server's own `usage` (whole or streamed); refusals recorded as such
    # (the 422 never reached the pool).
    assert _rows(private_state) == [
        (None, "default", "painter", 3, 200, "success"),
        (None, "default", "painter", 2, 300, "success"),
        (None, "default", "painter", 0, 0, "backend_error"),
        (None, "default", "painter", 0, 0, "invalid_request"),
        (None, "default", "chat", 0, 0, "wrong_model_kind"),
        (None, "default", "painter", 0, 0, "wrong_model_kind"),
    ]
    # The requests' metrics, as for any model.
    counted = {
        sample.labels["status"]: sample.value
        for family in text_string_to_metric_families(pool.render_metrics().decode())
        for sample in family.samples
        if sample.name == "llm_pool_requests_total" and sample.labels["model"] == "painter"
    }
    assert counted == {
        "success": 2,
        "backend_error": 1,
        "invalid_request": 1,
        "wrong_model_kind": 1,
    }


async def test_keys_and_tenants_apply_as_to_chat(nursery: trio.Nursery, tmp_path: Path) -> None:
    keys = {"keys": [{"name": "acme-key", "key": "k-acme", "tenant": "acme"}]}
    info = await _serve(nursery, _settings(tmp_path, auth=keys))
    body = {"model": "painter", "prompt": "a cat"}
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        for path, payload in (("/v1/images/generations", body), ("/v1/chat/completions", chat)):
            r = await http.post(path, json=payload)
            assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
            r = await http.post(path, json=payload, headers={"Authorization": "Bearer wrong"})
            assert r.status_code == 401
            # The key's tenant is the request's: naming another is refused.
            r = await http.post(
                path,
                json=payload,
                headers={"Authorization": "Bearer k-acme", "X-Tenant-ID": "globex"},
            )
            assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_forbidden"
            r = await http.post(path, json=payload, headers={"Authorization": "Bearer k-acme"})
            assert r.status_code == 200, r.text
    await wait_until(lambda: info.pool.parts_for_tests().usage.written == 2)  # type: ignore[union-attr]


async def test_a_multipart_form_is_forwarded_with_its_content_type(tmp_path: Path) -> None:
    boundary = "pool-test-boundary"
    audio = bytes(range(256)) * 4
    form = (
        (
            f'--{boundary}\r\nContent-Disposition: form-data; name="model"\r\n\r\nscribe\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.wav"\r\n'
            "Content-Type: audio/wav\r\n\r\n"
        ).encode()
        + audio
        + f"\r\n--{boundary}--\r\n".encode()
    )
    async with open_pool(_settings(tmp_path)) as pool:
        job = forward_job(
            "transcription",
            model="scribe",
            route="/v1/audio/transcriptions",
            body=form,
            content_type=f"multipart/form-data; boundary={boundary}",
        )
        done = await pool.run_task(TaskRequest("scribe", job))
        assert isinstance(done.value, Forwarded)
        assert json.loads(done.value.body) == {"text": "multipart/form-data file of 1024 bytes"}
        # A route the server does not serve fails cleanly.
        other = forward_job(
            "transcription",
            model="scribe",
            route="/v1/audio/translations",
            body=b"",
            content_type="x",
        )
        with pytest.raises(PoolError) as failed:
            await pool.run_task(TaskRequest("scribe", other))
        assert failed.value.code == "backend_error"
        # The kind is the job's: an image job on the transcription server is refused.
        wrong = forward_job(
            "image", model="scribe", route="/v1/images/generations", body=b"{}", content_type="x"
        )
        with pytest.raises(PoolError) as refused:
            await pool.run_task(TaskRequest("scribe", wrong))
        assert refused.value.code == "wrong_model_kind"
        assert refused.value.details == {"kind": "transcription", "wanted": "image"}


async def test_unload_ends_the_servers_group(tmp_path: Path) -> None:
    settings = build_settings(
        {
            "engine": {
                "models": {
                    "painter": _image_model(
                        tmp_path,
                        command=[sys.executable, str(SERVER), "--port", "${PORT}", "--spawn-child"],
                        model_path=None,
                    )
                }
            }
        }
    )
    async with open_pool(settings) as pool:
        runtime = pool.model("painter").replicas[0].runtime
        pid = runtime.process.pid  # type: ignore[union-attr]
        assert group_alive(pid)
        await pool.unload("painter")
        assert not group_alive(pid)


def test_the_server_dies_with_a_killed_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The pool's process imports this checkout's pool, whatever the environment installed.
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).resolve().parents[2]))
    settings = build_settings({"engine": {"models": {"painter": _image_model(tmp_path)}}})
    assert_killed_pool_leaves_no_server(settings, "painter", tmp_path)


async def test_a_chat_server_serves_every_generation_surface(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A chat server is spoken to by the pool's Chat Completions client (the fake server
    streams "one two three ..."), so Chat Completions, legacy Completions, Responses and
    Ollama all work; a server that never gets ready fails its load within its timeout."""
    fake = Path(__file__).with_name("fake_openai_server.py")
    settings = build_settings(
        {
            "service": {"shutdown_grace_s": 2},
            "engine": {
                "models": {
                    "talker": {
                        "backend": "server",
                        "command": [sys.executable, str(fake), "--port", "${PORT}"],
                        "target_inflight": 2,
                        "enabled": True,
                    },
                    "sleeper": {
                        "backend": "server",
                        "command": [sys.executable, str(fake), "--port", "${PORT}"],
                        "env": {"UNUSED": "x"},
                        "health_path": "/never",
                        "ready_timeout_s": 1.5,
                    },
                }
            },
        }
    )
    info = await _serve(nursery, settings)
    assert info.pool.snapshot("talker").effective_target_inflight == 2
    messages = [{"role": "user", "content": "hi"}]
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        r = await http.post(
            "/v1/chat/completions", json={"model": "talker", "messages": messages, "max_tokens": 3}
        )
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "one two three"
        usage = r.json()["usage"]
        # The server's own counts.
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (3, 3)
        r = await http.post(
            "/v1/completions", json={"model": "talker", "prompt": "hi", "max_tokens": 2}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "one two"
        r = await http.post(
            "/api/chat",
            json={
                "model": "talker",
                "messages": messages,
                "stream": False,
                "options": {"num_predict": 4},
            },
        )
        assert r.status_code == 200 and r.json()["message"]["content"] == "one two three four"
        r = await http.post("/v1/images/generations", json={"model": "talker", "prompt": "a cat"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "wrong_model_kind"
        r = await http.post("/v1/admin/models/sleeper/load")
        assert r.status_code == 500 and r.json()["error"]["code"] == "load_failed"
        assert "not ready within 1.5s" in r.json()["error"]["message"]
