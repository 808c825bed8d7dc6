"""What llama.cpp reports it allocated for a model: its buffers by device and part.

llama.cpp says, as it loads, how large each buffer is on each device
(``load_tensors: CUDA0 model buffer size = 4096.00 MiB``, ``llama_kv_cache: CUDA0 KV
buffer size = 512.00 MiB``). That is the runtime's own split of its memory into
weights and KV cache, which ``/metrics`` exports per model (spec: model-runner-api,
"GPU memory breakdown"). llama-cpp-python has no call that returns these figures and
drops the lines unless ``verbose``, so the pool hooks llama.cpp's log callback: lines
logged on a thread that is loading a model (llama.cpp logs on the calling thread) are
kept for that load, and every line still goes on to llama-cpp-python's own callback.
"""

from __future__ import annotations

import ctypes
import re
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

from pool.backends._protocol import MemorySplit

__all__ = ["buffer_sizes", "capture_load_log", "memory_split"]

# `<device> model buffer size = <n> MiB` and `<device> KV buffer size = <n> MiB`.
_BUFFER = re.compile(r"(?P<device>\S+)\s+(?P<part>model|KV) buffer size\s*=\s*(?P<mib>[\d.]+) MiB")
# Host buffers: the CPU and its mapped or pinned variants (CPU_Mapped, CUDA_Host, ...).
_HOST_SUFFIXES = ("_Mapped", "_Host", "_REPACK", "_AARCH64")

_loading = threading.local()
_hook_lock = threading.Lock()
_hook: Any = None  # the ctypes callback, kept alive for as long as llama.cpp may call it


def _on_gpu(device: str) -> bool:
    return not device.startswith("CPU") and not device.endswith(_HOST_SUFFIXES)


def buffer_sizes(lines: Iterable[str]) -> dict[tuple[str, str], float]:
    """MiB by ``(device, part)`` (part ``model`` or ``KV``) from llama.cpp's load log."""
    sizes: dict[tuple[str, str], float] = {}
    for line in lines:
        for found in _BUFFER.finditer(line):
            key = (found["device"], found["part"])
            sizes[key] = sizes.get(key, 0.0) + float(found["mib"])
    return sizes


def memory_split(sizes: dict[tuple[str, str], float]) -> MemorySplit:
    """The GPU buffers of :func:`buffer_sizes` as weights and KV cache (MiB); host
    buffers (the CPU's, mapped or pinned) do not count."""
    on_gpu = {key: mib for key, mib in sizes.items() if _on_gpu(key[0])}
    weights = sum((mib for (_, part), mib in on_gpu.items() if part == "model"), 0.0)
    kv_cache = sum((mib for (_, part), mib in on_gpu.items() if part == "KV"), 0.0)
    return MemorySplit(weights_mib=round(weights, 3), kv_cache_mib=round(kv_cache, 3))


def _install(llama_cpp: Any) -> None:
    """Route llama.cpp's log through :func:`_relay` (once per process)."""
    global _hook
    with _hook_lock:
        if _hook is not None:
            return
        from llama_cpp import _logger

        forward = _logger.llama_log_callback

        def relay(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
            lines = getattr(_loading, "lines", None)
            if lines is not None:
                lines.append(text.decode("utf-8", "replace"))
            forward(level, text, user_data)

        _hook = llama_cpp.llama_log_callback(relay)
        llama_cpp.llama_log_set(_hook, ctypes.c_void_p(0))


@contextmanager
def capture_load_log(llama_cpp: Any) -> Iterator[list[str]]:
    """Collect what llama.cpp logs on this thread while the block runs (a load)."""
    _install(llama_cpp)
    lines: list[str] = []
    _loading.lines = lines
    try:
        yield lines
    finally:
        _loading.lines = None
