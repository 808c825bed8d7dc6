"""The residency owner on virtual GPUs: one gate for every entry point, explained
decisions, the preview, the swap-cost-aware choice and evicted models coming back."""

from __future__ import annotations

from pathlib import Path

import pytest
import trio

from pool import PoolError, open_pool

from .helpers import Outcome, ask, run_request, stub_settings, wait_until
from .test_vram import model, watch_budget

BUDGET = 10_000


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Measured footprints and load times go to a fresh state dir, never the user's."""
    monkeypatch.setenv("LLM_POOL_STATE_DIR", str(tmp_path))
    return tmp_path


async def test_every_entry_point_goes_through_one_gate(autojump_clock: trio.abc.Clock) -> None:
    """An admin load, an Ollama-style preload, a runner load task and an on-demand
    request start together for four models, each alone filling most of the GPU: at no
    state change is more held or claimed than the budget, and every one of them is
    served or refused by the gate (never loaded past it)."""
    settings = stub_settings(
        {name: model(600, stub_load_seconds=2) for name in ("admin", "ollama", "runner", "ask")},
        gpu_budget_mib=[1000],
        min_resident_s=0,
        queue_timeout_s=120,
    )
    seen: list[int] = []
    async with open_pool(settings) as pool:
        watch_budget(pool, 1000, seen)
        refused: list[str] = []
        asked = Outcome()

        async def admin() -> None:
            try:
                await pool.load("admin")
            except PoolError as exc:
                refused.append(exc.code)

        async def ollama() -> None:
            try:
                await pool.preload("ollama", {"replicas": 1})
            except PoolError as exc:
                refused.append(exc.code)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(admin)
            nursery.start_soon(ollama)
            task = pool.start_load_task("runner")
            nursery.start_soon(run_request, pool, ask("ask", "served"), asked)
            with trio.fail_after(600):
                await task.done.wait()
        assert asked.text == "served"
        assert set(refused) <= {"load_failed"}
        assert task.status in ("completed", "failed")
        loads = sum(a.load_count for a in pool.parts_for_tests().models.values())
        assert loads == 1 + (2 - len(refused)) + (task.status == "completed")
        places = [d for d in pool.decisions() if d.action == "place"]
        assert len(places) == loads  # each load was placed by the gate, and only those
    assert seen and max(seen) <= 1000


@pytest.mark.parametrize("policy", ["swap_cost", "lru"])
async def test_the_cheapest_to_bring_back_goes_first(
    policy: str, autojump_clock: trio.abc.Clock
) -> None:
    """``slow`` takes 20 s to load and ``quick`` half a second; both are asked for as
    often, ``slow`` a little less recently. Plain LRU evicts ``slow`` for ``new``; the
    swap-cost policy evicts ``quick`` (and says why)."""
    settings = stub_settings(
        {
            "slow": model(4000, stub_load_seconds=20),
            "quick": model(4000, stub_load_seconds=0.5),
            "new": model(4000, stub_load_seconds=0.5),
        },
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
        queue_timeout_s=120,
        eviction_policy=policy,
    )
    async with open_pool(settings) as pool:
        for name in ("slow", "quick", "slow", "quick"):
            await pool.respond(ask(name))
            await trio.sleep(1)
        await pool.respond(ask("new"))
        victim = "quick" if policy == "swap_cost" else "slow"
        kept = "slow" if victim == "quick" else "quick"
        assert pool.snapshot(victim).unload_reason == "evicted"
        assert pool.snapshot(kept).state == "loaded"
        (evict,) = [d for d in pool.decisions() if d.action == "evict"]
        assert (evict.model, evict.for_model) == (victim, "new")
        if policy == "swap_cost":
            assert "reloads in 0.50s (measured)" in evict.reason
        else:
            assert "least recently used" in evict.reason
        assert pool.expected_load_s("slow") == pytest.approx(20, abs=0.01)


async def test_the_preview_says_what_the_load_then_does(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {
            **{name: model(3000) for name in ("a", "b", "c", "d")},
            "huge": model(20_000),
        },
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
    )
    async with open_pool(settings) as pool:
        for name in ("a", "b", "c"):
            await pool.load(name)
            await trio.sleep(1)
        before = [(s.name, s.state) for s in pool.snapshots()]
        decided = len(pool.decisions())

        preview = pool.preview_load("d")
        assert preview["fits"] is True and preview["error"] is None
        assert preview["evict"] == ["a"]
        assert (preview["gpus"], preview["gpu_split_mib"]) == ([[0]], [[3000]])
        assert preview["expected_load_s"] is None  # never loaded: nothing measured
        # Nothing changed, nothing was decided.
        assert [(s.name, s.state) for s in pool.snapshots()] == before
        assert len(pool.decisions()) == decided

        row = await pool.load("d")
        assert [list(p.gpus) for p in row.placement] == preview["gpus"]
        assert [list(p.mib) for p in row.placement] == preview["gpu_split_mib"]
        assert [d.model for d in pool.decisions() if d.action == "evict"] == preview["evict"]
        assert pool.snapshot("a").unload_reason == "evicted"

        again = pool.preview_load("a")
        assert again["expected_load_s"] is not None  # measured by its first load
        assert pool.preview_load("d")["reason"].startswith("already loaded")
        assert pool.preview_load("d", {"replicas": 1})["error"] == "invalid_load_request"

        never = pool.preview_load("huge")
        assert (never["fits"], never["error"]) == (False, "load_failed")
        assert "more than the GPUs can give it" in never["reason"]
        with pytest.raises(PoolError) as info:
            await pool.load("huge")
        assert info.value.message == never["reason"]
        (refusal,) = [d for d in pool.decisions("huge")]
        assert refusal.action == "refuse" and refusal.details["need_mib"] == 20_000


async def test_an_evicted_enabled_model_comes_back_when_room_frees(
    autojump_clock: trio.abc.Clock,
) -> None:
    """``resident`` (enabled) is evicted for the on-demand ``burst``; once ``burst``
    unloads by its keep_alive, ``resident`` loads again by itself, through the gate."""
    settings = stub_settings(
        {
            "resident": {"enabled": True, "stub_vram_mib": 600, "stub_load_seconds": 1},
            "burst": {**model(600, stub_load_seconds=1), "keep_alive": 30},
        },
        gpu_budget_mib=[1000],
        min_resident_s=0,
        queue_timeout_s=60,
    )
    seen: list[int] = []
    async with open_pool(settings) as pool:
        watch_budget(pool, 1000, seen)
        assert pool.snapshot("resident").state == "loaded"
        await pool.respond(ask("burst"))
        assert pool.snapshot("resident").unload_reason == "evicted"
        # Nothing frees the room before burst's keep_alive: resident stays evicted.
        await trio.sleep(20)
        assert pool.snapshot("resident").state == "unloaded"
        await wait_until(lambda: pool.snapshot("resident").state == "loaded", within_s=120)
        assert pool.snapshot("burst").unload_reason == "keep_alive"
        assert pool.model("resident").load_count == 2
        actions = [d.action for d in reversed(pool.decisions("resident"))]
        assert actions == ["place", "evict", "comeback", "place"]
    assert max(seen) <= 1000


async def test_an_operator_unload_does_not_come_back(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {"resident": {"enabled": True, "stub_vram_mib": 600}, "other": model(300)},
        gpu_budget_mib=[1000],
    )
    async with open_pool(settings) as pool:
        await pool.unload("resident")
        await pool.respond(ask("other"))
        await pool.unload("other")
        await trio.sleep(30)
        assert pool.snapshot("resident").state == "unloaded"
        assert not [d for d in pool.decisions() if d.action == "comeback"]
