"""``LOG_FORMAT=json``: one JSON object per log line, with the line's key=value facts."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import trio
from trio_websocket import open_websocket_url

from pool.cli import JsonFormatter
from pool.cli._logs import configure_logging

ROOT = Path(__file__).resolve().parents[2]


def test_a_record_becomes_one_json_object() -> None:
    record = logging.LogRecord(
        "pool.http", logging.INFO, __file__, 1,
        "request_id=%s model=%s status=200 ms=%.1f", ("r1", "echo", 2.5), None,
    )  # fmt: skip
    entry = json.loads(JsonFormatter().format(record))
    assert entry["level"] == "info" and entry["logger"] == "pool.http"
    assert entry["message"] == "request_id=r1 model=echo status=200 ms=2.5"
    assert (entry["request_id"], entry["model"], entry["status"]) == ("r1", "echo", "200")
    assert entry["time"].endswith("Z")


async def test_serve_logs_json_lines(tmp_path: Path) -> None:
    settings = tmp_path / "settings.json"
    models = {"echo": {"backend": "stub", "enabled": True}}
    settings.write_text(json.dumps({"engine": {"models": models}}))
    env = {**os.environ, "LOG_FORMAT": "json", "PYTHONPATH": str(ROOT)}
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pool", "serve", "--settings", str(settings), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    assert proc.stdout and proc.stderr
    try:
        with trio.fail_after(30):
            out = b""
            while b"listening on " not in out:
                out += await proc.stdout.receive_some()
            url = out.split(b"listening on ")[1].split()[0].decode()
            async with httpx.AsyncClient(base_url=url) as client:
                body = {"model": "echo", "input": "hi"}
                assert (await client.post("/v1/responses", json=body)).status_code == 200
            proc.send_signal(signal.SIGTERM)
            await proc.wait()
            err = b""
            while chunk := await proc.stderr.receive_some():
                err += chunk
    finally:
        if proc.returncode is None:
            proc.kill()
    entries = [json.loads(line) for line in err.decode().splitlines() if line.strip()]
    assert entries, "no log lines"
    request = [e for e in entries if e.get("model") == "echo" and "request_id" in e]
    assert request and request[0]["status"] == "200"
    assert {"time", "level", "logger", "message"} <= set(entries[0])


async def _serve_and_log(tmp_path: Path, *extra: str, exchange: Any) -> list[dict[str, Any]]:
    """Serve one stub model as ``llm-pool serve`` does, run ``exchange(url)``, stop with
    SIGTERM: the JSON log entries."""
    settings = tmp_path / "settings.json"
    models = {"echo": {"backend": "stub", "enabled": True}}
    settings.write_text(json.dumps({"engine": {"models": models}}))
    env = {**os.environ, "LOG_FORMAT": "json", "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "pool", "serve", "--settings", str(settings), "--port", "0"]
    proc = await trio.lowlevel.open_process(
        [*argv, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    )
    assert proc.stdout and proc.stderr
    err = bytearray()

    async def drain() -> None:
        assert proc.stderr
        while chunk := await proc.stderr.receive_some():
            err.extend(chunk)

    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(drain)
            with trio.fail_after(60):
                out = b""
                while b"listening on " not in out:
                    out += await proc.stdout.receive_some()
                await exchange(out.split(b"listening on ")[1].split()[0].decode())
                proc.send_signal(signal.SIGTERM)
                await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
    return [json.loads(line) for line in err.decode().splitlines() if line.strip()]


async def test_every_request_has_a_line_and_debug_follows_it(tmp_path: Path) -> None:
    ids: dict[str, str] = {}

    async def exchange(url: str) -> None:
        async with httpx.AsyncClient(base_url=url) as client:
            chat = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
            answered = await client.post("/v1/chat/completions", json=chat)
            assert answered.status_code == 200
            ids["chat"] = answered.headers["x-request-id"]
            missing = await client.get("/no/such/route")
            assert missing.status_code == 404
            ids["404"] = missing.headers["x-request-id"]
        async with open_websocket_url(url.replace("http", "ws") + "/v1/responses") as ws:
            await ws.send_message(json.dumps({"model": "echo", "input": "over the socket"}))
            while json.loads(await ws.get_message())["type"] != "response.completed":
                pass

    entries = await _serve_and_log(tmp_path, "--log-level", "debug", exchange=exchange)
    access = {
        e["request_id"]: e for e in entries if e["logger"] == "pool.access" and e["level"] == "info"
    }
    assert access[ids["chat"]]["path"] == "/v1/chat/completions"
    assert access[ids["chat"]]["status"] == "200"
    assert (access[ids["404"]]["path"], access[ids["404"]]["status"]) == ("/no/such/route", "404")
    assert any(e["method"] == "WEBSOCKET" for e in access.values())
    [turn] = [e for e in entries if e.get("websocket") == "true"]
    assert (turn["model"], turn["status"]) == ("echo", "200")
    # --log-level debug adds the life of each request (under the pool's own request id):
    # queued, started on a replica, finished. Two generations (the 404 is none), two lives.
    lives: dict[str, list[str]] = {}
    for e in entries:
        if e["level"] == "debug" and e.get("model") == "echo":
            words = e["message"].split()
            step = next(w for w in words if w in ("queued", "started", "finished"))
            lives.setdefault(e["request_id"], []).append(step)
    assert list(lives.values()) == [["queued", "started", "finished"]] * 2, lives


async def test_info_keeps_to_request_lines(tmp_path: Path) -> None:
    async def exchange(url: str) -> None:
        async with httpx.AsyncClient(base_url=url) as client:
            body = {"model": "echo", "input": "hi"}
            assert (await client.post("/v1/responses", json=body)).status_code == 200

    entries = await _serve_and_log(tmp_path, exchange=exchange)
    assert not [e for e in entries if e["level"] == "debug"]
    lines = [e for e in entries if e["logger"] == "pool.access"]
    assert [e["path"] for e in lines] == ["/v1/responses"]


def test_chatty_libraries_say_only_warnings_below_debug() -> None:
    try:
        configure_logging("info")
        assert not logging.getLogger("coredis").isEnabledFor(logging.INFO)
        assert logging.getLogger("coredis").isEnabledFor(logging.WARNING)
        assert logging.getLogger("pool.cluster").isEnabledFor(logging.INFO)
        configure_logging("debug")
        assert logging.getLogger("coredis").isEnabledFor(logging.DEBUG)
    finally:
        configure_logging("warning")
        logging.getLogger().handlers.clear()
