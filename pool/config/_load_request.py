"""The admin load body: schema (422) first, then the backend's rules (400).

The schema only checks shapes and signs (``gguf_n_ctx: 0`` is a 422). Whether a value
suits the model's backend is checked against that backend's ``load_constraints`` table
and raises ``invalid_load_request`` (400), as the admin spec lays out.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt

from pool.config._load_constraints import LOAD_CONSTRAINTS
from pool.config._models import CommonModelFields, ModelDefinition
from pool.errors import PoolError


class LoadRequest(BaseModel):
    """Optional body of ``POST /v1/admin/models/{name}/load``.

    Every field is optional; a field that is present (even as ``null``) becomes part of
    the sparse ``load_override`` patch for this one load. Fields of another backend are
    rejected with 400 ``invalid_load_request``.
    """

    model_config = ConfigDict(extra="forbid")

    replicas: PositiveInt | None = Field(None, description="Replica count for this load only.")
    # llama_cpp
    gguf_n_ctx: PositiveInt | None = None
    gguf_flash_attn: str | None = None
    gguf_type_k: str | None = None
    gguf_type_v: str | None = None
    # exllamav3
    exllama_cache_size: PositiveInt | None = None
    exllama_cache_quant: str | None = None
    exllama_cache_k_bits: Annotated[int, Field(ge=0, le=64)] | None = None
    exllama_cache_v_bits: Annotated[int, Field(ge=0, le=64)] | None = None
    exllama_max_rq_tokens: PositiveInt | None = None
    # vllm and vllm_serve
    vllm_max_model_len: PositiveInt | None = None
    vllm_kv_cache_dtype: str | None = None
    vllm_kv_cache_memory_bytes: PositiveInt | None = None
    vllm_max_pixels: PositiveInt | None = None
    vllm_speculative_method: str | None = None
    vllm_speculative_model: str | None = None
    vllm_num_speculative_tokens: PositiveInt | None = None
    # llama_server
    llama_server_n_ctx: PositiveInt | None = None
    llama_server_image_max_tokens: PositiveInt | None = None
    llama_server_spec_type: str | None = None
    llama_server_spec_draft_n_max: PositiveInt | None = None
    llama_server_spec_draft_p_min: float | None = None

    def override_patch(self) -> dict[str, Any]:
        """The backend fields that were present in the body, ``null`` values included."""
        return {k: getattr(self, k) for k in self.model_fields_set if k != "replicas"}


_NULLABLE_KINDS = {"string_or_null", "integer_or_null"}
_CACHE_QUANT = re.compile(r"^([2-8])(?:,([2-8]))?$")


def _invalid(message: str, field: str | None = None) -> PoolError:
    return PoolError("invalid_load_request", message, details={"field": field} if field else None)


def _check_value(field: str, value: Any, rule: dict[str, Any]) -> None:
    kind = rule["kind"]
    if value is None:
        if kind in _NULLABLE_KINDS or (kind == "enum" and field == "llama_server_spec_type"):
            return
        raise _invalid(f"{field} may not be null", field)
    if kind in ("integer", "integer_or_null"):
        if isinstance(value, bool) or not isinstance(value, int):
            raise _invalid(f"{field} must be an integer", field)
        low, high, step = rule.get("minimum"), rule.get("maximum"), rule.get("step")
        if low is not None and value < low:
            raise _invalid(f"{field} must be at least {low} (got {value})", field)
        if high is not None and value > high:
            raise _invalid(f"{field} must be at most {high} (got {value})", field)
        if step and step > 1 and value % step:
            raise _invalid(f"{field} must be a multiple of {step} (got {value})", field)
        allowed = rule.get("allowed_values")
        if allowed is not None and value not in allowed:
            raise _invalid(f"{field} must be one of {allowed} (got {value})", field)
    elif kind == "float":
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise _invalid(f"{field} must be a finite number", field)
        low, high = rule.get("minimum"), rule.get("maximum")
        if (low is not None and value < low) or (high is not None and value > high):
            raise _invalid(f"{field} must be between {low} and {high} (got {value})", field)
    elif kind in ("enum", "string_or_null"):
        allowed = rule.get("allowed_values")
        if allowed is not None and value not in allowed:
            raise _invalid(f"{field} must be one of {allowed} (got {value!r})", field)
        if field == "exllama_cache_quant" and not _CACHE_QUANT.match(str(value)):
            raise _invalid(
                f"exllama_cache_quant must be '<bits>' or '<k_bits>,<v_bits>' with bits 2-8"
                f" (got {value!r})",
                field,
            )


def _check_exllama_pairs(patch: dict[str, Any]) -> None:
    has_k, has_v = "exllama_cache_k_bits" in patch, "exllama_cache_v_bits" in patch
    if has_k != has_v:
        raise _invalid("exllama_cache_k_bits and exllama_cache_v_bits must be sent together")
    if has_k and "exllama_cache_quant" in patch:
        raise _invalid(
            "exllama_cache_quant cannot be combined with exllama_cache_k_bits/exllama_cache_v_bits"
        )
    if has_k and (patch["exllama_cache_k_bits"] is None) != (patch["exllama_cache_v_bits"] is None):
        raise _invalid(
            "exllama_cache_k_bits and exllama_cache_v_bits must both be null or both set"
        )


def validate_load_request(
    body: LoadRequest, definition: CommonModelFields
) -> tuple[int, dict[str, Any]]:
    """Check ``body`` against the model's backend; return (replicas, override patch).

    Raises:
        PoolError: ``invalid_load_request`` naming the first offending field.
    """
    constraints = LOAD_CONSTRAINTS.get(definition.backend, {})
    patch = body.override_patch()
    for field, value in patch.items():
        rule = constraints.get(field)
        if rule is None:
            raise _invalid(
                f"{field} is not a load override of backend {definition.backend!r}"
                f" (supported: {sorted(constraints) or 'none'})",
                field,
            )
        _check_value(field, value, rule)
    if definition.backend == "exllamav3":
        _check_exllama_pairs(patch)
    replicas = body.replicas if body.replicas is not None else definition.replicas
    if replicas > definition.effective_replica_max:
        raise _invalid(
            f"replicas ({replicas}) exceeds replica_max ({definition.effective_replica_max})",
            "replicas",
        )
    return replicas, patch


def apply_override(definition: ModelDefinition, patch: dict[str, Any]) -> ModelDefinition:
    """The effective definition of one load: ``patch`` over ``definition`` by key presence."""
    update = dict(patch)
    if "exllama_cache_k_bits" in update:
        k, v = update.pop("exllama_cache_k_bits"), update.pop("exllama_cache_v_bits")
        update["exllama_cache_quant"] = None if k is None else f"{k},{v}"
    return definition.model_copy(update=update)
