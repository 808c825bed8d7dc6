"""The hooks tests/http/test_schemathesis.py loads into the ``st`` process.

A request the document calls valid must be served: the only 400 it may get is one whose
code (``X-Error-Code``) the operation's 400 lists in ``x-valid-input-codes`` (the model
it names refuses it; pool/http/_openapi.py). schemathesis' own ``positive_data_acceptance``
looks at statuses only, so the test lets it take those operations' 400s and this check
holds each one to its code.

And the fuzzing loads models with bodies that are valid for them: a load override is
valid for one backend only, so a schema-valid load of a model keeps the fields that the
model's backend takes (``LLM_POOL_TEST_BACKENDS``: the test pool's model -> backend).
"""

from __future__ import annotations

import json
import os
from typing import Any

import schemathesis
from schemathesis import Case, CheckContext, HookContext, Response

from pool.backends import LoadRequest, get_backend
from pool.http._openapi import VALID_INPUT_CODES

_BACKENDS: dict[str, str] = json.loads(os.environ.get("LLM_POOL_TEST_BACKENDS", "{}"))
_ADMIN_LOAD = "/v1/admin/models/{name}/load"
_RUNNER_LOAD = "/v1/models/load"


def _positive(case: Case) -> bool:
    return case.meta is not None and case.meta.generation.mode.is_positive


@schemathesis.check
def valid_input_served(ctx: CheckContext, response: Response, case: Case) -> bool | None:
    """A schema-valid request gets no 400 but one with a code its operation lists."""
    if response.status_code != 400 or not _positive(case):
        return None
    refusal = case.operation.definition.raw["responses"].get("400", {})
    allowed = refusal.get(VALID_INPUT_CODES, [])
    code = (response.headers.get("x-error-code") or [None])[0]
    if code not in allowed:
        raise AssertionError(
            f"A schema-valid request was refused with 400 {code!r}; this operation documents"
            f" only {allowed} for a valid request (x-valid-input-codes).\n{response.text[:500]}"
        )
    return None


def _taken(backend: str) -> set[str]:
    return set(LoadRequest.model_fields) | set(get_backend(backend).load_overrides.model_fields)


def _for_the_model(overrides: Any, model: Any) -> Any:
    """``overrides`` without the fields that ``model``'s backend does not take."""
    backend = _BACKENDS.get(model) if isinstance(model, str) else None
    if backend is None or not isinstance(overrides, dict):
        return overrides  # an unknown model: 404 whatever the body
    return {k: v for k, v in overrides.items() if k in _taken(backend)}


@schemathesis.hook
def before_call(context: HookContext, case: Case, kwargs: dict[str, Any]) -> None:
    if not _positive(case) or case.method != "POST":
        return
    body = case.body
    if case.path == _ADMIN_LOAD and isinstance(body, dict):
        case.body = _for_the_model(body, (case.path_parameters or {}).get("name"))
    elif case.path == _RUNNER_LOAD and isinstance(body, dict):
        model = body.get("modelId")
        mapped = {**body, "overrides": _for_the_model(body.get("overrides", {}), model)}
        backend = _BACKENDS.get(model) if isinstance(model, str) else None
        if backend is not None and get_backend(backend).context_field is None:
            mapped.pop("maxContextLength", None)  # becomes a context override it lacks
        case.body = mapped
