"""GPU sources: the NVML monitor actor, and virtual GPUs for machines without one.

NVML calls block, so they run in a worker thread. NVML's own errors (no driver, no
device, a GPU lost mid-run) mean "no GPU information": the snapshot is an empty list,
``error`` says why in an operator's words, and the pool runs on. Any other exception
from the reading code (an ``AttributeError`` or ``TypeError`` when nvidia-ml-py changes
its API, a bug here) is logged as an error with its traceback and shown as a failure of
the monitor, never as a machine without GPUs.

``engine.gpu_budget_mib`` on a machine without an NVIDIA GPU (or with
``engine.virtual_gpus``) declares :class:`VirtualGpus` instead, so the VRAM policy runs
(and is tested) with stub models that declare ``stub_vram_mib``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

import trio

from pool.actors.values._snapshots import GpuReading, GpuView

log = logging.getLogger("pool.gpu")

MIB = 1024 * 1024

# What the GPU view says on a machine without a usable NVIDIA GPU (no driver, the
# driver not loaded, no device): plainly, with NVML's own words after it.
NO_NVIDIA_GPU = "no NVIDIA GPU found: models run on the CPU"
NOT_READ_YET = "not read yet"


class NoGpuInformation(Exception):
    """NVML answered with one of its own errors; ``str()`` says why, for an operator."""


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


@contextmanager
def _nvml_errors(pynvml: Any) -> Iterator[None]:
    """NVML's own exceptions become :class:`NoGpuInformation`; anything else passes."""
    try:
        yield
    except pynvml.NVMLError as exc:
        no_gpu = (pynvml.NVMLError_LibraryNotFound, pynvml.NVMLError_DriverNotLoaded)
        if isinstance(exc, no_gpu):
            raise NoGpuInformation(f"{NO_NVIDIA_GPU} (NVML: {exc})") from exc
        raise NoGpuInformation(f"no GPU information (NVML: {exc})") from exc
    except pynvml.NVMLLibraryMismatchError as exc:
        # The driver's NVML is older than nvidia-ml-py's: NVML's error, not ours.
        raise NoGpuInformation(f"no GPU information (NVML: {exc})") from exc


def read_gpus() -> list[GpuReading]:
    """One NVML reading of every GPU (blocking).

    Raises:
        NoGpuInformation: NVML could not be read (its own errors: no driver, no
            device access, a lost GPU). Anything else propagates unchanged.
    """
    try:
        import pynvml
    except ImportError as exc:
        raise NoGpuInformation("no GPU information (nvidia-ml-py is not installed)") from exc

    ours = process_tree(os.getpid())
    with _nvml_errors(pynvml):
        pynvml.nvmlInit()
        try:
            gpus = []
            for index in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
                name = pynvml.nvmlDeviceGetName(handle)
                try:
                    utilization = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100.0
                except pynvml.NVMLError:
                    utilization = None  # e.g. NVMLError_NotSupported on some boards
                gpus.append(
                    GpuReading(
                        index=index,
                        name=name.decode() if isinstance(name, bytes) else str(name),
                        used_mib=int(memory.used) // MIB,
                        total_mib=int(memory.total) // MIB,
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
    """The NVML readings of this machine, refreshed every ``interval_s`` while it has GPUs."""

    def __init__(self, interval_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.gpus: tuple[GpuReading, ...] = ()
        self.error: str | None = NOT_READ_YET
        self._limiter = trio.CapacityLimiter(1)

    def view(self) -> GpuView:
        return GpuView(self.gpus, self.error)

    async def refresh(self) -> None:
        """Read NVML now. Never raises for a failed reading: the view says what went wrong."""
        try:
            gpus = tuple(await trio.to_thread.run_sync(read_gpus, limiter=self._limiter))
        except NoGpuInformation as exc:
            # A machine without NVIDIA is normal; NVML failing where it had GPUs or
            # refusing to answer (permissions, a lost GPU) is worth a warning.
            first = self.error == NOT_READ_YET
            cpu_box = first and str(exc).startswith(NO_NVIDIA_GPU)
            self._show((), str(exc), logging.INFO if cpu_box else logging.WARNING)
        except Exception as exc:
            # Not NVML's own error: an nvidia-ml-py whose API changed, or a bug here.
            # An operator must see it as a failure, never as a machine without GPUs.
            error = (
                f"GPU monitor failed: {type(exc).__name__}: {exc} (a bug, or an"
                " nvidia-ml-py this pool does not support; the log has the traceback)"
            )
            if error != self.error:
                log.error("gpu monitor: reading NVML failed", exc_info=exc)
            self.gpus, self.error = (), error
        else:
            self._show(
                gpus, None if gpus else f"{NO_NVIDIA_GPU} (NVML lists no device)", logging.INFO
            )

    def _show(self, gpus: tuple[GpuReading, ...], error: str | None, level: int) -> None:
        if error != self.error:
            if error is not None:
                log.log(level, "gpu monitor: %s", error)
            elif self.error != NOT_READ_YET:
                log.info("gpu monitor: reading %d GPU(s) again", len(gpus))
        self.gpus, self.error = gpus, error

    async def run(
        self, *, task_status: trio.TaskStatus[GpuMonitor] = trio.TASK_STATUS_IGNORED
    ) -> None:
        await self.refresh()
        task_status.started(self)
        if not self.gpus:
            return  # nothing to poll on this machine; the snapshot stays empty
        while True:
            await trio.sleep(self.interval_s)
            await self.refresh()
