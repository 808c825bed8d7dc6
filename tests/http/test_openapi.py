"""The OpenAPI document against the app itself: every route of Quart's URL map is in it
with its request and success schemas, the document is valid OpenAPI 3.1, and real
answers of every route validate against the schemas it gives."""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from pool import ServerInfo
from pool.actors import open_pool
from pool.config import build_settings
from pool.http import create_app
from pool.http._openapi import openapi_document
from tests.http.conftest import start_server

# Added by Quart to every GET route (HEAD) and to every route (OPTIONS); HEAD / is
# documented on its own because Ollama clients probe with it.
_AUTOMATIC = {"HEAD", "OPTIONS"}


async def _app_routes() -> list[tuple[str, str, bool, Any]]:
    """(method, OpenAPI path, websocket, view) of every rule of the app's URL map."""
    settings = build_settings({"engine": {"models": {"echo": {"backend": "stub"}}}})
    async with open_pool(settings) as pool:
        app = create_app(pool, settings)
        routes = []
        for rule in app.url_map.iter_rules():
            path = re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule)
            view = app.view_functions[rule.endpoint]
            for method in sorted(rule.methods or ()):
                if method not in _AUTOMATIC:
                    routes.append((method.lower(), path, rule.websocket, view))
        return routes


async def test_every_route_of_the_app_is_documented() -> None:
    document = openapi_document()
    routes = await _app_routes()
    assert len(routes) > 30
    for method, path, websocket, view in routes:
        operation = document["paths"].get(path, {}).get(method)
        assert operation is not None, f"{method.upper()} {path} is not in the OpenAPI document"
        assert operation["summary"] and operation["description"]
        if websocket:
            assert "101" in operation["responses"], path
            continue
        source = inspect.getsource(view)
        # The body's model: what the route reads (a model route reads it as it opens).
        read = re.search(
            r"(?:read_body\(|authorized_body\(ctx, |open_model_route\(ctx, |read_form\()(\w+)",
            source,
        )
        if read:
            # The documented request schema is the model the route reads (a JSON body, or
            # a multipart form's fields).
            (media,) = operation["requestBody"]["content"].values()
            schema = media["schema"]
            assert schema == {"$ref": f"#/components/schemas/{read.group(1)}"}, path
        else:
            assert "requestBody" not in operation, f"{method.upper()} {path} takes no body"
        if "101" in operation["responses"]:
            # The WebSocket route's plain GET: 426, naming the upgrade (no success body).
            assert "426" in operation["responses"], path
            continue
        # /api/copy's only answer is its 400: copies are refused.
        successes = [s for s in operation["responses"] if s[0] in "123"] or ["400"]
        (success,) = successes
        content = operation["responses"][success].get("content")
        assert content, f"{method.upper()} {path}: no schema for its {success} answer"
        for media in content.values():
            assert media["schema"], path
    documented = {(m, p) for p, ops in document["paths"].items() for m in ops}
    served = {(m, p) for m, p, *_ in routes} | {("head", "/")}
    assert documented == served


def test_the_document_is_valid_openapi() -> None:
    validate(openapi_document())


def test_the_messages_routes_take_x_api_key_and_answer_anthropic_errors() -> None:
    paths = openapi_document()["paths"]
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        operation = paths[path]["post"]
        headers = {p["name"] for p in operation["parameters"] if p["in"] == "header"}
        assert headers == {"x-api-key", "anthropic-version"}
        for status in ("400", "401", "404"):
            error = operation["responses"][status]["content"]["application/json"]["schema"]
            assert error == {"$ref": "#/components/schemas/MessagesError"}, status
        assert {"apiKey": []} in operation["security"]
    assert "parameters" not in paths["/v1/chat/completions"]["post"]


# -- real answers against the documented schemas ------------------------------------------
MODELS: dict[str, dict[str, Any]] = {
    "echo": {"backend": "stub", "enabled": True},
    "cold": {"backend": "stub"},
    "vec": {"backend": "stub", "enabled": True, "embedding": True},
}


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(nursery, MODELS)


@pytest.fixture
async def client(server: ServerInfo) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        yield c


class Checker:
    def __init__(self, document: dict[str, Any]) -> None:
        self.document = document
        self.checked: set[tuple[str, str, int]] = set()

    def schema(self, method: str, path: str, status: int, media: str) -> dict[str, Any]:
        responses = self.document["paths"][path][method]["responses"]
        answer = responses.get(str(status)) or responses[f"{str(status)[0]}XX"]
        return dict(answer["content"][media]["schema"])

    def check(self, response: httpx.Response, path: str) -> Any:
        """Validate ``response`` against the schema documented for its path and status."""
        method = response.request.method.lower()
        media = response.headers.get("content-type", "").split(";")[0]
        if media == "application/json":
            schema = self.schema(method, path, response.status_code, media)
            Draft202012Validator(schema | {"components": self.document["components"]}).validate(
                response.json()
            )
        elif media == "application/x-ndjson":
            line_schema = self.schema(method, path, response.status_code, "application/json")
            validator = Draft202012Validator(
                line_schema | {"components": self.document["components"]}
            )
            for line in response.text.splitlines():
                validator.validate(json.loads(line))
        else:
            assert (
                media
                in self.document["paths"][path][method]["responses"][str(response.status_code)][
                    "content"
                ]
            ), (path, media)
        self.checked.add((method, path, response.status_code))
        return response.json() if media == "application/json" else response.text


