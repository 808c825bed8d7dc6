"""Keys with identities (``service.auth.keys``, ``/v1/admin/keys``) on every surface:
clear and hashed keys, tenant binding, roles, per-key rate limits, runtime keys kept
across a restart, and revocation, a WebSocket's included."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url

from pool import ServerInfo
from pool.actors import CALLER, Caller
from pool.config import AuthSettings
from pool.errors import ConfigError, PoolError
from pool.http._auth import Authenticator
from pool.http._common import PipelineRequest, pipeline_request, tenant_and_priority
from pool.http._keys import FILE_NAME, KeyRing
from tests.bounds import within

from .conftest import start_server

ALICE = "sk-alice-in-the-clear"
BOB = "sk-bob-known-by-hash-only"
ROOT = "sk-root-admin-key"
KEYS: list[dict[str, Any]] = [
    {"name": "alice", "key": ALICE, "tenant": "team-a", "priority": "normal"},
    {"name": "bob", "key_sha256": hashlib.sha256(BOB.encode()).hexdigest(), "rate_limit_rpm": 2},
    {"name": "root", "key": ROOT, "role": "admin"},
]
MODELS = {
    "echo": {"backend": "stub", "enabled": True, "target_inflight": 4},
    # A stream that runs for 100 s: a revocation has to end it.
    "endless": {
        "backend": "stub",
        "enabled": True,
        "stub_reply": " ".join(f"w{i}" for i in range(2000)),
        "stub_tokens_per_second": 20,
    },
}
# team-a has a request limit, so its answers carry X-RateLimit-* headers: that is how a
# test sees which tenant a request was counted for.
TENANCY = {"tenants": {"team-a": {"requests_per_minute": 1000, "burst": 100}}}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def keyed_server(nursery: trio.Nursery, **auth: Any) -> ServerInfo:
    return await start_server(nursery, MODELS, auth={"keys": KEYS, **auth}, tenancy=TENANCY)


@pytest.fixture
async def keyed(nursery: trio.Nursery) -> ServerInfo:
    return await keyed_server(nursery)


async def respond(client: httpx.AsyncClient, key: str | None, **headers: str) -> httpx.Response:
    sent = {**(bearer(key) if key else {}), **headers}
    return await client.post("/v1/responses", json={"model": "echo", "input": "hi"}, headers=sent)


# -- authentication on every surface ---------------------------------------------------


async def test_clear_and_hashed_keys_are_accepted_on_every_surface(keyed: ServerInfo) -> None:
    chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
    calls: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/responses", {"model": "echo", "input": "hi"}, "bearer"),
        ("/v1/chat/completions", chat, "bearer"),
        ("/openai/v1/chat/completions", chat, "bearer"),
        ("/openai/v1/responses", {"model": "echo", "input": "hi"}, "bearer"),
        ("/api/chat", {**chat, "stream": False}, "bearer"),
        ("/v1/messages", {**chat, "max_tokens": 8}, "x-api-key"),
    ]
    async with httpx.AsyncClient(base_url=keyed.url, timeout=10) as client:
        for key in (ALICE, BOB, ROOT):
            for path, body, how in calls:
                sent = bearer(key) if how == "bearer" else {"x-api-key": key}
                answer = await client.post(path, json=body, headers=sent)
                if key == BOB and answer.status_code == 429:
                    continue  # bob's 2 per minute: tested below
                assert answer.status_code == 200, (key, path, answer.text)
        assert (await client.get("/v1/models", headers=bearer(ALICE))).status_code == 200


async def test_a_wrong_or_missing_key_is_refused_401(keyed: ServerInfo) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=10) as client:
        for sent in ({}, bearer("sk-wrong"), bearer(hashlib.sha256(BOB.encode()).hexdigest())):
            answer = await client.post(
                "/v1/responses", json={"model": "echo", "input": "hi"}, headers=sent
            )
            assert answer.status_code == 401
            assert answer.json()["error"]["code"] == "unauthorized"
        wrong = await client.post(
            "/v1/messages",
            json={"model": "echo", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
            headers={"x-api-key": "sk-wrong"},
        )
        assert wrong.status_code == 401


async def test_roles_an_inference_key_cannot_reach_admin_routes(keyed: ServerInfo) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=10) as client:
        for key in (ALICE, BOB):
            refused = await client.get("/v1/admin/models", headers=bearer(key))
            assert refused.status_code == 401
            assert "inference role" in refused.json()["error"]["message"]
            assert (await client.get("/v1/admin/keys", headers=bearer(key))).status_code == 401
        assert (await client.get("/v1/admin/models", headers=bearer(ROOT))).status_code == 200
        assert (await client.get("/api/ps", headers=bearer(ROOT))).status_code == 200
        # The admin routes are guarded by the admin key alone: no admin token is set.
        assert (await client.get("/v1/admin/models")).status_code == 401


async def test_legacy_tokens_keep_working_beside_keys(nursery: trio.Nursery) -> None:
    info = await keyed_server(nursery, inference_tokens=["plain-user"], admin_token="plain-root")
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        assert (await respond(client, "plain-user")).status_code == 200
        assert (await respond(client, "plain-root")).status_code == 200
        assert (await client.get("/v1/admin/keys", headers=bearer("plain-root"))).status_code == 200
        assert (await client.get("/v1/admin/keys", headers=bearer("plain-user"))).status_code == 401
        # A plain token has no tenant of its own: X-Tenant-ID still decides.
        answer = await respond(client, "plain-user", **{"X-Tenant-ID": "team-b"})
        assert answer.status_code == 200


# -- identity: tenant, priority, rate limit, key name ----------------------------------


async def test_a_key_with_a_tenant_binds_its_requests_to_it(keyed: ServerInfo) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=10) as client:
        own = await respond(client, ALICE)
        assert own.status_code == 200
        assert own.headers["X-RateLimit-Limit"] == "1000"  # counted for team-a
        same = await respond(client, ALICE, **{"X-Tenant-ID": "team-a"})
        assert same.status_code == 200 and same.headers["X-RateLimit-Limit"] == "1000"
        other = await respond(client, ALICE, **{"X-Tenant-ID": "team-b"})
        assert other.status_code == 403
        error = other.json()["error"]
        assert error["code"] == "tenant_forbidden" and "team-a" in error["message"]
        # OpenAI's error shape on the OpenAI routes, Ollama's on Ollama's: still a 403.
        chat = await client.post(
            "/openai/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
            headers={**bearer(ALICE), "X-Tenant-ID": "team-b"},
        )
        assert chat.status_code == 403
        ollama = await client.post(
            "/api/chat",
            json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
            headers={**bearer(ALICE), "X-Tenant-ID": "team-b"},
        )
        assert ollama.status_code == 403
        # A key without a tenant leaves the choice to X-Tenant-ID.
        bob = await respond(client, BOB, **{"X-Tenant-ID": "team-a"})
        assert bob.status_code == 200 and bob.headers["X-RateLimit-Limit"] == "1000"


async def test_a_key_with_a_tenant_sees_only_that_tenants_stored_responses(
    keyed: ServerInfo,
) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=10) as client:
        created = await client.post(
            "/openai/v1/responses",
            json={"model": "echo", "input": "remember me", "store": True},
            headers=bearer(ALICE),
        )
        assert created.status_code == 200
        rid = created.json()["id"]
        path = f"/openai/v1/responses/{rid}"
        assert (await client.get(path, headers=bearer(ALICE))).status_code == 200
        # Another caller finds it only by naming alice's tenant.
        assert (await client.get(path, headers=bearer(ROOT))).status_code == 404
        found = await client.get(path, headers={**bearer(ROOT), "X-Tenant-ID": "team-a"})
        assert found.status_code == 200


def _tenant_and_priority(caller: Caller | None, **sent: str) -> tuple[str, str]:
    token = pipeline_request.set(PipelineRequest({k.lower(): v for k, v in sent.items()}, b"", "r"))
    bound = CALLER.set(caller)
    try:
        return tenant_and_priority()
    finally:
        CALLER.reset(bound)
        pipeline_request.reset(token)


def test_a_keys_priority_is_the_default_and_the_ceiling() -> None:
    normal = Caller("k", priority="normal")
    assert _tenant_and_priority(normal) == ("default", "normal")
    assert _tenant_and_priority(normal, **{"X-Priority": "low"}) == ("default", "low")
    assert _tenant_and_priority(normal, **{"X-Priority": "high"}) == ("default", "normal")
    high = Caller("k", priority="high")
    assert _tenant_and_priority(high) == ("default", "high")
    low = Caller("k", priority="low")
    assert _tenant_and_priority(low, **{"X-Priority": "high"}) == ("default", "low")
    # Without a key's priority, the header decides as before.
    assert _tenant_and_priority(Caller("k"), **{"X-Priority": "high"}) == ("default", "high")
    assert _tenant_and_priority(None, **{"X-Priority": "high"}) == ("default", "high")
    with pytest.raises(PoolError) as info:
        _tenant_and_priority(normal, **{"X-Priority": "urgent"})
    assert info.value.code == "invalid_request"
    bound = Caller("k", tenant="t")
    assert _tenant_and_priority(bound, **{"X-Tenant-ID": " t "}) == ("t", "normal")
    with pytest.raises(PoolError) as info:
        _tenant_and_priority(bound, **{"X-Tenant-ID": "u"})
    assert info.value.code == "tenant_forbidden" and info.value.status == 403


async def test_a_keys_rate_limit_limits_that_key_only(keyed: ServerInfo) -> None:
    async with httpx.AsyncClient(base_url=keyed.url, timeout=10) as client:
        # 2 per minute: the minute's two at once, then refused until one refills (30 s).
        for _ in range(2):
            assert (await respond(client, BOB)).status_code == 200
        refused = await respond(client, BOB)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded" and error["key"] == "bob"
        assert error["limit"] == 2
        assert 1 <= int(refused.headers["Retry-After"]) <= 30
        # Every surface counts against the same key.
        chat = await client.post(
            "/v1/chat/completions",
            json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
            headers=bearer(BOB),
        )
        assert chat.status_code == 429
        # Other keys, and the same tenant through them, are not affected.
        assert (await respond(client, ROOT)).status_code == 200


# -- runtime keys, revocation, persistence -----------------------------------------------


async def test_keys_added_and_revoked_at_runtime_survive_a_restart(
    nursery: trio.Nursery, private_state: Path
) -> None:
    async with trio.open_nursery() as inner:
        info = await keyed_server(inner)
        async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
            listed = (await client.get("/v1/admin/keys", headers=bearer(ROOT))).json()["keys"]
            assert [(k["name"], k["source"]) for k in listed] == [
                ("alice", "settings"),
                ("bob", "settings"),
                ("root", "settings"),
            ]
            assert all("key" not in k and "key_sha256" not in k for k in listed)
            added = await client.post(
                "/v1/admin/keys",
                json={
                    "name": "carol",
                    "tenant": "team-c",
                    "rate_limit_rpm": 30,
                    "preemptible": True,
                },
                headers=bearer(ROOT),
            )
            assert added.status_code == 201
            carol = added.json()
            assert carol["key"].startswith("sk-pool-") and carol["source"] == "runtime"
            assert carol["tenant"] == "team-c" and carol["created_at"] > 0
            assert carol["preemptible"] is True
            assert not any(k["preemptible"] for k in listed)
            assert (await respond(client, carol["key"])).status_code == 200
            # A key of a name in force, or with a secret in force, is refused.
            again = await client.post(
                "/v1/admin/keys", json={"name": "carol"}, headers=bearer(ROOT)
            )
            assert again.status_code == 409 and again.json()["error"]["code"] == "key_exists"
            same_secret = await client.post(
                "/v1/admin/keys",
                json={"name": "dave", "key_sha256": hashlib.sha256(ALICE.encode()).hexdigest()},
                headers=bearer(ROOT),
            )
            assert same_secret.status_code == 409
            hashed = await client.post(
                "/v1/admin/keys",
                json={"name": "erin", "key_sha256": hashlib.sha256(b"erins-own").hexdigest()},
                headers=bearer(ROOT),
            )
            assert hashed.status_code == 201 and hashed.json()["key"] is None
            # Revoke a settings key and a runtime key: refused at once.
            gone = await client.delete("/v1/admin/keys/alice", headers=bearer(ROOT))
            assert gone.status_code == 200 and gone.json()["revoked"] is True
            assert (await respond(client, ALICE)).status_code == 401
            assert (await client.delete("/v1/admin/keys/erin", headers=bearer(ROOT))).is_success
            assert (await respond(client, "erins-own")).status_code == 401
            missing = await client.delete("/v1/admin/keys/nobody", headers=bearer(ROOT))
            assert missing.status_code == 404 and missing.json()["error"]["code"] == "unknown_key"
        inner.cancel_scope.cancel()
    # The state directory keeps digests only.
    text = (private_state / FILE_NAME).read_text()
    assert carol["key"] not in text and hashlib.sha256(carol["key"].encode()).hexdigest() in text
    # A new pool over the same state directory.
    info = await keyed_server(nursery)
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        assert (await respond(client, carol["key"])).status_code == 200
        assert (await respond(client, ALICE)).status_code == 401
        assert (await respond(client, "erins-own")).status_code == 401
        rows = (await client.get("/v1/admin/keys", headers=bearer(ROOT))).json()["keys"]
        assert [k["name"] for k in rows] == ["bob", "root", "carol"]
        # Its preemptible setting came back from keys.json with it.
        assert [k["preemptible"] for k in rows] == [False, False, True]


async def test_a_revoked_settings_key_comes_back_only_with_another_secret(
    nursery: trio.Nursery,
) -> None:
    async with trio.open_nursery() as inner:
        info = await keyed_server(inner)
        async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
            assert (await client.delete("/v1/admin/keys/alice", headers=bearer(ROOT))).is_success
        inner.cancel_scope.cancel()
    renewed = [{**KEYS[0], "key": "sk-alice-renewed"}, *KEYS[1:]]
    # (Until then, its name may be given to a runtime key: tested below.)
    info = await start_server(nursery, MODELS, auth={"keys": renewed}, tenancy=TENANCY)
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        assert (await respond(client, "sk-alice-renewed")).status_code == 200
        assert (await respond(client, ALICE)).status_code == 401


async def test_a_revoked_settings_keys_name_can_go_to_a_runtime_key(
    nursery: trio.Nursery,
) -> None:
    async with trio.open_nursery() as inner:
        info = await keyed_server(inner)
        async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
            assert (await client.delete("/v1/admin/keys/alice", headers=bearer(ROOT))).is_success
            added = await client.post(
                "/v1/admin/keys", json={"name": "alice", "tenant": "team-z"}, headers=bearer(ROOT)
            )
            assert added.status_code == 201
            new_alice = added.json()["key"]
        inner.cancel_scope.cancel()
    info = await keyed_server(nursery)  # the same settings: their alice stays revoked
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        assert (await respond(client, ALICE)).status_code == 401
        assert (await respond(client, new_alice)).status_code == 200
        listed = (await client.get("/v1/admin/keys", headers=bearer(ROOT))).json()["keys"]
        assert [(k["name"], k["source"], k["tenant"]) for k in listed][-1] == (
            "alice",
            "runtime",
            "team-z",
        )


# -- WebSocket ---------------------------------------------------------------------------


def _ws_url(server: ServerInfo) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


async def _revoke(server: ServerInfo, name: str) -> None:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        answer = await client.delete(f"/v1/admin/keys/{name}", headers=bearer(ROOT))
        assert answer.status_code == 200


async def test_a_websocket_is_closed_at_its_keys_revocation(keyed: ServerInfo) -> None:
    headers = [("Authorization", f"Bearer {ALICE}")]
    async with open_websocket_url(_ws_url(keyed), extra_headers=headers) as ws:
        await ws.send_message(json.dumps({"model": "echo", "input": "before"}))
        while json.loads(await ws.get_message())["type"] != "response.completed":
            pass
        # Idle, then revoked: closed without waiting for its next message (the client
        # sends none: only the revocation can end this wait).
        await _revoke(keyed, "alice")
        with within("the idle socket's error and close after its key's revocation"):
            event = json.loads(await ws.get_message())
            assert event["type"] == "error"
            assert event["error"]["code"] == "unauthorized"
            assert "revoked" in event["error"]["message"]
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
        assert closed.value.reason.code == 1008
        assert "revoked" in (closed.value.reason.reason or "")
        # Its next message is refused: the socket is gone.
        with pytest.raises(ConnectionClosed):
            await ws.send_message(json.dumps({"model": "echo", "input": "after"}))
    # A new handshake with the key is refused too.
    async with open_websocket_url(_ws_url(keyed), extra_headers=headers) as ws:
        event = json.loads(await ws.get_message())
        assert event["error"]["code"] == "unauthorized"


async def test_a_websockets_next_message_after_a_revocation_is_refused(
    keyed: ServerInfo, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Even where the socket was not closed first (its watcher is held back here), the
    message that follows a revocation is refused and the socket closed."""

    async def never(self: KeyRing, caller: Caller) -> None:
        await trio.sleep_forever()

    monkeypatch.setattr(KeyRing, "revoked", never)
    headers = [("Authorization", f"Bearer {ALICE}")]
    async with open_websocket_url(_ws_url(keyed), extra_headers=headers) as ws:
        await _revoke(keyed, "alice")
        await ws.send_message(json.dumps({"model": "echo", "input": "after"}))
        with within("the refusal of the message after the revocation"):
            event = json.loads(await ws.get_message())
            assert event["error"]["code"] == "unauthorized"
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
        assert closed.value.reason.code == 1008


