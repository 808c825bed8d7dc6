"""``pass-through``: the relay's two paths beside the upstream itself (issue #44).

One upstream is read, interleaved in every round (A B C D A B C D). Two kinds
(``--upstream``):

- ``zero`` (the default): ``benchmarks/zero_upstream.py``, a bare asyncio protocol that
  writes prepared bytes, about 0.02 ms of CPU a request: what a proxy costs, with next to
  nothing beside it;
- ``stub-pool``: a pool serving the ``stub`` backend, the upstream of issue #44's own
  table (and of ``proxy-peers``): an OpenAI-compatible Python server with no model work,
  whose requests/s a proxy's are a share of. Results go to ``pass-through/stub-pool-upstream``.

The sides:

- ``direct``: the upstream itself;
- ``bare``: ``benchmarks/bare_app.py``, Hypercorn and an ASGI app that answers the stub's
  bytes at once, on the proxies' cores: the floor of any pool served by Hypercorn, which
  reads, parses and answers each request as the pool does but calls no upstream (the
  relay-capacity load leaves it out: it writes one event a send);
- ``pass_through``: a pool's ``openai_remote`` model on ``/v1/chat/completions``, the
  upstream's own dialect, so the upstream's bytes go through
  (pool/backends/_pass_through.py);
- ``translated``: the same pool on ``/v1/responses`` (SSE), a dialect that needs every
  token rendered again;
- ``translated_chat``: a second pool with ``service.pass_through: false`` on
  ``/v1/chat/completions``: the same dialect on the translated path;
- ``litellm``: LiteLLM's proxy in front of the same upstream (its own environment,
  ``scripts/build-litellm-env``; ``--no-litellm`` leaves it out).

Phases: one-token JSON answers and 16-token streams at 1 and 16 clients (latency p50/p99,
TTFT, requests/s), then the relay-capacity load (256-token streams at 64 clients) for
the pool's CPU per relayed token on each path.

Cores: the proxies under test run on their own CPUs and the client and the upstream on
others (``taskset``; ``--pin PROXY:UPSTREAM:CLIENT``, CPU lists as taskset takes them).
With two cores the default gives the proxies core 0 and both the client and the upstream
core 1; with three or more, one each. The run records the pinning it used.
"""

from __future__ import annotations

import os
import secrets
import shutil
import time
from contextlib import AbstractContextManager, ExitStack
from typing import Any

from benchmarks._http import CHAT_DELTA_MARK, DELTA_MARK
from benchmarks.harness import (
    Server,
    bare_server,
    closed_loop,
    litellm_server,
    pool_server,
    progress,
    summarize,
    zero_upstream,
)
from benchmarks.stub_bodies import stub_text

CAPACITY_TOKENS = 256
SHORT_TOKENS = 16
UPSTREAMS = ("zero", "stub-pool")

# side: (server, path, delta mark)
_SIDES = {
    "direct": ("direct", "/v1/chat/completions", CHAT_DELTA_MARK),
    "bare": ("bare", "/v1/responses", DELTA_MARK),
    "pass_through": ("pool", "/v1/chat/completions", CHAT_DELTA_MARK),
    "translated": ("pool", "/v1/responses", DELTA_MARK),
    "translated_chat": ("pool_translated", "/v1/chat/completions", CHAT_DELTA_MARK),
    "litellm": ("litellm", "/v1/chat/completions", CHAT_DELTA_MARK),
}


