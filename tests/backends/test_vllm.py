"""The in-process ``vllm`` backend: its settings here, the real engine in vLLM's environment.

vLLM is not in the pool's environment, so the real checks live in ``vllm_in_env.py``
and run there: :func:`test_real_vllm_backend_in_its_env` builds that environment
(``scripts/build-vllm-env --with-pool``, cached) and runs pytest on that module with
PYTHONPATH at this checkout.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import trio

from pool.backends import get_backend
from pool.backends.vllm import VllmModel, sampling_arguments
from pool.backends.vllm_serve import VllmServeModel, command_line
from pool.config import build_settings
from pool.convert import cached_model
from pool.errors import PoolError

ROOT = Path(__file__).resolve().parents[2]


def _model(**fields: object) -> VllmModel:
    settings = build_settings({"engine": {"models": {"v": {"backend": "vllm", **fields}}}})
    model = settings.engine.models["v"]
    assert isinstance(model, VllmModel)
    return model


def test_inflight_is_the_engine_batch() -> None:
    backend = get_backend("vllm")
    assert backend.effective_target_inflight(_model(vllm_max_num_seqs=16)) == 16
    # An explicit target may ask for fewer than the engine holds, never more.
    assert backend.effective_target_inflight(_model(vllm_max_num_seqs=16, target_inflight=4)) == 4
    assert backend.effective_target_inflight(_model(vllm_max_num_seqs=2, target_inflight=8)) == 2
    assert backend.effective_target_inflight(_model(target_inflight=3)) == 3


def test_both_vllm_backends_share_one_mapping() -> None:
    """The same fields give ``vllm serve`` the flags of the in-process engine's arguments."""
    from pool.backends._vllm_fields import engine_arguments

    fields = {
        "vllm_model": "/m",
        "vllm_kv_cache_dtype": "fp8_e5m2",
        "vllm_max_model_len": 4096,
        "vllm_max_pixels": 200704,
        "vllm_speculative_method": "mtp",
        "vllm_speculative_attention_backend": "triton_attn",
        "vllm_enforce_eager": True,
    }
    arguments = engine_arguments(_model(**fields))
    settings = build_settings({"engine": {"models": {"s": {"backend": "vllm_serve", **fields}}}})
    served = settings.engine.models["s"]
    assert isinstance(served, VllmServeModel)
    args = command_line(served, "vllm", "/m", 1, "s")
    for name, value in arguments.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            assert flag in args
        elif value is not False:
            assert flag in args, flag
    assert arguments["speculative_config"] == {"method": "mtp", "attention_backend": "triton_attn"}
    assert arguments["mm_processor_kwargs"] == {"max_pixels": 200704}


def test_any_kv_cache_dtype_passes_the_table() -> None:
    """The table does not fix the cache types: the installed vLLM decides at load."""
    for name in ("vllm", "vllm_serve"):
        backend = get_backend(name)
        for dtype in ("bfloat16", "fp8_e5m2", "turboquant_k8v4", None):
            backend.check_load_override({"vllm_kv_cache_dtype": dtype})
        # Beyond the enum only by name: a number is no cache type.
        with pytest.raises(PoolError) as refused:
            backend.check_load_override({"vllm_kv_cache_dtype": 8})
        assert refused.value.details["field"] == "vllm_kv_cache_dtype"
    backend = get_backend("vllm")
    backend.check_load_override(
        {"vllm_speculative_moe_backend": "triton", "vllm_speculative_attention_backend": "x"}
    )


def test_sampling_reaches_vllm_names() -> None:
    from pool.backends import Decoding, GenerationRequest, TextPart, Turn
    from pool.backends.prompt_formats import RenderedPrompt

    decoding = Decoding(top_k=0, min_p=0.1, seed=3, logit_bias=((7, -5.0),), stop=("END",))
    request = GenerationRequest("r", "v", (Turn("user", (TextPart("hi"),)),), decoding)
    arguments = sampling_arguments(request, RenderedPrompt("p", ("<|im_end|>",)))
    assert arguments["stop"] == ["<|im_end|>", "END"] and arguments["top_k"] == 0
    assert arguments["min_p"] == 0.1 and arguments["seed"] == 3
    assert arguments["logit_bias"] == {7: -5.0} and "presence_penalty" not in arguments


