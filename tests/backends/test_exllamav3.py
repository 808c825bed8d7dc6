"""The exllamav3 backend through the pool, with exllamav3 replaced at its import boundary.

No machine that runs this suite has a GPU, and importing exllamav3 compiles its CUDA
extension, so ``sys.modules["exllamav3"]`` holds the fake of ``fake_exllamav3`` (its
docstring says which lines of exllamav3 1.6.5 its shapes come from; the fixture installs
its metadata, so the backend's version check sees the pinned release) and the backend's
``torch.cuda`` view is a fake device. The pool, the replica, the backend's driver thread
and its hand-over to Trio are the real ones. ``scripts/gpu-check exllamav3`` runs the
real library on an NVIDIA machine. What the backend uses of exllamav3 is checked against
the pinned release's source (``exllamav3_contract``; scripts/test fetches that source).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import trio

from pool import Delta, Finished, InferenceRequest, PoolError, open_pool, request_from_responses
from pool.backends import ALL_THINKING_MODES
from pool.backends import exllamav3 as backend
from pool.backends.exllamav3 import ExLlamaV3Model, cache_bits, load_plan
from pool.config import build_settings
from pool.errors import BackendError
from tests.backends import exllamav3_contract as contract
from tests.backends import fake_exllamav3 as fake
from tests.backends.streaming import assert_cut_is_charged
from tests.components import missing


@pytest.fixture
def world(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[fake.World]:
    world = fake.reset()
    monkeypatch.setitem(sys.modules, "exllamav3", fake.module())
    # The fake's release, as the backend's version check reads it (importlib.metadata).
    dist = fake.install_metadata(tmp_path_factory.mktemp("exllamav3-dist"), fake.VERSION)
    monkeypatch.syspath_prepend(str(dist))
    monkeypatch.setattr(backend, "_open_cuda", fake.FakeCuda)
    yield world
    leftover = [t.name for t in threading.enumerate() if t.name.startswith("exllamav3-")]
    assert not leftover, f"driver threads outlived the pool: {leftover}"


def _settings(tmp_path: Path, engine: dict[str, Any] | None = None, **fields: Any) -> Any:
    model = {
        "backend": "exllamav3",
        "model_path": str(tmp_path),
        "prompt_format": "qwen3_template",
        **fields,
    }
    return build_settings(
        {
            "engine": {
                "decoding": {"temperature": 0.0},
                "models": {"exl": model},
                **(engine or {}),
            }
        }
    )


def _ask(text: str = "What is the capital of France?", **fields: Any) -> InferenceRequest:
    return request_from_responses({"model": "exl", "input": text, **fields})


async def _until(condition: Any, limit_s: float = 2.0) -> None:
    with trio.fail_after(limit_s):
        while not condition():
            await trio.sleep(0.005)


# -- the driver loop ------------------------------------------------------------------


async def test_tokens_stream_and_the_job_reports_its_numbers(
    world: fake.World, tmp_path: Path
) -> None:
    world.script.step_s = 0.002
    async with open_pool(_settings(tmp_path)) as pool:
        await pool.load("exl")
        deltas: list[str] = []
        finished = None
        async for event in pool.stream(_ask()):
            if isinstance(event, Delta):
                deltas.append(event.text)
            elif isinstance(event, Finished):
                finished = event
        assert "".join(deltas) == "The capital of France is Paris."
        assert len(deltas) > 1  # streamed, not one piece at the end
        assert finished is not None and finished.finish_reason == "stop"
        # The prompt is the rendered ChatML; the EOS token counts as a sampled token.
        assert finished.usage.prompt_tokens == len(world.encoded[0]["text"].split())
        assert finished.usage.output_tokens == len(world.script.reply) + 1
        assert finished.timings.time_to_first_token_ms is not None
        assert finished.timings.tokenize_ms is not None
        (job,) = world.jobs
        assert world.generators[0].enqueued == [job]


async def test_every_call_into_exllamav3_after_the_load_is_on_the_driver_thread(
    world: fake.World, tmp_path: Path
) -> None:
    async with open_pool(_settings(tmp_path)) as pool:
        await pool.load("exl")
        loaded_at = len(world.calls)
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(pool.respond, _ask())
        calls = world.calls[loaded_at:]
        # Generator.close comes after the driver has stopped, with the model's release.
        await pool.unload("exl")
    driver = {thread for name, thread in calls if name.startswith(("Generator.", "Tokenizer."))}
    assert driver == {"exllamav3-exl-0"}
    assert ("Generator.iterate", "exllamav3-exl-0") in calls


async def test_a_stop_string_ends_the_reply_without_appearing(
    world: fake.World, tmp_path: Path
) -> None:
    async with open_pool(_settings(tmp_path)) as pool:
        await pool.load("exl")
        reply = await pool.respond(_ask(decoding={"stop": ["is Paris"]}))
        assert reply.text == "The capital of France "
        assert reply.finish_reason == "stop" and reply.stop_sequence == "is Paris"


async def test_max_tokens_ends_with_length(world: fake.World, tmp_path: Path) -> None:
    world.script.then = "repeat"
    async with open_pool(_settings(tmp_path)) as pool:
        await pool.load("exl")
        reply = await pool.respond(_ask(decoding={"max_tokens": 3}))
        assert reply.text == "The capital of"
        assert reply.finish_reason == "length"
        assert reply.usage.output_tokens == 3
        assert world.jobs[0].max_new_tokens == 3


async def test_the_job_carries_the_sampler_stops_and_rendered_prompt(
    world: fake.World, tmp_path: Path
) -> None:
    async with open_pool(_settings(tmp_path, exllama_max_rq_tokens=512)) as pool:
        await pool.load("exl")
        await pool.respond(
            _ask(
                decoding={
                    "temperature": 0.7,
                    "top_k": 20,
                    "top_p": 0.9,
                    "repetition_penalty": 1.1,
                    "max_tokens": 50,
                    "stop": ["END"],
                }
            )
        )
    (job,) = world.jobs
    assert world.samplers[0].kwargs == {"rep_p": 1.1, "temperature": 0.7, "top_k": 20, "top_p": 0.9}
    assert job.sampler is world.samplers[0]
    # EOS ids from the config, the format's turn markers (special tokens: by id too,
    # deduplicated), then the request's own stop strings.
    assert job.stop_conditions == [fake.EOS_ID, "<|im_end|>", "<|im_start|>", 1, "END"]
    assert job.max_new_tokens == 50 and job.max_rq_tokens == 512
    (encoded,) = world.encoded
    assert encoded["text"].startswith("<|im_start|>user\nWhat is the capital of France?")
    assert encoded["text"].endswith("<|im_start|>assistant\n")
    assert encoded == {**encoded, "add_bos": False, "encode_special_tokens": True}


async def test_thinking_follows_the_prompt_format(world: fake.World, tmp_path: Path) -> None:
    async with open_pool(_settings(tmp_path)) as pool:
        assert pool.snapshot("exl").capabilities.thinking_modes == ALL_THINKING_MODES
        await pool.load("exl")
        await pool.respond(_ask(thinking="disabled"))
    assert "<think>\n\n</think>" in world.encoded[0]["text"]


@pytest.mark.parametrize("prompt_format", ["qwen3_template", "generic", "translategemma_template"])
async def test_single_turn_input_only_whatever_the_format(
    world: fake.World, tmp_path: Path, prompt_format: str
) -> None:
    """A conversation is refused before it is queued, even where the format could render
    one (qwen3_template and generic are multi-turn formats on llama_cpp)."""
    async with open_pool(_settings(tmp_path, prompt_format=prompt_format)) as pool:
        assert not pool.snapshot("exl").capabilities.multi_turn
        await pool.load("exl")
        conversation = request_from_responses(
            {
                "model": "exl",
                "messages": [
                    {"role": "user", "content": "My favourite colour is teal."},
                    {"role": "assistant", "content": "Noted."},
                    {"role": "user", "content": "What is my favourite colour?"},
                ],
            }
        )
        with pytest.raises(PoolError) as info:
            await pool.respond(conversation)
        assert info.value.code == "multi_turn_unsupported" and info.value.status == 400
    assert world.jobs == []


async def test_a_prompt_longer_than_the_cache_is_a_400(world: fake.World, tmp_path: Path) -> None:
    async with open_pool(_settings(tmp_path, exllama_cache_size=256)) as pool:
        await pool.load("exl")
        with pytest.raises(PoolError) as info:
            await pool.respond(_ask("word " * 300))
        assert info.value.code == "invalid_request" and info.value.status == 400
        assert "cache of 256 tokens" in info.value.message
        assert (await pool.respond(_ask())).text  # the replica serves on


# -- cancellation ---------------------------------------------------------------------


async def test_a_cancelled_request_cancels_its_job_within_a_step(
    world: fake.World, tmp_path: Path
) -> None:
    world.script.then, world.script.step_s = "repeat", 0.01
    async with open_pool(_settings(tmp_path)) as pool:
        await pool.load("exl")
        stream = pool.stream(_ask(decoding={"max_tokens": 5000}))
        deltas = 0
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            async for event in stream:
                deltas += isinstance(event, Delta)
                if deltas == 3:
                    break
        generator = world.generators[0]
        # The job itself was cancelled (not finished); ten times the room a loaded
        # machine needs for it.
        await _until(lambda: generator.cancelled == world.jobs, limit_s=10.0)
        await _until(lambda: pool.snapshot("exl").running == 0, limit_s=10.0)
        assert generator.num_remaining_jobs() == 0
        steps = generator.steps
        await trio.sleep(0.1)
        assert generator.steps == steps  # idle: the driver sleeps, it does not spin
        world.script.then = "eos"
        assert (await pool.respond(_ask())).text == "The capital of France is Paris."


async def test_a_stream_left_early_is_charged_its_prompt_and_tokens(
    world: fake.World, tmp_path: Path
) -> None:
    world.script.then, world.script.step_s = "repeat", 0.01
    async with open_pool(_settings(tmp_path)) as pool:
        await pool.load("exl")
        used = await assert_cut_is_charged(pool, _ask(decoding={"max_tokens": 5000}))
        assert used.prompt_tokens == len(world.encoded[0]["text"].split())


async def test_closing_the_pool_cuts_running_requests_and_frees_the_model(
    world: fake.World, tmp_path: Path
) -> None:
    world.script.then, world.script.step_s = "repeat", 0.005
    with trio.fail_after(5):
        async with open_pool(_settings(tmp_path)) as pool, trio.open_nursery() as nursery:
            await pool.load("exl")

            async def endless() -> None:
                with contextlib.suppress(PoolError):
                    await pool.respond(_ask(decoding={"max_tokens": 100000}))

            nursery.start_soon(endless)
            await _until(lambda: pool.snapshot("exl").running == 1)
            nursery.cancel_scope.cancel()
    (generator,), (model,) = world.generators, world.models
    assert generator.num_remaining_jobs() == 0 and generator.cancelled == world.jobs
    assert model.unloaded and generator.closed


# -- batching admission -----------------------------------------------------------------


async def test_concurrent_requests_become_jobs_of_one_generator(
    world: fake.World, tmp_path: Path
) -> None:
    world.script.step_s = 0.01
    async with open_pool(_settings(tmp_path, exllama_max_batch_size=4)) as pool:
        await pool.load("exl")
        assert pool.snapshot("exl").effective_target_inflight == 4
        replies: list[str] = []

        async def ask() -> None:
            replies.append((await pool.respond(_ask())).text)

        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(ask)
        assert replies == ["The capital of France is Paris."] * 4
        (generator,) = world.generators
        assert len(generator.enqueued) == 4 and generator.peak_batch == 4
        assert generator.max_batch_size == 4


async def test_past_the_batch_size_requests_wait_in_the_pools_queue(
    world: fake.World, tmp_path: Path
) -> None:
    world.script.step_s = 0.02
    world.script.reply = [f"w{i}" for i in range(30)]
    async with open_pool(_settings(tmp_path, exllama_max_batch_size=2)) as pool:
        await pool.load("exl")
        async with trio.open_nursery() as nursery:
            for _ in range(3):
                nursery.start_soon(pool.respond, _ask())
            await _until(lambda: pool.snapshot("exl").queue_depth == 1)
            snapshot = pool.snapshot("exl")
            assert snapshot.running == 2
            # The third is in the pool's queue, not the generator's.
            await _until(lambda: len(world.generators[0].enqueued) == 2)
            await trio.sleep(0.05)
            assert len(world.generators[0].enqueued) == 2
            assert pool.snapshot("exl").queue_depth == 1
        (generator,) = world.generators
        assert len(generator.enqueued) == 3 and generator.peak_batch == 2


async def test_default_batch_size_is_the_target_inflight(world: fake.World) -> None:
    definition = ExLlamaV3Model(target_inflight=3)
    assert backend.BACKEND.effective_target_inflight(definition) == 3
    assert (
        backend.BACKEND.effective_target_inflight(
            ExLlamaV3Model(target_inflight=3, exllama_max_batch_size=16)
        )
        == 16
    )


# -- field mapping ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("quant", "expected"), [(None, None), ("8", (8, 8)), ("8,4", (8, 4)), ("4, 2", (4, 2))]
)
def test_cache_quant_pairs(quant: str | None, expected: tuple[int, int] | None) -> None:
    assert cache_bits(quant) == expected


@pytest.mark.parametrize("quant", ["fp16", "9", "8,1", "8,4,2", ""])
def test_bad_cache_quant_is_refused(quant: str) -> None:
    with pytest.raises(BackendError, match="exllama_cache_quant"):
        cache_bits(quant)


def test_the_load_plan_maps_devices_splits_and_tensor_parallel(tmp_path: Path) -> None:
    def plan(**fields: Any) -> backend.LoadPlan:
        return load_plan(ExLlamaV3Model(**fields), tmp_path)

    assert plan().load_kwargs == {"device": "cuda:0", "max_batch_size": 1}
    assert plan(device="cuda:1").load_kwargs["device"] == "cuda:1"
    assert "device" not in plan(device="auto").load_kwargs  # autosplit over every GPU
    split = plan(exllama_gpu_split=[20, 40.5], exllama_max_chunk_size=1024)
    assert split.load_kwargs == {
        "use_per_device": [20.0, 40.5],
        "max_batch_size": 1,
        "max_chunk_size": 1024,
    }
    assert split.generator_kwargs == {"max_chunk_size": 1024}
    tp = plan(exllama_tensor_parallel=True, exllama_gpu_split=[30, 30])
    assert tp.load_kwargs == {
        "tensor_p": True,
        "tp_backend": "native",
        "use_per_device": [30.0, 30.0],
        "max_batch_size": 1,
    }
    nccl = plan(exllama_tensor_parallel=True, exllama_tp_backend="nccl", exllama_max_batch_size=8)
    assert nccl.load_kwargs == {"tensor_p": True, "tp_backend": "nccl", "max_batch_size": 8}
    assert nccl.batch_size == 8
    sizes = plan(exllama_max_q_size=16, exllama_max_rq_tokens=2048, exllama_cache_size=4096)
    assert sizes.generator_kwargs == {"max_q_size": 16}
    assert sizes.max_rq_tokens == 2048 and sizes.cache_tokens == 4096


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"exllama_cache_size": 1000}, "multiple of 256"),
        ({"exllama_tensor_parallel": True, "exllama_tp_backend": "mpi"}, "exllama_tp_backend"),
        ({"exllama_tp_backend": "nccl"}, "exllama_tensor_parallel"),
        ({"exllama_gpu_split": [-1.0]}, "exllama_gpu_split"),
    ],
)
def test_the_load_plan_refuses_what_exllamav3_would(
    tmp_path: Path, fields: dict[str, Any], message: str
) -> None:
    with pytest.raises(BackendError, match=message):
        load_plan(ExLlamaV3Model(**fields), tmp_path)


async def test_the_fields_reach_exllamav3(world: fake.World, tmp_path: Path) -> None:
    fields = {
        "exllama_cache_size": 4096,
        "exllama_cache_quant": "8",
        "exllama_gpu_split": [10, 20],
        "exllama_max_batch_size": 6,
        "exllama_max_chunk_size": 512,
        "exllama_max_q_size": 4,
    }
    async with open_pool(_settings(tmp_path, **fields)) as pool:
        await pool.load("exl")
        (cache,) = world.caches
        assert cache.layer_type is fake.CacheLayer_quant
        assert cache.kwargs == {"k_bits": 8, "v_bits": 8}
        assert cache.max_num_tokens == 4096 and cache.max_batch_size == 6
        (model,) = world.models
        assert model.load_kwargs == {
            "use_per_device": [10.0, 20.0],
            "max_batch_size": 6,
            "max_chunk_size": 512,
        }
        (generator,) = world.generators
        assert (generator.max_batch_size, generator.max_chunk_size, generator.max_q_size) == (
            6,
            512,
            4,
        )
        assert generator.cache is cache and generator.model is model
        await pool.unload("exl")
        # A live load override: the k/v pair becomes the cache quant.
        await pool.load("exl", {"exllama_cache_k_bits": 8, "exllama_cache_v_bits": 4})
        assert world.caches[-1].kwargs == {"k_bits": 8, "v_bits": 4}
        await pool.unload("exl")
        await pool.load("exl", {"exllama_cache_quant": None})
        assert world.caches[-1].layer_type is fake.CacheLayer_fp16
        assert world.caches[-1].kwargs == {}


async def test_a_bad_field_fails_the_load_with_its_name(world: fake.World, tmp_path: Path) -> None:
    async with open_pool(_settings(tmp_path, exllama_cache_size=1000)) as pool:
        with pytest.raises(PoolError) as info:
            await pool.load("exl")
        assert info.value.code == "load_failed"
        assert "exllama_cache_size must be a multiple of 256" in info.value.details["last_error"]
        assert not world.models  # refused before exllamav3 was touched


# -- load, failure, unload --------------------------------------------------------------


async def test_without_cuda_the_load_fails_with_the_reason(tmp_path: Path) -> None:
    # The real probe: this machine's torch is a CPU build (or absent).
    had_exllamav3 = "exllamav3" in sys.modules
    async with open_pool(_settings(tmp_path)) as pool:
        with pytest.raises(PoolError) as info:
            await pool.load("exl")
        assert info.value.code == "load_failed" and info.value.status == 500
        reason = info.value.details["last_error"]
        assert "exllamav3 needs" in reason and ("CUDA" in reason or "torch" in reason), reason
        assert pool.snapshot("exl").state == "failed"
    # exllamav3 was not imported: without CUDA its import would try to compile.
    assert ("exllamav3" in sys.modules) == had_exllamav3


def test_importing_the_backend_imports_neither_exllamav3_nor_torch() -> None:
    code = (
        "import sys, pool.backends.exllamav3 as b; b.BACKEND;"
        " print(sorted(m for m in ('torch', 'exllamav3') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]"


async def test_a_missing_model_folder_fails_the_load(world: fake.World, tmp_path: Path) -> None:
    (tmp_path / "model.gguf").write_bytes(b"")
    async with open_pool(_settings(tmp_path / "model.gguf")) as pool:
        with pytest.raises(PoolError) as info:
            await pool.load("exl")
        assert "is not a folder" in info.value.details["last_error"]


async def test_unload_frees_the_model_and_reports_what_stays(
    world: fake.World, tmp_path: Path
) -> None:
    async with open_pool(_settings(tmp_path)) as pool:
        snapshot = await pool.load("exl")
        assert snapshot.vram.mib == world.script.model_mib
        assert snapshot.vram.source == "observed_load_delta"
        runtime = pool.model("exl").replicas[0].runtime
        assert isinstance(runtime, backend.ExLlamaV3Runtime)
        await pool.respond(_ask())
        await pool.unload("exl")
        (model,), (generator,) = world.models, world.generators
        assert model.unloaded and generator.closed
        assert ("cuda.empty_cache", "MainThread") not in world.calls  # off the event loop
        assert runtime.retained_mib == 0 and runtime.vram_mib == 0
        assert pool.snapshot("exl").state == "unloaded"
        assert not [t for t in threading.enumerate() if t.name.startswith("exllamav3-")]
        # Loads again from scratch.
        await pool.load("exl")
        assert (await pool.respond(_ask())).text == "The capital of France is Paris."


async def test_a_generator_failure_fails_its_requests_and_recycles_the_replica(
    world: fake.World, tmp_path: Path
) -> None:
    """A generator that fails (a CUDA fault) ends its requests, and the watchdog treats
    it as a dead runtime: the replica is recycled, a reload decision says why."""
    world.script.then, world.script.step_s, world.script.fail_at_step = "repeat", 0.002, 5
    async with open_pool(_settings(tmp_path)) as pool:
        await pool.load("exl")
        with pytest.raises(PoolError) as info:
            await pool.respond(_ask(decoding={"max_tokens": 1000}))
        assert info.value.code == "backend_error"
        assert "illegal memory access" in info.value.message
        await _until(lambda: any(d.action == "reload" for d in pool.decisions("exl")))
        recycle = next(d for d in pool.decisions("exl") if d.action == "reload")
        assert recycle.details["fault"] == "exit", recycle
        assert "illegal memory access" in recycle.reason


async def test_a_generator_failure_past_the_recycle_budget_fails_the_model(
    world: fake.World, tmp_path: Path
) -> None:
    world.script.then, world.script.step_s, world.script.fail_at_step = "repeat", 0.002, 5
    settings = _settings(tmp_path, engine={"watchdog_recycles_per_hour": 0})
    async with open_pool(settings) as pool:
        await pool.load("exl")
        with pytest.raises(PoolError) as info:
            await pool.respond(_ask(decoding={"max_tokens": 1000}))
        assert info.value.code == "backend_error"
        await _until(lambda: pool.snapshot("exl").state == "failed")
        assert "illegal memory access" in (pool.snapshot("exl").last_error or "")


# -- the pinned release ---------------------------------------------------------------------


def _another_release(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, version: str) -> None:
    """Metadata of another exllamav3 release, found before the fixture's."""
    monkeypatch.syspath_prepend(str(fake.install_metadata(tmp_path / "dist", version)))


