"""The Host/Origin allow-list: DNS rebinding is refused on every surface (issue #19)."""

from __future__ import annotations

import json

import httpx
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from pool import ServerInfo
from pool.http._hosts import HostAllowList, split_authority

from .conftest import start_server

EVIL = "evil.example"


def _ws_url(server: ServerInfo) -> str:
    return server.url.replace("http://", "ws://") + "/v1/responses"


async def _ask(client: httpx.AsyncClient, **headers: str) -> httpx.Response:
    return await client.post(
        "/v1/responses", json={"model": "echo", "input": "hi"}, headers=headers
    )


async def test_a_foreign_host_is_refused_on_every_surface(client: httpx.AsyncClient) -> None:
    pool_shape = await _ask(client, host=EVIL)
    assert pool_shape.status_code == 403
    assert pool_shape.json()["error"]["code"] == "host_not_allowed"
    assert EVIL in pool_shape.json()["error"]["message"]

    openai = await client.post(
        "/v1/chat/completions",
        json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
        headers={"host": EVIL},
    )
    assert openai.status_code == 403
    assert openai.json()["error"]["code"] == "host_not_allowed"
    assert openai.json()["error"]["type"] == "invalid_request_error"

    ollama = await client.post(
        "/api/generate", json={"model": "echo", "prompt": "hi"}, headers={"host": EVIL}
    )
    assert ollama.status_code == 403
    assert set(ollama.json()) == {"error"} and EVIL in ollama.json()["error"]

    for method, path in [
        ("GET", "/health"),
        ("GET", "/v1/admin/models"),
        ("POST", "/v1/admin/models/cold/load"),
        ("GET", "/api/tags"),
        ("GET", "/no/such/route"),
    ]:
        reply = await client.request(method, path, headers={"host": f"{EVIL}:80"})
        assert reply.status_code == 403, path
        assert "X-Request-Id" in reply.headers
    row = (await client.get("/v1/admin/models/cold")).json()
    assert row["runtime_state"] == "unloaded"


async def test_loopback_names_with_the_bound_port_pass(
    client: httpx.AsyncClient, server: ServerInfo
) -> None:
    for host in (
        f"localhost:{server.port}",
        f"127.0.0.1:{server.port}",
        f"[::1]:{server.port}",
        "localhost",
        "127.0.0.1",
        f"LocalHost.:{server.port}",
    ):
        reply = await _ask(client, host=host)
        assert reply.status_code == 200, host
        assert reply.json()["output_text"] == "hi"
    for host in (f"localhost:{server.port + 1}", "localhost:0x1f", "[::1", f"{EVIL}@localhost"):
        reply = await _ask(client, host=host)
        assert reply.status_code == 403, host


async def test_a_browser_origin_must_be_listed(
    client: httpx.AsyncClient, server: ServerInfo
) -> None:
    refused = await _ask(client, origin=f"http://{EVIL}")
    assert refused.status_code == 403
    assert refused.json()["error"]["code"] == "origin_not_allowed"
    # The rebinding case: the page's own name in Origin, the victim's in Host.
    rebound = await _ask(client, origin=f"http://{EVIL}:{server.port}")
    assert rebound.json()["error"]["code"] == "origin_not_allowed"
    for origin in ("null", "file://", f"http://user@127.0.0.1:{server.port}"):
        assert (await _ask(client, origin=origin)).status_code == 403, origin
    ollama = await client.post(
        "/api/chat",
        json={"model": "echo", "messages": [{"role": "user", "content": "hi"}]},
        headers={"origin": f"https://{EVIL}"},
    )
    assert ollama.status_code == 403 and "origin" in ollama.json()["error"]

    for origin in (server.url, f"http://localhost:{server.port}", "http://localhost"):
        reply = await _ask(client, origin=origin)
        assert reply.status_code == 200, origin