async def test_without_vllm_a_load_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    from pool.backends import LoadContext
    from pool.errors import BackendError

    backend = get_backend("vllm")
    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    with pytest.raises(BackendError, match="vLLM is not installed"):
        await backend.load(_model(vllm_model=str(tmp_path)), LoadContext("v", 0))
    # Set before vLLM's import (which reads it), unless the environment had chosen.
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "1")
    with pytest.raises(BackendError):
        await backend.load(_model(vllm_model=str(tmp_path)), LoadContext("v", 0))
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "1"


@pytest.mark.real_model
@pytest.mark.timeout(1800)  # scripts/build-vllm-env first: minutes when not cached
async def test_real_vllm_backend_in_its_env() -> None:
    """vllm_in_env.py inside vLLM's environment: Paris, streaming, a batch of 8,
    cancel, unload, a refused override, images, and tools and JSON schemas through
    vLLM's own parsers and structured outputs."""
    built = await trio.run_process(
        ["bash", str(ROOT / "scripts" / "build-vllm-env"), "--with-pool"],
        capture_stdout=True,
        check=False,
    )
    assert built.returncode == 0, "scripts/build-vllm-env --with-pool failed"
    interpreter = built.stdout.decode().strip()
    checkout = cached_model("transformers")
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "LLM_POOL_VLLM_TEST_MODEL": str(checkout),
        # 1 GiB of KV cache on the CPU (vLLM's default takes a share of the RAM).
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
    }
    result = await trio.run_process(
        [
            interpreter,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-q",
            "-s",
            str(ROOT / "tests" / "backends" / "vllm_in_env.py"),
        ],
        cwd=ROOT,
        env=env,
        capture_stdout=True,
        stderr=subprocess.STDOUT,
        check=False,
    )
    output = result.stdout.decode(errors="replace")
    print(output[-6000:])
    assert result.returncode == 0, output[-6000:]


def test_engine_processes_do_not_import_the_pools_main_script() -> None:
    """vLLM's spawned engine core must not re-import ``__main__`` (the llm-pool script
    imports Quart, whose proxies break vLLM's CPU worker); other spawns still do."""
    import multiprocessing.spawn as spawn

    from pool.backends._vllm_engine import _keep_main_out_of_spawn, _starting_engine

    _keep_main_out_of_spawn()
    _keep_main_out_of_spawn()  # installed once
    plain = spawn.get_preparation_data("other")
    assert "init_main_from_name" in plain or "init_main_from_path" in plain
    _starting_engine.active = True
    try:
        engine = spawn.get_preparation_data("EngineCore")
    finally:
        _starting_engine.active = False
    assert "init_main_from_name" not in engine and "init_main_from_path" not in engine
    assert engine["sys_path"] == plain["sys_path"]


def _runtime() -> Any:
    """A runtime around an engine host that never started (no vLLM needed): what it
    hands the engine and how it flushes are the pool's own bookkeeping."""
    from pool.backends._vllm_engine import EngineHost
    from pool.backends.prompt_formats import get_prompt_format
    from pool.backends.vllm import VllmRuntime

    return VllmRuntime(
        EngineHost("vllm-test"),
        _model(vllm_model="/m", prompt_format="qwen3_template"),
        get_prompt_format("qwen3_template"),
        trio.CapacityLimiter(1),
        0.0,
    )


def _scoped(tenant: str = "a", tag: str | None = None, enabled: bool = True) -> Any:
    from pool.backends import CacheScope, Decoding, GenerationRequest, TextPart, Turn

    turns = (Turn("user", (TextPart("hi"),)),)
    return GenerationRequest("r", "v", turns, Decoding(), cache=CacheScope(tenant, tag, enabled))


