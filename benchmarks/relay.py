"""``relay-capacity``: how many streamed tokens one pool process relays, and at what cost.

A zero-work upstream (``benchmarks/zero_upstream.py``) streams Chat Completions as fast as
it can; the same client reads it directly and through a pool whose ``openai_remote``
model points at it, on ``/v1/chat/completions`` and on ``/v1/responses`` (SSE), at 1, 16
and 64 concurrent streams, interleaved in each round. Then the in-process case: the
``stub`` backend at 64 streams. The pool's CPU time comes from /proc, so its CPU per
token holds even when other work shares the machine (tokens/s does not).
"""

from __future__ import annotations

import time
from typing import Any

from benchmarks._http import CHAT_DELTA_MARK, DELTA_MARK
from benchmarks.harness import Server, closed_loop, pool_server, progress, summarize, zero_upstream
from benchmarks.stub_bodies import stub_text

TOKENS = 256

# side: (server, path, model, delta mark)
_SIDES = {
    "direct": ("upstream", "/v1/chat/completions", "zero", CHAT_DELTA_MARK),
    "pool_chat": ("pool", "/v1/chat/completions", "relay", CHAT_DELTA_MARK),
    "pool_responses": ("pool", "/v1/responses", "relay", DELTA_MARK),
}
# One-token JSON answers (no stream): what the relay adds to a plain request.
_JSON_SIDES = {
    "direct": ("upstream", "/v1/chat/completions", "zero", CHAT_DELTA_MARK),
    "pool": ("pool", "/v1/chat/completions", "relay", CHAT_DELTA_MARK),
}
_STUB_SIDES = {
    "stub_chat": ("pool", "/v1/chat/completions", "stub", CHAT_DELTA_MARK),
    "stub_responses": ("pool", "/v1/responses", "stub", DELTA_MARK),
}


def _body(path: str, model: str, stream: bool = True) -> dict[str, Any]:
    if not stream:
        return {
            "model": model,
            "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 1,
            "allow_remote": True,
        }
    if path == "/v1/responses":
        return {
            "model": model,
            "input": "x",
            "stream": True,
            "decoding": {"max_tokens": TOKENS},
            "allow_remote": True,
        }
    return {
        "model": model,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": TOKENS,
        "stream": True,
        "allow_remote": True,
    }


async def _phase(
    servers: dict[str, Server],
    side: tuple[str, str, str, bytes],
    concurrency: int,
    seconds: float,
    stream: bool = True,
) -> dict[str, Any]:
    name, path, model, mark = side
    server = servers[name]
    body = _body(path, model, stream)
    cpu = {key: s.cpu_seconds() for key, s in servers.items()}
    started = time.perf_counter()
    results = await closed_loop(
        server,
        concurrency,
        1_000_000,
        lambda index: (body, {}),
        max_s=seconds + 60,
        path=path,
        delta_mark=mark,
        stop_after_s=seconds,
    )
    wall = time.perf_counter() - started
    summary = summarize(results, wall, servers["pool"].cpu_seconds() - cpu["pool"])
    summary["upstream_cpu_s"] = servers["upstream"].cpu_seconds() - cpu["upstream"]
    tokens = sum(r.tokens for r in results if r.error is None and r.status == 200)
    summary["tokens"] = tokens
    summary["pool_cpu_ms_per_token"] = (
        summary["server_cpu_s"] * 1000 / tokens if tokens and name == "pool" else None
    )
    summary["upstream_cpu_ms_per_token"] = (
        summary["upstream_cpu_s"] * 1000 / tokens if tokens else None
    )
    return summary


