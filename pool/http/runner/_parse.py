"""What the runner API's bodies ask for, as the pool's own requests."""

from __future__ import annotations

from pool.backends import LoadRequest, context_field
from pool.config import ModelDefinition
from pool.errors import PoolError
from pool.http._common import validate
from pool.schemas import CacheFlushRequest, RunnerLoadRequest


def load_request(body: RunnerLoadRequest, definition: ModelDefinition) -> LoadRequest:
    """The admin load body a runner load asks for: its ``overrides``, with
    ``maxContextLength`` as the backend's context-length field.

    The admin load body's schema: a bad shape is 422 here, as on the admin route, before
    any rule of the backend (400, checked when the task starts).
    """
    if body.quantization is not None:
        raise PoolError(
            "invalid_load_request",
            "a model id has one quantization; configure another model id for another",
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
