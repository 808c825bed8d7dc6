"""schemathesis against a served pool of stub models: the API keeps its OpenAPI promises.

Every operation, every check, a fixed seed and a bounded number of examples, then the
stateful phase along the document's links; once on an open pool and once with tokens
configured (where ``ignored_auth`` must find nothing), and once more with schema-valid
requests only, which must be served. Any finding fails the test with schemathesis'
report. docs/api.md says how to run the same by hand.

A schema-valid request may get a 400 only where the model it names refuses it: with a
code that its operation lists in ``x-valid-input-codes`` (``valid_input_served`` in
tests/http/schemathesis_hooks.py). A route that refused every valid request fails here.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from pool import ServerInfo
from pool.http._openapi import VALID_INPUT_CODES
from tests.http.conftest import start_server

ST = Path(sys.executable).with_name("st")
HOOKS = Path(__file__).with_name("schemathesis_hooks.py")
ROOT = Path(__file__).parents[2]
SEED = 31
# Per operation: enough for the examples, the coverage phase's boundary cases and a few
# random bodies; the whole run stays within a minute or two on a 2-core machine.
MAX_EXAMPLES = 8
# The run with schema-valid requests only has no coverage phase, so it affords more: with
# 8, hypothesis' small bodies leave most optional fields (sampling, limits) unset.
POSITIVE_EXAMPLES = 25
ADMIN_TOKEN = "admin-secret"
USER_TOKEN = "user-secret"

# schemathesis' default for a schema-valid request (positive_data_acceptance).
_ACCEPTED = ["2xx", "3xx", "401", "403", "404", "409", "429", "5xx"]
# Its default refusals of a schema-violating one (negative_data_rejection), and 413: a
# violation may be a body larger than service.max_body_bytes (1,025 nested messages of
# generated blocks), which is refused as too large before its shape is read.
_REFUSED = ["400", "401", "403", "404", "405", "406", "409", "413", "415", "422", "428", "429",
            "5xx"]  # fmt: skip


def st_config(document: dict[str, Any]) -> str:
    """The schemathesis.toml of a run against ``document``.

    schemathesis' defaults, without its crash cache, with the hooks of
    tests/http/schemathesis_hooks.py. Where an
    operation's 400 lists ``x-valid-input-codes``, schemathesis' own check takes that
    400 for a schema-valid request and ``valid_input_served`` holds it to those codes; a
    documented 426 is an answer too (the plain GET of the WebSocket route, which has no
    other without the handshake).
    """
    refused = ", ".join(f'"{s}"' for s in _REFUSED)
    blocks = [
        f'hooks = "{HOOKS}"\n',
        # No crash cache: a run replays no earlier run's findings and leaves no files.
        "[cache]\nenabled = false\n",
        f"[checks.negative_data_rejection]\nexpected-statuses = [{refused}]\n",
    ]
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            responses = operation["responses"]
            extra = [
                status
                for status in ("400", "426")
                if status in responses
                and (status == "426" or responses[status].get(VALID_INPUT_CODES))
            ]
            if not extra:
                continue
            statuses = ", ".join(f'"{s}"' for s in [*_ACCEPTED, *extra])
            blocks.append(
                f'[[operations]]\ninclude-name = "{method.upper()} {path}"\n'
                f"checks.positive_data_acceptance.expected-statuses = [{statuses}]\n"
            )
    return "\n".join(blocks)


def st_config_for(url: str) -> str:
    """:func:`st_config` of the pool at ``url`` (docs/api.md: running it by hand)."""
    return st_config(httpx.get(f"{url}/openapi.json", timeout=30).json())


def models(tmp_path: Path) -> dict[str, dict[str, Any]]:
    weights = tmp_path / "tiny.bin"
    weights.write_bytes(b"stub weights\n" * 64)
    # On demand: after the fuzzing phase has unloaded them (the admin and runner unloads
    # take their example names), the stateful phase's requests still reach a model.
    return {
        "echo": {"backend": "stub", "enabled": True, "on_demand": True, "target_inflight": 4},
        "cold": {"backend": "stub"},
        "vec": {"backend": "stub", "enabled": True, "on_demand": True, "embedding": True},
        # A model with a source, so the pull -> pull status sequence has one to pull.
        "pulled": {"backend": "stub", "source": str(weights)},
    }


def backends(models: dict[str, dict[str, Any]]) -> str:
    """``LLM_POOL_TEST_BACKENDS`` of the hooks: each model's backend."""
    return json.dumps({name: model["backend"] for name, model in models.items()})


ALL_PHASES = "examples,coverage,fuzzing,stateful"
# The coverage phase's cases (boundary values, undeclared methods, missing headers) do
# not depend on tokens and are most of a run's time: the run with tokens leaves them to
# the open run. `ignored_auth` checks every answer of the phases it runs.
AUTH_PHASES = "examples,fuzzing,stateful"
POSITIVE_PHASES = "examples,fuzzing,stateful"
# A key added through the API puts the pool under tokens: every later request of a run
# on the open pool would be a 401, which tells nothing. The run with tokens adds keys.
OPEN_ONLY = ("POST /v1/admin/keys",)


