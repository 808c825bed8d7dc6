"""Backends: the protocol every runtime implements, and a registry by name.

Backend modules are imported on first use, so a pool that serves only stub models
never imports llama-cpp-python, CTranslate2 or vLLM.
"""

from __future__ import annotations

import importlib

from pool.backends._protocol import (
    Backend,
    Capabilities,
    Decoding,
    FinishReason,
    GenerationRequest,
    GenerationStats,
    ImagePart,
    LoadContext,
    Runtime,
    TextPart,
    ThinkingMode,
    TokenSink,
    Turn,
)

# backend name -> (module, class). A backend whose runtime is not built yet is absent;
# its models still validate and list, and a load fails with a clear message.
_REGISTRY: dict[str, tuple[str, str]] = {
    "stub": ("pool.backends.stub", "StubBackend"),
    "llama_cpp": ("pool.backends.llama_cpp", "LlamaCppBackend"),
    "ct2": ("pool.backends.ct2", "Ct2Backend"),
    "llama_server": ("pool.backends.llama_server", "LlamaServerBackend"),
    "vllm_serve": ("pool.backends.vllm_serve", "VllmServeBackend"),
    "openai_remote": ("pool.backends.openai_remote", "OpenAIRemoteBackend"),
}

_instances: dict[str, Backend] = {}


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``, or an :class:`UnavailableBackend` placeholder."""
    if name in _instances:
        return _instances[name]
    from pool.backends._unavailable import UnavailableBackend

    entry = _REGISTRY.get(name)
    backend: Backend
    if entry is None:
        backend = UnavailableBackend(name)
    else:
        try:
            module = importlib.import_module(entry[0])
        except ImportError as exc:
            # Listing and rows still work; loading says what is missing.
            backend = UnavailableBackend(name, reason=f"{type(exc).__name__}: {exc}")
        else:
            backend = getattr(module, entry[1])()
    _instances[name] = backend
    return backend


__all__ = [
    "Backend",
    "Capabilities",
    "Decoding",
    "FinishReason",
    "GenerationRequest",
    "GenerationStats",
    "ImagePart",
    "LoadContext",
    "Runtime",
    "TextPart",
    "ThinkingMode",
    "TokenSink",
    "Turn",
    "get_backend",
]
