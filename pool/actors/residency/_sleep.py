"""Whether an eviction may put a model to sleep instead of unloading it (docs/vram.md,
"Sleeping instead of unloading").

A runtime that can sleep (in-process vLLM with its sleep mode, level 1) hands its GPU
memory back and keeps its weights in host RAM, so its next request wakes it in a
fraction of a load. The residency owner lets it sleep only where the host has the RAM:
what the operating system reports available (psutil), less the weights, must leave a
margin free. The RAM of the models already asleep is held, not available, so it counts
against every later sleep; their GPU memory counts as free (the model is unloaded as far
as the gate is concerned).
"""

from __future__ import annotations

from dataclasses import dataclass

_MIB = 1024 * 1024
# What a sleep must leave free of the host's RAM: the larger of these two.
HOST_RAM_MARGIN_MIB = 2048
HOST_RAM_MARGIN_SHARE = 0.1


@dataclass(frozen=True, slots=True)
class HostRam:
    available_mib: int
    total_mib: int

    @property
    def margin_mib(self) -> int:
        return max(HOST_RAM_MARGIN_MIB, int(self.total_mib * HOST_RAM_MARGIN_SHARE))


def read_host_ram() -> HostRam | None:
    """The host's RAM now (psutil, which the ``vllm`` extra brings); None without it.
    Reads /proc: call it on a worker thread."""
    try:
        import psutil
    except ImportError:
        return None
    memory = psutil.virtual_memory()
    return HostRam(int(memory.available) // _MIB, int(memory.total) // _MIB)


def sleep_verdict(need_mib: int | None, ram: HostRam | None) -> tuple[bool, str]:
    """Whether a model whose sleep holds ``need_mib`` of host RAM may sleep (None: it
    cannot), and what the eviction's decision says about it ("" for a model that
    cannot sleep at all)."""
    if need_mib is None:
        return False, ""
    if ram is None:
        return False, "unloads: the host's free RAM cannot be read (psutil is missing)"
    if ram.available_mib - need_mib < ram.margin_mib:
        return False, (
            f"unloads: host RAM is short for a sleep ({need_mib} MiB of weights,"
            f" {ram.available_mib} MiB available, {ram.margin_mib} MiB kept free)"
        )
    return True, (
        f"sleeps (vLLM sleep mode, level 1): {need_mib} MiB of weights to host RAM"
        f" ({ram.available_mib} MiB available); its GPU memory is freed and its next"
        " request wakes it"
    )
