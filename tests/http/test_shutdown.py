"""The served process: prints its URL, shuts down gracefully on SIGTERM, reports bad config."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import trio


def _write_settings(tmp_path: Path, models: dict[str, object]) -> Path:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"service": {"shutdown_grace_s": 5}, "engine": {"models": models}}))
    return path


async def _start(settings: Path) -> tuple[trio.Process, str]:
    process = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pool", "serve", "--settings", str(settings), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert process.stdout is not None
    buffer = b""
    with trio.fail_after(30):
        while b"listening on " not in buffer or not buffer.endswith(b"\n"):
            buffer += await process.stdout.receive_some()
    return process, buffer.decode().split("listening on ")[1].split()[0]


async def test_sigterm_lets_the_open_stream_finish(tmp_path: Path) -> None:
    reply = " ".join(f"t{i}" for i in range(30))
    settings = _write_settings(
        tmp_path,
        {
            "slow": {
                "backend": "stub",
                "enabled": True,
                "stub_reply": reply,
                "stub_tokens_per_second": 20,
            }
        },
    )
    process, url = await _start(settings)
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            lines: list[str] = []
            deltas = 0
            body = {"model": "slow", "input": "x", "stream": True}
            async with client.stream("POST", "/v1/responses", json=body) as resp:
                async for line in resp.aiter_lines():
                    lines.append(line)
                    if line == "event: response.output_text.delta":
                        deltas += 1
                        if deltas == 1:
                            process.send_signal(signal.SIGTERM)
        assert "event: response.completed" in lines
        with trio.fail_after(5):
            code = await process.wait()
        assert code == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


def test_bad_config_exits_2_with_one_line_per_problem(tmp_path: Path) -> None:
    settings = _write_settings(
        tmp_path, {"a": {"backend": "nope"}, "b": {"backend": "stub", "stub_typo": 1}}
    )
    result = subprocess.run(
        [sys.executable, "-m", "pool", "serve", "--settings", str(settings), "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "engine.models.a.backend: unknown backend 'nope'" in result.stderr
    assert "engine.models.b.stub_typo" in result.stderr


async def test_a_stream_longer_than_the_grace_ends_with_an_error_event(tmp_path: Path) -> None:
    """Cut by the shutdown, a stream still ends as a stream: its error event, then a
    complete chunked body, on each streaming surface."""
    reply = " ".join(f"t{i}" for i in range(400))
    path = tmp_path / "settings.json"
    slow = {"backend": "stub", "enabled": True, "stub_reply": reply, "target_inflight": 4}
    path.write_text(
        json.dumps(
            {
                "service": {"shutdown_grace_s": 2},
                "engine": {"models": {"slow": slow | {"stub_tokens_per_second": 20}}},
            }
        )
    )
    process, url = await _start(path)
    streams = {
        "/v1/responses": {"input": "x", "stream": True},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "stream": True},
        "/api/generate": {"prompt": "x"},
    }
    ends: dict[str, str] = {}
    try:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            started = trio.Semaphore(0)

            async def read(route: str, body: dict[str, object]) -> None:
                lines: list[str] = []
                async with client.stream("POST", route, json={"model": "slow", **body}) as resp:
                    first = True
                    async for line in resp.aiter_lines():
                        if first:
                            started.release()
                            first = False
                        if line.strip():
                            lines.append(line)
                ends[route] = "\n".join(lines[-3:])

            async with trio.open_nursery() as nursery:
                for route, body in streams.items():
                    nursery.start_soon(read, route, body)
                for _ in streams:
                    await started.acquire()
                process.send_signal(signal.SIGTERM)
        # Each stream read to its end (httpx raises on a cut chunked body) and said why.
        for route in streams:
            assert "shutting_down" in ends[route] or "shut down" in ends[route], (route, ends)
        with trio.fail_after(10):
            assert await process.wait() == 0
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
