"""The CUDA context of in-process runtimes, kept apart from each model's footprint.

A scripted GPU source plays NVML's per-process reading of the pool process on one
24 GiB GPU: the loaded replicas' memory, plus a CUDA context of ``CONTEXT`` MiB from the
first in-process load on, which stays after every unload (as a real process's does).
The in-process runtime is the stub with ``holds_cuda_context`` true.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from pool import Pool, PoolError, open_pool
from pool.actors import GpuReading, GpuView
from pool.backends.stub import StubBackend, StubModel

from .helpers import stub_settings

CONTEXT = 600
TOTAL = 24_000


class InProcessStub(StubBackend):
    """The stub, counted as an in-process GPU runtime."""

    def holds_cuda_context(self, definition: StubModel) -> bool:
        return True


class ScriptedGpu:
    """What NVML would show for the pool process on one GPU."""

    def __init__(self, early_mib: int = 0) -> None:
        self.pool: Pool | None = None
        self.context_open = False
        # Part of the context opened before any load (llama.cpp's CUDA build opens it
        # when it starts: 480 of 584 MiB on an H100 with scripts/gpu-check vram).
        self.early_mib = early_mib

    def view(self) -> GpuView:
        held = 0
        models = self.pool.parts_for_tests().models.values() if self.pool is not None else ()
        for actor in models:
            for replica in actor.replicas:
                if replica.runtime is not None:
                    held += replica.runtime.vram_mib or 0
                    self.context_open |= isinstance(actor.backend, InProcessStub)
        held += CONTEXT if self.context_open else self.early_mib
        reading = GpuReading(0, "scripted", used_mib=held, total_mib=TOTAL, pool_used_mib=held)
        return GpuView((reading,), None)


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLM_POOL_STATE_DIR", str(tmp_path))
    return tmp_path


def settings(**models: dict[str, Any]) -> Any:
    return stub_settings({n: {"stub_vram_mib": 0, **m} for n, m in models.items()})


def in_process(pool: Pool, *names: str) -> None:
    for name in names:
        pool.model(name).backend = InProcessStub()


async def test_the_first_in_process_load_pays_the_context_and_unloading_keeps_it() -> None:
    # Real time: the store is written from worker threads, which an autojump clock would
    # race with its bounded save.
    gpu = ScriptedGpu()
    config = settings(a={"stub_vram_mib": 1000}, b={"stub_vram_mib": 2000})
    async with open_pool(config, gpus=gpu) as pool:
        gpu.pool = pool
        in_process(pool, "a", "b")
        # The first load's delta holds the context too: its size is not known yet.
        assert (await pool.load("a")).observed_load_delta_mib == 1000 + CONTEXT
        assert pool.residence("a").unsplit_context == {0}
        # A later one pays none.
        assert (await pool.load("b")).observed_load_delta_mib == 2000
        # Unloading "a" shows what the pool process keeps beyond "b": the context.
        await pool.unload("a")
        assert pool.parts_for_tests().footprints.context_mib(0) == CONTEXT
        assert pool.snapshot("a").vram.mib == 1000  # the footprint, corrected
        assert pool.snapshot("a").vram.source == "observed_load_delta"
        await pool.unload("b")
        # With nothing loaded the context is still held by the pool process, not free.
        assert gpu.view().gpus[0].pool_used_mib == CONTEXT
        assert pool.parts_for_tests().contexts.held() == {0: CONTEXT}
        # Loading "a" again pays no context, and is measured at its own size.
        assert (await pool.load("a")).observed_load_delta_mib == 1000

    # The next boot knows the context: a first load is split at once.
    restarted = ScriptedGpu()
    async with open_pool(config, gpus=restarted) as pool:
        restarted.pool = pool
        in_process(pool, "a", "b")
        assert pool.parts_for_tests().footprints.context_mib(0) == CONTEXT
        assert pool.snapshot("b").vram.mib == 2000
        assert (await pool.load("b")).observed_load_delta_mib == 2000
        assert pool.residence("b").unsplit_context == set()


async def test_a_managed_runtime_pays_no_context(autojump_clock: trio.abc.Clock) -> None:
    gpu = ScriptedGpu()
    async with open_pool(settings(m={"stub_vram_mib": 1000}), gpus=gpu) as pool:
        gpu.pool = pool
        assert (await pool.load("m")).observed_load_delta_mib == 1000
        await pool.unload("m")
        assert pool.parts_for_tests().footprints.context_mib(0) is None
        assert pool.parts_for_tests().contexts.held() == {}


async def test_the_gate_counts_the_context_an_in_process_load_would_open(
    autojump_clock: trio.abc.Clock,
) -> None:
    # 3000 MiB of budget: a 2700 MiB model fits alone, but not beside the context that
    # an in-process runtime would open in the pool process (500 MiB before measured).
    gpu = ScriptedGpu()
    config = stub_settings(
        {"m": {"stub_vram_mib": 2700}, "n": {"stub_vram_mib": 2700}},
        gpu_budget_mib=[3000],
    )
    async with open_pool(config, gpus=gpu) as pool:
        gpu.pool = pool
        in_process(pool, "n")
        with pytest.raises(PoolError) as caught:
            await pool.load("n")
        assert caught.value.code == "load_failed"
        assert (await pool.load("m")).state == "loaded"


async def test_a_context_opened_before_the_first_load_is_not_taken_from_its_footprint() -> None:
    # Measured with scripts/gpu-check vram on an H100: the pool process held 480 MiB
    # before any load, 584 after the first model unloaded; that model (546 MiB measured)
    # was recorded at 0 MiB, as if the whole context had been paid by its load.
    early = 480
    config = settings(a={"stub_vram_mib": 1000}, b={"stub_vram_mib": 2000})
    gpu = ScriptedGpu(early_mib=early)
    async with open_pool(config, gpus=gpu) as pool:
        gpu.pool = pool
        in_process(pool, "a", "b")
        assert (await pool.load("a")).observed_load_delta_mib == 1000 + CONTEXT - early
        await pool.unload("a")
        assert pool.parts_for_tests().footprints.context_mib(0) == CONTEXT
        # Only the context that grew during the load is taken out.
        assert pool.snapshot("a").vram.mib == 1000

    # A new process with the context known: its first load again finds part of it open.
    restarted = ScriptedGpu(early_mib=early)
    async with open_pool(config, gpus=restarted) as pool:
        restarted.pool = pool
        in_process(pool, "a", "b")
        assert (await pool.load("b")).observed_load_delta_mib == 2000
        assert pool.snapshot("b").vram.mib == 2000
        await pool.unload("b")
        assert pool.snapshot("b").vram.mib == 2000
