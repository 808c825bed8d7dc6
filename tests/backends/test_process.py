"""Supervision of managed server processes, with a real (small) server child."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from pool import Delta, Failed, InferenceRequest, PoolError, open_pool, request_from_responses
from pool.backends import Decoding, GenerationRequest, TextPart, TokensUsed, Turn
from pool.backends._managed import STOP_GRACE_S
from pool.backends._process import ManagedProcess, group_alive
from pool.config import build_settings
from tests.bounds import within
from tests.reliability.conftest import live_in_group

FAKE = Path(__file__).with_name("fake_openai_server.py")


@pytest.fixture
def fake_binary(tmp_path: Path) -> Path:
    """An executable that runs the fake server with this interpreter."""
    script = tmp_path / "fake-llama-server"
    script.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE} "$@"\n')
    script.chmod(0o755)
    return script


def _settings(
    binary: Path | str, tmp_path: Path, engine: dict[str, Any] | None = None, **fields: Any
) -> Any:
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    return build_settings(
        {
            "engine": {
                **(engine or {}),
                "models": {
                    "srv": {
                        "backend": "llama_server",
                        "model_path": str(model),
                        "llama_server_binary": str(binary),
                        "llama_server_start_timeout_s": 10,
                        **fields,
                    },
                    "other": {"backend": "stub", "enabled": True},
                },
            }
        }
    )


def _gone(pgid: int) -> bool:
    """No live process (zombies awaiting their reaper don't count) in group ``pgid``."""
    return not group_alive(pgid)


def assert_group_running(pgid: int, members: int = 1) -> None:
    """Group ``pgid`` has ``members`` or more live processes (the server and what it started):
    checked before an unload, so that a later :func:`_gone` shows the unload ended them."""
    assert len(live_in_group(pgid)) >= members, live_in_group(pgid)


def _running(pid: int) -> bool:
    """Process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _ask(**fields: Any) -> InferenceRequest:
    return request_from_responses({"model": "srv", "input": "hi", **fields})


async def test_serves_streams_and_unload_ends_the_group(fake_binary: Path, tmp_path: Path) -> None:
    settings = _settings(
        fake_binary, tmp_path, llama_server_extra_args=["--spawn-child"], target_inflight=2
    )
    async with open_pool(settings) as pool:
        await pool.load("srv")
        assert pool.snapshot("srv").effective_target_inflight == 2
        runtime = pool.model("srv").replicas[0].runtime
        pid = runtime.process.pid  # type: ignore[union-attr]
        reply = await pool.respond(_ask(decoding={"max_tokens": 5}))
        assert reply.text == "one two three four five"
        assert reply.usage.output_tokens == 5 and reply.usage.prompt_tokens == 3
        assert_group_running(pid, members=2)  # the server and the grandchild
        await pool.unload("srv")
        assert _gone(pid)


class _Text:
    """A token sink that keeps the text."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.used = TokensUsed()

    async def send(self, text: object) -> None:
        assert isinstance(text, str)
        self.parts.append(text)


async def test_a_traced_request_carries_traceparent_to_the_server(
    fake_binary: Path, tmp_path: Path
) -> None:
    """The managed server gets the request span's ``traceparent``, as a remote API does
    (a vLLM server with tracing on then joins the pool's trace)."""
    given = f"00-{'ab' * 16}-{'cd' * 8}-01"
    async with open_pool(_settings(fake_binary, tmp_path)) as pool:
        await pool.load("srv")
        runtime = pool.model("srv").replicas[0].runtime
        traced = GenerationRequest(
            request_id="traced-1",
            model="srv",
            turns=(Turn("user", (TextPart("traced"),)),),
            decoding=Decoding(max_tokens=2),
            trace_parent=given,
        )
        sink = _Text()
        await runtime.generate(traced, sink)  # type: ignore[arg-type]
        assert "".join(sink.parts) == "one two"
        # Untraced: no header.
        untraced = dataclasses.replace(
            traced, turns=(Turn("user", (TextPart("untraced"),)),), trace_parent=None
        )
        await runtime.generate(untraced, _Text())  # type: ignore[arg-type]
        process = runtime.process  # type: ignore[attr-defined]
        with within("the server's lines for both requests in the pool's log"):
            while len(traces := _traces(process.tail())) < 2:
                await trio.sleep(0.02)
        assert traces == {"traced": given, "untraced": "-"}


def _traces(tail: str) -> dict[str, str]:
    """The traceparent each of the test's requests reached the fake server with, by the
    request's text (from the line the server writes for each request)."""
    found = {}
    for line in tail.splitlines():
        if match := re.search(r'request "(traced|untraced)" with traceparent (\S+)', line):
            found[match[1]] = match[2]
    return found


async def test_missing_binary_fails_fast(tmp_path: Path) -> None:
    async with open_pool(_settings(tmp_path / "no-such-binary", tmp_path)) as pool:
        with trio.fail_after(5), pytest.raises(PoolError) as info:
            await pool.load("srv")
        assert "not found" in info.value.message
        assert pool.snapshot("other").state == "loaded"


async def test_never_ready_times_out_and_leaves_nothing(fake_binary: Path, tmp_path: Path) -> None:
    settings = _settings(
        fake_binary,
        tmp_path,
        llama_server_extra_args=["--mode", "never-ready", "--spawn-child"],
        llama_server_start_timeout_s=2,
    )
    async with open_pool(settings) as pool:
        with pytest.raises(PoolError) as info:
            await pool.load("srv")
        assert "not ready within 2s" in info.value.message
        assert "fake server for" in info.value.message  # the tail of its output
        match = re.search(r"pid (\d+) grandchild (\d+)", info.value.message)
        assert match is not None, info.value.message
        assert pool.snapshot("srv").state == "failed"
    server, grandchild = int(match[1]), int(match[2])
    # The server leads its own process group; the grandchild is in it, and both are gone.
    assert _gone(server)
    assert not _running(server) and not _running(grandchild)


async def test_a_crash_fails_the_model_and_the_stream(fake_binary: Path, tmp_path: Path) -> None:
    # No recycles allowed: the watchdog marks the model failed (docs/faults.md).
    settings = _settings(
        fake_binary,
        tmp_path,
        {"watchdog_recycles_per_hour": 0},
        llama_server_extra_args=["--mode", "slow"],
    )
    async with open_pool(settings) as pool:
        await pool.load("srv")
        pid = pool.model("srv").replicas[0].runtime.process.pid  # type: ignore[union-attr]
        deltas = 0
        events = []
        async for event in pool.stream(_ask(decoding={"max_tokens": 30})):
            events.append(event)
            if isinstance(event, Delta):
                deltas += 1
                if deltas == 2:
                    os.kill(pid, signal.SIGKILL)
        assert 2 <= deltas < 30  # the stream ended early
        assert isinstance(events[-1], Failed) and events[-1].error.code == "backend_error"
        with trio.fail_after(5):
            while pool.snapshot("srv").state != "failed":
                await trio.sleep(0.02)
        row = pool.snapshot("srv")
        assert "exited with status -9" in row.last_error and "fake server for" in row.last_error
        assert (await pool.respond(InferenceRequest.prompt("other", "fine"))).text == "fine"


async def test_a_stopped_server_is_killed_without_its_grace(
    fake_binary: Path, tmp_path: Path
) -> None:
    """A SIGSTOPped server cannot act on SIGTERM: the unload kills its group at once
    instead of waiting out the stop grace (STOP_GRACE_S, 10 s)."""
    settings = _settings(fake_binary, tmp_path, llama_server_extra_args=["--spawn-child"])
    async with open_pool(settings) as pool:
        await pool.load("srv")
        pid = pool.model("srv").replicas[0].runtime.process.pid  # type: ignore[union-attr]
        assert_group_running(pid, members=2)
        os.kill(pid, signal.SIGSTOP)
        started = trio.current_time()
        await pool.unload("srv")
        assert trio.current_time() - started < STOP_GRACE_S / 2
        assert _gone(pid)


def assert_killed_pool_leaves_no_server(settings: Any, model: str, tmp_path: Path) -> None:
    """Run a pool serving ``model`` in a child process, SIGKILL it (no cleanup code runs),
    and check that the server process it started goes too."""
    (tmp_path / "settings.json").write_text(settings.model_dump_json())
    script = tmp_path / "run_pool.py"
    script.write_text(
        textwrap.dedent(f"""
        import pathlib, trio, pool
        from pool.config import load_settings
        async def main():
            settings = load_settings(pathlib.Path({str(tmp_path / "settings.json")!r}))
            async with pool.open_pool(settings) as p:
                if p.snapshot({model!r}).state != "loaded":
                    await p.load({model!r})
                print(p.model({model!r}).replicas[0].runtime.process.pid, flush=True)
                await trio.sleep_forever()
        trio.run(main)
    """)
    )
    runner = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert runner.stdout is not None
        child = int(runner.stdout.readline())
        assert not _gone(child)
        runner.kill()
        runner.wait(timeout=30)
        end = time.monotonic() + 30
        while not _gone(child) and time.monotonic() < end:
            time.sleep(0.05)
        assert _gone(child)
    finally:
        if runner.poll() is None:
            runner.kill()


def test_children_die_with_a_killed_pool(fake_binary: Path, tmp_path: Path) -> None:
    assert_killed_pool_leaves_no_server(_settings(fake_binary, tmp_path), "srv", tmp_path)


async def test_the_guard_ends_the_group_on_eof_without_stop() -> None:
    """A dying pool's end of the guard's pipe closes before the kernel reparents the
    guard, so the guard may read EOF while its parent id is still the pool's: EOF alone
    (no "stop", which the pool writes once it ended the group itself) ends the group."""
    sleeper = "import time; time.sleep(60)"
    parent = (
        "import subprocess, sys, time;"
        f" subprocess.Popen([sys.executable, '-c', {sleeper!r}]); print('up', flush=True);"
        " time.sleep(60)"
    )
    process = ManagedProcess("guarded", [sys.executable, "-c", parent], dict(os.environ))
    process.spawn()
    pid = process.pid
    try:
        with trio.fail_after(30):
            while len(live_in_group(pid)) < 2:  # the server and its child
                await trio.sleep(0.02)
            guard = process._guard
            assert guard is not None and guard.stdin is not None
            guard.stdin.close()  # as the pool's death closes it, the pool itself alive
            while live_in_group(pid):
                await trio.sleep(0.02)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        await process.stop(grace_s=1.0)
