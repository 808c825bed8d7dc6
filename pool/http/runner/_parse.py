"""What the runner API's bodies ask for, as the pool's own requests."""

from __future__ import annotations

from pool.actors import quantization_name, same_quantization
from pool.backends import LoadRequest, context_field
from pool.config import ModelDefinition, invalid_load_request
from pool.errors import PoolError
from pool.http._common import validate
from pool.schemas import CacheFlushRequest, RunnerLoadRequest


def load_request(
    body: RunnerLoadRequest, definition: ModelDefinition, quantization: str | None
) -> LoadRequest:
    """The admin load body a runner load asks for: its ``overrides``, with
    ``maxContextLength`` as the backend's context-length field. ``quantization`` (the
    model's own, from its metadata) is what a ``quantization`` in the body must name.

    The admin load body's schema: a bad shape is 422 here, as on the admin route, before
    any rule of the backend (400, checked when the task starts).
    """
    if body.quantization is not None and not same_quantization(body.quantization, quantization):
        # A model id has one set of weights: another quantization is another model id.
        if quantization:
            said = f"is {quantization_name(quantization)}, not {body.quantization!r}"
        else:
            said = f"does not say its quantization, so {body.quantization!r} cannot be checked"
        raise invalid_load_request(
            f"model {body.modelId!r} {said}; a model id has one quantization (leave the"
            " field out, or configure a model id for the other one)",
            "quantization",
        )
    load = validate(LoadRequest, body.overrides, at=("overrides",))
    if body.maxContextLength is not None:
        field = context_field(definition.backend)
        if field is None:
            raise PoolError(
                "invalid_load_request",
                f"backend {definition.backend!r} has no context-length override",
            )
        load = validate(LoadRequest, {**body.overrides, field: body.maxContextLength})
    return load


def check_flush_scope(body: CacheFlushRequest) -> None:
    """Each scope names what it flushes (400 otherwise)."""
    if body.scope == "model" and not body.modelId:
        raise PoolError("invalid_request", "scope model needs modelId")
    if body.scope == "tenant" and not body.tenantId:
        raise PoolError("invalid_request", "scope tenant needs tenantId")
    if body.scope == "tag" and not body.tag:
        raise PoolError("invalid_request", "scope tag needs tag")