def default_pinning() -> tuple[str, str, str]:
    """(proxies, upstream, client) CPU lists for this machine (the module's doc)."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 3:
        return str(cpus[0]), str(cpus[1]), str(cpus[2])
    if len(cpus) == 2:
        return str(cpus[0]), str(cpus[1]), str(cpus[1])
    return "", "", ""


def _cpu_set(cpus: str) -> set[int]:
    out: set[int] = set()
    for part in cpus.split(","):
        low, _, high = part.partition("-")
        out.update(range(int(low), int(high or low) + 1))
    return out


def _body(path: str, model: str, tokens: int, stream: bool) -> dict[str, Any]:
    if path == "/v1/responses":
        return {
            "model": model,
            "input": "x",
            "stream": stream,
            "decoding": {"max_tokens": tokens},
            "allow_remote": True,
        }
    return {
        "model": model,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": tokens,
        "stream": stream,
        "allow_remote": True,
    }


async def _phase(
    servers: dict[str, Server],
    side: str,
    concurrency: int,
    seconds: float,
    tokens: int,
    stream: bool,
    headers: dict[str, str],
) -> dict[str, Any]:
    name, path, mark = _SIDES[side]
    server = servers[name]
    model = "zero" if name == "direct" else "relay"
    body = _body(path, model, tokens, stream)
    cpu_before = server.cpu_seconds()
    started = time.perf_counter()
    results = await closed_loop(
        server,
        concurrency,
        10_000_000,
        lambda index: (body, headers),
        max_s=seconds + 60,
        path=path,
        delta_mark=mark,
        stop_after_s=seconds,
    )
    wall = time.perf_counter() - started
    summary = summarize(results, wall, server.cpu_seconds() - cpu_before)
    streamed = sum(r.tokens for r in results if r.error is None and r.status == 200)
    summary["tokens"] = streamed
    summary["proxy_cpu_ms_per_token"] = (
        summary["server_cpu_s"] * 1000 / streamed if streamed and name != "direct" else None
    )
    return summary


async def warm_up(servers: dict[str, Server], side: str, headers: dict[str, str]) -> None:
    """Half a second of each load on ``side``; a side that fails there would fail every
    phase, so the run stops with its errors rather than give a table of zeros."""
    for tokens, stream in ((SHORT_TOKENS, True), (1, False)):
        warm = await _phase(servers, side, 4, 0.5, tokens, stream, headers)
        if warm["errors"]:
            raise RuntimeError(f"pass-through: {side} failed its warm-up: {warm}")


def open_upstream(kind: str, cpus: str | None) -> AbstractContextManager[Server]:
    """The upstream every side reads, serving its model as ``zero``."""
    if kind == "zero":
        return zero_upstream(cpus=cpus)
    stub = {
        "backend": "stub",
        "enabled": True,
        "stub_reply": stub_text(CAPACITY_TOKENS),  # max_tokens cuts it per request
        "target_inflight": 256,
    }
    return pool_server({"zero": stub}, name="stub-pool", cpus=cpus)


async def pass_through(
    quick: bool,
    *,
    litellm: bool = True,
    pin: tuple[str, str, str] | None = None,
    upstream_kind: str = "zero",
) -> dict[str, Any]:
    proxies_cpus, upstream_cpus, client_cpus = pin or default_pinning()
    if not shutil.which("taskset"):
        proxies_cpus = upstream_cpus = client_cpus = ""
    rounds = 1 if quick else 5
    seconds = 1.0 if quick else 4.0
    capacity_clients = 16 if quick else 64
    key = "sk-bench-" + secrets.token_hex(16)
    headers = {"Authorization": f"Bearer {key}"}
    auth = {"auth": {"inference_tokens": [key]}}
    sides = [s for s in _SIDES if litellm or s != "litellm"]
    raw: dict[str, dict[str, list[dict[str, Any]]]] = {}
    client_before = os.sched_getaffinity(0)
    versions: dict[str, str | None] = {}
    with ExitStack() as stack:
        upstream = stack.enter_context(open_upstream(upstream_kind, upstream_cpus or None))
        relay = {
            "backend": "openai_remote",
            "enabled": True,
            "remote_base_url": f"{upstream.url}/v1",
            "remote_model": "zero",
            "remote_timeout_s": 120,
            "target_inflight": 256,
        }
        servers = {"direct": upstream}
        servers["bare"] = stack.enter_context(bare_server(cpus=proxies_cpus or None))
        servers["pool"] = stack.enter_context(
            pool_server({"relay": relay}, service=auth, cpus=proxies_cpus or None)
        )
        servers["pool_translated"] = stack.enter_context(
            pool_server(
                {"relay": relay},
                service={**auth, "pass_through": False},
                name="pool-translated",
                cpus=proxies_cpus or None,
            )
        )
        if litellm:
            server = stack.enter_context(
                litellm_server(
                    "relay",
                    f"{upstream.url}/v1",
                    key,
                    cpus=proxies_cpus or None,
                    upstream_model="zero",
                )
            )
            servers["litellm"] = server
            versions["litellm"] = server.version
        if client_cpus:
            os.sched_setaffinity(0, _cpu_set(client_cpus))
        try:
            for side in sides:
                await warm_up(servers, side, headers)
            cells: list[tuple[str, int, int, bool]] = [
                (f"{mode} c={c}", c, tokens, mode == "sse")
                for mode, tokens in (("json", 1), ("sse", SHORT_TOKENS))
                for c in (1, 16)
            ]
            cells.append(
                (f"capacity c={capacity_clients}", capacity_clients, CAPACITY_TOKENS, True)
            )
            for round_index in range(rounds):
                for cell, concurrency, tokens, stream in cells:
                    # LiteLLM takes minutes for the capacity load, and the bare app has no
                    # relay to measure there: both are left out of it.
                    for side in sides:  # interleaved: A B C D A B C D
                        if side in ("litellm", "bare") and cell.startswith("capacity"):
                            continue
                        progress(f"pass-through round {round_index + 1}/{rounds} {cell} {side}")
                        summary = await _phase(
                            servers, side, concurrency, seconds, tokens, stream, headers
                        )
                        raw.setdefault(cell, {}).setdefault(side, []).append(summary)
        finally:
            os.sched_setaffinity(0, client_before)
    return {
        "rows": _rows(raw),
        "capacity": _capacity_rows(raw),
        "upstream": upstream_kind,
        "pinning": [
            {
                "proxies": proxies_cpus or "unpinned",
                "upstream": upstream_cpus or "unpinned",
                "client": client_cpus or "unpinned",
            }
        ],
        "versions": versions,
        "raw": raw,
    }


def _median(values: list[float | None]) -> float | None:
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    middle = len(present) // 2
    return present[middle] if len(present) % 2 else (present[middle - 1] + present[middle]) / 2


def _quantile(runs: list[dict[str, Any]], metric: str, q: str) -> float | None:
    return _median([run[metric][q] for run in runs])


def _rows(raw: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """Per cell and side: latency p50/p99, TTFT p50 (streams), requests/s, and each
    proxy's requests/s as a share of direct's."""
    rows = []
    for cell, by_side in raw.items():
        if cell.startswith("capacity"):
            continue
        direct_rps = _median([r["requests_per_s"] for r in by_side["direct"]])
        for side, runs in by_side.items():
            rps = _median([r["requests_per_s"] for r in runs])
            rows.append(
                {
                    "cell": cell,
                    "side": side,
                    "p50_ms": _quantile(runs, "latency_ms", "p50"),
                    "p99_ms": _quantile(runs, "latency_ms", "p99"),
                    "ttft_p50_ms": _quantile(runs, "ttft_ms", "p50")
                    if cell.startswith("sse")
                    else None,
                    "rps": rps,
                    "of_direct": rps / direct_rps if rps and direct_rps else None,
                    "cpu_ms_per_request": _median([r["server_cpu_ms_per_request"] for r in runs]),
                    "errors": sum(r["errors"] for r in runs),
                }
            )
    return rows


def _capacity_rows(raw: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    """The relay-capacity load: tokens/s and the proxy's CPU per token, per path."""
    rows = []
    for cell, by_side in raw.items():
        if not cell.startswith("capacity"):
            continue
        for side, runs in by_side.items():
            rows.append(
                {
                    "cell": cell,
                    "side": side,
                    "tokens_per_s": _median([r["tokens_per_s"] for r in runs]),
                    "proxy_cpu_ms_per_token": _median([r["proxy_cpu_ms_per_token"] for r in runs]),
                    "ttft_p50_ms": _quantile(runs, "ttft_ms", "p50"),
                    "ttft_p99_ms": _quantile(runs, "ttft_ms", "p99"),
                    "errors": sum(r["errors"] for r in runs),
                }
            )
    return rows
