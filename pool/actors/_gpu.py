"""GPU sources: the NVML monitor actor, and virtual GPUs for machines without one.

NVML calls block, so they run in a worker thread. With no GPU, no driver or no
``pynvml``, the snapshot is an empty list and ``error`` says why; the pool runs on.
``engine.gpu_budget_mib`` on such a machine declares :class:`VirtualGpus` instead, so
the VRAM policy runs (and is tested) with stub models that declare ``stub_vram_mib``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import trio

from pool.actors._snapshots import GpuReading, GpuView

log = logging.getLogger("pool.gpu")

MIB = 1024 * 1024


class GpuSource(Protocol):
    """Where the pool reads GPU memory from (the NVML monitor, virtual GPUs, a test's fake).

    A source may also have ``async def refresh()``, which the pool awaits for a fresh
    reading around a load and while it waits for an evicted model's memory to come
    back; and it may fill :attr:`GpuReading.pool_used_mib` (what the pool's own
    processes hold), which keeps other processes out of a load's measured delta.
    """

    def view(self) -> GpuView: ...


class NoGpus:
    """The GPU source of a pool that runs no monitor (embedded use, tests)."""

    def view(self) -> GpuView:
        return GpuView((), "no GPU monitor is running")


def process_tree(root: int) -> set[int]:
    """``root`` and its descendants (managed runtimes are children of the pool), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            parent = int(stat.rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    tree, todo = {root}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in tree:
                tree.add(child)
                todo.append(child)
    return tree


def _pool_used_mib(pynvml: Any, handle: Any, ours: set[int]) -> int | None:
    """MiB the pool's processes hold on one GPU; None when NVML cannot tell (e.g. a
    container whose process ids NVML does not see)."""
    try:
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except pynvml.NVMLError:
        return None
    mine = [p for p in processes if p.pid in ours]
    if not mine:
        return None
    return sum(int(p.usedGpuMemory or 0) for p in mine) // MIB


def read_gpus() -> list[GpuReading]:
    """One NVML reading of every GPU (blocking). Raises on any NVML problem."""
    import pynvml

    ours = process_tree(os.getpid())
    pynvml.nvmlInit()
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            used = int(memory.used) // MIB
            total = int(memory.total) // MIB
            try:
                utilization = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
            except pynvml.NVMLError:
                utilization = None
            gpus.append(
                GpuReading(
                    index=index,
                    name=name.decode() if isinstance(name, bytes) else str(name),
                    used_mib=used,
                    total_mib=total,
                    utilization=utilization,
                    pool_used_mib=_pool_used_mib(pynvml, handle, ours),
                )
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


# What the pool's runtimes hold: (GPU index, MiB) per loaded replica.
Holdings = Callable[[], Iterable[tuple[int, int]]]


class VirtualGpus:
    """GPUs that exist only as budgets (``engine.gpu_budget_mib`` with no NVIDIA GPU).

    Each loaded replica holds what its runtime reports (``stub_vram_mib``) on the GPU
    it was placed on; ``external_mib`` stands for other processes on the same GPU.
    """

    def __init__(self, budgets_mib: Sequence[int]) -> None:
        self.budgets_mib = tuple(budgets_mib)
        self.external_mib = [0] * len(self.budgets_mib)
        self._holdings: Holdings = lambda: ()

    def bind(self, holdings: Holdings) -> None:
        """Read the pool's holdings through ``holdings`` (the pool binds itself)."""
        self._holdings = holdings

    def view(self) -> GpuView:
        held = [0] * len(self.budgets_mib)
        for index, mib in self._holdings():
            if 0 <= index < len(held):
                held[index] += mib
        return GpuView(
            tuple(
                GpuReading(
                    index=i,
                    name=f"virtual GPU {i}",
                    used_mib=held[i] + self.external_mib[i],
                    total_mib=budget,
                    pool_used_mib=held[i],
                    virtual=True,
                )
                for i, budget in enumerate(self.budgets_mib)
            ),
            None,
        )


class GpuMonitor:
    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.gpus: tuple[GpuReading, ...] = ()
        self.error: str | None = "not read yet"
        self._limiter = trio.CapacityLimiter(1)

    def view(self) -> GpuView:
        return GpuView(self.gpus, self.error)

    async def refresh(self) -> None:
        try:
            self.gpus = tuple(await trio.to_thread.run_sync(read_gpus, limiter=self._limiter))
            self.error = None if self.gpus else "NVML reports no GPUs"
        except Exception as exc:  # noqa: BLE001 - any NVML failure means "no GPU info"
            self.gpus = ()
            self.error = f"no GPU information: {type(exc).__name__}: {exc}"

    async def run(
        self, *, task_status: trio.TaskStatus[GpuMonitor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await self.refresh()
        if self.error:
            log.info("gpu monitor: %s", self.error)
        task_status.started(self)
        if not self.gpus:
            return  # nothing to poll on this machine; the snapshot stays empty
        while True:
            await trio.sleep(self.interval_s)
            await self.refresh()
