"""The benchmark scenarios; each returns a report dict (tables, figures, raw summaries)."""

from __future__ import annotations

import os
import secrets
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import trio

from benchmarks._http import CHAT_DELTA_MARK
from benchmarks.cluster_relay import cluster_relay
from benchmarks.harness import (
    Server,
    bare_server,
    closed_loop,
    free_port,
    litellm_server,
    measure,
    open_loop,
    pool_server,
    progress,
    stop_process,
    wait_healthy,
)
from benchmarks.llama_cpp_direct import GGUF, QUESTION
from benchmarks.llama_cpp_direct import main as compare_llama_cpp
from benchmarks.pass_through import pass_through
from benchmarks.preemption import preemption
from benchmarks.prefix_cache import prefix_cache as run_prefix_cache
from benchmarks.relay import relay_capacity
from benchmarks.soak import soak
from benchmarks.stub_bodies import stub_text
from benchmarks.tracing import tracing_cost
from benchmarks.usage_cost import usage_cost
from benchmarks.vram_swap import vram_swap
from benchmarks.warm_conversations import warm_conversations
from pool.config import resolve_model_path


def _stub_body(tokens: int, stream: bool) -> Callable[[int], tuple[dict[str, Any], dict[str, str]]]:
    body = {"model": "stub", "input": "x", "stream": stream, "decoding": {"max_tokens": tokens}}
    return lambda index: (body, {})


