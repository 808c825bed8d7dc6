"""``llm-pool keys list|add|revoke`` against a pool on 127.0.0.1 port 0."""

from __future__ import annotations

import hashlib

import httpx
import pytest
import trio

from tests.cli.test_cli import cli
from tests.http.conftest import STUB_MODELS, start_server

ADMIN = "cli-admin-token"


async def test_keys_list_add_revoke(nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLM_POOL_ADMIN_TOKEN", ADMIN)
    info = await start_server(
        nursery,
        STUB_MODELS,
        auth={"admin_token": ADMIN, "keys": [{"name": "ops", "key": "sk-ops", "tenant": "ops"}]},
    )
    listed = await cli(info, "keys", "list")
    assert listed.code == 0, listed.err
    header, *rows = listed.out.splitlines()
    for column in ("NAME", "TENANT", "ROLE", "PRIORITY", "RPM", "PREEMPTIBLE", "SOURCE"):
        assert column in header
    assert rows[0].split()[:7] == ["ops", "ops", "inference", "-", "-", "no", "settings"]

    added = await cli(
        info, "keys", "add", "ci", "--tenant", "team-ci", "--priority", "low", "--rpm", "30",
        "--preemptible",
    )  # fmt: skip
    assert added.code == 0, added.err
    key = added.out.strip()
    assert key.startswith("sk-pool-") and "not shown again" in added.err
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        answer = await client.post(
            "/v1/responses",
            json={"model": "echo", "input": "hi"},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert answer.status_code == 200
    hashed = await cli(
        info, "keys", "add", "own", "--role", "admin",
        "--key-sha256", hashlib.sha256(b"my-own-key").hexdigest(), "--json",
    )  # fmt: skip
    assert hashed.code == 0, hashed.err
    (body,) = hashed.json_lines()
    assert body["key"] is None and body["role"] == "admin" and body["source"] == "runtime"

    as_json = (await cli(info, "keys", "list", "--json")).json_lines()[0]
    assert [k["name"] for k in as_json["keys"]] == ["ops", "ci", "own"]
    ci = as_json["keys"][1]
    assert (ci["tenant"], ci["priority"], ci["rate_limit_rpm"]) == ("team-ci", "low", 30)
    assert ci["preemptible"] is True and as_json["keys"][0]["preemptible"] is False

    revoked = await cli(info, "keys", "revoke", "ci")
    assert revoked.code == 0 and revoked.out.strip() == "key ci revoked"
    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:
        answer = await client.post(
            "/v1/responses",
            json={"model": "echo", "input": "hi"},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert answer.status_code == 401
    # Refusals exit 1 with the pool's code.
    again = await cli(info, "keys", "revoke", "ci")
    assert again.code == 1 and "unknown_key (404)" in again.err
    taken = await cli(info, "keys", "add", "ops")
    assert taken.code == 1 and "key_exists (409)" in taken.err
    # Without the admin token: refused.
    monkeypatch.delenv("LLM_POOL_ADMIN_TOKEN")
    assert (await cli(info, "keys", "list")).code == 1