async def test_each_prompt_carries_its_scopes_salt_and_a_flush_moves_it() -> None:
    from pool.backends import CacheFlushed

    runtime = _runtime()

    def salt(request: Any) -> str:
        job = runtime.engine_job(request, runtime.render(request))
        assert job.prompt["prompt"]
        value: str = job.prompt["cache_salt"]
        return value

    alice, bob, tagged = salt(_scoped("alice")), salt(_scoped("bob")), salt(_scoped("alice", "t"))
    assert len({alice, bob, tagged}) == 3 and salt(_scoped("alice")) == alice
    # X-Cache-Mode none: a salt no other request has, so nothing is reused.
    assert salt(_scoped("alice", enabled=False)) != salt(_scoped("alice", enabled=False))

    # A tenant flush moves that tenant's scopes (with and without a tag), no other.
    assert await runtime.flush_cache(scope="tenant", tenant="alice") == CacheFlushed(2)
    assert salt(_scoped("alice")) != alice and salt(_scoped("alice", "t")) != tagged
    assert salt(_scoped("bob")) == bob
    assert await runtime.flush_cache(scope="tag", tag="t") == CacheFlushed(1)
    # All: every scope moves; the engine's reset is tried (here there is no engine,
    # which is logged, not raised: the new salts already keep the old blocks unused).
    assert await runtime.flush_cache(scope="all") == CacheFlushed(3)
    assert salt(_scoped("bob")) != bob


def test_cache_usage_is_the_engines_kv_cache() -> None:
    from pool.backends import CacheUsage

    runtime = _runtime()
    assert runtime.cache_usage() is None  # no engine, no size
    runtime.host.kv_cache_mib = 512.0
    runtime.host.counts.kv_cache_usage = 0.25
    assert runtime.cache_usage() == CacheUsage(512.0, 128.0)


def test_stats_carry_the_engines_cached_token_count() -> None:
    from types import SimpleNamespace

    from pool.backends._vllm_engine import job_stats

    def output(cached: int | None) -> Any:
        completion = SimpleNamespace(finish_reason="stop")
        return SimpleNamespace(
            outputs=[completion], metrics=None, prompt_token_ids=[1] * 40, num_cached_tokens=cached
        )

    assert job_stats(output(32), 3).cached_tokens == 32
    assert job_stats(output(0), 3).cached_tokens == 0
    assert job_stats(output(None), 3).cached_tokens is None


def test_a_vision_model_takes_images_through_its_template() -> None:
    """``modalities: [text, image]`` says image; the template marks each image in
    place and the decoded images ride along as vLLM's multimodal data."""
    import base64
    import io

    from PIL import Image

    from pool.backends import Decoding, GenerationRequest, ImagePart, TextPart, Turn
    from pool.backends._vllm_engine import EngineHost
    from pool.backends.prompt_formats import ModelTemplate, get_prompt_format
    from pool.backends.vllm import BACKEND, VllmRuntime, request_images
    from pool.errors import PoolError

    assert BACKEND.capabilities(_model(vllm_model="m")).modalities == ("text",)
    definition = _model(
        vllm_model="/m", prompt_format="model_template", modalities=["text", "image"]
    )
    assert BACKEND.capabilities(definition).modalities == ("text", "image")
    template = ModelTemplate(
        "{% for m in messages %}{{ m.role }}:{% if m.content is string %}{{ m.content }}"
        "{% else %}{% for p in m.content %}{% if p.type == 'image' %}<image>"
        "{% else %}{{ p.text }}{% endif %}{% endfor %}{% endif %}\n{% endfor %}"
    )
    runtime = VllmRuntime(
        EngineHost("vllm-test"),
        definition,
        get_prompt_format("model_template", model_template=template, images=True),
        trio.CapacityLimiter(1),
        0.0,
    )
    buffer = io.BytesIO()
    Image.new("RGB", (5, 3), (0, 0, 255)).save(buffer, format="PNG")
    png = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    turns = (Turn("user", (TextPart("a"), ImagePart(png), TextPart("b"), ImagePart(png))),)
    request = GenerationRequest("r", "v", turns, Decoding())
    images = request_images(request)
    assert [image.size for image in images] == [(5, 3), (5, 3)]
    job = runtime.engine_job(request, runtime.render(request), images)
    assert job.prompt["prompt"] == "user:a<image>b<image>"
    assert job.prompt["multi_modal_data"] == {"image": images}
    # Text only: no multimodal data at all.
    plain = GenerationRequest("r", "v", (Turn("user", (TextPart("a"),)),), Decoding())
    assert "multi_modal_data" not in runtime.engine_job(plain, runtime.render(plain)).prompt

    # A data: URL whose bytes start like a PNG but do not decode is the client's error.
    broken = "data:image/png;base64," + base64.b64encode(buffer.getvalue()[:40]).decode()
    bad = GenerationRequest("r", "v", (Turn("user", (ImagePart(broken),)),), Decoding())
    with pytest.raises(PoolError) as refused:
        request_images(bad)
    assert refused.value.status == 400 and refused.value.code == "image_refused"