async def test_real_answers_match_the_documented_schemas(client: httpx.AsyncClient) -> None:
    document = (await client.get("/openapi.json")).json()
    checker = Checker(document)
    check = checker.check
    chat = [{"role": "user", "content": "hi"}]

    check(
        await client.post("/v1/responses", json={"model": "echo", "input": "hi"}), "/v1/responses"
    )
    check(await client.get("/v1/models"), "/v1/models")
    check(await client.get("/v1/admin/models"), "/v1/admin/models")
    check(await client.get("/v1/admin/models/echo"), "/v1/admin/models/{name}")
    check(await client.post("/v1/admin/models/cold/load"), "/v1/admin/models/{name}/load")
    check(await client.post("/v1/admin/models/cold/unload"), "/v1/admin/models/{name}/unload")
    check(await client.get("/v1/admin/gpu-memory"), "/v1/admin/gpu-memory")
    check(await client.get("/v1/admin/decisions"), "/v1/admin/decisions")
    check(
        await client.post("/v1/admin/models/cold/load?dry_run=true"),
        "/v1/admin/models/{name}/load",
    )
    check(await client.get("/v1/capabilities"), "/v1/capabilities")
    task = check(await client.post("/v1/models/load", json={"modelId": "cold"}), "/v1/models/load")
    with trio.fail_after(5):
        while (state := await client.get(f"/v1/models/load/{task['taskId']}")).json()[
            "status"
        ] == "loading":
            await trio.sleep(0.01)
    check(state, "/v1/models/load/{task_id}")
    check(await client.post("/v1/models/unload", json={"modelId": "cold"}), "/v1/models/unload")
    check(await client.post("/v1/cache/flush", json={"scope": "all"}), "/v1/cache/flush")
    check(
        await client.post("/v1/chat/completions", json={"model": "echo", "messages": chat}),
        "/v1/chat/completions",
    )
    check(
        await client.post("/v1/completions", json={"model": "echo", "prompt": ["a", "b"]}),
        "/v1/completions",
    )
    message = {"model": "echo", "max_tokens": 5, "messages": chat}
    for stream in (False, True):
        check(await client.post("/v1/messages", json=message | {"stream": stream}), "/v1/messages")
    check(await client.post("/v1/messages/count_tokens", json=message), "/v1/messages/count_tokens")
    for encoding in ("float", "base64"):
        body = {"model": "vec", "input": ["a", "b"], "encoding_format": encoding}
        check(await client.post("/v1/embeddings", json=body), "/v1/embeddings")
    # Rerank and score (an embedding model answers by cosine similarity), and a refusal.
    rerank = {"model": "vec", "query": "q", "documents": ["a", {"text": "b"}],
              "return_documents": True}  # fmt: skip
    for path in ("/v1/rerank", "/rerank", "/v2/rerank", "/openai/v1/rerank"):
        check(await client.post(path, json=rerank), path)
    check(await client.post("/v1/rerank", json=rerank | {"model": "echo"}), "/v1/rerank")
    for path in ("/v1/score", "/score", "/openai/v1/score"):
        body = {"model": "vec", "text_1": "q", "text_2": ["a", "b"]}
        check(await client.post(path, json=body), path)
    # OpenAI's base URL: the Responses API in OpenAI's shapes, and the same routes as /v1.
    created = check(
        await client.post(
            "/openai/v1/responses", json={"model": "echo", "input": "hi", "metadata": {"a": "b"}}
        ),
        "/openai/v1/responses",
    )
    check(
        await client.post(
            "/openai/v1/responses", json={"model": "echo", "input": "hi", "stream": True}
        ),
        "/openai/v1/responses",
    )
    rid = created["id"]
    check(await client.get(f"/openai/v1/responses/{rid}"), "/openai/v1/responses/{response_id}")
    check(
        await client.get(f"/openai/v1/responses/{rid}/input_items"),
        "/openai/v1/responses/{response_id}/input_items",
    )
    check(await client.delete(f"/openai/v1/responses/{rid}"), "/openai/v1/responses/{response_id}")
    check(await client.get(f"/openai/v1/responses/{rid}"), "/openai/v1/responses/{response_id}")
    check(
        await client.post("/openai/v1/chat/completions", json={"model": "echo", "messages": chat}),
        "/openai/v1/chat/completions",
    )
    check(
        await client.post("/openai/v1/completions", json={"model": "echo", "prompt": "a"}),
        "/openai/v1/completions",
    )
    check(
        await client.post("/openai/v1/embeddings", json={"model": "vec", "input": "a"}),
        "/openai/v1/embeddings",
    )
    check(await client.get("/openai/v1/models"), "/openai/v1/models")
    check(await client.get("/openai/v1/models/echo"), "/openai/v1/models/{model}")
    check(await client.get("/openai/v1/models/nope"), "/openai/v1/models/{model}")
    for stream in (True, False):
        body = {"model": "echo", "messages": chat, "stream": stream}
        check(await client.post("/api/chat", json=body), "/api/chat")
        body = {"model": "echo", "prompt": "hi", "stream": stream}
        check(await client.post("/api/generate", json=body), "/api/generate")
    check(await client.post("/api/chat", json={"model": "cold", "messages": []}), "/api/chat")
    check(await client.post("/api/embed", json={"model": "vec", "input": ["a"]}), "/api/embed")
    check(
        await client.post("/api/embeddings", json={"model": "vec", "prompt": "a"}),
        "/api/embeddings",
    )
    check(await client.get("/api/tags"), "/api/tags")
    check(await client.get("/api/ps"), "/api/ps")
    for model in ("echo", "vec"):
        check(await client.post("/api/show", json={"model": model}), "/api/show")
    copy = {"source": "echo", "destination": "other"}
    check(await client.post("/api/copy", json=copy), "/api/copy")
    assert check(await client.get("/"), "/") == "Ollama is running"
    check(await client.get("/api/version"), "/api/version")
    check(await client.get("/api/pull/status/echo"), "/api/pull/status/{model}")  # 404
    check(await client.delete("/api/pull/echo"), "/api/pull/{model}")  # 404
    check(
        await client.request("DELETE", "/api/delete", json={"model": "echo"}), "/api/delete"
    )  # 404: not pulled
    check(await client.post("/api/pull", json={"model": "echo"}), "/api/pull")  # no source
    check(await client.get("/health"), "/health")
    check(await client.get("/api/status"), "/api/status")
    check(await client.get("/metrics"), "/metrics")
    check(await client.get("/openapi.json"), "/openapi.json")
    check(await client.get("/docs"), "/docs")
    # Errors of each surface have their documented shape too.
    check(
        await client.post("/v1/embeddings", json={"model": "nope", "input": "x"}), "/v1/embeddings"
    )
    check(await client.post("/api/embed", json={"model": "nope", "input": "x"}), "/api/embed")
    check(await client.get("/v1/admin/models/nope"), "/v1/admin/models/{name}")
    check(await client.post("/v1/messages", json=message | {"model": "nope"}), "/v1/messages")
    check(await client.post("/v1/messages", json={"model": "echo"}), "/v1/messages")
    successes = {(m, p) for m, p, s in checker.checked if s < 400}
    assert len(successes) >= 30


