"""A paused stream over HTTP: the connection stays open with the dialect's keep-alive and
the text goes on where it stopped (docs/vram.md, "Pause and resume"; #46)."""

from __future__ import annotations

import json

import httpx
import trio

from .conftest import start_server

WORDS = [f"w{i}" for i in range(30)]
MODELS = {
    "low": {
        "backend": "stub",
        "on_demand": True,
        "stub_vram_mib": 700,
        "vram_mb": 700,
        "stub_reply": " ".join(WORDS),
        "stub_tokens_per_second": 20,
    },
    "high": {
        "backend": "stub",
        "on_demand": True,
        "stub_vram_mib": 700,
        "vram_mb": 700,
        "stub_reply": "the answer",
        "stub_load_seconds": 0.3,
    },
}
ENGINE = {
    "gpu_budget_mib": [1000],
    "virtual_gpus": True,
    "gpu_reserve_mib": 0,
    "min_resident_s": 0,
}


async def test_an_openai_stream_paused_for_a_swap_keeps_its_connection_and_its_text(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, MODELS, engine=ENGINE)
    body = {"model": "low", "messages": [{"role": "user", "content": "go"}], "stream": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        raw: list[str] = []
        high_done = trio.Event()

        async def high() -> None:
            reply = await http.post(
                "/v1/chat/completions",
                json={"model": "high", "messages": [{"role": "user", "content": "now"}]},
                headers={"X-Priority": "high"},
            )
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["message"]["content"] == "the answer"
            high_done.set()

        async with http.stream(
            "POST", "/v1/chat/completions", json=body, headers={"X-Priority": "low"}
        ) as stream:
            assert stream.status_code == 200
            async for line in stream.aiter_lines():
                raw.append(line)
                if sum(1 for r in raw if '"content": "' in r or '"content":"' in r) == 5:
                    nursery.start_soon(high)
        assert high_done.is_set()
    assert ": keep-alive" in raw  # the pause showed itself as SSE comments
    chunks = [json.loads(r[6:]) for r in raw if r.startswith("data: {")]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == " ".join(WORDS)
    assert raw[-1] == "data: [DONE]" or "data: [DONE]" in raw
    actions = [d.action for d in server.pool.decisions("low")]
    assert "pause" in actions and "resume" in actions


async def test_an_ollama_stream_stalls_through_a_pause_and_goes_on(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, MODELS, engine=ENGINE)
    body = {"model": "low", "messages": [{"role": "user", "content": "go"}], "stream": True}
    async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
        lines: list[dict[str, object]] = []

        async def high() -> None:
            reply = await http.post(
                "/api/chat",
                json={"model": "high", "messages": [{"role": "user", "content": "now"}]},
                headers={"X-Priority": "high"},
            )
            assert reply.status_code == 200, reply.text

        async with http.stream(
            "POST", "/api/chat", json=body, headers={"X-Priority": "low"}
        ) as stream:
            async for line in stream.aiter_lines():
                assert line.strip(), "NDJSON has no blank keep-alive lines"
                lines.append(json.loads(line))
                if len(lines) == 5:
                    nursery.start_soon(high)
    text = "".join(str(line["message"]["content"]) for line in lines)  # type: ignore[index]
    assert text == " ".join(WORDS) and lines[-1]["done"] is True
    assert "pause" in [d.action for d in server.pool.decisions("low")]