def test_stats_name_the_stop_string_the_engine_stopped_at() -> None:
    from types import SimpleNamespace

    from pool.backends._vllm_engine import job_stats

    def output(stop_reason: object) -> Any:
        completion = SimpleNamespace(finish_reason="stop", stop_reason=stop_reason)
        return SimpleNamespace(outputs=[completion], metrics=None, prompt_token_ids=[1])

    assert job_stats(output("Paris"), 1).stop_sequence == "Paris"
    # A stop token (an id) or the end of the sequence is no stop string.
    assert job_stats(output(151645), 1).stop_sequence is None
    assert job_stats(output(None), 1).stop_sequence is None


def test_tools_and_output_formats_go_to_vllms_chat_side() -> None:
    """The in-process engine offers tools where the prompt format shows them, picks the
    parser of the format's markup, and hands vLLM the request's OpenAI fields (no vLLM
    needed to build them)."""
    from pool.backends import Decoding, GenerationRequest, OutputFormat, TextPart, Turn
    from pool.backends._tools import ToolChoice, ToolSpec
    from pool.backends._vllm_tools import chat_spec
    from pool.backends.vllm import tool_parser

    backend = get_backend("vllm")
    shipped = _model(vllm_model="/m", prompt_format="qwen3_template")
    assert backend.capabilities(shipped).tools and backend.capabilities(shipped).structured_output
    generic = _model(vllm_model="/m", prompt_format="generic")
    assert not backend.capabilities(generic).tools
    assert backend.capabilities(generic).structured_output
    assert backend.capabilities(_model(vllm_model="/m", prompt_format="model_template")).tools
    assert tool_parser(shipped) == "qwen3_json"
    assert tool_parser(_model(vllm_model="/m", prompt_format="mistral_template")) == "mistral"
    assert tool_parser(_model(vllm_model="/m/granite-3", prompt_format="model_template")) == (
        "granite"
    )
    assert tool_parser(_model(vllm_model="/m", vllm_tool_call_parser="llama3_json")) == (
        "llama3_json"
    )

    weather = ToolSpec("get_weather", "Weather", {"type": "object", "properties": {}})
    turns = (Turn("user", (TextPart("Weather?"),)),)

    def request(**fields: Any) -> GenerationRequest:
        return GenerationRequest("r", "m", turns, Decoding(), **fields)

    assert chat_spec(request(), "hermes") is None
    forced = chat_spec(
        request(tools=(weather,), tool_choice=ToolChoice("function", "get_weather")),
        "hermes",
        "parameter",
    )
    assert forced is not None
    assert forced.tool_parser == "hermes" and forced.strict_level == "parameter"
    assert forced.body["messages"] == [{"role": "user", "content": "Weather?"}]
    assert forced.body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert forced.body["tools"][0]["function"]["name"] == "get_weather"
    # tool_choice none: nothing to parse, the format still constrains the reply.
    none = chat_spec(
        request(
            tools=(weather,),
            tool_choice=ToolChoice("none"),
            output_format=OutputFormat("json_object"),
        ),
        "hermes",
    )
    assert none is not None and none.tool_parser is None and none.strict_level == "auto"
    assert "tools" not in none.body and none.body["response_format"] == {"type": "json_object"}


async def test_piece_streams_carry_tool_call_pieces_in_order() -> None:
    """A batching engine's stream joins the text that piled up, never across a call."""
    from pool.backends._threaded import PieceStream
    from pool.backends._tools import ToolCallDelta

    stream = PieceStream()
    call = ToolCallDelta(0, "call_1", "get_weather", "")
    for piece in ("Let ", "me ", "see.", call, ToolCallDelta(0, arguments="{}"), "Done", "."):
        stream.put(piece)
    stream.finish()
    got: list[Any] = []

    class Sink:
        async def send(self, piece: Any) -> None:
            got.append(piece)

    await stream.deliver(Sink())
    assert got == ["Let me see.", call, ToolCallDelta(0, arguments="{}"), "Done."]
