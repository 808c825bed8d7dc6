"""Which runtime failures are a GPU out of memory (pool/backends/_oom.py)."""

from __future__ import annotations

import pytest

from pool.backends import out_of_memory
from pool.errors import BackendError


class OutOfMemoryError(RuntimeError):
    """Named as torch.cuda.OutOfMemoryError is (the pool never imports torch)."""


@pytest.mark.parametrize(
    "text",
    [
        "CUDA out of memory. Tried to allocate 2.00 GiB (GPU 0; 23.65 GiB total capacity)",
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 4096.00 MiB on device 0:"
        " cudaMalloc failed: out of memory",
        "CUDA failed with error out of memory",
        "CUDA error: cudaErrorMemoryAllocation",
        "CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate(handle)",
        "vk::Device::allocateMemory: ErrorOutOfDeviceMemory",
        "ValueError: No available memory for the cache blocks. Try increasing"
        " `gpu_memory_utilization`",
        "llama-server exited with status 1: ... CUDA error: OUT OF MEMORY",
    ],
)
def test_what_runtimes_say(text: str) -> None:
    assert out_of_memory(text)
    assert out_of_memory(BackendError(text))


@pytest.mark.parametrize(
    "text",
    [
        "no GPU has room for model 'm'",
        "stub_fail_load is set for model 'm' (replica 0)",
        "the runtime exited with status -9",
        "",
    ],
)
def test_other_failures_are_not(text: str) -> None:
    assert not out_of_memory(text)
    assert not out_of_memory(BackendError(text))


def test_torch_s_class_and_a_wrapped_cause() -> None:
    assert out_of_memory(OutOfMemoryError("Tried to allocate 20.00 MiB"))
    try:
        try:
            raise OutOfMemoryError("allocation failed")
        except OutOfMemoryError as exc:
            raise BackendError("the engine stopped") from exc
    except BackendError as outer:
        assert out_of_memory(outer)
    # Host memory is not GPU memory.
    assert not out_of_memory(MemoryError())