async def test_a_websocket_handshake_is_bound_to_the_keys_tenant(keyed: ServerInfo) -> None:
    headers = [("Authorization", f"Bearer {ALICE}"), ("X-Tenant-ID", "team-b")]
    async with open_websocket_url(_ws_url(keyed), extra_headers=headers) as ws:
        event = json.loads(await ws.get_message())
        assert event["error"]["code"] == "tenant_forbidden"
        with pytest.raises(ConnectionClosed) as closed:
            await ws.get_message()
        assert closed.value.reason.code == 1008


async def test_a_revocation_ends_the_websockets_running_generation(keyed: ServerInfo) -> None:
    headers = [("Authorization", f"Bearer {ROOT}")]
    async with (
        open_websocket_url(_ws_url(keyed), extra_headers=headers) as ws,
        httpx.AsyncClient(base_url=keyed.url, timeout=10) as client,
    ):
        await ws.send_message(json.dumps({"model": "endless", "input": "x"}))
        while json.loads(await ws.get_message())["type"] != "response.output_text.delta":
            pass
        # Another admin key revokes this socket's key mid-stream.
        added = await client.post(
            "/v1/admin/keys", json={"name": "second", "role": "admin"}, headers=bearer(ROOT)
        )
        second = added.json()["key"]
        revoked = await client.delete("/v1/admin/keys/root", headers=bearer(second))
        assert revoked.status_code == 200
        # The generation would go on for ever: only the revocation ends the stream.
        with within("the running generation's socket closing after the revocation"):
            while True:
                try:
                    event = json.loads(await ws.get_message())
                except ConnectionClosed as exc:
                    assert exc.reason.code == 1008
                    break
                assert event["type"] in ("response.output_text.delta", "error")
        with within("the revoked stream's generation ending"):
            while (await client.get("/v1/admin/models/endless", headers=bearer(second))).json()[
                "runtime_inflight"
            ]:
                await trio.sleep(0.02)


