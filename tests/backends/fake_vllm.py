"""A stand-in for vLLM at the boundary the in-process ``vllm`` backend calls, for tests
of the pool around the engine (vLLM itself runs in its own environment: vllm_in_env.py).

It follows vLLM 0.32's signatures where the backend touches them: ``AsyncEngineArgs``
takes ``enable_sleep_mode`` (default False) with the other engine arguments and builds
a config whose ``model_config.enable_sleep_mode`` carries it;
``AsyncLLM.from_vllm_config(vllm_config, ..., stat_loggers=..., disable_log_stats=...)``
starts an engine; ``AsyncLLM.sleep(level=1, mode="abort")``, ``AsyncLLM.wake_up(tags=None)``
(True once fully awake) and ``AsyncLLM.is_sleeping()`` are coroutines, and sleeping an
engine started without sleep mode fails, as vLLM's worker does (``vllm_contract.py``
holds these signatures to the source of the vLLM that scripts/build-vllm-env installs).
Each engine holds GPU memory in :class:`FakeGpu` (weights plus KV cache while awake, a
CUDA context always), so the pool's GPU source sees what a sleep hands back. No request
is served: generation is vLLM's own.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from pool.actors import GpuReading, GpuView

# What one fake engine holds on the GPU.
WEIGHTS_MIB = 2000
KV_CACHE_MIB = 1500
CONTEXT_MIB = 300


@dataclass
class FakeGpu:
    """One real-looking GPU (not virtual): what the fake engines hold on it, as NVML
    would read the pool's processes."""

    total_mib: int = 8192
    held: dict[int, int] = field(default_factory=dict)  # engine id -> MiB

    def view(self) -> GpuView:
        used = sum(self.held.values())
        reading = GpuReading(0, "Fake GPU", used, self.total_mib, pool_used_mib=used)
        return GpuView((reading,), None)


class EngineArgs:
    """``vllm.engine.arg_utils.AsyncEngineArgs``: the arguments the backend passes."""

    def __init__(
        self, model: str, *, enable_sleep_mode: bool = False, disable_log_stats: bool = False,
        **arguments: Any,
    ) -> None:  # fmt: skip
        self.model = model
        self.enable_sleep_mode = enable_sleep_mode
        self.arguments = arguments

    def create_engine_config(self, usage_context: Any = None) -> Any:
        model_config = types.SimpleNamespace(
            model=self.model, enable_sleep_mode=self.enable_sleep_mode
        )
        return types.SimpleNamespace(model_config=model_config, arguments=self.arguments)


class FakeTokenizer:
    chat_template = None
    bos_token = ""
    eos_token = "</s>"
    bos_token_id = None
    all_special_ids: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


class FakeAsyncLLM:
    """``vllm.v1.engine.async_llm.AsyncLLM`` as far as the backend's engine host uses it."""

    gpu: FakeGpu
    engines: list[FakeAsyncLLM]

    def __init__(self, vllm_config: Any) -> None:
        self.vllm_config = vllm_config
        self.errored = False
        self.dead_error: BaseException | None = None
        self.level = 0
        self.calls: list[str] = []
        self.shut_down = False
        self.gpu.held[id(self)] = CONTEXT_MIB + WEIGHTS_MIB + KV_CACHE_MIB

    @classmethod
    def from_vllm_config(
        cls,
        vllm_config: Any,
        start_engine_loop: bool = True,
        usage_context: Any = None,
        stat_loggers: list[Any] | None = None,
        enable_log_requests: bool = False,
        aggregate_engine_logging: bool = False,
        disable_log_stats: bool = False,
        client_addresses: dict[str, str] | None = None,
        client_count: int = 1,
        client_index: int = 0,
    ) -> FakeAsyncLLM:
        engine = cls(vllm_config)
        cls.engines.append(engine)
        return engine

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if not self.vllm_config.model_config.enable_sleep_mode:
            raise ValueError("Sleep mode is not enabled in the model config")
        self.calls.append(f"sleep({level})")
        self.level = level
        # Level 1: the weights go to host RAM, the KV cache is dropped.
        self.gpu.held[id(self)] = CONTEXT_MIB

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        self.calls.append("wake_up")
        self.level = 0
        self.gpu.held[id(self)] = CONTEXT_MIB + WEIGHTS_MIB + KV_CACHE_MIB
        return True  # fully awake: every tag was woken

    async def is_sleeping(self) -> bool:
        return self.level > 0

    def get_tokenizer(self) -> FakeTokenizer:
        return FakeTokenizer()

    def shutdown(self, timeout: float | None = None) -> None:
        self.calls.append("shutdown")
        self.shut_down = True
        self.gpu.held.pop(id(self), None)


class StatLoggerBase:
    pass


def install(monkeypatch: pytest.MonkeyPatch, gpu: FakeGpu) -> type[FakeAsyncLLM]:
    """Make ``import vllm`` (and the modules the backend imports) give these fakes for
    one test; the engines they start hold memory on ``gpu``."""
    monkeypatch.setattr(FakeAsyncLLM, "gpu", gpu, raising=False)
    monkeypatch.setattr(FakeAsyncLLM, "engines", [], raising=False)
    modules = {
        "vllm": {},
        "vllm.v1": {},
        "vllm.v1.engine": {},
        "vllm.v1.engine.async_llm": {"AsyncLLM": FakeAsyncLLM},
        "vllm.v1.metrics": {},
        "vllm.v1.metrics.loggers": {"StatLoggerBase": StatLoggerBase},
        "vllm.engine": {},
        "vllm.engine.arg_utils": {"AsyncEngineArgs": EngineArgs},
        "vllm.usage": {},
        "vllm.usage.usage_lib": {
            "UsageContext": types.SimpleNamespace(ENGINE_CONTEXT="ENGINE_CONTEXT")
        },
    }
    for name, attributes in modules.items():
        module = types.ModuleType(name)
        module.__path__ = []  # a package, so its submodules import
        for key, value in attributes.items():
            setattr(module, key, value)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", "0")
    return FakeAsyncLLM