async def overhead_stub(quick: bool, baseline: Path | None = None) -> dict[str, Any]:
    """The pool's own cost per request: zero-work stub vs a bare Hypercorn handler.

    Args:
        baseline: another checkout of the pool (a before-state, e.g. a git worktree of
            an earlier commit), served beside this one and interleaved with it in every
            cell: ``baseline_*`` columns and the change's cost in one run.
    """
    concurrencies = [1, 8] if quick else [1, 8, 64]
    rounds = 1 if quick else 3
    cells = [("json", 1, False), ("sse-100", 100, True)]
    per_request = 20 if quick else 300
    stub = {"backend": "stub", "enabled": True, "stub_reply": stub_text(100), "target_inflight": 64}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with ExitStack() as servers:
        bare = servers.enter_context(bare_server())
        pool = servers.enter_context(pool_server({"stub": stub}))
        compared = [bare, pool]
        if baseline is not None:
            environ = {"PYTHONPATH": str(baseline)}
            compared.append(
                servers.enter_context(pool_server({"stub": stub}, environ=environ, name="baseline"))
            )
        for server in compared:  # warm-up
            await closed_loop(server, 4, 50, _stub_body(100, True))
        for round_index in range(rounds):
            for mode, tokens, stream in cells:
                for concurrency in concurrencies:
                    count = per_request * max(1, concurrency // 4)
                    for server in compared:  # interleaved: A B A B
                        key = f"{mode} c={concurrency}"
                        progress(
                            f"overhead-stub round {round_index + 1}/{rounds} {key} {server.name}"
                        )
                        summary = await measure(
                            server,
                            lambda s=server, c=concurrency, n=count, t=tokens, st=stream: (
                                closed_loop(s, c, n, _stub_body(t, st))
                            ),
                        )
                        results.setdefault(key, {}).setdefault(server.name, []).append(summary)
        # Open loop: Poisson arrivals at fixed rates, each on a new connection, to see
        # up to which rate latency stays flat (the sustainable rate, unlike the closed
        # loop's maximum, which lets clients wait).
        # Past saturation a side pays for the backlog of the one before it, so each
        # round starts the rotation at another side; the table gives the medians.
        open_rates = [100, 300] if quick else [100, 300, 500, 700]
        open_rounds = 1 if quick else 3
        open_results: dict[str, dict[str, list[dict[str, Any]]]] = {}
        for round_index in range(open_rounds):
            shift = round_index % len(compared)
            for rate in open_rates:
                for server in compared[shift:] + compared[:shift]:
                    progress(
                        f"overhead-stub open loop round {round_index + 1}/{open_rounds}"
                        f" {rate}/s {server.name}"
                    )
                    summary = await measure(
                        server,
                        lambda s=server, r=rate: open_loop(
                            s, r, int(r * (1 if quick else 5)), _stub_body(1, False)
                        ),
                    )
                    open_results.setdefault(f"{rate}/s", {}).setdefault(server.name, []).append(
                        summary
                    )
    open_rows = [
        {
            "offered_rate": rate,
            **{
                f"{name}_{field}": _median([pick(summary) for summary in summaries])
                for name, summaries in sides.items()
                for field, pick in (
                    ("achieved_rps", lambda m: m["requests_per_s"]),
                    ("p50_ms", lambda m: m["latency_ms"]["p50"]),
                    ("p99_ms", lambda m: m["latency_ms"]["p99"]),
                    ("errors", lambda m: m["errors"]),
                )
            },
        }
        for rate, sides in open_results.items()
    ]
    rows = []
    for key, sides in results.items():
        bare_runs, pool_runs = sides["bare"], sides["pool"]
        p50 = [
            p["latency_ms"]["p50"] - b["latency_ms"]["p50"]
            for b, p in zip(bare_runs, pool_runs, strict=True)
        ]
        p99 = [
            p["latency_ms"]["p99"] - b["latency_ms"]["p99"]
            for b, p in zip(bare_runs, pool_runs, strict=True)
        ]
        rows.append(
            {
                "cell": key,
                "bare_p50_ms": _median([b["latency_ms"]["p50"] for b in bare_runs]),
                "pool_p50_ms": _median([p["latency_ms"]["p50"] for p in pool_runs]),
                "added_p50_ms": _median(p50),
                "added_p99_ms": _median(p99),
                "bare_rps": _median([b["requests_per_s"] for b in bare_runs]),
                "pool_rps": _median([p["requests_per_s"] for p in pool_runs]),
                "pool_cpu_ms_per_request": _median(
                    [p["server_cpu_ms_per_request"] for p in pool_runs]
                ),
                "added_p50_ms_per_token": _median(p50) / 100 if key.startswith("sse") else None,
            }
        )
        if "baseline" in sides:
            before = sides["baseline"]
            rows[-1].update(
                {
                    "baseline_p50_ms": _median([b["latency_ms"]["p50"] for b in before]),
                    "baseline_rps": _median([b["requests_per_s"] for b in before]),
                    "baseline_cpu_ms_per_request": _median(
                        [b["server_cpu_ms_per_request"] for b in before]
                    ),
                    # Per round, this checkout's CPU per request minus the baseline's.
                    "change_cpu_ms_per_request": _median(
                        [
                            p["server_cpu_ms_per_request"] - b["server_cpu_ms_per_request"]
                            for b, p in zip(before, pool_runs, strict=True)
                        ]
                    ),
                }
            )
    return {
        "rows": rows,
        "open_loop": open_rows,
        "raw": {**results, "open_loop": open_results},
        "cdf": _cdf_series(results),
    }


async def replicas(quick: bool) -> dict[str, Any]:
    """Throughput of 1, 2, 4 replicas: a stub with a fixed per-token delay, and SmolLM2
    in-process (llama_cpp, one thread per replica) on this machine's two cores."""
    counts = [1, 2] if quick else [1, 2, 4]
    stub = {
        "backend": "stub",
        "stub_reply": stub_text(20),
        "stub_tokens_per_second": 100,
    }
    smol = {
        "backend": "llama_cpp",
        "model_path": GGUF,
        "prompt_format": "qwen3_template",
        "gguf_n_threads": 1,
        "gguf_n_ctx": 1024,
    }
    cases = [
        ("stub, 20 tokens at 100 tokens/s", stub, 16, 16 if quick else 96, {}),
        (
            "SmolLM2 llama_cpp, 1 thread each",
            smol,
            8,
            4 if quick else 24,
            {"input": "Name three colours.", "decoding": {"max_tokens": 24, "temperature": 0}},
        ),
    ]
    rows = []
    raw: dict[str, Any] = {}
    for label, definition, clients, requests, fields in cases:
        if definition["backend"] == "llama_cpp":
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                progress(f"replicas: skipping {label} (llama-cpp-python is not installed)")
                continue
        body = {"model": "m", "input": "x", **fields}
        ask = lambda i, b=body: (b, {})  # noqa: E731
        base = None
        for count in counts:
            model = {
                **definition,
                "enabled": True,
                "replicas": count,
                "replica_max": count,
                "target_inflight": 1,
            }
            with pool_server({"m": model}) as pool:
                await closed_loop(pool, count, count, ask)  # warm-up
                progress(f"replicas: {label}: {count}")
                summary = await measure(
                    pool,
                    lambda p=pool, c=clients, n=requests, a=ask: closed_loop(p, c, n, a),
                )
            raw[f"{label}: {count}"] = summary
            rps = summary["requests_per_s"]
            base = base or rps
            rows.append(
                {
                    "model": label,
                    "replicas": count,
                    "requests_per_s": rps,
                    "speedup": rps / base,
                    "ideal": count,
                    "efficiency": rps / base / count,
                    "errors": summary["errors"],
                }
            )
    return {"rows": rows, "raw": raw}


async def fairness(quick: bool) -> dict[str, Any]:
    """A light tenant's latency alone and beside a flooding tenant; priorities under load."""
    light_count = 10 if quick else 40
    stub = {
        "backend": "stub",
        "enabled": True,
        "stub_reply": stub_text(10),
        "stub_tokens_per_second": 200,
        "target_inflight": 1,
    }
    rows = []
    raw: dict[str, Any] = {}
    with pool_server({"stub": stub}) as pool:
        light = lambda i: ({"model": "stub", "input": "x"}, {"X-Tenant-ID": "light"})  # noqa: E731
        flood = lambda i: ({"model": "stub", "input": "x"}, {"X-Tenant-ID": "flood"})  # noqa: E731
        progress("fairness: light tenant alone")
        alone = await measure(pool, lambda: closed_loop(pool, 1, light_count, light))
        progress("fairness: light tenant beside a flood of 16 clients")
        beside: dict[str, Any] = {}

        async def light_run() -> None:
            beside.update(await measure(pool, lambda: closed_loop(pool, 1, light_count, light)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(closed_loop, pool, 16, light_count * 16, flood)
            await trio.sleep(0.5)
            await light_run()
            nursery.cancel_scope.cancel()
        raw["alone"], raw["beside_flood"] = alone, beside
        rows.append(
            {
                "case": "light alone",
                "p50_ms": alone["latency_ms"]["p50"],
                "p99_ms": alone["latency_ms"]["p99"],
            }
        )
        rows.append(
            {
                "case": "light beside flood",
                "p50_ms": beside["latency_ms"]["p50"],
                "p99_ms": beside["latency_ms"]["p99"],
            }
        )
        progress("fairness: high vs low priority under saturation")
        prio: dict[str, Any] = {}

        async def run_priority(priority: str) -> None:
            headers = {"X-Priority": priority, "X-Tenant-ID": priority}

            def body(index: int) -> tuple[dict[str, Any], dict[str, str]]:
                return {"model": "stub", "input": "x"}, headers

            prio[priority] = await measure(
                pool, lambda: closed_loop(pool, 8, light_count * 4, body)
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_priority, "high")
            nursery.start_soon(run_priority, "low")
        raw["priority"] = prio
        for priority in ("high", "low"):
            rows.append(
                {
                    "case": f"{priority} priority (8 clients each)",
                    "p50_ms": prio[priority]["latency_ms"]["p50"],
                    "p99_ms": prio[priority]["latency_ms"]["p99"],
                }
            )
    return {"rows": rows, "raw": raw}


async def llama_cpp(quick: bool) -> dict[str, Any]:
    """SmolLM2 in-process through the pool vs llama-cpp-python called directly."""
    report = await compare_llama_cpp(3 if quick else 9, None)
    rows = [
        {
            "side": side,
            "median_tokens_per_s": s["median_tokens_per_s"],
            "median_ttft_ms": s["median_ttft_ms"],
        }
        for side, s in report["summary"].items()
    ]
    rows.append(
        {
            "side": "pool / direct",
            "median_tokens_per_s": report["ratio_tokens_per_s"],
            "median_ttft_ms": report["ttft_added_ms"],
        }
    )
    return {"rows": rows, "raw": report["runs"]}


def _llama_server_binary() -> str:
    return os.environ.get("LLM_POOL_LLAMA_SERVER") or (
        subprocess.run(
            ["bash", "scripts/build-llama-server"], capture_output=True, text=True, check=True
        ).stdout.strip()
    )


@contextmanager
def _llama_router(binary: str, model_path: str, server_args: dict[str, Any]) -> Iterator[Server]:
    """``llama-server`` in router mode, serving the same GGUF as ``smol`` via a preset."""
    with tempfile.TemporaryDirectory() as folder:
        preset = Path(folder) / "models.ini"
        lines = ["[smol]", f"model = {model_path}"]
        lines += [f"{key} = {value}" for key, value in server_args.items()]
        preset.write_text("\n".join(lines) + "\n")
        port = free_port()
        command = [binary, "--models-preset", str(preset), "--host", "127.0.0.1"]
        command += ["--port", str(port), "--no-webui"]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            yield Server("router", f"http://127.0.0.1:{port}", process)
        finally:
            stop_process(process)


async def llama_server(quick: bool, threads: int | None = None) -> dict[str, Any]:
    """SmolLM2 via the pool's llama_server backend, direct, and via llama-server's router."""
    binary = _llama_server_binary()
    port = free_port()
    extra = ["-t", str(threads)] if threads else []
    model = {
        "backend": "llama_server",
        "enabled": True,
        "llama_server_binary": binary,
        "model_path": GGUF,
        "prompt_format": "qwen3_template",
        "llama_server_port": port,
        "llama_server_parallel": 4,
        "llama_server_n_ctx": 4096,
        "llama_server_extra_args": extra,
    }
    # The router's child gets the same settings as the pool's server.
    router_args: dict[str, Any] = {"chat-template": "chatml", "parallel": 4, "ctx-size": 4096}
    if threads:
        router_args["threads"] = threads
    rounds = 1 if quick else 5
    count = 4 if quick else 16
    pool_body = {
        "model": "smol",
        "input": QUESTION,
        "stream": True,
        "decoding": {"max_tokens": 64, "temperature": 0},
    }
    chat_body = {
        "model": "smol",
        "stream": True,
        "max_tokens": 64,
        "temperature": 0,
        "messages": [{"role": "user", "content": QUESTION}],
    }
    sides = ("pool", "direct", "router")
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with (
        pool_server({"smol": model}) as pool,
        _llama_router(binary, str(resolve_model_path(GGUF)), router_args) as router,
    ):
        direct = Server("direct", f"http://127.0.0.1:{port}", pool.process)
        servers = {"pool": pool, "direct": direct, "router": router}
        wait_healthy(router, "/health", 60.0)

        def phase(name: str, concurrency: int, n: int) -> Any:
            server = servers[name]
            if name == "pool":
                return closed_loop(server, concurrency, n, lambda i: (pool_body, {}))
            return closed_loop(
                server,
                concurrency,
                n,
                lambda i: (chat_body, {}),
                path="/v1/chat/completions",
                delta_mark=CHAT_DELTA_MARK,
            )

        # Warm-up, at the higher concurrency too: every slot then holds the prompt in
        # its cache, and the router has started its child.
        for name in sides:
            await phase(name, 4, 8)
        for concurrency in (1, 4):
            for round_index in range(rounds):
                for name in sides:  # interleaved: A B C A B C
                    progress(
                        f"llama-server c={concurrency} round {round_index + 1}/{rounds} {name}"
                    )
                    summary = await measure(
                        servers[name], lambda n=name, c=concurrency: phase(n, c, count)
                    )
                    raw.setdefault(f"c={concurrency}", {}).setdefault(name, []).append(summary)
    rows = []
    for key, results in raw.items():
        tps = {n: _median([s["tokens_per_s"] for s in results[n]]) for n in sides}
        ttft = {n: _median([s["ttft_ms"]["p50"] for s in results[n]]) for n in sides}
        row: dict[str, Any] = {"concurrency": int(key.removeprefix("c="))}
        for name in sides:
            row[f"{name}_tokens_per_s"] = tps[name]
        for name in sides:
            row[f"{name}_ttft_p50_ms"] = ttft[name]
        for name in ("pool", "router"):
            row[f"{name}_ratio"] = (tps[name] or 0) / tps["direct"] if tps["direct"] else None
            row[f"{name}_ttft_added_ms"] = (ttft[name] or 0) - (ttft["direct"] or 0)
        # Per-round ratios (each pool round beside the direct round next to it).
        row["pool_ratio_rounds"] = [
            round(p["tokens_per_s"] / d["tokens_per_s"], 3)
            for p, d in zip(results["pool"], results["direct"], strict=True)
        ]
        rows.append(row)
    return {"rows": rows, "raw": raw, "threads": threads}


async def proxy_peers(quick: bool) -> dict[str, Any]:
    """One upstream (a pool serving a stub over Chat Completions) reached directly,
    through the pool's ``openai_remote`` backend and through LiteLLM's proxy."""
    tokens = 20
    key = "sk-bench-" + secrets.token_hex(16)
    concurrencies = [1, 8] if quick else [1, 8, 32]
    rounds = 1 if quick else 3
    per_client = 20 if quick else 150
    upstream_model = {
        "backend": "stub",
        "enabled": True,
        "stub_reply": stub_text(tokens),
        "target_inflight": 256,
    }
    sides = ("direct", "pool", "litellm")
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with pool_server({"stub": upstream_model}) as upstream:
        remote = {
            "backend": "openai_remote",
            "enabled": True,
            "remote_base_url": f"{upstream.url}/v1",
            "remote_model": "stub",
            "remote_timeout_s": 60,
            "target_inflight": 256,
        }
        # Both proxies check a bearer token, as a deployment in front of users would.
        auth = {"auth": {"inference_tokens": [key]}}
        with (
            pool_server({"stub": remote}, service=auth) as pool,
            litellm_server("stub", f"{upstream.url}/v1", key) as litellm,
        ):
            servers = {"direct": upstream, "pool": pool, "litellm": litellm}
            litellm_version = litellm.version
            headers = {"Authorization": f"Bearer {key}"}

            def body_for(stream: bool) -> Callable[[int], tuple[dict[str, Any], dict[str, str]]]:
                body = {
                    "model": "stub",
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": tokens,
                    "stream": stream,
                    "allow_remote": True,  # the pool's opt-in for remote models
                }
                return lambda index: (body, headers)

            def phase(server: Server, concurrency: int, count: int, stream: bool) -> Any:
                return closed_loop(
                    server,
                    concurrency,
                    count,
                    body_for(stream),
                    path="/v1/chat/completions",
                    delta_mark=CHAT_DELTA_MARK,
                )

            for server in servers.values():  # warm-up
                await phase(server, 4, 40, False)
                await phase(server, 4, 40, True)
            for round_index in range(rounds):
                for mode in ("json", "sse"):
                    for concurrency in concurrencies:
                        count = per_client * max(1, concurrency // 4)
                        key_name = f"{mode} c={concurrency}"
                        for name in sides:  # interleaved: A B C A B C
                            progress(
                                f"proxy-peers round {round_index + 1}/{rounds} {key_name} {name}"
                            )
                            summary = await measure(
                                servers[name],
                                lambda s=servers[name], c=concurrency, n=count, m=mode: phase(
                                    s, c, n, m == "sse"
                                ),
                            )
                            results.setdefault(key_name, {}).setdefault(name, []).append(summary)
    rows = []
    for cell, by_side in results.items():
        row: dict[str, Any] = {"cell": cell}
        direct_runs = by_side["direct"]
        row["direct_p50_ms"] = _median([r["latency_ms"]["p50"] for r in direct_runs])
        for name in ("pool", "litellm"):
            runs = by_side[name]
            for q in ("p50", "p99"):
                row[f"{name}_added_{q}_ms"] = _median(
                    [
                        r["latency_ms"][q] - d["latency_ms"][q]
                        for r, d in zip(runs, direct_runs, strict=True)
                        if r["latency_ms"][q] is not None and d["latency_ms"][q] is not None
                    ]
                )
        for name in sides:
            row[f"{name}_rps"] = _median([r["requests_per_s"] for r in by_side[name]])
        for name in ("pool", "litellm"):
            row[f"{name}_cpu_ms_per_request"] = _median(
                [r["server_cpu_ms_per_request"] for r in by_side[name]]
            )
            row[f"{name}_errors"] = sum(r["errors"] for r in by_side[name])
        rows.append(row)
    return {
        "rows": rows,
        "raw": results,
        "cdf": _cdf_series(results),
        "versions": {"litellm": litellm_version},
    }


def _median(values: list[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    middle = len(present) // 2
    return present[middle] if len(present) % 2 else (present[middle - 1] + present[middle]) / 2


def _cdf_series(
    results: dict[str, dict[str, list[dict[str, Any]]]],
) -> dict[str, dict[str, list[float]]]:
    series: dict[str, dict[str, list[float]]] = {}
    for key, sides in results.items():
        for name, runs in sides.items():
            series.setdefault(key, {})[name] = sorted(
                v for run in runs for v in run["latencies_ms"]
            )
    return series


async def prefix_cache(quick: bool) -> dict[str, Any]:
    """Multi-turn conversations with a long system prompt: TTFT with the prefix cache
    on and off, through the pool and with llama-server's own ``cache_prompt``."""
    return await run_prefix_cache(quick, _llama_server_binary())


SCENARIOS = {
    "overhead-stub": overhead_stub,
    "replicas": replicas,
    "fairness": fairness,
    "llama-cpp": llama_cpp,
    "llama-server": llama_server,
    "proxy-peers": proxy_peers,
    "vram-swap": vram_swap,
    "preemption": preemption,
    "soak": soak,
    "relay-capacity": relay_capacity,
    "pass-through": pass_through,
    "cluster-relay": cluster_relay,
    "prefix-cache": prefix_cache,
    "usage-cost": usage_cost,
    "warm-conversations": warm_conversations,
    "tracing": tracing_cost,
}
