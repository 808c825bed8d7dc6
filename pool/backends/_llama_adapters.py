"""LoRA adapters on one llama.cpp context, through llama-cpp-python's adapter API.

llama.cpp loads an adapter into the model (``llama_adapter_lora_init``) and applies a
set of them to a context (``llama_set_adapters_lora``, which changes nothing when the
set is the one applied). A context applies one set at a time, so a replica serves one
adapter per generation; the KV cells a generation leaves were computed with its adapter,
which is why the prompt cache files them under a scope of their own (:func:`cache_key`).

Everything here runs on the replica's worker thread (under its limiter): llama.cpp
contexts are not thread-safe.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pool.backends._prefix_cache import ScopeKey
from pool.backends._protocol import AdapterUse
from pool.errors import BackendError, PoolError

log = logging.getLogger("pool.backends")


@dataclass(slots=True)
class _Loaded:
    handle: Any
    path: Path
    scale: float
    # Distinguishes prompt states of this file and scale from another's of the same name.
    fingerprint: str


class LlamaAdapters:
    """The adapters loaded into one replica's model, and the one its context applies."""

    def __init__(self, llama: Any) -> None:
        self._llama = llama
        self._loaded: dict[str, _Loaded] = {}
        # The (name, scale) the context applies now; None: the base model alone.
        self._applied: tuple[str, float] | None = None
        self.switches = 0

    @property
    def names(self) -> list[str]:
        return list(self._loaded)

    def add(self, name: str, path: Path, scale: float) -> None:
        """Load ``path`` into the model as ``name`` (replacing an adapter of that name)."""
        import llama_cpp

        if not path.is_file():
            raise BackendError(f"LoRA adapter file {path} does not exist")
        handle = llama_cpp.llama_adapter_lora_init(self._llama._model.model, str(path).encode())
        if not handle:
            raise BackendError(
                f"llama.cpp could not load LoRA adapter {path} (not a LoRA GGUF of this"
                " model's architecture and shapes?)"
            )
        if name in self._loaded:
            self.remove(name)
        stat = path.stat()
        fingerprint = hashlib.sha256(
            f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{scale}".encode()
        ).hexdigest()[:16]
        self._loaded[name] = _Loaded(handle, path, scale, fingerprint)

    def remove(self, name: str) -> None:
        """Free the adapter ``name`` (taken off the context first where applied)."""
        import llama_cpp

        loaded = self._loaded.pop(name, None)
        if loaded is None:
            return
        if self._applied is not None and self._applied[0] == name:
            self._set(None)
        llama_cpp.llama_adapter_lora_free(loaded.handle)

    def apply(self, use: AdapterUse | None) -> None:
        """Make the context apply ``use`` (None: no adapter) for the next generation."""
        wanted = None if use is None else (use.name, use.scale)
        if wanted == self._applied:
            return
        if use is not None and use.name not in self._loaded and use.path is not None:
            # Given back when the pool evicted it alone: loaded again for this request.
            self.add(use.name, Path(use.path), use.scale)
        self._set(use)
        self._applied = wanted
        self.switches += 1

    def cache_key(self, key: ScopeKey | None, use: AdapterUse | None) -> ScopeKey | None:
        """The prompt-cache scope of a generation with ``use``: the request's own for
        the base model; for an adapter, a scope of that adapter's file and scale (its
        KV cells differ from the base's for the same tokens)."""
        if key is None or use is None:
            return key
        loaded = self._loaded.get(use.name)
        fingerprint = loaded.fingerprint if loaded is not None else "?"
        tenant, tag = key
        return tenant, f"{tag or ''}#lora:{use.name}:{fingerprint}:{use.scale}"

    def _set(self, use: AdapterUse | None) -> None:
        import llama_cpp

        ctx = self._llama._ctx.ctx
        if use is None:
            result = llama_cpp.llama_set_adapters_lora(ctx, None, 0, None)
        else:
            loaded = self._loaded.get(use.name)
            if loaded is None:
                raise PoolError(
                    "unknown_model",
                    f"LoRA adapter {use.name!r} is not loaded on this model (removed?)",
                )
            adapters = (llama_cpp.llama_adapter_lora_p_ctypes * 1)(loaded.handle)
            scales = (ctypes.c_float * 1)(use.scale)
            result = llama_cpp.llama_set_adapters_lora(ctx, adapters, 1, scales)
        if result != 0:
            raise BackendError(f"llama.cpp could not apply LoRA adapter {use!r} ({result})")
