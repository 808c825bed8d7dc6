"""The GPU monitor actor: polls NVML on an interval and publishes a snapshot.

NVML calls block, so they run in a worker thread. With no GPU, no driver or no
``pynvml``, the snapshot is an empty list and ``error`` says why; the pool runs on.
"""

from __future__ import annotations

import logging

import trio

from pool.actors._snapshots import GpuReading, GpuView

log = logging.getLogger("pool.gpu")


def read_gpus() -> list[GpuReading]:
    """One NVML reading of every GPU (blocking). Raises on any NVML problem."""
    import pynvml

    pynvml.nvmlInit()
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            used = int(memory.used) // (1024 * 1024)
            total = int(memory.total) // (1024 * 1024)
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
                )
            )
        return gpus
    finally:
        pynvml.nvmlShutdown()


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