async def run_schemathesis(
    server: ServerInfo,
    tmp_path: Path,
    phases: str,
    *headers: str,
    mode: str = "all",
    exclude: tuple[str, ...] = (),
    max_examples: int = MAX_EXAMPLES,
) -> tuple[int, str]:
    assert ST.exists(), f"schemathesis (a test dependency) is not installed: no {ST}"
    async with httpx.AsyncClient(timeout=30) as client:
        document = (await client.get(f"{server.url}/openapi.json")).json()
    config = tmp_path / "schemathesis.toml"
    config.write_text(st_config(document))
    command = [
        str(ST),
        "--config-file",
        str(config),
        "run",
        f"{server.url}/openapi.json",
        "--checks",
        "all",
        "--phases",
        phases,
        "--mode",
        mode,
        "--seed",
        str(SEED),
        "--max-examples",
        str(max_examples),
        "--generation-database",
        "none",
        "--workers",
        "1",
        "--request-timeout",
        "60",
        "--no-color",
        "--warnings",
        "off",
        *(arg for header in headers for arg in ("-H", header)),
        *(arg for name in exclude for arg in ("--exclude-name", name)),
    ]
    result = await trio.run_process(
        command,
        cwd=tmp_path,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={k: v for k, v in os.environ.items() if not k.startswith("SCHEMATHESIS_")}
        | {"PYTHONPATH": str(ROOT), "LLM_POOL_TEST_BACKENDS": backends(models(tmp_path))},
    )
    report = result.stdout.decode(errors="replace") + result.stderr.decode(errors="replace")
    return result.returncode, report


def _assert_clean(code: int, report: str) -> None:
    # The report's end is the summary: phases, failures by kind, seed.
    assert code == 0, f"schemathesis found something (exit {code}):\n{report[-20000:]}"
    assert "Stateful" in report, report[-5000:]


# The coverage phase alone takes minutes on a busy 2-core machine.
@pytest.mark.timeout(1200)
async def test_open_pool_keeps_its_document(nursery: trio.Nursery, tmp_path: Path) -> None:
    server = await start_server(
        nursery, models(tmp_path), model_store=str(tmp_path / "store"), hf_endpoint=None
    )
    _assert_clean(*await run_schemathesis(server, tmp_path, ALL_PHASES, exclude=OPEN_ONLY))


async def test_schema_valid_requests_are_served(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Schema-valid requests only: each is served, or refused by the model it names with
    a code its operation documents (``valid_input_served``)."""
    server = await start_server(
        nursery, models(tmp_path), model_store=str(tmp_path / "store"), hf_endpoint=None
    )
    code, report = await run_schemathesis(
        server,
        tmp_path,
        POSITIVE_PHASES,
        mode="positive",
        exclude=OPEN_ONLY,
        max_examples=POSITIVE_EXAMPLES,
    )
    _assert_clean(code, report)


async def test_pool_with_tokens_keeps_its_document(nursery: trio.Nursery, tmp_path: Path) -> None:
    server = await start_server(
        nursery,
        models(tmp_path),
        model_store=str(tmp_path / "store"),
        hf_endpoint=None,
        auth={"inference_tokens": [USER_TOKEN], "admin_token": ADMIN_TOKEN},
    )
    code, report = await run_schemathesis(
        server, tmp_path, AUTH_PHASES, f"Authorization: Bearer {ADMIN_TOKEN}"
    )
    _assert_clean(code, report)


@pytest.mark.parametrize("path", ["/v1/models/load", "/v1/cache/flush"])
async def test_unauthenticated_malformed_body_is_401(nursery: trio.Nursery, path: str) -> None:
    """Authentication comes before the body: a caller without a token learns nothing about
    what its body should have been."""

    server = await start_server(nursery, auth={"admin_token": ADMIN_TOKEN})
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        for body in (b"{not json", b'{"modelId": 5, "scope": "nowhere"}'):
            answer = await client.post(path, content=body)
            assert answer.status_code == 401, answer.text
            assert answer.json()["error"]["code"] == "unauthorized"
        # With the token, the same bodies are judged on their own: 400 and 422.
        admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
        assert (await client.post(path, content=b"{not json", headers=admin)).status_code == 400
        bad = await client.post(path, content=b'{"modelId": 5, "scope": "x"}', headers=admin)
        assert bad.status_code == 422


async def test_405_names_the_allowed_methods(nursery: trio.Nursery) -> None:
    """RFC 9110: a 405 carries ``Allow``, the methods OPTIONS lists, on the lean hot
    routes (which hand every other method to Quart) as on the rest."""

    server = await start_server(nursery)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        for method, path, allowed in (
            ("PUT", "/v1/chat/completions", {"POST", "OPTIONS"}),
            ("TRACE", "/v1/responses", {"GET", "HEAD", "POST", "OPTIONS"}),
            ("DELETE", "/v1/admin/models", {"GET", "HEAD", "OPTIONS"}),
            ("PATCH", "/api/pull/echo", {"DELETE", "OPTIONS"}),
        ):
            answer = await client.request(method, path)
            assert answer.status_code == 405, (method, path)
            error = answer.json()["error"]
            if path.startswith("/api/"):  # Ollama's route, Ollama's shape: a string
                assert error == f"{method} is not allowed on {path}"
            else:
                assert error["code"] == "method_not_allowed"
            assert set(answer.headers["allow"].split(", ")) == allowed, (method, path)
            options = await client.options(path)
            assert set(options.headers["allow"].split(", ")) == allowed, path


async def test_plain_get_of_the_websocket_route_is_426(nursery: trio.Nursery) -> None:

    server = await start_server(nursery, auth={"inference_tokens": [USER_TOKEN]})
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        assert (await client.get("/v1/responses")).status_code == 401
        answer = await client.get(
            "/v1/responses", headers={"Authorization": f"Bearer {USER_TOKEN}"}
        )
        assert answer.status_code == 426
        assert answer.headers["upgrade"] == "websocket"
        assert answer.json()["error"]["code"] == "upgrade_required"
