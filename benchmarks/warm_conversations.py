"""``warm-conversations``: multi-turn conversations of several tenants, replayed (#30).

Two parts, each comparing two pools that run side by side and take turns: turn by turn
(the side that goes first alternates), every conversation's next turn on one side, then
on the other, so both meet the same machine:

1. **Affinity.** SmolLM2 in-process (``llama_cpp``, one thread each) with four replicas;
   ``engine.prefix_affinity`` on against off (least loaded). Eight tenants, one
   conversation each, four clients at a time (each client takes two conversations in
   turn, so a replica's next request is often another conversation's); every turn
   resends the whole history: the tenant's system prompt, the questions and the
   model's real answers.
2. **Persistence.** Three SmolLM2 models, one resident at a time
   (``engine.max_loaded_models: 1``; a virtual GPU budget cannot force it here: a CPU
   llama.cpp model is measured at 0 MiB on a virtual GPU), one conversation each, taken
   in turn, so every turn swaps; the prompt states saved to disk at an unload
   (``prefix_cache_disk_mib: 256``) against none (0).

Per side: TTFT of streamed Chat Completions (p50, p99, later turns apart) and the prompt
tokens the model evaluated (prompt less cached, from ``usage``).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import httpx
import trio

from benchmarks.harness import Server, percentile, pool_server, progress, wait_healthy
from benchmarks.llama_cpp_direct import GGUF

MAX_TOKENS = 12
REPLICAS = 4
SMOL: dict[str, Any] = {
    "backend": "llama_cpp",
    "model_path": GGUF,
    "prompt_format": "qwen3_template",
    "gguf_n_ctx": 2048,
    "gguf_n_gpu_layers": 0,
    "gguf_n_threads": 1,
}


def _system(tenant: str) -> str:
    """A system prompt of about 150 tokens of the tenant's own."""
    facts = " ".join(f"Item {i} of {tenant} costs {3 * i + 7} coins." for i in range(10))
    return f"You are the shop assistant of {tenant}. Answer in one short sentence. {facts}"


def _question(conversation: int, turn: int) -> str:
    item = (turn * 3 + conversation) % 10
    return f"Question {turn + 1}: what does item {item} cost?"


async def _ask(
    client: httpx.AsyncClient, model: str, messages: list[dict[str, str]], tenant: str
) -> dict[str, Any]:
    """One streamed turn: its TTFT, answer and prompt/cached tokens."""
    body = {
        "model": model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first: float | None = None
    text, usage = "", dict[str, Any]()
    async with client.stream(
        "POST", "/v1/chat/completions", json=body, headers={"X-Tenant-ID": tenant}
    ) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices") or ():
                delta = choice.get("delta", {}).get("content")
                if delta:
                    first = first or time.perf_counter()
                    text += delta
            usage = chunk.get("usage") or usage
    cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    prompt = int(usage.get("prompt_tokens") or 0)
    return {
        "ttft_ms": None if first is None else (first - started) * 1000,
        "answer": text,
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "evaluated_tokens": prompt - cached,
    }


class Conversation:
    """One tenant's conversation with one model: its history, turn by turn."""

    def __init__(self, model: str, tenant: str, number: int) -> None:
        self.model = model
        self.tenant = tenant
        self.number = number
        self.messages = [{"role": "system", "content": _system(tenant)}]

    async def turn(self, client: httpx.AsyncClient, turn: int) -> dict[str, Any]:
        self.messages.append({"role": "user", "content": _question(self.number, turn)})
        result = await _ask(client, self.model, self.messages, self.tenant)
        self.messages.append({"role": "assistant", "content": result.get("answer") or ""})
        return {"turn": turn, **result}


async def _turn_of_all(
    server: Server, conversations: list[Conversation], clients: int, turn: int
) -> list[dict[str, Any]]:
    """Turn ``turn`` of every conversation, ``clients`` at a time; each client takes its
    conversations in order, so a replica's next request is often another conversation."""
    results: list[dict[str, Any]] = []

    async def client_runs(mine: list[Conversation]) -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=900) as client:
            for conversation in mine:
                results.append(await conversation.turn(client, turn))

    async with trio.open_nursery() as nursery:
        for c in range(clients):
            nursery.start_soon(client_runs, conversations[c::clients])
    return results


