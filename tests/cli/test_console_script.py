"""Each client command once as a user's shell runs it: the ``llm-pool`` console script.

The other CLI tests call the command in-process; here the entry point, argument parsing,
exit status and output of the installed script are the point (stub models only).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from pool import ServerInfo
from tests.components import missing
from tests.http.conftest import start_server

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(sys.executable).parent / "llm-pool"


@pytest.fixture(autouse=True)
def console_script() -> Path:
    """The entry point that installing the pool puts beside this Python."""
    if not SCRIPT.exists():
        missing(
            f"the llm-pool console script ({SCRIPT})",
            "installing the pool into the test environment makes it; scripts/sync-env does",
        )
    return SCRIPT


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{SCRIPT.parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    env.pop("LLM_POOL_URL", None)
    return env


async def shell(
    info: ServerInfo, *argv: str, stdin: bytes = b""
) -> subprocess.CompletedProcess[bytes]:
    with trio.fail_after(120):
        result: subprocess.CompletedProcess[bytes] = await trio.run_process(
            ["llm-pool", *argv, "--url", info.url],
            stdin=stdin,
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            env=_env(),
        )
    return result


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(nursery)


async def test_ps(server: ServerInfo) -> None:
    r = await shell(server, "ps")
    assert r.returncode == 0, r.stderr
    assert b"echo" in r.stdout and b"cold" in r.stdout


async def test_load_then_unload(server: ServerInfo) -> None:
    r = await shell(server, "load", "cold", "--set", "replicas=1")
    assert r.returncode == 0, r.stderr
    assert server.pool.snapshot("cold").state == "loaded"
    r = await shell(server, "unload", "cold")
    assert r.returncode == 0, r.stderr
    assert server.pool.snapshot("cold").state != "loaded"


async def test_pull_of_a_model_without_a_source_exits_1(server: ServerInfo) -> None:
    # In a terminal Ctrl-C's watcher is a nursery: the error must still be one line.
    r = await shell(server, "pull", "echo")
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith(b"llm-pool pull: "), r.stderr
    assert b"Traceback" not in r.stderr and b"ExceptionGroup" not in r.stderr


async def test_chat(server: ServerInfo) -> None:
    r = await shell(server, "chat", "echo", stdin=b"hello there\n/bye\n")
    assert r.returncode == 0, r.stderr
    assert b"hello there" in r.stdout


async def test_chat_with_a_model_not_served_exits_1_before_the_prompt(server: ServerInfo) -> None:
    for name in ("nope", "cold"):  # unknown; configured but not loaded
        r = await shell(server, "chat", name, stdin=b"hello\n")
        assert r.returncode == 1, (name, r.stderr)
        assert f"model {name!r} is not served".encode() in r.stderr, r.stderr
        assert b">>>" not in r.stderr


async def test_events(server: ServerInfo, nursery: trio.Nursery) -> None:
    done = trio.Event()
    result: list[subprocess.CompletedProcess[bytes]] = []

    async def follow() -> None:
        result.append(await shell(server, "events", "--count", "1"))
        done.set()

    nursery.start_soon(follow)
    # Load a model until the follower has seen a change (it may connect after the first).
    with trio.fail_after(120):
        while not done.is_set():
            await shell(server, "load", "cold")
            await shell(server, "unload", "cold")
    assert result[0].returncode == 0, result[0].stderr
    assert b"cold" in result[0].stdout


async def test_bench(server: ServerInfo) -> None:
    r = await shell(server, "bench", "echo", "-n", "2", "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
