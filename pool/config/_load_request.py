"""The admin load body: schema (422) first, then the backend's rules (400).

The schema only checks shapes and signs (``gguf_n_ctx: 0`` is a 422); it is every
registered backend's override fields together, so a field no backend has is a 422 too.
Whether a value suits the model's backend is checked against that backend's
``load_constraints`` table and raises ``invalid_load_request`` (400), as the admin spec
lays out.

The backends own their fields and tables (pool/backends), and they import this package,
so both are looked up in the backend registry when a body is checked, never at import.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PositiveInt,
    create_model,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from pool.config._models import ModelDefinition
from pool.errors import PoolError

if TYPE_CHECKING:
    from pydantic import GetJsonSchemaHandler

    from pool.backends import Backend


def _backend(name: str) -> Backend:
    from pool.backends import get_backend

    return get_backend(name)


class _LoadRequestFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: PositiveInt | None = Field(None, description="Replica count for this load only.")


class LoadRequest(_LoadRequestFields):
    """Optional body of ``POST /v1/admin/models/{name}/load``.

    Every field is optional; a field that is present (even as ``null``) becomes part of
    the sparse ``load_override`` patch for this one load. The fields are ``replicas`` and
    every backend's live load overrides; fields of another backend than the model's are
    rejected with 400 ``invalid_load_request``.
    """

    # The backend fields are checked by the registry's schema, then kept as extras.
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="wrap")
    @classmethod
    def _backend_fields(cls, data: Any, handler: ModelWrapValidatorHandler[Self]) -> Self:
        if isinstance(data, Mapping):
            checked = load_request_schema().model_validate(data)
            # In the body's order, so "the first offending field" is the client's first.
            data = {field: getattr(checked, field) for field in data}
        return handler(data)

    @classmethod
    def __get_pydantic_json_schema__(
        cls, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return handler(load_request_schema().__pydantic_core_schema__)

    def override_patch(self) -> dict[str, Any]:
        """The backend fields that were present in the body, ``null`` values included."""
        return dict(self.model_extra or {})


def load_request_schema() -> type[BaseModel]:
    """The schema of the load body: ``replicas`` and every registered backend's overrides."""
    from pool.backends import load_override_models

    return _combined_schema(load_override_models())


@functools.lru_cache(maxsize=8)
def _combined_schema(models: tuple[type[BaseModel], ...]) -> type[BaseModel]:
    fields: dict[str, tuple[type[BaseModel], FieldInfo]] = {}
    for model in models:
        for name, info in model.model_fields.items():
            first, seen = fields.setdefault(name, (model, info))
            if _shape(seen) != _shape(info):
                raise TypeError(
                    f"load override {name} has two schemas: {first.__qualname__} and"
                    f" {model.__qualname__}"
                )
    return create_model(  # type: ignore[call-overload, no-any-return]
        "LoadRequest",
        __base__=_LoadRequestFields,
        __doc__=LoadRequest.__doc__,
        **{name: (info.annotation, info) for name, (_, info) in fields.items()},
    )


def _shape(info: FieldInfo) -> tuple[Any, ...]:
    return info.annotation, tuple(info.metadata), info.default


_NULLABLE_KINDS = {"string_or_null", "integer_or_null"}


def invalid_load_request(message: str, field: str | None = None) -> PoolError:
    """The 400 ``invalid_load_request`` error, naming ``field`` in its details."""
    return PoolError("invalid_load_request", message, details={"field": field} if field else None)


def check_override_value(field: str, value: Any, rule: Mapping[str, Any]) -> None:
    """Check one override value against its ``load_constraints`` rule.

    Raises:
        PoolError: ``invalid_load_request`` naming ``field``.
    """
    kind = rule["kind"]
    if value is None:
        if kind in _NULLABLE_KINDS:
            return
        raise invalid_load_request(f"{field} may not be null", field)
    if kind in ("integer", "integer_or_null"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise invalid_load_request(f"{field} must be an integer", field)
        low, high, step = rule.get("minimum"), rule.get("maximum"), rule.get("step")
        if low is not None and value < low:
            raise invalid_load_request(f"{field} must be at least {low} (got {value})", field)
        if high is not None and value > high:
            raise invalid_load_request(f"{field} must be at most {high} (got {value})", field)
        if step and step > 1 and value % step:
            raise invalid_load_request(f"{field} must be a multiple of {step} (got {value})", field)
        allowed = rule.get("allowed_values")
        if allowed is not None and value not in allowed:
            raise invalid_load_request(f"{field} must be one of {allowed} (got {value})", field)
    elif kind == "float":
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise invalid_load_request(f"{field} must be a finite number", field)
        low, high = rule.get("minimum"), rule.get("maximum")
        if (low is not None and value < low) or (high is not None and value > high):
            raise invalid_load_request(
                f"{field} must be between {low} and {high} (got {value})", field
            )
    elif kind in ("enum", "string_or_null"):
        allowed = rule.get("allowed_values")
        if allowed is not None and value not in allowed:
            raise invalid_load_request(f"{field} must be one of {allowed} (got {value!r})", field)


def validate_load_request(
    body: LoadRequest, definition: ModelDefinition
) -> tuple[int, dict[str, Any]]:
    """Check ``body`` against the model's backend; return (replicas, override patch).

    Raises:
        PoolError: ``invalid_load_request`` naming the first offending field.
    """
    patch = body.override_patch()
    _backend(definition.backend).check_load_override(patch)
    replicas = body.replicas if body.replicas is not None else definition.replicas
    if replicas > definition.effective_replica_max:
        raise invalid_load_request(
            f"replicas ({replicas}) exceeds replica_max ({definition.effective_replica_max})",
            "replicas",
        )
    return replicas, patch


def apply_override(definition: ModelDefinition, patch: dict[str, Any]) -> ModelDefinition:
    """The effective definition of one load: ``patch`` over ``definition`` by key presence."""
    return _backend(definition.backend).apply_load_override(definition, patch)


def load_constraints(backend: str) -> dict[str, dict[str, Any]]:
    """A copy of the constraint table of ``backend`` (callers may serialise or mutate it)."""
    return {k: dict(v) for k, v in _backend(backend).load_constraints.items()}


def load_recommendations(backend: str) -> dict[str, dict[str, Any]]:
    """A copy of the recommendations table of ``backend``."""
    return {k: dict(v) for k, v in _backend(backend).load_recommendations.items()}
