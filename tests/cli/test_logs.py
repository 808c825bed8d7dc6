"""``LOG_FORMAT=json``: one JSON object per log line, with the line's key=value facts."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import trio

from pool.cli import JsonFormatter

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
