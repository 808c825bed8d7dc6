"""What a load override value may be: the check of one value against its rule in a
backend's ``load_constraints`` table, and the 400 ``invalid_load_request`` error.

The load body itself (its schema, validation against the model's backend, applying
the override) lives beside the backend registry it needs: pool/backends/_load_request.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from pool.errors import PoolError

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
