"""Placement: the GPUs of each replica, splits over GPUs, and what each backend is told.

The pool's part runs on virtual GPUs (``engine.gpu_budget_mib`` with no NVIDIA GPU);
a managed server's environment is read from a really spawned process.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import trio

from pool import PoolError, open_pool
from pool.actors.residency._vram import place, proportional_shares
from pool.backends import GpuPlacement
from pool.backends.ct2 import Ct2Model, device_options
from pool.backends.exllamav3 import ExLlamaV3Model, load_plan
from pool.backends.llama_cpp import SPLIT_MODE_LAYER, SPLIT_MODE_NONE, gpu_options
from pool.backends.llama_server import LlamaServerModel
from pool.backends.llama_server import command_line as llama_server_command
from pool.backends.vllm_serve import VllmServeBackend, VllmServeModel
from pool.backends.vllm_serve import command_line as vllm_command
from pool.config import build_settings

from .helpers import Outcome, ask, run_request, stub_settings

FAKE_SERVER = Path(__file__).parents[1] / "backends" / "fake_openai_server.py"


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LLM_POOL_STATE_DIR", str(tmp_path))
    return tmp_path


def model(mib: int, **fields: Any) -> dict[str, Any]:
    return {"on_demand": True, "keep_alive": -1, "stub_vram_mib": mib, **fields}


# -- the arithmetic -----------------------------------------------------------------------


def test_a_replica_goes_whole_to_the_gpu_with_most_room() -> None:
    assert place({0: 3000, 1: 5000}, 4000, 1) == (GpuPlacement((1,), (4000,)),)
    # Two replicas: the second goes where room is left.
    assert place({0: 5000, 1: 5000}, 4000, 2) == (
        GpuPlacement((0,), (4000,)),
        GpuPlacement((1,), (4000,)),
    )


def test_a_replica_larger_than_any_gpu_is_split_in_proportion_to_room() -> None:
    (split,) = place({0: 6000, 1: 3000, 2: 1000}, 7500, 1) or ()
    # The fewest GPUs that hold it (the two roomiest), 2:1 as their room.
    assert split.gpus == (0, 1) and split.mib == (5000, 2500)
    assert split.split == pytest.approx((2 / 3, 1 / 3))
    # Needing all three, none past its room, shares summing to the need exactly.
    (wide,) = place({0: 6000, 1: 3000, 2: 1000}, 9999, 1) or ()
    assert wide.gpus == (0, 1, 2) and sum(wide.mib) == 9999
    assert all(m <= r for m, r in zip(wide.mib, (6000, 3000, 1000), strict=True))
    assert place({0: 6000, 1: 3000}, 9001, 1) is None


def test_proportional_shares_never_pass_a_gpus_room() -> None:
    assert proportional_shares(10, [7, 3]) == (7, 3)
    assert proportional_shares(5, [3, 3, 3]) == (2, 2, 1)
    assert proportional_shares(11, [7, 3]) is None


def test_even_splits_and_a_fixed_gpu_count() -> None:
    # Tensor parallelism takes equal shares: 4000 + 4000 does not fit beside 3000 free.
    assert place({0: 6000, 1: 3000}, 8000, 1, even=True) is None
    (even,) = place({0: 6000, 1: 4500}, 8000, 1, even=True) or ()
    assert even.mib == (4000, 4000)
    # A tensor-parallel size of 2 spans two GPUs even when one would hold it.
    (fixed,) = place({0: 9000, 1: 9000}, 4000, 1, gpus_per_replica=2, even=True) or ()
    assert fixed.gpus == (0, 1) and fixed.mib == (2000, 2000)
    # One GPU per replica (CTranslate2 cannot split).
    assert place({0: 3000, 1: 3000}, 4000, 1, gpus_per_replica=1) is None


def test_local_indices_follow_the_pools_own_visible_devices() -> None:
    placement = GpuPlacement((2, 3), (1, 1))
    assert placement.local_indices({}) == (2, 3)
    assert placement.local_indices({"CUDA_VISIBLE_DEVICES": "3,2"}) == (1, 0)
    assert placement.local_indices({"CUDA_VISIBLE_DEVICES": "0,2"}) is None
    assert placement.local_indices({"CUDA_VISIBLE_DEVICES": "GPU-1234"}) is None


# -- the pool on virtual GPUs ---------------------------------------------------------


async def test_a_model_of_one_and_a_half_gpus_is_split_over_two(
    autojump_clock: trio.abc.Clock,
) -> None:
    settings = stub_settings(
        {"small": model(4000), "big": model(12_000)}, gpu_budget_mib=[8000, 8000]
    )
    async with open_pool(settings) as pool:
        await pool.load("small")
        big = await pool.load("big")
        (placement,) = big.placement
        # GPU 0 has 4000 left beside "small", GPU 1 all 8000: split 1:2.
        assert placement.gpus == (0, 1) and placement.mib == (4000, 8000)
        assert [g.used_mib for g in pool.gpu_view().gpus] == [8000, 8000]
        assert big.observed_load_delta_mib == 12_000
        assert (await pool.unload("big")).placement == ()


async def test_a_split_that_can_never_fit_fails_at_once(autojump_clock: trio.abc.Clock) -> None:
    settings = stub_settings({"huge": model(17_000)}, gpu_budget_mib=[8000, 8000])
    async with open_pool(settings) as pool:
        with pytest.raises(PoolError) as caught:
            await pool.load("huge")
        assert caught.value.code == "load_failed"


async def test_two_split_loads_at_once_never_hold_half_each(
    autojump_clock: trio.abc.Clock,
) -> None:
    # Each needs 1.5 GPUs of two: only one fits at a time. Both get served, in turn,
    # and no moment charges a GPU past its budget.
    settings = stub_settings(
        {n: model(12_000, stub_load_seconds=2) for n in ("x", "y")},
        gpu_budget_mib=[8000, 8000],
        min_resident_s=0,
        warm_wait_s=1,
        queue_timeout_s=600,
    )
    async with open_pool(settings) as pool:
        peaks: list[int] = []

        async def watch() -> None:
            while True:
                peaks.append(max(g.used_mib for g in pool.gpu_view().gpus))
                loaded, pending = pool.parts_for_tests().residency.charges()
                for index in (0, 1):
                    assert loaded.get(index, 0) + pending.get(index, 0) <= 8000
                await trio.sleep(0.05)

        outcomes = {n: Outcome() for n in ("x", "y")}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            for name, outcome in outcomes.items():
                nursery.start_soon(run_request, pool, ask(name), outcome)
            for outcome in outcomes.values():
                await outcome.done.wait()
            nursery.cancel_scope.cancel()
        assert all(o.error is None for o in outcomes.values())
        assert max(peaks) <= 8000
        assert pool.evictions == 1


# -- what the backends are told ---------------------------------------------------------


def test_llama_cpp_gets_main_gpu_and_tensor_split() -> None:
    assert gpu_options(GpuPlacement((1,), (900,)), -1) == {
        "split_mode": SPLIT_MODE_NONE,
        "main_gpu": 1,
    }
    options = gpu_options(GpuPlacement((0, 2), (3000, 1000)), -1)
    assert options["split_mode"] == SPLIT_MODE_LAYER and options["main_gpu"] == 0
    assert options["tensor_split"] == pytest.approx([0.75, 0.0, 0.25])
    # Nothing for virtual GPUs, a CPU-only model, or no placement.
    assert gpu_options(GpuPlacement((1,), (900,), virtual=True), -1) == {}
    assert gpu_options(GpuPlacement((1,), (900,)), 0) == {}
    assert gpu_options(None, -1) == {}


def test_llama_server_gets_a_tensor_split_only_when_split(tmp_path: Path) -> None:
    definition = LlamaServerModel(model_path="m.gguf")
    split = llama_server_command(
        definition, "llama-server", "m.gguf", 1, placement=GpuPlacement((0, 1), (2000, 1000))
    )
    assert split[split.index("--tensor-split") + 1] == "0.6667,0.3333"
    whole = llama_server_command(
        definition, "llama-server", "m.gguf", 1, placement=GpuPlacement((1,), (2000,))
    )
    assert "--tensor-split" not in whole
    virtual = GpuPlacement((0, 1), (2000, 1000), virtual=True)
    assert "--tensor-split" not in llama_server_command(
        definition, "llama-server", "m.gguf", 1, placement=virtual
    )
    own = LlamaServerModel(model_path="m.gguf", llama_server_extra_args=["-ts", "1,1"])
    args = llama_server_command(
        own, "llama-server", "m.gguf", 1, placement=GpuPlacement((0, 1), (2000, 1000))
    )
    assert "--tensor-split" not in args and "-ts" in args


def test_vllm_serve_spans_its_gpus_with_tensor_parallelism() -> None:
    definition = VllmServeModel(vllm_model="/m")
    split = vllm_command(definition, "vllm", "/m", 1, "m", GpuPlacement((0, 1), (4000, 4000)))
    assert split[split.index("--tensor-parallel-size") + 1] == "2"
    whole = vllm_command(definition, "vllm", "/m", 1, "m", GpuPlacement((1,), (4000,)))
    assert whole[whole.index("--tensor-parallel-size") + 1] == "1"
    backend = VllmServeBackend()
    assert backend.even_gpu_split
    assert backend.gpus_per_replica(VllmServeModel(vllm_model="/m")) is None
    tp = VllmServeModel(vllm_model="/m", vllm_tensor_parallel_size=4)
    assert backend.gpus_per_replica(tp) == 4


def test_exllamav3_and_ct2_use_their_own_device_options(tmp_path: Path) -> None:
    exl = ExLlamaV3Model(model_path=str(tmp_path))
    one = load_plan(exl, tmp_path, GpuPlacement((1,), (5000,)))
    assert one.load_kwargs["device"] == "cuda:1"
    split = load_plan(exl, tmp_path, GpuPlacement((0, 1), (10_240, 5120)))
    assert split.load_kwargs["use_per_device"] == [11.0, 5.5]
    assert "device" not in split.load_kwargs
    # The definition's own split wins over the pool's.
    own = load_plan(
        ExLlamaV3Model(model_path=str(tmp_path), exllama_gpu_split=[20, 4]),
        tmp_path,
        GpuPlacement((0, 1), (10_240, 5120)),
    )
    assert own.load_kwargs["use_per_device"] == [20, 4]
    assert load_plan(exl, tmp_path, None).load_kwargs["device"] == "cuda:0"
    cuda = Ct2Model(model_path="m", device="cuda")
    assert device_options(cuda, GpuPlacement((1,), (900,))) == {"device_index": 1}
    assert device_options(Ct2Model(model_path="m"), GpuPlacement((1,), (900,))) == {}
    assert device_options(cuda, GpuPlacement((1,), (900,), virtual=True)) == {}


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


async def test_a_managed_server_sees_only_its_gpus(tmp_path: Path) -> None:
    """A real spawned server process: its environment names the GPUs it was placed on."""
    binary = tmp_path / "fake-llama-server"
    binary.write_text(f'#!/bin/sh\nexec {sys.executable} {FAKE_SERVER} "$@"\n')
    binary.chmod(0o755)
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF")
    server = {
        "backend": "llama_server",
        "model_path": str(weights),
        "llama_server_binary": str(binary),
        "llama_server_start_timeout_s": 20,
    }
    settings = build_settings(
        {
            "engine": {
                "gpu_budget_mib": [1000, 1200],
                "models": {"one": {**server, "vram_mb": 700}, "split": {**server, "vram_mb": 1500}},
            }
        }
    )
    async with open_pool(settings) as pool:
        await pool.load("one")
        process = pool.model("one").replicas[0].runtime.process  # type: ignore[union-attr]
        environ = _environ(process.pid)
        assert environ["CUDA_VISIBLE_DEVICES"] == "1"
        assert environ["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        await pool.unload("one")
        await pool.load("split")
        process = pool.model("split").replicas[0].runtime.process  # type: ignore[union-attr]
        assert _environ(process.pid)["CUDA_VISIBLE_DEVICES"] == "0,1"
        assert [p.mib for p in pool.snapshot("split").placement] == [(681, 819)]
