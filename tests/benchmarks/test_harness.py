"""The benchmark harness still runs: a quick scenario end to end, results written."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import trio

from benchmarks.__main__ import _versions
from benchmarks._http import CHAT_DELTA_MARK, Connection, Result
from benchmarks.harness import installed_version, summarize, zero_upstream
from benchmarks.pass_through import open_upstream, warm_up


def test_quick_overhead_scenario_writes_results(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "benchmarks", "run", "overhead-stub", "--quick"]
    result = subprocess.run(
        [*command, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / "overhead-stub" / "results.json").read_text())
    cells = {row["cell"] for row in report["rows"]}
    assert cells == {"json c=1", "json c=8", "sse-100 c=1", "sse-100 c=8"}
    for row in report["rows"]:
        assert row["pool_rps"] > 0 and row["bare_rps"] > 0
    assert report["raw"]["json c=1"]["pool"][0]["errors"] == 0
    assert [row["offered_rate"] for row in report["open_loop"]] == ["100/s", "300/s"]
    assert all(row["pool_errors"] == 0 and row["pool_p50_ms"] > 0 for row in report["open_loop"])
    assert (tmp_path / "overhead-stub" / "results.md").read_text().startswith("# overhead-stub")


@pytest.mark.parametrize(
    ("upstream", "folder"),
    [("zero", "pass-through"), ("stub-pool", "pass-through/stub-pool-upstream")],
)
def test_quick_pass_through_has_every_side_and_the_bare_floor(
    tmp_path: Path, upstream: str, folder: str
) -> None:
    command = [sys.executable, "-m", "benchmarks", "run", "pass-through", "--quick"]
    result = subprocess.run(
        [*command, "--no-litellm", "--upstream", upstream, "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    report = json.loads((tmp_path / folder / "results.json").read_text())
    assert report["upstream"] == upstream
    sides = ["direct", "bare", "pass_through", "translated", "translated_chat"]
    for cell in ("json c=1", "json c=16", "sse c=1", "sse c=16"):
        rows = [row for row in report["rows"] if row["cell"] == cell]
        assert [row["side"] for row in rows] == sides
        assert all(row["errors"] == 0 and row["rps"] > 0 for row in rows), rows
    # The bare app relays nothing: the capacity load is the relay's, without it.
    assert [row["side"] for row in report["capacity"]] == [
        "direct",
        "pass_through",
        "translated",
        "translated_chat",
    ]


def test_the_stub_pool_upstream_is_a_pool_serving_the_stub_as_zero() -> None:
    """``--upstream stub-pool`` reads a pool (the quick run above only sees its label);
    the zero-work upstream has no model list at all."""
    with open_upstream("stub-pool", None) as pool:
        models = json.loads(urllib.request.urlopen(f"{pool.url}/v1/models", timeout=10).read())
    assert [(m["id"], m["owned_by"]) for m in models["data"]] == [("zero", "llm-pool")]
    with open_upstream("zero", None) as zero, pytest.raises(urllib.error.HTTPError, match="404"):
        urllib.request.urlopen(f"{zero.url}/v1/models", timeout=10)


def test_a_side_that_fails_its_warm_up_stops_the_run() -> None:
    # The zero-work upstream answers Chat Completions only: read as the bare app's side
    # (on /v1/responses) every request fails.
    with zero_upstream() as upstream:
        trio.run(warm_up, {"direct": upstream}, "direct", {})
        with pytest.raises(RuntimeError, match="bare failed its warm-up"):
            trio.run(warm_up, {"bare": upstream}, "bare", {})


def test_zero_upstream_streams_what_it_is_asked_for() -> None:
    async def ask(url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        connection = Connection(host, int(port), CHAT_DELTA_MARK)
        try:
            for tokens in (5, 300):
                body = {"model": "zero", "messages": [], "max_tokens": tokens, "stream": True}
                streamed = await connection.post("/v1/chat/completions", body)
                assert streamed.error is None and streamed.status == 200
                assert streamed.tokens == tokens and len(streamed.token_times) == tokens
            answer = await connection.post("/v1/chat/completions", {"max_tokens": 3})
            assert answer.status == 200 and answer.tokens == 3
        finally:
            await connection.aclose()

    with zero_upstream() as upstream:
        trio.run(ask, upstream.url)


def test_installed_version_reads_the_environments_metadata(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin/litellm").write_text("#!/bin/sh\n")
    assert installed_version(str(venv / "bin/litellm"), "litellm") is None
    dist = venv / "lib/python3.11/site-packages/litellm-1.106.2.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: litellm\nVersion: 1.106.2\n\n"
        "Version: 9 (in the description)\n"
    )
    assert installed_version(str(venv / "bin/litellm"), "litellm") == "1.106.2"
    assert installed_version(str(venv / "bin/litellm"), "fastapi") is None


def test_results_md_names_the_recorded_versions() -> None:
    assert _versions(None) == "" and _versions({}) == ""
    assert _versions({"litellm": "1.106.2"}) == "  \nVersions: litellm 1.106.2"
    assert _versions({"litellm": None}) == "  \nVersions: litellm unknown"


def test_a_summary_says_what_each_lost_request_was() -> None:
    # Status 0 alone does not tell a reset from a refused connection or a cut stream.
    results = [
        Result(status=200, ended=0.001),
        Result(error="ConnectionResetError: [Errno 104] Connection reset by peer"),
        Result(error="ConnectionResetError: [Errno 104] Connection reset by peer"),
        Result(error="ConnectionRefusedError: [Errno 111] Connection refused"),
        Result(status=503, ended=0.001),
    ]
    summary = summarize(results, wall_s=1.0)
    assert summary["statuses"] == {"0": 3, "200": 1, "503": 1}
    assert summary["errors_by_kind"] == {"ConnectionRefusedError": 1, "ConnectionResetError": 2}
