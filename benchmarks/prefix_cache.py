"""``prefix-cache``: multi-turn conversations that resend a long system prompt.

Each conversation (its own ``X-Cache-Tag``) sends the same ~1,000-token system prompt
and its history on every turn; the conversations take turns (A1 B1 C1 A2 B2 ...), so
a runtime that keeps only the last prompt would lose each conversation's state before
its next turn. TTFT of streamed Chat Completions, per side:

- ``pool llama_cpp``: the in-process backend, cache on (saved states by scope);
- ``pool llama_server``: the managed server, cache on (slot per scope);
- ``llama-server direct``: the same llama-server binary and settings used directly
  with its own ``cache_prompt`` (its default slot choice by prompt similarity and its
  RAM prompt cache);
- and the pool's two backends with ``X-Cache-Mode: none``: the cost without reuse.

Every server computes on one thread (``-t 1``, ``gguf_n_threads: 1``), so the sides
compare like for like on a shared machine.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from benchmarks._http import CHAT_DELTA_MARK
from benchmarks.harness import (
    Server,
    closed_loop,
    free_port,
    percentile,
    pool_server,
    progress,
    stop_process,
    wait_healthy,
)
from benchmarks.llama_cpp_direct import GGUF
from pool.config import resolve_model_path

SYSTEM = "You are a helpful assistant. " + " ".join(
    f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(85)
)
SLOTS = 3
SLOT_CONTEXT = 2048


def _conversation_body(conversation: int, turn: int) -> dict[str, Any]:
    """Turn ``turn`` (0-based) of conversation ``conversation``: its whole history."""
    messages: list[dict[str, str]] = [{"role": "system", "content": SYSTEM}]
    for t in range(turn + 1):
        number = 10 * conversation + t
        messages.append({"role": "user", "content": f"Is {number} even or odd?"})
        if t < turn:
            # A fixed reply keeps the histories the same for every side.
            messages.append(
                {
                    "role": "assistant",
                    "content": f"{number} is {'even' if number % 2 == 0 else 'odd'}.",
                }
            )
    return {
        "model": "smol",
        "messages": messages,
        "max_tokens": 16,
        "temperature": 0,
        "stream": True,
    }


@contextmanager
def _direct_llama_server(binary: str) -> Iterator[Server]:
    port = free_port()
    command = [
        binary,
        "-m",
        str(resolve_model_path(GGUF)),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--parallel",
        str(SLOTS),
        "-c",
        str(SLOTS * SLOT_CONTEXT),
        "-t",
        "1",
        "--chat-template",
        "chatml",
        "--no-webui",
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        server = Server("direct", f"http://127.0.0.1:{port}", process)
        wait_healthy(server, "/health", 120.0)
        yield server
    finally:
        stop_process(process)


async def prefix_cache(quick: bool, llama_server_binary: str) -> dict[str, Any]:
    conversations, turns = (2, 2) if quick else (SLOTS, 4)
    order = [(c, t) for t in range(turns) for c in range(conversations)]
    models: dict[str, dict[str, Any]] = {
        "llama_cpp": {
            "backend": "llama_cpp",
            "enabled": True,
            "model_path": GGUF,
            "prompt_format": "qwen3_template",
            "gguf_n_ctx": SLOT_CONTEXT * 2,
            "gguf_n_gpu_layers": 0,
            "gguf_n_threads": 1,
        },
        "llama_server": {
            "backend": "llama_server",
            "enabled": True,
            "llama_server_binary": llama_server_binary,
            "model_path": GGUF,
            "prompt_format": "qwen3_template",
            "llama_server_parallel": SLOTS,
            "target_inflight": SLOTS,
            "llama_server_n_ctx": SLOTS * SLOT_CONTEXT,
            "llama_server_extra_args": ["-t", "1"],
        },
    }

    async def run(server: Server, *, cache: bool, via_pool: bool) -> dict[str, Any]:
        def body_for(index: int) -> tuple[dict[str, Any], dict[str, str]]:
            conversation, turn = order[index]
            headers = {"X-Cache-Tag": f"conversation-{conversation}"} if via_pool else {}
            if via_pool and not cache:
                headers["X-Cache-Mode"] = "none"
            return _conversation_body(conversation, turn), headers

        results = await closed_loop(
            server,
            1,
            len(order),
            body_for,
            max_s=900.0,
            path="/v1/chat/completions",
            delta_mark=CHAT_DELTA_MARK,
        )
        # One client: the results are in the order sent.
        ttfts = [(order[i], r.ttft_ms) for i, r in enumerate(results) if r.error is None]
        return {
            "requests": len(results),
            "errors": sum(1 for r in results if r.error is not None or r.status != 200),
            "ttft_ms": [t for _, t in ttfts if t is not None],
            "first_turns_ttft_ms": [t for (_, turn), t in ttfts if turn == 0 and t is not None],
            "later_turns_ttft_ms": [t for (_, turn), t in ttfts if turn > 0 and t is not None],
        }

    raw: dict[str, dict[str, Any]] = {}
    for backend in ("llama_cpp", "llama_server"):
        with pool_server({"smol": models[backend]}) as pool:
            wait_healthy(pool, "/health", 300.0)
            # Off first: the cache-on run then starts from a context nobody may reuse.
            for cache in (False, True):
                side = f"pool {backend} cache {'on' if cache else 'off'}"
                progress(f"prefix-cache: {side}")
                raw[side] = await run(pool, cache=cache, via_pool=True)
    with _direct_llama_server(llama_server_binary) as direct:
        side = "llama-server direct cache_prompt"
        progress(f"prefix-cache: {side}")
        raw[side] = await run(direct, cache=True, via_pool=False)

    rows = []
    cdf: dict[str, list[float]] = {}
    for side, summary in raw.items():
        ttfts = sorted(summary["ttft_ms"])
        cdf[side] = ttfts
        rows.append(
            {
                "side": side,
                "requests": summary["requests"],
                "errors": summary["errors"],
                "ttft_p50_ms": percentile(ttfts, 0.5),
                "ttft_p99_ms": percentile(ttfts, 0.99),
                "first_turn_ttft_p50_ms": percentile(summary["first_turns_ttft_ms"], 0.5),
                "later_turns_ttft_p50_ms": percentile(summary["later_turns_ttft_ms"], 0.5),
            }
        )
    return {
        "rows": rows,
        "raw": raw,
        "cdf": {"time to first token (ms)": cdf},
        "conversations": conversations,
        "turns": turns,
        "system_prompt_chars": len(SYSTEM),
    }
