"""The pool process and its signals: SIGKILL leaves no runtime process behind (every
managed backend), SIGTERM lets open streams finish within ``service.shutdown_grace_s``
and exits 0."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import trio

from pool.config import Settings, build_settings
from tests.backends.test_process import FAKE, assert_killed_pool_leaves_no_server

from .conftest import live_in_group, words


def _managed(tmp_path: Path, backend: str, extra_args: list[str]) -> Settings:
    binary = tmp_path / "fake-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    binary.chmod(0o755)
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    fields = {
        "llama_server": {
            "llama_server_binary": str(binary),
            "llama_server_start_timeout_s": 20,
            "llama_server_extra_args": extra_args,
        },
        "vllm_serve": {
            "vllm_serve_binary": str(binary),
            "vllm_serve_start_timeout_s": 20,
            "vllm_serve_extra_args": extra_args,
        },
    }[backend]
    return build_settings(
        {"engine": {"models": {"srv": {"backend": backend, "model_path": str(model), **fields}}}}
    )


@pytest.mark.parametrize("backend", ["llama_server", "vllm_serve"])
def test_a_killed_pool_leaves_no_runtime_process(tmp_path: Path, backend: str) -> None:
    assert_killed_pool_leaves_no_server(_managed(tmp_path, backend, []), "srv", tmp_path)


def test_a_killed_pool_leaves_no_grandchild(tmp_path: Path) -> None:
    settings = _managed(tmp_path, "llama_server", ["--spawn-child"])
    (tmp_path / "settings.json").write_text(settings.model_dump_json())
    script = tmp_path / "run_pool.py"
    script.write_text(
        "import pathlib, trio, pool\n"
        "from pool.config import load_settings\n"
        "async def main():\n"
        f"    s = load_settings(pathlib.Path({str(tmp_path / 'settings.json')!r}))\n"
        "    async with pool.open_pool(s) as p:\n"
        "        await p.load('srv')\n"
        "        print(p.model('srv').replicas[0].runtime.process.pid, flush=True)\n"
        "        await trio.sleep_forever()\n"
        "trio.run(main)\n"
    )
    runner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    server = 0
    try:
        assert runner.stdout is not None
        server = int(runner.stdout.readline())
        # The server started its grandchild before it answered /health, so the load
        # that printed the pid saw both: the group is whole when the pool dies.
        assert len(live_in_group(server)) == 2, live_in_group(server)
        runner.kill()
        runner.wait(timeout=30)
        deadline = time.monotonic() + 30
        while live_in_group(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not live_in_group(server)
    finally:
        if runner.poll() is None:
            runner.kill()
        if server:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(server, signal.SIGKILL)


# Ten times the 1.5 s stream: it completes inside the grace on a loaded machine too.
GRACE_S = 15.0


async def _start_serving(settings: Path) -> trio.Process:
    """``llm-pool serve`` as a user starts it: its own process, signalled for real."""
    return await trio.lowlevel.open_process(
        [sys.executable, "-m", "pool", "serve", "--settings", str(settings), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )


async def _listening_url(process: trio.Process) -> str:
    """The URL the served pool prints once it accepts connections."""
    assert process.stdout is not None
    buffer = b""
    with trio.fail_after(60):
        while b"listening on " not in buffer or not buffer.endswith(b"\n"):
            buffer += await process.stdout.receive_some()
    return buffer.decode().split("listening on ")[1].split()[0]


async def test_sigterm_drains_open_streams(tmp_path: Path) -> None:
    settings = tmp_path / "settings.json"
    slow = {
        "backend": "stub",
        "enabled": True,
        "stub_reply": words(30),
        "stub_tokens_per_second": 20,  # 1.5 s of words: a tenth of the grace
    }
    settings.write_text(
        json.dumps({"service": {"shutdown_grace_s": GRACE_S}, "engine": {"models": {"m": slow}}})
    )
    process = await _start_serving(settings)
    try:
        url = await _listening_url(process)
        signalled_at = 0.0
        lines: list[str] = []
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            body = {"model": "m", "input": "x", "stream": True}
            async with client.stream("POST", "/v1/responses", json=body) as response:
                async for line in response.aiter_lines():
                    lines.append(line)
                    if line == "event: response.output_text.delta" and not signalled_at:
                        process.send_signal(signal.SIGTERM)
                        signalled_at = trio.current_time()
            completed_at = trio.current_time()
        # Draining: a new connection is not served (refused, or reset as the process
        # exits). A fresh client: a request on the stream's kept-alive connection would
        # hang until the grace ran out (the connection is neither answered nor closed).
        async with httpx.AsyncClient(base_url=url, timeout=30) as fresh:
            with pytest.raises(httpx.TransportError):
                await fresh.get("/health")
        with trio.fail_after(GRACE_S + 5):
            code = await process.wait()
        exited_at = trio.current_time()
        assert "event: response.completed" in lines
        done = json.loads(lines[lines.index("event: response.completed") + 1][6:])
        assert done["response"]["output_text"] == words(30)
        assert completed_at - signalled_at < GRACE_S
        assert code == 0
        # Exit follows the drain (unloading a stub model is instant), not the grace.
        assert exited_at - signalled_at < GRACE_S
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


KEEPALIVE_GRACE_S = 30.0


async def _until_stopping(host: str, port: int, request: bytes) -> None:
    """Wait until the server has begun its shutdown: a new connection is refused or
    closed unanswered, or its request answered 503."""
    with trio.fail_after(KEEPALIVE_GRACE_S / 3):
        while True:
            try:
                probe = await trio.open_tcp_stream(host, port)
            except OSError:
                return
            async with probe:
                with contextlib.suppress(trio.BrokenResourceError):
                    await probe.send_all(request)
                reply = await _read_reply(probe)
            if not reply.startswith(b"HTTP/1.1 200"):
                return
            await trio.sleep(0.01)


async def _read_reply(stream: trio.SocketStream) -> bytes:
    """One whole reply with a Content-Length, or what came before the server closed."""
    data = b""
    while True:
        try:
            part = await stream.receive_some()
        except trio.BrokenResourceError:  # reset: closed with our request unread
            return data
        if not part:
            return data
        data += part
        head, _, body = data.partition(b"\r\n\r\n")
        length = [
            int(line.split(b":", 1)[1])
            for line in head.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        ]
        if length and len(body) >= length[0]:
            return data


async def test_sigterm_closes_kept_alive_connections(tmp_path: Path) -> None:
    """A kept-alive connection reused after SIGTERM is closed at once, not left to hang
    for the grace (the reply-ending ``send`` was cancelled by the app's disconnect
    watcher, cutting Hypercorn's bookkeeping short), and the process exits once the
    open stream is done, not when the grace ends."""
    settings = tmp_path / "settings.json"
    slow = {
        "backend": "stub",
        "enabled": True,
        "stub_reply": words(30),
        "stub_tokens_per_second": 20,
    }
    settings.write_text(
        json.dumps(
            {"service": {"shutdown_grace_s": KEEPALIVE_GRACE_S}, "engine": {"models": {"m": slow}}}
        )
    )
    process = await _start_serving(settings)
    try:
        url = await _listening_url(process)
        host, port = url.split("//")[1].rsplit(":", 1)
        health = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
        kept = await trio.open_tcp_stream(host, int(port))
        await kept.send_all(health)
        with trio.fail_after(30):
            assert (await _read_reply(kept)).startswith(b"HTTP/1.1 200")
        signalled_at = 0.0
        lines: list[str] = []
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            body = {"model": "m", "input": "x", "stream": True}
            async with client.stream("POST", "/v1/responses", json=body) as response:
                async for line in response.aiter_lines():
                    lines.append(line)
                    if line == "event: response.output_text.delta" and not signalled_at:
                        process.send_signal(signal.SIGTERM)
                        signalled_at = trio.current_time()
                        # A request that arrives before the server has read the signal
                        # is served as any other (a loaded CI host once did): reuse the
                        # idle connection once the server says it is stopping.
                        await _until_stopping(host, int(port), health)
                        # The idle connection, reused while the stream still runs.
                        # Sent before the server closed it, or refused after.
                        with contextlib.suppress(trio.BrokenResourceError):
                            await kept.send_all(health)
                        with trio.fail_after(KEEPALIVE_GRACE_S / 3):
                            reply = await _read_reply(kept)
                        assert reply == b"" or reply.startswith(b"HTTP/1.1 503"), reply
            # The stream's own connection, reused: closed, and no new one is served.
            with trio.fail_after(KEEPALIVE_GRACE_S / 3), pytest.raises(httpx.TransportError):
                await client.get("/health")
        with trio.fail_after(KEEPALIVE_GRACE_S + 5):
            code = await process.wait()
        exited_at = trio.current_time()
        assert "event: response.completed" in lines
        assert code == 0
        assert exited_at - signalled_at < KEEPALIVE_GRACE_S / 3
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()
