"""Whether a runtime's failure was a GPU running out of memory.

Each runtime says it in its own words: PyTorch raises ``torch.cuda.OutOfMemoryError``
(vLLM, ExLlamaV3), CTranslate2 and llama.cpp raise or log CUDA's own text
(``CUDA failed with error out of memory``, ``cudaMalloc failed: out of memory``), vLLM
finds no room for its KV cache, and a managed server's exit reason carries the tail of
its log. This module is the one place that reads them, so that the pool's record of an
out-of-memory (``/health``'s ``gpu_oom``) does not depend on which backend failed.
"""

from __future__ import annotations

import re

# Exception classes by name: the pool imports no torch, so it cannot name the class.
_OUT_OF_MEMORY_TYPES = frozenset({"OutOfMemoryError"})

_OUT_OF_MEMORY_TEXT = re.compile(
    r"out of memory"  # CUDA, cuBLAS, CTranslate2, llama.cpp, torch's own message
    r"|cudaErrorMemoryAllocation"
    r"|CUBLAS_STATUS_ALLOC_FAILED"
    r"|ErrorOutOfDeviceMemory"  # Vulkan (llama.cpp's Vulkan build)
    r"|No available memory for the cache blocks",  # vLLM: the weights left no KV cache
    re.IGNORECASE,
)


def out_of_memory(failure: BaseException | str) -> bool:
    """Whether ``failure`` (an exception, its chain included, or a runtime's exit reason)
    reports a GPU out of memory."""
    if isinstance(failure, str):
        return _OUT_OF_MEMORY_TEXT.search(failure) is not None
    seen: set[int] = set()
    exc: BaseException | None = failure
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if type(exc).__name__ in _OUT_OF_MEMORY_TYPES or _OUT_OF_MEMORY_TEXT.search(str(exc)):
            return True
        exc = exc.__cause__ or exc.__context__
    return False
