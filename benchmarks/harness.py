"""The benchmark harness: servers on loopback, load generators, statistics, reports.

Servers run in their own processes (so the client does not share their event loop and
their CPU time can be read from /proc); the client here drives closed-loop load (N
concurrent clients, each sending its next request when the last one is answered) or
open-loop load (Poisson arrivals at a rate), always bounded in count and time.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from benchmarks._http import DELTA_MARK, Connection, Result
from pool.backends import free_port

CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    name: str
    url: str
    process: subprocess.Popen[bytes]
    # The version of the server's software where the run records it (LiteLLM's).
    version: str | None = None

    @property
    def host_port(self) -> tuple[str, int]:
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        return host, int(port)

    def cpu_seconds(self) -> float:
        """User plus system CPU time of the server process so far."""
        fields = Path(f"/proc/{self.process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK


@contextmanager
def run_server(
    name: str,
    command: list[str],
    timeout_s: float = 120.0,
    environ: dict[str, str] | None = None,
    cpus: str | None = None,
    cwd: Path | None = None,
) -> Iterator[Server]:
    """Start ``command`` (which prints ``listening on URL``) and stop it afterwards;
    ``environ`` adds to the environment it inherits; ``cpus`` pins it (taskset's list);
    ``cwd``: where it runs (``python -m`` imports from there first)."""
    process = subprocess.Popen(
        pinned(command, cpus),
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **environ} if environ else None,
    )
    try:
        assert process.stdout is not None
        deadline = time.monotonic() + timeout_s
        url = ""
        while time.monotonic() < deadline:
            line = process.stdout.readline().decode()
            if not line:
                raise RuntimeError(f"{name} exited before listening")
            if "listening on " in line:
                url = line.split("listening on ")[1].strip()
                break
        if not url:
            raise RuntimeError(f"{name} did not start within {timeout_s}s")
        yield Server(name, url, process)
    finally:
        stop_process(process)


def pinned(command: list[str], cpus: str | None) -> list[str]:
    """``command`` run on ``cpus`` only (taskset execs it: the pid, and so the CPU time
    read from /proc, stay the server's)."""
    return ["taskset", "-c", cpus, *command] if cpus else command


def stop_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL if it has not exited within 20 s."""
    process.terminate()
    try:
        process.wait(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


@contextmanager
def pool_server(
    models: dict[str, dict[str, Any]],
    service: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
    name: str = "pool",
    cpus: str | None = None,
    checkout: Path | None = None,
    **engine: Any,
) -> Iterator[Server]:
    """A pool serving ``models`` (``engine`` settings beside them; ``environ`` adds to
    its environment, e.g. ``LLM_POOL_STATE_DIR``; ``checkout``: a folder holding another
    checkout's ``pool`` package, served in place of this one)."""
    if checkout is not None:
        environ = {**(environ or {}), "PYTHONPATH": str(checkout.resolve())}
    settings = {
        "service": {"log_level": "warning", "shutdown_grace_s": 1, **(service or {})},
        "engine": {"max_queue": 4096, **engine, "models": models},
    }
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "settings.json"
        path.write_text(json.dumps(settings))
        command = [
            sys.executable,
            "-m",
            "pool",
            "serve",
            "--settings",
            str(path),
            "--port",
            "0",
            "--log-level",
            "warning",
        ]
        with run_server(name, command, environ=environ, cpus=cpus, cwd=checkout) as server:
            yield server


@contextmanager
def litellm_server(
    model: str,
    upstream_base: str,
    master_key: str,
    cpus: str | None = None,
    upstream_model: str | None = None,
) -> Iterator[Server]:
    """LiteLLM's proxy (from its own environment, scripts/build-litellm-env) serving
    ``model`` from the OpenAI-compatible ``upstream_base``, where it is named
    ``upstream_model`` (default: the same); one worker, no database."""
    binary = subprocess.run(
        ["bash", "scripts/build-litellm-env"], capture_output=True, text=True, check=True
    ).stdout.strip()
    config = (
        "model_list:\n"
        f"  - model_name: {model}\n"
        "    litellm_params:\n"
        f"      model: openai/{upstream_model or model}\n"
        f"      api_base: {upstream_base}\n"
        "      api_key: none\n"
        "litellm_settings:\n"
        "  drop_params: true\n"
        "  telemetry: false\n"
        "  turn_off_message_logging: true\n"
    )
    env = {
        **os.environ,
        "LITELLM_MASTER_KEY": master_key,
        # Offline: the bundled model price list instead of fetching one at start.
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        "LITELLM_LOG": "ERROR",
    }
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "config.yaml"
        path.write_text(config)
        port = free_port()
        command = [binary, "--config", str(path), "--host", "127.0.0.1", "--port", str(port)]
        process = subprocess.Popen(
            pinned([*command, "--num_workers", "1"], cpus),
            cwd=folder,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            version = installed_version(binary, "litellm")
            server = Server("litellm", f"http://127.0.0.1:{port}", process, version)
            wait_healthy(server, "/health/liveliness", 120.0)
            yield server
        finally:
            stop_process(process)


def installed_version(command: str, distribution: str) -> str | None:
    """The version of ``distribution`` in the virtual environment that holds ``command``
    (``VENV/bin/litellm``), read from its metadata; None when there is none."""
    venv = Path(command).resolve().parent.parent
    pattern = f"lib/python*/site-packages/{distribution}-*.dist-info/METADATA"
    for metadata in sorted(venv.glob(pattern)):
        for line in metadata.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("Version:"):
                return line.removeprefix("Version:").strip()
            if not line:
                break  # the headers end at the first blank line
    return None


def wait_healthy(server: Server, path: str, timeout_s: float) -> None:
    """Poll ``path`` until it answers 200 (blocking: called before any load runs)."""
    import http.client

    host, port = server.host_port
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(f"{server.name} exited with status {server.process.returncode}")
        try:
            connection = http.client.HTTPConnection(host, port, timeout=2)
            connection.request("GET", path)
            if connection.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{server.name} was not healthy within {timeout_s:g}s")


@contextmanager
def zero_upstream(cpus: str | None = None) -> Iterator[Server]:
    """``benchmarks/zero_upstream.py``: Chat Completions streamed at no cost per token."""
    command = [sys.executable, "-m", "benchmarks.zero_upstream", "--port", "0"]
    with run_server("direct", command, cpus=cpus) as server:
        yield server


@contextmanager
def bare_server(cpus: str | None = None) -> Iterator[Server]:
    """``benchmarks/bare_app.py``: Hypercorn and an ASGI app that only answers."""
    command = [sys.executable, "-m", "benchmarks.bare_app", "--port", "0"]
    with run_server("bare", command, cpus=cpus) as server:
        yield server


BodyFor = Callable[[int], tuple[dict[str, Any], dict[str, str]]]


async def closed_loop(
    server: Server,
    concurrency: int,
    count: int,
    body_for: BodyFor,
    max_s: float = 120.0,
    *,
    path: str = "/v1/responses",
    delta_mark: bytes = DELTA_MARK,
    stop_after_s: float | None = None,
) -> list[Result]:
    """``concurrency`` clients send ``count`` requests in all, each waiting for its answer.

    Args:
        stop_after_s: start no request after this many seconds (those under way finish,
            so a throughput over the phase counts no half-read stream).
    """
    host, port = server.host_port
    results: list[Result] = []
    counter = iter(range(count))
    stop_at = None if stop_after_s is None else trio.current_time() + stop_after_s

    async def client() -> None:
        connection = Connection(host, port, delta_mark)
        try:
            for index in counter:
                if stop_at is not None and trio.current_time() >= stop_at:
                    break
                body, headers = body_for(index)
                results.append(await connection.post(path, body, headers))
        finally:
            await connection.aclose()

    with trio.move_on_after(max_s):
        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(client)
    return results


async def open_loop(
    server: Server, rate: float, count: int, body_for: BodyFor, max_s: float = 120.0, seed: int = 7
) -> list[Result]:
    """Poisson arrivals at ``rate`` per second, ``count`` in all, each on its own connection."""
    host, port = server.host_port
    results: list[Result] = []
    rng = random.Random(seed)

    async def one(index: int) -> None:
        connection = Connection(host, port)
        try:
            body, headers = body_for(index)
            results.append(await connection.post("/v1/responses", body, headers))
        finally:
            await connection.aclose()

    with trio.move_on_after(max_s):
        async with trio.open_nursery() as nursery:
            # Arrival times on an absolute schedule, so timer overshoot does not add up.
            arrival = trio.current_time()
            for index in range(count):
                await trio.sleep_until(arrival)
                nursery.start_soon(one, index)
                arrival += rng.expovariate(rate)
    return results


def percentile(values: list[float], fraction: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def summarize(results: list[Result], wall_s: float, cpu_s: float | None = None) -> dict[str, Any]:
    ok = [r for r in results if r.error is None and r.status == 200]
    latencies = [r.latency_ms for r in ok]
    ttfts = [t for r in ok if (t := r.ttft_ms) is not None]
    gaps = [
        (b - a) * 1000 for r in ok for a, b in zip(r.token_times, r.token_times[1:], strict=False)
    ]
    tokens = sum(r.tokens for r in ok)
    return {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        # Counted in one pass: a phase of one-token answers has tens of thousands.
        "statuses": dict(sorted(Counter(str(r.status) for r in results).items())),
        # What a status 0 was: a reset, a refused connection or a timeout read differently.
        "errors_by_kind": dict(
            sorted(Counter(r.error.split(":")[0] for r in results if r.error).items())
        ),
        "latency_ms": {
            q: percentile(latencies, f) for q, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
        },
        "latency_median_ms": statistics.median(latencies) if latencies else None,
        "ttft_ms": {
            q: percentile(ttfts, f) for q, f in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))
        },
        "inter_token_ms": {q: percentile(gaps, f) for q, f in (("p50", 0.5), ("p99", 0.99))},
        "requests_per_s": len(ok) / wall_s if wall_s else None,
        "tokens_per_s": tokens / wall_s if wall_s else None,
        "server_cpu_s": cpu_s,
        "server_cpu_ms_per_request": (cpu_s * 1000 / len(ok)) if cpu_s is not None and ok else None,
        "latencies_ms": latencies,
    }


async def measure(server: Server, runner: Callable[[], Any]) -> dict[str, Any]:
    """Run one load phase against ``server`` and summarize it with the server's CPU time."""
    cpu_before = server.cpu_seconds()
    started = time.perf_counter()
    results = await runner()
    wall = time.perf_counter() - started
    return summarize(results, wall, server.cpu_seconds() - cpu_before)


def progress(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)
