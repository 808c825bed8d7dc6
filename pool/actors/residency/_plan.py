"""A load request checked once: what the residency owner hands a model actor.

Every entry point (admin, runner API, startup, on-demand, Ollama preload, pulls) turns
its body into a :class:`LoadPlan` here, once: the body is validated against the model's
backend and its override applied to the definition. The VRAM gate places the plan and
the model actor carries it out as it is; neither checks it again.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pool.backends import LoadRequest, apply_override, validate_load_request
from pool.config import ModelDefinition


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """One validated load: replica count, the override patch and the definition it gives."""

    replicas: int
    patch: Mapping[str, Any] = field(default_factory=dict)
    # The body asked for replicas or overrides (a loaded model then refuses it).
    explicit: bool = False
    # The model's definition the plan was checked against, and with ``patch`` applied
    # (what the replicas load).
    base: ModelDefinition | None = None
    definition: ModelDefinition | None = None
    # The body named a replica count (a loaded copy with another count does not serve it).
    replicas_asked: bool = False

    def effective(self, current: ModelDefinition) -> ModelDefinition:
        """What to load now: the planned definition, or ``patch`` over ``current`` when
        the model's definition changed since the plan (a pull placed its files)."""
        if self.definition is not None and current is self.base:
            return self.definition
        return apply_override(current, dict(self.patch)) if self.patch else current


def plan_load(
    body: LoadRequest | Mapping[str, Any] | None, definition: ModelDefinition
) -> LoadPlan:
    """Validate ``body`` for a model of ``definition``; the plan of that load.

    Raises:
        pydantic.ValidationError: ``body`` is a mapping that fails the load schema.
        PoolError: ``invalid_load_request`` naming the first offending field.
    """
    if body is None:
        body = LoadRequest()
    elif not isinstance(body, LoadRequest):
        body = LoadRequest.model_validate(dict(body))
    replicas, patch = validate_load_request(body, definition)
    effective = apply_override(definition, patch) if patch else definition
    return LoadPlan(
        replicas,
        patch,
        bool(body.model_fields_set),
        definition,
        effective,
        replicas_asked=body.replicas is not None,
    )
