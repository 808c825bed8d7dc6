"""Bodies of the runner API (``/v1/models/load``, ``/v1/models/unload``, ``/v1/cache/flush``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, WithJsonSchema

from pool.schemas._documented import fields

ModelId = Annotated[str, StringConstraints(min_length=1, max_length=512)]
OpToken = Annotated[str, StringConstraints(min_length=1, max_length=16_384)] | dict[str, Any]


class RunnerLoadRequest(BaseModel):
    """Start loading a configured model; answered with 202 and a task id."""

    # Any quantization is refused with a sentence of its own (pool/http/runner/_parse.py).
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra=fields(
            quantization={
                "type": "null",
                "description": "Must be omitted: a model id has one quantization (use another id).",
            }
        ),
    )

    modelId: ModelId = Field(description="A configured model name.")
    quantization: str | None = Field(
        None,
        description="Optional: the model's own quantization (`awq-4bit`, `fp16`, `q4_k_m`;"
        " any case or separator); another, or one a model without metadata cannot confirm,"
        " is a 400 `invalid_load_request` (a model id has one quantization).",
    )
    maxContextLength: Annotated[int, Field(gt=0, le=10_000_000)] | None = Field(
        None, description="Becomes the backend's context-length load override."
    )
    gpuMemoryBudgetMB: Annotated[int, Field(gt=0)] | None = Field(
        None,
        description="Applied to the runtime, shared by the replicas: the longest context"
        " whose VRAM estimate fits, and for vLLM the KV cache bytes the budget leaves beside"
        " the weights. 400 when not even the smallest context fits.",
    )
    evictModel: ModelId | None = Field(None, description="Unloaded first, to make room.")
    # Checked as the admin load body (`LoadRequest`): the document refers to its schema.
    overrides: Annotated[
        dict[str, Any], WithJsonSchema({"allOf": [{"$ref": "#/components/schemas/LoadRequest"}]})
    ] = Field(
        default_factory=dict,
        description="The admin load body's fields (`LoadRequest`): the load overrides of"
        " the model's backend; another backend's fields are a 400 `invalid_load_request`.",
    )
    verifiedOpToken: OpToken | None = Field(None, description="Signed operation token.")


class RunnerUnloadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    modelId: ModelId
    verifiedOpToken: OpToken | None = None


def _scope(scope: str, *needs: str) -> dict[str, Any]:
    branch: dict[str, Any] = {"properties": {"scope": {"const": scope}}}
    if needs:
        branch["required"] = list(needs)
        branch["properties"] |= {name: {"type": "string", "minLength": 1} for name in needs}
    return branch


class CacheFlushRequest(BaseModel):
    """Scope ``all``; ``model`` needs ``modelId``, ``tenant`` ``tenantId``, ``tag`` ``tag``."""

    model_config = ConfigDict(
        extra="forbid",
        # The route answers 400 for a scope without its name; the schema says so first.
        json_schema_extra={
            "oneOf": [
                _scope("all"),
                _scope("model", "modelId"),
                _scope("tenant", "tenantId"),
                _scope("tag", "tag"),
            ]
        },
    )

    scope: Literal["all", "model", "tenant", "tag"]
    modelId: ModelId | None = None
    tenantId: Annotated[str, StringConstraints(max_length=128)] | None = None
    tag: Annotated[str, StringConstraints(max_length=64)] | None = None
    verifiedOpToken: OpToken | None = None
