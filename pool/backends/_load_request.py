"""The admin load body: schema (422) first, then the backend's rules (400).

The schema only checks shapes and signs (``gguf_n_ctx: 0`` is a 422); it is every
registered backend's override fields together, so a field no backend has is a 422 too.
Whether a value suits the model's backend is checked against that backend's
``load_constraints`` table and raises ``invalid_load_request`` (400), as the admin spec
lays out (one value's check: ``pool.config.check_override_value``).

It lives beside the backend registry, which owns every backend's fields and tables.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    NonNegativeFloat,
    PositiveInt,
    create_model,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from pool.backends._registry import get_backend, load_override_models
from pool.config import ModelDefinition, invalid_load_request

if TYPE_CHECKING:
    from pydantic import GetJsonSchemaHandler


class _LoadRequestFields(BaseModel):
    model_config = ConfigDict(extra="forbid")

    replicas: PositiveInt | None = Field(None, description="Replica count for this load only.")
    stay_warm_s: NonNegativeFloat | None = Field(
        None,
        description="The model's stay-warm window for this load only (null: its kind's"
        ' default); every backend takes it (docs/vram.md, "Stay warm").',
    )


# Load overrides of the pool's own model fields, which every backend takes: kept in the
# override patch (and the row's ``load_override``) beside the backend's, never checked
# against a backend's table.
POOL_OVERRIDES = ("stay_warm_s",)


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
        """The override fields that were present in the body (the backend's and the
        pool's own, ``replicas`` aside), ``null`` values included."""
        own = {
            name: getattr(self, name) for name in POOL_OVERRIDES if name in self.model_fields_set
        }
        return {**own, **(self.model_extra or {})}


def load_request_schema() -> type[BaseModel]:
    """The schema of the load body: ``replicas`` and every registered backend's overrides."""
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


def validate_load_request(
    body: LoadRequest, definition: ModelDefinition
) -> tuple[int, dict[str, Any]]:
    """Check ``body`` against the model's backend; return (replicas, override patch).

    Raises:
        PoolError: ``invalid_load_request`` naming the first offending field.
    """
    patch = body.override_patch()
    get_backend(definition.backend).check_load_override(_backend_part(patch))
    replicas = body.replicas if body.replicas is not None else definition.replicas
    if replicas > definition.effective_replica_max:
        raise invalid_load_request(
            f"replicas ({replicas}) exceeds replica_max ({definition.effective_replica_max})",
            "replicas",
        )
    return replicas, patch


def apply_override(definition: ModelDefinition, patch: dict[str, Any]) -> ModelDefinition:
    """The effective definition of one load: ``patch`` over ``definition`` by key presence."""
    effective: ModelDefinition = get_backend(definition.backend).apply_load_override(
        definition, _backend_part(patch)
    )
    own = {name: patch[name] for name in POOL_OVERRIDES if name in patch}
    return effective.model_copy(update=own) if own else effective


def _backend_part(patch: dict[str, Any]) -> dict[str, Any]:
    return {name: value for name, value in patch.items() if name not in POOL_OVERRIDES}


def load_constraints(backend: str) -> dict[str, dict[str, Any]]:
    """A copy of the constraint table of ``backend`` (callers may serialise or mutate it)."""
    return {k: dict(v) for k, v in get_backend(backend).load_constraints.items()}


def load_recommendations(backend: str) -> dict[str, dict[str, Any]]:
    """A copy of the recommendations table of ``backend``."""
    return {k: dict(v) for k, v in get_backend(backend).load_recommendations.items()}
