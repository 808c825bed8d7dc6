"""The ct2 backend with SmolLM2 converted locally (GGUF -> transformers -> CTranslate2)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import trio

from pool import Delta, InferenceRequest, PoolError, open_pool, request_from_responses
from pool.config import build_settings
from pool.convert import cached_model

from .streaming import assert_cut_is_charged, assert_streams

pytestmark = pytest.mark.real_model
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def ct2_dir() -> Path:
    return cached_model("ct2")  # built once per machine, then reused from the cache


def _settings(path: Path | str, **extra: Any) -> Any:
    return build_settings(
        {
            "engine": {
                "decoding": {"temperature": 0},
                "models": {
                    "ct": {
                        "backend": "ct2",
                        "model_path": str(path),
                        "prompt_format": "qwen3_template",
                        "enabled": True,
                        **extra,
                    }
                },
            }
        }
    )


def _ask(text: str = QUESTION, **fields: Any) -> InferenceRequest:
    return request_from_responses({"model": "ct", "input": text, **fields})


async def test_greedy_answer_and_streaming(ct2_dir: Path) -> None:
    async with open_pool(_settings(ct2_dir)) as pool:
        reply = await pool.respond(_ask())
        assert "Paris" in reply.text
        assert reply.usage.prompt_tokens and reply.usage.output_tokens
        await assert_streams(pool, _ask("Write a story about a cat.", decoding={"max_tokens": 64}))


async def test_a_stream_left_early_is_charged_its_prompt_and_tokens(ct2_dir: Path) -> None:
    async with open_pool(_settings(ct2_dir)) as pool:
        story = _ask("Write a story about a cat.", decoding={"max_tokens": 64})
        used = await assert_cut_is_charged(pool, story)
        assert used.prompt_tokens == (await pool.respond(story)).usage.prompt_tokens


class _RecordingGenerator:
    """Stands between the runtime and its ``ctranslate2.Generator``: records each call."""

    def __init__(self, generator: Any) -> None:
        self._generator = generator
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def generate_batch(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("generate_batch", kwargs))
        return self._generator.generate_batch(*args, **kwargs)

    def generate_tokens(self, *args: Any, **kwargs: Any) -> Any:
        self.calls.append(("generate_tokens", kwargs))
        return self._generator.generate_tokens(*args, **kwargs)


async def test_beam_search_is_honoured(ct2_dir: Path) -> None:
    async with open_pool(_settings(ct2_dir)) as pool:
        runtime: Any = pool.model("ct").replicas[0].runtime
        recorder = runtime._generator = _RecordingGenerator(runtime._generator)
        beam = await pool.respond(_ask(decoding={"beam_size": 3}))
        greedy = await pool.respond(_ask())
        assert "Paris" in beam.text and "Paris" in greedy.text
        # At the boundary with CTranslate2: beam search with the requested width and no
        # sampling settings, then the greedy request token by token.
        (beam_call, beam_kwargs), (greedy_call, greedy_kwargs) = recorder.calls
        assert beam_call == "generate_batch" and beam_kwargs["beam_size"] == 3
        assert not any(key.startswith("sampling_") for key in beam_kwargs)
        assert greedy_call == "generate_tokens" and greedy_kwargs["sampling_topk"] == 1
        assert "beam_size" not in greedy_kwargs
        # Beam search hands the finished text over at once: a single delta.
        deltas = [
            e async for e in pool.stream(_ask(decoding={"beam_size": 3})) if isinstance(e, Delta)
        ]
        assert len(deltas) == 1 and deltas[0].text == beam.text


async def test_single_turn_only_and_capabilities(ct2_dir: Path) -> None:
    async with open_pool(_settings(ct2_dir)) as pool:
        row = pool.snapshot("ct")
        caps = row.capabilities
        assert caps.modalities == ("text",) and not caps.multi_turn and not caps.remote
        assert caps.thinking_modes == ("default", "enabled", "disabled")
        with pytest.raises(PoolError) as info:
            await pool.respond(
                request_from_responses(
                    {"model": "ct", "messages": [{"role": "user", "content": "hi"}]}
                )
            )
        assert info.value.code == "multi_turn_unsupported"


async def test_cancel_stops_generation(ct2_dir: Path) -> None:
    # Greedy SmolLM2 lists past 1500 tokens here (150 s on a busy two-core machine, over
    # 10 s even at 150 tokens a second), so a count back at 0 within 10 s, ten times what
    # a stop takes, means the generation stopped. ("Count to one thousand." ends by itself
    # after 76 tokens.)
    async with open_pool(_settings(ct2_dir)) as pool:
        request = _ask(
            "List the numbers from 1 to 1000, one per line.", decoding={"max_tokens": 6000}
        )
        stream = pool.stream(request)
        async with contextlib.aclosing(stream):  # type: ignore[type-var]
            deltas = 0
            async for event in stream:
                deltas += isinstance(event, Delta)
                if deltas == 3:
                    assert pool.snapshot("ct").running == 1
                    break
        with trio.fail_after(10):
            while pool.snapshot("ct").running:
                await trio.sleep(0.01)


async def test_missing_model_folder_fails_the_load(tmp_path: Path) -> None:
    async with open_pool(_settings(tmp_path / "nothing")) as pool:
        row = pool.snapshot("ct")
        assert row.state == "failed" and "model.bin" in row.last_error


def test_convert_command_reuses_the_cache(ct2_dir: Path) -> None:
    import subprocess
    import sys

    result = subprocess.run(
        [sys.executable, "-m", "pool", "convert", "ct2"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert Path(result.stdout.strip()) == ct2_dir