# -- settings validation and the key file ------------------------------------------------


@pytest.mark.parametrize(
    ("keys", "problem"),
    [
        ([{"name": "a"}], "exactly one of"),
        ([{"name": "a", "key": "x", "key_sha256": "0" * 64}], "exactly one of"),
        ([{"name": "a", "key_sha256": "0" * 63}], "key_sha256"),
        ([{"name": "a", "key_sha256": "g" * 64}], "key_sha256"),
        ([{"name": "a", "key": "x"}, {"name": "a", "key": "y"}], "unique"),
        ([{"name": "a b", "key": "x"}], "name"),
        ([{"name": "a", "key": "x", "role": "root"}], "role"),
        ([{"name": "a", "key": "x", "rate_limit_rpm": 0}], "rate_limit_rpm"),
        ([{"name": "a", "key": "x", "tenant": "bad\ttenant"}], "tenant"),
        ([{"name": "a", "key": " x "}], "blanks"),
    ],
)
def test_settings_keys_are_validated(keys: list[dict[str, Any]], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        AuthSettings.model_validate({"keys": keys})


def _env() -> dict[str, str]:
    return {"LLM_POOL_STATE_DIR": os.environ["LLM_POOL_STATE_DIR"]}


def test_two_keys_with_one_secret_are_refused_at_start() -> None:
    digest = hashlib.sha256(b"same").hexdigest()
    settings = AuthSettings.model_validate(
        {"keys": [{"name": "a", "key": "same"}, {"name": "b", "key_sha256": digest.upper()}]}
    )
    with pytest.raises(ConfigError, match="same secret"):
        Authenticator(settings, environ=_env())


def test_an_unreadable_key_file_stops_the_start(private_state: Path) -> None:
    """Starting without it would bring revoked keys back: refuse instead."""
    private_state.mkdir(parents=True, exist_ok=True)
    (private_state / FILE_NAME).write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable"):
        Authenticator(AuthSettings.model_validate({"keys": KEYS}), environ=_env())


def test_a_presented_key_is_matched_against_every_key() -> None:
    auth = Authenticator(AuthSettings.model_validate({"keys": KEYS}), environ=_env())
    assert auth.authenticate(f"Bearer {BOB}", "inference") == Caller("bob", rate_limit_rpm=2)
    alice = auth.authenticate(None, "inference", api_key=ALICE)
    assert alice is not None and alice.tenant == "team-a"
    # A key before a plain token; either header may carry it.
    assert auth.authenticate("Bearer sk-wrong", "inference", api_key=ROOT) == Caller(
        "root", role="admin"
    )
    with pytest.raises(PoolError) as info:
        auth.authenticate(f"Bearer {ALICE}", "admin")
    assert info.value.code == "unauthorized"
    assert auth.guards("inference") and auth.guards("admin") and auth.enabled