async def relay_capacity(quick: bool) -> dict[str, Any]:
    concurrencies = [1, 16] if quick else [1, 16, 64]
    rounds = 1 if quick else 3
    seconds = 1.5 if quick else 4.0
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    with zero_upstream() as upstream:
        relay = {
            "backend": "openai_remote",
            "enabled": True,
            "remote_base_url": f"{upstream.url}/v1",
            "remote_model": "zero",
            "remote_timeout_s": 120,
            "target_inflight": 256,
        }
        stub = {
            "backend": "stub",
            "enabled": True,
            "stub_reply": stub_text(TOKENS),
            "target_inflight": 256,
        }
        with pool_server({"relay": relay, "stub": stub}) as pool:
            servers = {"upstream": upstream, "pool": pool}
            for side in (*_SIDES.values(), *_STUB_SIDES.values()):  # warm-up
                await _phase(servers, side, 4, 0.5)
            for round_index in range(rounds):
                for concurrency in concurrencies:
                    for key, side in _SIDES.items():  # interleaved: A B C A B C
                        progress(
                            f"relay-capacity round {round_index + 1}/{rounds} c={concurrency} {key}"
                        )
                        summary = await _phase(servers, side, concurrency, seconds)
                        raw.setdefault(f"c={concurrency}", {}).setdefault(key, []).append(summary)
                for key, side in _STUB_SIDES.items():
                    progress(f"relay-capacity round {round_index + 1}/{rounds} c=64 {key}")
                    summary = await _phase(servers, side, 64, seconds)
                    raw.setdefault("stub c=64", {}).setdefault(key, []).append(summary)
                for concurrency in (1, 16):
                    for key, side in _JSON_SIDES.items():
                        progress(
                            f"relay-capacity round {round_index + 1}/{rounds}"
                            f" json c={concurrency} {key}"
                        )
                        summary = await _phase(servers, side, concurrency, seconds, stream=False)
                        raw.setdefault(f"json c={concurrency}", {}).setdefault(key, []).append(
                            summary
                        )
    return {
        "rows": _rows(raw),
        "in_process": _stub_rows(raw["stub c=64"]),
        "json": _json_rows(raw),
        "raw": raw,
    }


def _median(values: list[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    middle = len(present) // 2
    return present[middle] if len(present) % 2 else (present[middle - 1] + present[middle]) / 2


def _rows(raw: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    rows = []
    for key, sides in raw.items():
        if not key.startswith("c="):
            continue
        direct = sides["direct"]
        row: dict[str, Any] = {"concurrency": int(key.removeprefix("c="))}
        for side in _SIDES:
            row[f"{side}_tokens_per_s"] = _median([s["tokens_per_s"] for s in sides[side]])
        for side in ("pool_chat", "pool_responses"):
            runs = sides[side]
            short = side.removeprefix("pool_")
            row[f"{short}_ratio"] = _median(
                [p["tokens_per_s"] / d["tokens_per_s"] for p, d in zip(runs, direct, strict=True)]
            )
            row[f"{short}_pool_cpu_ms_per_token"] = _median(
                [s["pool_cpu_ms_per_token"] for s in runs]
            )
            for metric, quantile in (("ttft_ms", "p50"), ("ttft_ms", "p99")):
                row[f"{short}_ttft_added_{quantile}_ms"] = _added(runs, direct, metric, quantile)
            for quantile in ("p50", "p99"):
                row[f"{short}_gap_added_{quantile}_ms"] = _added(
                    runs, direct, "inter_token_ms", quantile
                )
            row[f"{short}_errors"] = sum(s["errors"] for s in runs)
        row["direct_upstream_cpu_ms_per_token"] = _median(
            [s["upstream_cpu_ms_per_token"] for s in direct]
        )
        rows.append(row)
    return rows


def _added(
    runs: list[dict[str, Any]], direct: list[dict[str, Any]], metric: str, quantile: str
) -> float | None:
    return _median(
        [
            p[metric][quantile] - d[metric][quantile]
            for p, d in zip(runs, direct, strict=True)
            if p[metric][quantile] is not None and d[metric][quantile] is not None
        ]
    )


def _json_rows(raw: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    rows = []
    for key, sides in raw.items():
        if not key.startswith("json "):
            continue
        direct, pool = sides["direct"], sides["pool"]
        rows.append(
            {
                "cell": key,
                "direct_p50_ms": _median([s["latency_ms"]["p50"] for s in direct]),
                "pool_p50_ms": _median([s["latency_ms"]["p50"] for s in pool]),
                "added_p50_ms": _added(pool, direct, "latency_ms", "p50"),
                "added_p99_ms": _added(pool, direct, "latency_ms", "p99"),
                "direct_rps": _median([s["requests_per_s"] for s in direct]),
                "pool_rps": _median([s["requests_per_s"] for s in pool]),
                "pool_cpu_ms_per_request": _median([s["server_cpu_ms_per_request"] for s in pool]),
                "errors": sum(s["errors"] for s in (*direct, *pool)),
            }
        )
    return rows


def _stub_rows(sides: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    return [
        {
            "surface": side.removeprefix("stub_"),
            "streams": 64,
            "tokens_per_s": _median([s["tokens_per_s"] for s in runs]),
            "pool_cpu_ms_per_token": _median([s["pool_cpu_ms_per_token"] for s in runs]),
            "ttft_p50_ms": _median([s["ttft_ms"]["p50"] for s in runs]),
            "inter_token_p50_ms": _median([s["inter_token_ms"]["p50"] for s in runs]),
            "inter_token_p99_ms": _median([s["inter_token_ms"]["p99"] for s in runs]),
            "errors": sum(s["errors"] for s in runs),
        }
        for side, runs in sides.items()
    ]
