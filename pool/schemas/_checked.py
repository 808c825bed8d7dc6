"""Each renderer names the reply model it builds, and tests check the dict against it
where it is built.

The pool renders its replies as plain dicts (or byte templates on the streams): the
JSON on the wire is pinned byte for byte by the golden tests, and building a pydantic
model per reply, let alone per streamed chunk, would cost every request for nothing
the wire shows. So the models of :mod:`pool.schemas._replies` describe the replies (for
the OpenAPI document) and :func:`renders` binds each description to the one function
that builds that dict. With ``LLM_POOL_CHECK_REPLIES=1`` in the environment when the
renderers are imported (the test suite sets it), every dict a renderer returns is
validated, strictly, against its model, so any test that renders a reply keeps the
model and the dict in step; without it the decorator hands the function back
unchanged, and a served pool pays nothing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import wraps
from typing import Any, ParamSpec, TypeVar

from pydantic import BaseModel, TypeAdapter

P = ParamSpec("P")
R = TypeVar("R")

CHECK_REPLIES = os.environ.get("LLM_POOL_CHECK_REPLIES") == "1"


def renders(model: Any) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Mark a function as the source of ``model``'s dicts (a reply model, or a type
    such as ``list[Model]`` or ``Model | None``); check what it returns while
    ``LLM_POOL_CHECK_REPLIES=1``."""
    adapter: TypeAdapter[Any] = TypeAdapter(model)

    def bind(render: Callable[P, R]) -> Callable[P, R]:
        render.__reply_model__ = model  # type: ignore[attr-defined]
        if not CHECK_REPLIES:
            return render

        @wraps(render)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            body = render(*args, **kwargs)
            _described(adapter.validate_python(body, strict=True), render.__qualname__)
            return body

        return checked

    return bind


def _described(value: Any, source: str) -> None:
    """Fail on a field the reply's model does not describe: the models accept fields
    added later (for clients), but the pool sends none that its document leaves out."""
    if isinstance(value, BaseModel):
        if value.model_extra:
            raise AssertionError(
                f"{source} sends {sorted(value.model_extra)} that"
                f" {type(value).__name__} does not describe"
            )
        for name in type(value).model_fields:
            _described(getattr(value, name), source)
    elif isinstance(value, list | tuple):
        for item in value:
            _described(item, source)
    elif isinstance(value, dict):
        for item in value.values():
            _described(item, source)