async def test_websocket_handshake_checks_the_origin(server: ServerInfo) -> None:
    with pytest.raises(ConnectionRejected) as info:
        async with open_websocket_url(
            _ws_url(server), extra_headers=[(b"origin", f"http://{EVIL}".encode())]
        ):
            pass  # pragma: no cover - the handshake fails
    assert info.value.status_code == 403
    assert info.value.body is not None
    assert json.loads(info.value.body)["error"]["code"] == "origin_not_allowed"

    same_origin = [(b"origin", server.url.encode())]
    async with open_websocket_url(_ws_url(server), extra_headers=same_origin) as ws:
        await ws.send_message(json.dumps({"model": "echo", "input": "same origin"}))
        with trio.fail_after(5):
            while (event := json.loads(await ws.get_message()))["type"] != "response.completed":
                assert event["type"] != "error", event
        assert event["response"]["output_text"] == "same origin"


async def test_configured_hosts_pass(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, allowed_hosts=["pool.example", "proxy.example:8443"])
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        for headers in (
            {"host": "pool.example"},
            {"host": "POOL.example:9999"},
            {"host": "proxy.example:8443"},
            {"host": "pool.example", "origin": "https://pool.example"},
            {"origin": "https://proxy.example:8443"},
            {"host": f"localhost:{server.port}"},
        ):
            assert (await _ask(client, **headers)).status_code == 200, headers
        for headers in (
            {"host": "proxy.example"},
            {"host": "proxy.example:8444"},
            {"host": EVIL},
            {"origin": f"http://{EVIL}"},
        ):
            assert (await _ask(client, **headers)).status_code == 403, headers


async def test_a_star_turns_the_check_off(nursery: trio.Nursery) -> None:
    server = await start_server(nursery, allowed_hosts=["*"])
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        reply = await _ask(client, host=f"{EVIL}:1", origin=f"http://{EVIL}")
        assert reply.status_code == 200
    ws_headers = [(b"origin", f"http://{EVIL}".encode())]
    async with open_websocket_url(_ws_url(server), extra_headers=ws_headers) as ws:
        await ws.send_message(json.dumps({"model": "echo", "input": "x"}))
        with trio.fail_after(5):
            assert json.loads(await ws.get_message())["type"] == "response.created"


def test_split_authority() -> None:
    assert split_authority("LocalHost:8011") == ("localhost", 8011)
    assert split_authority("[::1]:8011") == ("[::1]", 8011)
    assert split_authority("[::1]") == ("[::1]", None)
    assert split_authority("example.com.") == ("example.com", None)
    assert split_authority("example.com:") == ("example.com", None)
    for bad in ("", ":80", "[::1", "[::1]80", "host:80:80", "host:١٢", "host:123456"):
        assert split_authority(bad) is None, bad


def test_the_port_is_learned_after_binding() -> None:
    hosts = HostAllowList([], bound_host="127.0.0.1", port=0)
    assert hosts.host_allowed("localhost")
    assert not hosts.host_allowed("localhost:4321")
    hosts.listening_on(4321)
    assert hosts.host_allowed("localhost:4321")
    assert not hosts.host_allowed("localhost:4322")


def test_a_wildcard_bind_accepts_addresses_never_foreign_names() -> None:
    hosts = HostAllowList([], bound_host="0.0.0.0", port=8011)
    assert hosts.host_allowed("192.168.1.20:8011")
    assert hosts.host_allowed("[fe80::1]:8011")
    assert hosts.host_allowed("localhost:8011")
    assert not hosts.host_allowed("0.0.0.0.evil.example:8011")
    assert not hosts.host_allowed(f"{EVIL}:8011")
    specific = HostAllowList([], bound_host="10.0.0.5", port=8011)
    assert specific.host_allowed("10.0.0.5:8011")
    assert not specific.host_allowed("10.0.0.6:8011")
    v6 = HostAllowList([], bound_host="fd00::5", port=8011)
    assert v6.host_allowed("[fd00::5]:8011")
