"""A runner load's ``gpuMemoryBudgetMB`` applied to the runtime (spec: model-runner-api,
"Model Loading"), not only compared with the estimate.

The VRAM estimate chain (``_estimate.py``) decides what the budget buys: the longest
context whose estimate fits (the backend's context field, in the steps of its
``load_constraints`` and of the runtime's padding; the estimate grows with the context,
so a binary search finds it),
and, for a backend that sizes its KV cache in bytes (vLLM), the bytes the budget leaves
beside the weights and buffers, so the runtime takes no more than the budget. An
estimate that does not depend on the context (a configured ``vram_mb``, a measured
footprint) can only be compared; a model with no estimate at all gets the load as asked.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pool.actors.residency._residence import Residence
from pool.backends import LoadRequest, apply_override, validate_load_request
from pool.config import invalid_load_request

MIB = 1024 * 1024


def fit_memory_budget(residence: Residence, load: LoadRequest, budget_mib: int) -> LoadRequest:
    """``load`` of the model of ``residence`` with the overrides that keep each replica
    within its share of ``budget_mib`` (the budget over the load's replicas).

    Raises:
        PoolError: ``invalid_load_request`` (400, field ``gpuMemoryBudgetMB``) when the
            model does not fit the budget even at its smallest context.
    """
    actor = residence.actor
    replicas, patch = validate_load_request(load, actor.definition)
    per_replica = budget_mib // replicas
    backend = actor.backend

    def estimate(update: Mapping[str, Any]) -> int | None:
        effective = apply_override(actor.definition, {**patch, **update})
        return residence.vram_estimate(definition=effective, replicas=1).mib

    asked = estimate({})
    if asked is None:
        return load  # nothing to measure the budget against
    fitted: dict[str, Any] = {}
    field = backend.context_field
    context = _context(residence, patch)
    if asked > per_replica:
        if field is None or context is None:
            raise _over_budget(actor.name, asked, per_replica)
        rule = backend.load_constraints.get(field, {})
        step = max(int(rule.get("step", 1)), backend.context_padding)
        fits = _longest_context(
            lambda c: estimate({field: c}), context, int(rule.get("minimum", 1)), step, per_replica
        )
        if fits is None:
            raise _over_budget(actor.name, asked, per_replica, at_least=True)
        fitted[field] = fits
    cache_field = backend.cache_bytes_field
    if cache_field is not None:
        # Beside the weights and buffers (the estimate of a one-token context), the
        # cache gets the rest of the budget; one the load asked smaller stays smaller.
        base = estimate({field: 1} if field is not None else {})
        room = per_replica - (base if base is not None else asked)
        if room <= 0:
            raise _over_budget(actor.name, asked, per_replica, at_least=True)
        cache_bytes = room * MIB
        if isinstance(patch.get(cache_field), int):
            cache_bytes = min(cache_bytes, patch[cache_field])
        fitted[cache_field] = cache_bytes
    if not fitted:
        return load
    return LoadRequest.model_validate({**load.model_dump(exclude_unset=True), **fitted})


def _context(residence: Residence, patch: Mapping[str, Any]) -> int | None:
    """The context a load of ``patch`` gets: its backend's setting, else the model's own."""
    effective = apply_override(residence.actor.definition, dict(patch))
    return residence.actor.backend.memory_profile(effective).context or (
        residence.details.context_length
    )


def _longest_context(
    estimate: Callable[[int], int | None], context: int, minimum: int, step: int, budget: int
) -> int | None:
    """The longest context up to ``context``, a multiple of ``step`` from ``minimum`` on,
    whose estimate is within ``budget``; None when not even the smallest is."""
    step = max(1, step)
    smallest = max(step, -(-minimum // step) * step)

    def within(steps: int) -> bool:
        mib = estimate(steps * step)
        return mib is not None and mib <= budget

    low, high = smallest // step, context // step
    if high < low or not within(low):
        return None
    while low < high:  # the last step count that fits
        middle = (low + high + 1) // 2
        if within(middle):
            low = middle
        else:
            high = middle - 1
    return low * step


def _over_budget(model: str, needs: int, budget: int, *, at_least: bool = False) -> Exception:
    smallest = " even at its smallest context" if at_least else ""
    return invalid_load_request(
        f"model {model!r} needs about {needs} MiB per replica{smallest}, over the budget of"
        f" {budget} MiB",
        "gpuMemoryBudgetMB",
    )