def test_the_fake_follows_the_pinned_release() -> None:
    # Moving the pin means reading the new release and updating the fake (its docstring).
    assert fake.VERSION == backend.EXLLAMAV3_VERSION


def test_the_fetch_script_reads_the_pin_from_the_backend() -> None:
    # scripts/fetch-exllamav3-source takes the version from this exact line (sed).
    source = Path(backend.__file__).read_text(encoding="utf-8")
    pins = re.findall(r'^EXLLAMAV3_VERSION = "([^"]*)"$', source, re.MULTILINE)
    assert pins == [backend.EXLLAMAV3_VERSION]
    script = Path(__file__).parents[2] / "scripts/fetch-exllamav3-source"
    assert "^EXLLAMAV3_VERSION = " in script.read_text(encoding="utf-8")


async def test_another_exllamav3_release_fails_the_load_naming_both_versions(
    world: fake.World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _another_release(monkeypatch, tmp_path, "1.6.4")
    async with open_pool(_settings(tmp_path)) as pool:
        with pytest.raises(PoolError) as info:
            await pool.load("exl")
        assert info.value.code == "load_failed"
        reason = info.value.details["last_error"]
        assert "exllamav3 1.6.4 is installed" in reason, reason
        assert f"exllamav3=={backend.EXLLAMAV3_VERSION}" in reason, reason
        assert pool.snapshot("exl").state == "failed"
    assert not world.calls  # refused before anything of exllamav3 was called


async def test_the_pinned_release_loads(
    world: fake.World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same check with the pinned version in front: it passes.
    _another_release(monkeypatch, tmp_path, backend.EXLLAMAV3_VERSION)
    async with open_pool(_settings(tmp_path)) as pool:
        await pool.load("exl")
        assert (await pool.respond(_ask())).text == "The capital of France is Paris."


async def test_without_exllamav3_installed_the_load_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    try:
        importlib.metadata.version("exllamav3")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        pytest.skip("exllamav3 is installed here")
    fake.reset()
    monkeypatch.setitem(sys.modules, "exllamav3", fake.module())  # importable, not installed
    monkeypatch.setattr(backend, "_open_cuda", fake.FakeCuda)
    async with open_pool(_settings(tmp_path)) as pool:
        with pytest.raises(PoolError) as info:
            await pool.load("exl")
        reason = info.value.details["last_error"]
        assert "exllamav3 is not installed" in reason, reason
        assert f"exllamav3=={backend.EXLLAMAV3_VERSION}" in reason, reason


# -- the real package's source --------------------------------------------------------------

SOURCE_ENV = "LLM_POOL_EXLLAMAV3_SOURCE"


def _installed_source() -> Path | None:
    """An installed exllamav3's source, found without importing it (its import compiles)."""
    if "exllamav3" in sys.modules:
        return None
    try:
        spec = importlib.util.find_spec("exllamav3")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@pytest.fixture
def exllamav3_source() -> Path:
    """exllamav3's package source: ``$LLM_POOL_EXLLAMAV3_SOURCE`` (scripts/test exports
    what scripts/fetch-exllamav3-source prints), else an installed exllamav3. Its absence
    fails the test under CI and skips it elsewhere (tests/components.py)."""
    configured = os.environ.get(SOURCE_ENV)
    if configured:
        root = Path(configured)
        if not (root / "__init__.py").is_file() and (root / "exllamav3/__init__.py").is_file():
            root = root / "exllamav3"
        if not (root / "__init__.py").is_file():
            pytest.fail(f"{SOURCE_ENV}={configured} holds no exllamav3 package source")
        return root
    installed = _installed_source()
    if installed is not None:
        return installed
    missing(
        "exllamav3's source",
        f"{SOURCE_ENV} is unset and exllamav3 is not installed; scripts/test sets"
        f" {SOURCE_ENV} to what `bash scripts/fetch-exllamav3-source` prints, the pinned"
        f" exllamav3 {backend.EXLLAMAV3_VERSION} wheel, unpacked, never imported",
    )


def test_the_backends_uses_of_exllamav3_are_in_its_source(exllamav3_source: Path) -> None:
    """Every call, keyword, attribute and result field the backend uses of exllamav3 is in
    the pinned release's source (read with ``ast``: ``inspect`` would need the import,
    which compiles the CUDA extension). ``tests/backends/exllamav3_contract.py`` says how."""
    problems = contract.problems(exllamav3_source)
    assert not problems, f"exllamav3 at {exllamav3_source}:\n" + "\n".join(problems)


def test_the_source_checked_is_the_pinned_release(exllamav3_source: Path) -> None:
    assert contract.source_version(exllamav3_source) == backend.EXLLAMAV3_VERSION


def test_the_check_reads_the_uses_out_of_the_backend() -> None:
    """What the check derives from the backend's source: among them the ones an older
    release lacks (``Generator.close`` before 1.6.0, ``"error"`` results before 1.4.7)."""
    uses = contract.backend_uses()
    assert not uses.unresolved
    calls = {(call.cls, call.method): call.keywords for call in uses.calls}
    assert ("Generator", "close") in calls and ("Generator", "iterate") in calls
    assert {"use_per_device", "tensor_p", "tp_backend", "device"} <= calls[("Model", "load")]
    assert {"layer_type", "k_bits", "v_bits"} <= calls[("Cache", "__init__")]
    assert {"input_ids", "stop_conditions", "max_rq_tokens"} <= calls[("Job", "__init__")]
    assert {"error", "job"} <= uses.fields["error"]
    assert {"text", "eos", "eos_reason", "time_prefill", "new_tokens"} <= uses.fields["streaming"]
    assert "eos_triggering_string" in uses.fields["streaming"]
    assert ("eos_reason", "max_new_tokens") in uses.values
    assert ("Config", "eos_token_id_list") in uses.attributes


def test_the_check_finds_what_an_older_release_lacks(
    exllamav3_source: Path, tmp_path: Path
) -> None:
    """The pinned source with ``Generator.close`` and the ``"error"`` results taken out,
    as in releases before 1.6.0 and 1.4.7: the check names both."""
    copy = tmp_path / "exllamav3"
    shutil.copytree(exllamav3_source, copy, ignore=shutil.ignore_patterns("*_ext", "*.so"))
    generator = copy / "generator/generator.py"
    source = generator.read_text(encoding="utf-8")
    source = source.replace("def close(self", "def close_renamed(self")
    source = source.replace('"stage": "error"', '"stage": "failed"')
    generator.write_text(source, encoding="utf-8")
    problems = contract.problems(copy)
    assert any(p.startswith("Generator.close ") and "no such method" in p for p in problems)
    assert """results: no "stage": 'error' result""" in "\n".join(problems), problems
