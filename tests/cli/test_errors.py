"""Every way ``llm-pool`` fails ends in one line on stderr and a non-zero exit: usage
mistakes, a URL without a scheme, refusals of the pool, no pool at all, and a ``serve``
that cannot listen where it is told to (said before any model loads).
"""

from __future__ import annotations

import io
import json
import os
import socket
import sys
import tomllib
from pathlib import Path

import pytest
import trio

import pool
from pool import ServerInfo
from pool.cli import main, run_command
from tests.cli.test_cli import Ran, free_port
from tests.http.conftest import start_server

ROOT = Path(__file__).resolve().parents[2]


async def run(*argv: str) -> Ran:
    out, err = io.StringIO(), io.StringIO()
    code = await run_command(list(argv), stdout=out, stderr=err)
    return Ran(code, out.getvalue(), err.getvalue())


def one_line(ran: Ran) -> str:
    """The error ``ran`` ended in; fails unless it is exactly one line."""
    assert ran.code != 0, ran.out
    lines = ran.err.splitlines()
    assert len(lines) == 1, ran.err
    return lines[0]


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    models = {
        "cold": {"backend": "stub"},
        "broken": {"backend": "stub", "stub_fail_load": True},
    }
    return await start_server(nursery, models)


async def test_a_url_without_a_scheme_is_taken_as_http(server: ServerInfo) -> None:
    bare = server.url.removeprefix("http://")
    assert bare != server.url
    ran = await run("ps", "--url", bare)
    assert ran.code == 0, ran.err
    assert "cold" in ran.out


@pytest.mark.parametrize("url", ["ftp://127.0.0.1:8011", "http://", "http://[::1", ""])
async def test_a_url_that_names_no_pool_is_refused(url: str) -> None:
    line = one_line(await run("ps", "--url", url))
    assert line.startswith("llm-pool ps: argument --url:")


@pytest.mark.parametrize("requests", ["0", "-3"])
async def test_bench_wants_at_least_one_request(server: ServerInfo, requests: str) -> None:
    ran = await run("bench", "cold", "-n", requests, "--url", server.url)
    assert ran.code == 2 and ran.out == ""  # no table of NaN
    assert "argument -n/--requests: must be above 0" in one_line(ran)


def test_version_is_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"llm-pool {pool.__version__}\n"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert pool.__version__ == project["version"]


async def test_a_usage_mistake_is_one_line(server: ServerInfo) -> None:
    # argparse's own message, without the usage argparse prints before it.
    assert one_line(await run("frobnicate")).startswith("llm-pool: argument COMMAND: invalid")
    assert "required: name" in one_line(await run("load", "--url", server.url))
    negative = await run("ps", "--timeout", "-1", "--url", server.url)  # was a traceback
    assert "--timeout: must be above 0" in one_line(negative)
    assert "--interval: must be above 0" in one_line(await run("events", "--interval", "0"))


def test_a_usage_mistake_of_convert_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # convert's own parser (pool.convert reads its arguments itself).
    with pytest.raises(SystemExit) as exited:
        main(["convert", "nope"])
    assert exited.value.code == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("llm-pool convert: argument kind: invalid choice: 'nope'")


async def test_a_refusal_is_one_line(server: ServerInfo) -> None:
    # A schema refusal names every field it refused, on the one line.
    sets = ("--set", "replicas=0", "--set", "nope=1")
    schema = await run("load", "cold", *sets, "--url", server.url)
    assert schema.code == 1
    line = one_line(schema)
    assert line.startswith("llm-pool load: validation_error (422): field replicas: ")
    assert "; field nope: " in line
    # A failed load: its last error is the message's own words, said once.
    failed = await run("load", "broken", "--url", server.url)
    assert one_line(failed).startswith("llm-pool load: load_failed (500): ")
    assert one_line(failed).count("stub_fail_load is set") == 1
    unknown = await run("unload", "nope", "--url", server.url)
    assert one_line(unknown).startswith("llm-pool unload: unknown_model (404)")


async def test_a_load_refused_says_nothing_before_the_refusal(server: ServerInfo) -> None:
    # Off a terminal, no progress line: the refusal is all stderr holds.
    unknown = await run("load", "nope", "--url", server.url)
    assert one_line(unknown).startswith("llm-pool load: unknown_model (404)")


async def test_no_pool_at_the_url_is_one_line() -> None:
    gone = await run("ps", "--url", f"http://127.0.0.1:{free_port()}")
    assert gone.code == 3 and "cannot reach the pool" in one_line(gone)


# `llm-pool serve` where it cannot listen: one line, before anything loads.


async def serve_process(tmp_path: Path, *argv: str) -> Ran:
    settings = tmp_path / "settings.json"
    models = {"echo": {"backend": "stub", "enabled": True}}  # loads at start when served
    settings.write_text(json.dumps({"engine": {"models": models}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LOG_LEVEL": "info"}
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-m", "pool", "serve", "--settings", str(settings), *argv],
            stdin=b"", capture_stdout=True, capture_stderr=True, check=False, env=env,
        )  # fmt: skip
    return Ran(done.returncode, done.stdout.decode(), done.stderr.decode())


async def test_serve_on_a_port_in_use_says_so(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ran = await serve_process(tmp_path, "--port", str(port))
    # One line: no traceback, and no log line (the model was never loaded).
    line = one_line(ran)
    assert line == f"llm-pool serve: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert ran.code == 1


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (("--port", "99999"), "cannot listen on 127.0.0.1:99999: port must be 0-65535"),
        # TEST-NET-1: an address no machine of a test run has (no DNS asked).
        (("--host", "192.0.2.1", "--port", "0"), "cannot listen on 192.0.2.1:0: "),
    ],
)
async def test_serve_where_it_cannot_listen_says_so(
    tmp_path: Path, argv: tuple[str, ...], said: str
) -> None:
    ran = await serve_process(tmp_path, *argv)
    assert one_line(ran).startswith(f"llm-pool serve: {said}")
    assert ran.code == 1


async def test_invalid_settings_are_one_line_each(tmp_path: Path) -> None:
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"service": {"port": "x", "host": 1}}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with trio.fail_after(60):
        done = await trio.run_process(
            [sys.executable, "-m", "pool", "serve", "--settings", str(settings)],
            stdin=b"", capture_stderr=True, check=False, env=env,
        )  # fmt: skip
    assert done.returncode == 2
    lines = done.stderr.decode().splitlines()
    assert len(lines) == 2, lines  # two problems, a line each
    for line in lines:
        assert line.startswith(f"llm-pool serve: invalid settings: {settings}: service.")
