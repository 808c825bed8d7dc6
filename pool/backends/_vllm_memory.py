"""What ``vllm serve`` says its GPU memory holds: the weights and the KV cache.

vLLM's GPU workers log both as they start (``Model loading took 15.2 GiB memory and
12.1 seconds``, ``Available KV cache memory: 40.5 GiB``), one line each per worker, so
a tensor-parallel replica's figures are the sums over its workers. That is vLLM's own
split, which ``/metrics`` exports; where the lines are missing (vLLM on the CPU logs
neither) the split is unknown.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from pool.backends._protocol import MemorySplit

__all__ = ["VLLM_MEMORY_LINES", "vllm_memory_split"]

_WEIGHTS = re.compile(r"Model loading took (?P<gib>[\d.]+) GiB memory")
_KV_CACHE = re.compile(r"Available KV cache memory: (?P<gib>[\d.]+) GiB")
# The output lines a replica keeps for :func:`vllm_memory_split`.
VLLM_MEMORY_LINES = re.compile(r"Model loading took [\d.]+ GiB memory|Available KV cache memory: ")


def vllm_memory_split(lines: Iterable[str]) -> MemorySplit | None:
    """Weights and KV cache in MiB from vLLM's startup lines; None unless both are there."""
    weights = kv_cache = 0.0
    seen_weights = seen_kv = False
    for line in lines:
        if found := _WEIGHTS.search(line):
            weights += float(found["gib"]) * 1024
            seen_weights = True
        if found := _KV_CACHE.search(line):
            kv_cache += float(found["gib"]) * 1024
            seen_kv = True
    if not (seen_weights and seen_kv):
        return None
    return MemorySplit(weights_mib=round(weights, 3), kv_cache_mib=round(kv_cache, 3))
