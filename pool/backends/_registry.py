"""The backends of this build, one line each; the rest of the pool derives from them.

A backend's module holds everything about it (see :class:`~pool.backends.Backend`): its
config class, load-override fields and tables, context field, capabilities and runtime,
ending with ``BACKEND = TheBackend()``. This table only says where that module is. The
settings' dispatch by ``backend`` name, the names in error messages, the load body's
schema and each model's tables and context field all come from here.

Modules are imported on first use and keep their runtime libraries (llama-cpp-python,
CTranslate2, vLLM, ExLlamaV3) out of their module level, so validating settings that
name a backend costs the import of a small module, never of its engine.
"""

from __future__ import annotations

import importlib
from typing import Any

from pool.backends._protocol import Backend, LoadOverrides
from pool.config import CommonModelFields, UnknownBackendError, use_definition_classes

_MODULES: dict[str, str] = {
    "stub": "pool.backends.stub",
    "llama_cpp": "pool.backends.llama_cpp",
    "llama_server": "pool.backends.llama_server",
    "ct2": "pool.backends.ct2",
    "whisper": "pool.backends.whisper",
    "exllamav3": "pool.backends.exllamav3",
    "vllm": "pool.backends.vllm",
    "vllm_serve": "pool.backends.vllm_serve",
    "openai_remote": "pool.backends.openai_remote",
    "server": "pool.backends.server",
    "piper": "pool.backends.piper",
}

_backends: dict[str, Backend[Any]] = {}


def backend_names() -> tuple[str, ...]:
    """Every registered backend name, in registry order."""
    return tuple(_MODULES)


def get_backend(name: str) -> Backend[Any]:
    """The backend registered as ``name``, its module imported on first use.

    Raises:
        UnknownBackendError: no backend has that name.
        TypeError: the module does not have the shape of a backend module.
    """
    backend = _backends.get(name)
    if backend is None:
        module = _MODULES.get(name)
        if module is None:
            raise UnknownBackendError(name, _MODULES)
        backend = _backends[name] = _checked(name, module)
    return backend


def _checked(name: str, module_name: str) -> Backend[Any]:
    backend = getattr(importlib.import_module(module_name), "BACKEND", None)
    if not isinstance(backend, Backend):
        raise TypeError(f"{module_name}.BACKEND is not a pool.backends.Backend")
    if backend.name != name:
        raise TypeError(
            f"{module_name} is registered as backend {name!r}, but its config class"
            f" {backend.config.__qualname__} says backend {backend.name!r}"
        )
    if set(backend.load_overrides.model_fields) != set(backend.load_constraints):
        raise TypeError(
            f"{module_name}: the fields of {backend.load_overrides.__qualname__} differ from"
            " the keys of its load_constraints"
        )
    return backend


def definition_class(name: object) -> type[CommonModelFields]:
    """The model definition class of the backend named ``name``.

    Raises:
        UnknownBackendError: no backend has that name (or it is not a string).
    """
    if not isinstance(name, str):
        raise UnknownBackendError(name, _MODULES)
    return get_backend(name).config


def context_field(name: str) -> str | None:
    """The load override that sets the context length of backend ``name``, if any."""
    return get_backend(name).context_field


def load_override_models() -> tuple[type[LoadOverrides], ...]:
    """Every registered backend's override schema, in registry order, each once."""
    return tuple(dict.fromkeys(get_backend(name).load_overrides for name in _MODULES))


def register_backend(name: str, module: str) -> Backend[Any]:
    """Add the backend in ``module`` as ``name``, as if it had its line above.

    For tests: the build's own backends are the table above. The module is imported at
    once, so one without a backend's shape fails here.

    Raises:
        ValueError: ``name`` is taken.
        TypeError: the module does not have the shape of a backend module.
    """
    if name in _MODULES:
        raise ValueError(f"backend {name!r} is already registered")
    _MODULES[name] = module
    try:
        return get_backend(name)
    except BaseException:
        del _MODULES[name]
        raise


def unregister_backend(name: str) -> None:
    """Remove a backend added by :func:`register_backend`."""
    del _MODULES[name]
    _backends.pop(name, None)


# Settings read from now on find each backend's model class here.
use_definition_classes(definition_class)
