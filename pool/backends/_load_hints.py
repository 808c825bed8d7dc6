"""Whether a loaded copy of a model already serves what a request's load hints ask for.

A request may carry load hints: Ollama's ``options.num_ctx``, a runner load's
``maxContextLength`` and overrides (cache types). Ollama reloads the model whenever
``num_ctx`` changes; the pool does not, because a reload costs seconds of every other
client's time and the copy in memory usually serves the request as it is. A hint is met
when the loaded definition covers it:

- a capacity (the backend's context field, the field that sizes its KV cache in bytes):
  the loaded value is at least the asked one, since a smaller context fits in a larger;
- any other field (cache types, speculative decoding, image limits): the loaded value
  equals the asked one, with an unset value read as the field's default in the
  backend's ``load_constraints`` table (``f16`` is ``f16`` whether or not it was named);
- a ``null`` hint asks for nothing.

A quantization is the model id's own (a runner load that names another one is refused
before it gets here), so it is always compatible.

The function is pure: facts in, the first unmet field's reason out (None when every
hint is met). The residency owner reloads only on a reason, and records it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pool.backends._load_request import POOL_OVERRIDES
from pool.backends._registry import get_backend
from pool.config import ModelDefinition


def capacity_fields(backend: str) -> frozenset[str]:
    """The override fields of ``backend`` where a larger loaded value covers a smaller ask."""
    impl = get_backend(backend)
    return frozenset(f for f in (impl.context_field, impl.cache_bytes_field) if f is not None)


def unmet_load_hint(
    loaded: ModelDefinition, hint: Mapping[str, Any], *, context_length: int | None = None
) -> str | None:
    """Why the copy loaded with ``loaded`` cannot serve a request hinting ``hint``; None
    when it can (every hint is met).

    Args:
        loaded: the definition the replicas were loaded with (``active_definition``).
        hint: load override fields a request asked for (already valid for the backend);
            the pool's own fields (``stay_warm_s``) say nothing about what the copy
            serves and are skipped.
        context_length: the context the copy serves where its context field is unset
            (the model's own, from its metadata); None where not known, and then an
            asked context is not taken as met.
    """
    impl = get_backend(loaded.backend)
    capacities = capacity_fields(loaded.backend)
    for field, asked in hint.items():
        if asked is None or field in POOL_OVERRIDES:
            continue
        have = getattr(loaded, field, None)
        if have is None and field == impl.context_field:
            have = context_length
        if field in capacities:
            if have is None or have < asked:
                shown = "its default" if have is None else str(have)
                return f"{field} {asked} asked; the loaded copy has {shown}"
            continue
        rule = impl.load_constraints.get(field, {})
        if have is None:
            have = rule.get("default")
        if have != asked:
            return f"{field} {asked!r} asked; the loaded copy has {have!r}"
    return None
