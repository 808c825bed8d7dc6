"""The stay-warm window (docs/vram.md, "Stay warm") on virtual GPUs: a model that just
served is evicted only when no model out of its window can make the room; a load that
may wait waits for the window to end, within the no-starvation bound; defaults by kind."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import trio

from pool import PoolError, open_pool
from pool.actors.residency._plan import plan_load
from pool.backends import get_backend
from pool.config import model_definition

from .helpers import ask, stub_settings
from .test_vram import model

BUDGET = 10_000


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Measured footprints and load times go to a fresh state dir, never the user's."""
    monkeypatch.setenv("LLM_POOL_STATE_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("policy", ["swap_cost", "lru"])
async def test_a_model_in_its_window_is_spared_while_another_can_make_room(
    policy: str, autojump_clock: trio.abc.Clock
) -> None:
    """``a`` served first, so either policy would evict it for ``d``; its stay-warm
    window spares it and ``b`` (no window) goes instead, and the decision says why."""
    settings = stub_settings(
        {
            "a": model(3000, stay_warm_s=300),
            "b": model(3000, stay_warm_s=0),
            "c": model(3000, stay_warm_s=0),
            "d": model(3000),
        },
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
        eviction_policy=policy,
    )
    async with open_pool(settings) as pool:
        for name in ("a", "b", "c"):
            await pool.respond(ask(name))
            await trio.sleep(1)
        for name in ("b", "c"):
            await pool.respond(ask(name))  # b and c are now the busier, more recent
        await pool.respond(ask("d"))
        assert pool.snapshot("a").state == "loaded"
        assert pool.snapshot("b").unload_reason == "evicted"
        (evict,) = [d for d in pool.decisions() if d.action == "evict"]
        assert (evict.model, evict.for_model) == ("b", "d")
        assert "spared: 'a' served 3s ago, in its stay-warm window (stay_warm_s 300)" in (
            evict.reason
        )


async def test_the_window_runs_from_the_end_of_the_last_request(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A 20 s stream ends at t=20: the 30 s window lasts until t=50, not t=30."""
    settings = stub_settings(
        {
            "a": model(
                3000, stay_warm_s=30, stub_reply=" ".join(["w"] * 20), stub_tokens_per_second=1
            ),
        },
        gpu_budget_mib=[BUDGET],
    )
    async with open_pool(settings) as pool:
        started = trio.current_time()
        await pool.respond(ask("a"))
        actor = pool.residence("a")
        assert actor.served_at is not None and actor.served_at >= started + 19
        assert actor.served_at == pytest.approx(trio.current_time())
        assert actor.warm_until() == pytest.approx(actor.served_at + 30)
        await trio.sleep(actor.served_at + 30 - trio.current_time())
        assert actor.warm_until() is None


async def test_an_admin_load_evicts_a_warm_model_when_nothing_else_can_go(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Admin loads never wait: the window orders the victims but never refuses a load."""
    settings = stub_settings(
        {"a": model(6000, stay_warm_s=300), "b": model(6000)},
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
    )
    async with open_pool(settings) as pool:
        await pool.respond(ask("a"))
        preview = pool.preview_load("b")
        assert (preview["fits"], preview["evict"], preview["spared_warm"]) == (True, ["a"], [])
        assert "evicts 'a' served 0s ago, in its stay-warm window" in preview["reason"]
        await pool.load("b")
        assert pool.snapshot("a").unload_reason == "evicted"
        (evict,) = [d for d in pool.decisions() if d.action == "evict"]
        assert "in its stay-warm window (stay_warm_s 300)" in evict.reason
        assert "models out of their stay-warm windows cannot make the room" in evict.reason


async def test_the_preview_names_the_models_it_spares(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {
            "a": model(4000, stay_warm_s=300),
            "b": model(4000),
            "c": model(4000),
        },
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
    )
    async with open_pool(settings) as pool:
        await pool.respond(ask("b"))
        await trio.sleep(1)
        await pool.respond(ask("a"))
        preview = pool.preview_load("c")
        assert (preview["evict"], preview["spared_warm"]) == (["b"], ["a"])
        assert "spares 'a' served 0s ago" in preview["reason"]
        await pool.load("c")
        assert [d.model for d in pool.decisions() if d.action == "evict"] == preview["evict"]


async def test_an_on_demand_load_waits_for_the_window_to_end(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Only ``a`` could make room, and it served a moment ago: ``b``'s load waits
    until ``a``'s 20 s window is over (a request for ``a`` meanwhile is served warm),
    then evicts it."""
    settings = stub_settings(
        {"a": model(6000, stay_warm_s=20), "b": model(6000)},
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
        warm_wait_s=60,
        queue_timeout_s=120,
    )
    async with open_pool(settings) as pool:
        await pool.respond(ask("a"))
        asked = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(pool.respond, ask("b"))
            await trio.sleep(5)
            assert pool.snapshot("a").state == "loaded"
            await pool.respond(ask("a"))  # served warm; its window starts again
            served = trio.current_time()
        assert trio.current_time() - served == pytest.approx(20, abs=0.5)
        assert trio.current_time() - asked == pytest.approx(25, abs=0.5)
        assert pool.snapshot("a").unload_reason == "evicted"
        assert pool.model("a").load_count == 1
        (wait,) = [d for d in pool.decisions("b") if d.action == "wait"]
        assert "only models in their stay-warm windows could make the room" in wait.reason
        assert "'a' served 0s ago, in its stay-warm window (stay_warm_s 20)" in wait.reason
        (evict,) = [d for d in pool.decisions() if d.action == "evict"]
        assert evict.model == "a" and "stay-warm" not in evict.reason


@pytest.mark.parametrize(
    ("queue_timeout_s", "load_s", "waited_s"),
    [
        (600, 1, 30),  # engine.warm_wait_s binds
        (10, 4, 3),  # half what the request's queue_timeout_s leaves after its load binds
    ],
)
async def test_the_wait_for_a_window_is_bounded(
    queue_timeout_s: float, load_s: float, waited_s: float, autojump_clock: trio.abc.Clock
) -> None:
    """No starvation: a window of an hour holds a load for ``warm_wait_s`` at most, and
    past half of what its request's ``queue_timeout_s`` leaves after the load itself."""
    settings = stub_settings(
        {
            "a": model(6000, stay_warm_s=3600),
            "b": model(6000, stub_load_seconds=load_s, queue_timeout_s=queue_timeout_s),
        },
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
        warm_wait_s=30,
    )
    async with open_pool(settings) as pool:
        await pool.load("b")  # measures b's load time, then goes
        await pool.unload("b")
        await pool.respond(ask("a"))
        asked = trio.current_time()
        reply = await pool.respond(ask("b", "bee"))
        assert reply.text == "bee"
        assert trio.current_time() - asked == pytest.approx(waited_s + load_s, abs=0.5)
        assert trio.current_time() - asked < queue_timeout_s
        assert pool.snapshot("a").unload_reason == "evicted"
        (evict,) = [d for d in pool.decisions() if d.action == "evict"]
        assert "in its stay-warm window (stay_warm_s 3600)" in evict.reason


def test_defaults_by_kind() -> None:
    """The seed's per-kind windows: an LLM 300 s, the slow loaders (vLLM) 900 s, small
    encoders (embedding models) 60 s; the stub and remote models none."""

    def window(backend: str, **fields: object) -> float:
        definition = model_definition({"backend": backend, **fields}, "stub")
        return get_backend(backend).default_stay_warm_s(definition)

    assert window("llama_cpp") == 300
    assert window("llama_server") == 300
    assert window("ct2") == 300
    assert window("vllm") == 900
    assert window("vllm_serve") == 900
    assert window("llama_cpp", embedding=True) == 60
    assert window("stub") == 0
    assert window("openai_remote", remote_base_url="http://127.0.0.1:1", remote_model="m") == 0


async def test_set_per_model_and_per_load(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"a": model(1000, stay_warm_s=45)}, gpu_budget_mib=[BUDGET])
    async with open_pool(settings) as pool:
        await pool.load("a")
        assert pool.residence("a").stay_warm_s == 45
        await pool.unload("a")
        row = await pool.load("a", {"stay_warm_s": 5})
        assert row.load_override == {"stay_warm_s": 5}
        assert pool.residence("a").stay_warm_s == 5
        with pytest.raises(PoolError) as info:
            await pool.load("a", {"stay_warm_s": 7})  # loaded: overrides need an unload
        assert info.value.code == "invalid_load_request"
        await pool.unload("a")
        await pool.load("a", {"stay_warm_s": None})  # null: the kind's default (stub: 0)
        assert pool.residence("a").stay_warm_s == 0
        await pool.unload("a")
        await pool.load("a")
        assert pool.residence("a").stay_warm_s == 45


def test_a_negative_window_is_a_schema_error() -> None:
    definition = model_definition({"backend": "stub"}, "stub")
    with pytest.raises(pydantic.ValidationError):
        plan_load({"stay_warm_s": -1}, definition)
    with pytest.raises(pydantic.ValidationError):
        model_definition({"backend": "stub", "stay_warm_s": -1}, "stub")