@contextmanager
def _pools(sides: dict[str, dict[str, Any]]) -> Iterator[dict[str, Server]]:
    """One pool per side (``models`` and engine settings), each with a state directory
    of its own, all healthy."""
    with ExitStack() as stack:
        servers = {}
        for side, config in sides.items():
            folder = stack.enter_context(tempfile.TemporaryDirectory())
            server = stack.enter_context(
                pool_server(
                    config["models"], environ={"LLM_POOL_STATE_DIR": folder}, **config["engine"]
                )
            )
            wait_healthy(server, "/health", 300.0)
            servers[side] = server
        yield servers


def _row(part: str, side: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in results if "error" not in r and r["ttft_ms"] is not None]
    ttfts = [r["ttft_ms"] for r in ok]
    later = [r["ttft_ms"] for r in ok if r["turn"] > 0]
    return {
        "part": part,
        "side": side,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p99_ms": percentile(ttfts, 0.99),
        "later_turns_ttft_p50_ms": percentile(later, 0.5),
        "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
        "evaluated_tokens": sum(r["evaluated_tokens"] for r in ok),
        "evaluated_share": (
            sum(r["evaluated_tokens"] for r in ok) / max(1, sum(r["prompt_tokens"] for r in ok))
        ),
    }


async def _interleaved(
    part: str,
    sides: dict[str, dict[str, Any]],
    conversations: dict[str, list[Conversation]],
    clients: int,
    turns: int,
    raw: dict[str, list[dict[str, Any]]],
) -> None:
    """Every side's pool up at once; turn by turn, each side in its turn (the side that
    goes first alternates), so both meet the same machine."""
    with _pools(sides) as servers:
        names = list(servers)
        for turn in range(turns):
            for side in names if turn % 2 == 0 else reversed(names):
                progress(f"warm-conversations: {part}: turn {turn + 1}: {side}")
                raw.setdefault(side, []).extend(
                    await _turn_of_all(servers[side], conversations[side], clients, turn)
                )


async def warm_conversations(quick: bool) -> dict[str, Any]:
    tenants, turns = (4, 2) if quick else (8, 3)
    raw: dict[str, list[dict[str, Any]]] = {}

    affinity_sides = {
        f"prefix_affinity {'on' if on else 'off'}": {
            "models": {
                "smol": {**SMOL, "enabled": True, "replicas": REPLICAS, "replica_max": REPLICAS}
            },
            "engine": {"prefix_affinity": on},
        }
        for on in (True, False)
    }
    chats = {
        side: [Conversation("smol", f"{side[-3:].strip()}-tenant{t}", t) for t in range(tenants)]
        for side in affinity_sides
    }
    await _interleaved("4 replicas", affinity_sides, chats, REPLICAS, turns, raw)

    # Three models, one resident at a time: each turn of each conversation swaps.
    swap_model = {**SMOL, "on_demand": True, "keep_alive": -1}
    swap_sides = {
        f"disk states {'on' if mib else 'off'}": {
            "models": {f"smol{m}": {**swap_model, "prefix_cache_disk_mib": mib} for m in range(3)},
            "engine": {"max_loaded_models": 1},
        }
        for mib in (256, 0)
    }
    chats = {
        side: [Conversation(f"smol{m}", f"{side[-3:].strip()}-tenant{m}", m) for m in range(3)]
        for side in swap_sides
    }
    await _interleaved("3 models swapping", swap_sides, chats, 1, turns, raw)

    rows = [_row("4 replicas", side, raw[side]) for side in affinity_sides]
    rows += [_row("3 models swapping", side, raw[side]) for side in swap_sides]
    for results in raw.values():
        for result in results:
            result.pop("answer", None)
    return {
        "rows": rows,
        "raw": raw,
        "cdf": {
            "4 replicas: TTFT (ms)": {
                side: sorted(r["ttft_ms"] for r in raw[side] if r.get("ttft_ms") is not None)
                for side in affinity_sides
            },
            "3 models swapping: TTFT (ms)": {
                side: sorted(r["ttft_ms"] for r in raw[side] if r.get("ttft_ms") is not None)
                for side in swap_sides
            },
        },
        "workload": {
            "tenants": tenants,
            "turns": turns,
            "clients": REPLICAS,
            "max_tokens": MAX_TOKENS,
            "system_prompt_chars": len(_system("on-tenant0")),
            "cpu_count": os.cpu_count(),
        },
    }