def test_security_and_examples_follow_the_serving_pool() -> None:
    """Each operation's `security` says what this pool asks for (an empty requirement
    where it needs no token), and its examples name configured models."""
    from pool.http._app import served_by
    from pool.http._auth import Authenticator

    models = {"vec": {"backend": "stub", "embedding": True}, "echo": {"backend": "stub"}}
    open_settings = build_settings({"engine": {"models": models}})
    open_doc = openapi_document(
        served=served_by(open_settings, Authenticator(open_settings.service.auth, environ={}))
    )
    paths = open_doc["paths"]
    assert {} in paths["/v1/responses"]["post"]["security"]
    assert {} in paths["/v1/admin/models"]["get"]["security"]
    assert paths["/health"]["get"]["security"] == []
    body = paths["/v1/responses"]["post"]["requestBody"]["content"]["application/json"]
    assert body["example"]["model"] == "echo"
    body = paths["/v1/embeddings"]["post"]["requestBody"]["content"]["application/json"]
    assert body["example"]["model"] == "vec"
    assert set(open_doc["components"]["securitySchemes"]) == {
        "inferenceToken",
        "adminToken",
        "apiKey",
    }

    auth = {"inference_tokens": ["user"], "admin_token": "root"}
    closed = build_settings({"service": {"auth": auth}, "engine": {"models": models}})
    paths = openapi_document(
        served=served_by(closed, Authenticator(closed.service.auth, environ={}))
    )["paths"]
    assert paths["/v1/responses"]["post"]["security"] == [
        {"inferenceToken": []},
        {"adminToken": []},
    ]
    assert paths["/v1/admin/models"]["get"]["security"] == [{"adminToken": []}]
    assert paths["/v1/models/load"]["post"]["security"] == [{"adminToken": []}]
    assert paths["/health"]["get"]["security"] == []
    # Every operation documents the statuses it can refuse with, 401 where it has a token.
    for path, methods in paths.items():
        for method, operation in methods.items():
            if operation["security"]:
                assert "401" in operation["responses"], (method, path)
            assert "403" in operation["responses"], (method, path)
