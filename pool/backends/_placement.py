"""Where one replica runs: the GPUs the pool's VRAM gate placed it on.

The gate (``pool/actors/residency/_vram.py``) hands each replica a :class:`GpuPlacement`; each
backend turns it into its own option: ``CUDA_VISIBLE_DEVICES`` for a managed server,
``main_gpu``/``tensor_split`` for in-process llama.cpp, a ``gpu_split`` for ExLlamaV3,
a ``device_index`` for CTranslate2.

GPU indices are NVML's, which follow the PCI bus order. CUDA numbers devices fastest
first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``: a managed server gets that order with
its devices; an in-process runtime numbers the devices the pool process itself sees,
which :meth:`GpuPlacement.local_indices` maps to.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class GpuPlacement:
    """The GPUs of one replica in index order, and the MiB planned on each.

    ``virtual``: the GPUs exist only as budgets (``engine.gpu_budget_mib`` on a machine
    with no NVIDIA GPU); in-process runtimes then get no device options, since there
    is no device to name.
    """

    gpus: tuple[int, ...]
    mib: tuple[int, ...]
    virtual: bool = False

    @property
    def split(self) -> tuple[float, ...]:
        """Each GPU's share of the replica (sums to 1; even when nothing was planned)."""
        total = sum(self.mib)
        if total <= 0:
            return tuple(1.0 / len(self.gpus) for _ in self.gpus)
        return tuple(m / total for m in self.mib)

    def scaled(self, mib: int) -> tuple[int, ...]:
        """``mib`` spread over the GPUs in this placement's proportions (whole MiB)."""
        shares = [int(mib * s) for s in self.split]
        shares[0] += mib - sum(shares)
        return tuple(shares)

    def cuda_visible_devices(self) -> str:
        return ",".join(str(g) for g in self.gpus)

    def child_environment(self) -> dict[str, str]:
        """What a managed server's environment needs to see exactly these GPUs."""
        return {
            "CUDA_VISIBLE_DEVICES": self.cuda_visible_devices(),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        }

    def local_indices(self, environ: Mapping[str, str] | None = None) -> tuple[int, ...] | None:
        """The CUDA device numbers of these GPUs inside the pool process.

        The NVML index itself when the pool sees every GPU; its position in the pool's
        own ``CUDA_VISIBLE_DEVICES`` when that lists indices. None when a GPU is not
        visible to the pool (or the variable names devices by UUID).
        """
        visible = (os.environ if environ is None else environ).get("CUDA_VISIBLE_DEVICES")
        if visible is None or not visible.strip():
            return self.gpus
        try:
            order = [int(v) for v in visible.split(",") if v.strip()]
        except ValueError:
            return None
        if any(g not in order for g in self.gpus):
            return None
        return tuple(order.index(g) for g in self.gpus)
