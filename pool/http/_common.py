"""What every route module shares: JSON in and out, errors, request ids, auth checks."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import sys
import uuid
from collections.abc import Awaitable, Callable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from pydantic import BaseModel, ValidationError
from quart import Response, g, has_request_context, request, websocket
from werkzeug.datastructures import Headers

from pool.actors import CALLER, CacheMode, Caller, InferenceRequest
from pool.backends import Turn
from pool.errors import PoolError

if TYPE_CHECKING:
    from pool.actors import Pool
    from pool.config import Settings
    from pool.http._auth import Access, Authenticator

log = logging.getLogger("pool.http")

T = TypeVar("T", bound=BaseModel)
# The response header that carries an error answer's code (STATUS_BY_CODE's), whatever
# the dialect's body looks like.
ERROR_CODE_HEADER = "X-Error-Code"
_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
JSON_TYPE = "application/json"


@dataclass(frozen=True)
class ErrorShape:
    """How a dialect answers an error: the pool's own, OpenAI's, Ollama's, Anthropic's.
    The request pipeline (pool/http/_pipeline.py) and Quart's error handlers
    (pool/http/_app.py) both answer through it, by the blueprint that serves the path."""

    pool_error: Callable[[PoolError], Response]
    schema_error: Callable[[SchemaError], Response]


@dataclass(frozen=True)
class HotRoute:
    """A ``POST`` route the request pipeline calls without Quart's request machinery
    (pool/http/_pipeline.py): its view, and the blueprint whose error shape it answers in
    (None: the pool's own)."""

    view: Callable[[], Awaitable[Response]]
    dialect: str | None = None


@dataclass
class AppContext:
    """What the routes need, built once per app."""

    pool: Pool
    settings: Settings
    auth: Authenticator
    # POST routes by path that the pipeline serves without Quart (the inference hot path).
    hot_routes: dict[str, HotRoute] = field(default_factory=dict)
    # Error shapes by blueprint name; a route outside any blueprint answers in the pool's.
    error_shapes: dict[str, ErrorShape] = field(default_factory=dict)
    # The blueprint whose shape a path no route serves answers in (a 404), by path
    # prefix: a dialect's clients read its errors under the whole of its base URL.
    path_dialects: dict[str, str] = field(default_factory=dict)

    def unrouted_dialect(self, path: str) -> str | None:
        """The blueprint that owns ``path``'s prefix (the longest that matches), if any."""
        owning = [prefix for prefix in self.path_dialects if path.startswith(prefix)]
        return self.path_dialects[max(owning, key=len)] if owning else None

    def error_answer(self, exc: PoolError | SchemaError, dialect: str | None) -> Response:
        """``exc`` in the error shape of ``dialect`` (a blueprint name), with the pool's
        code in ``X-Error-Code``: Ollama's and Anthropic's bodies have no place for it,
        and a client (or tests/http/test_schemathesis.py) tells a 400 for this model
        (``tools_unsupported``) from one for the body by it on every dialect."""
        shape = self.error_shapes.get(dialect or "", POOL_ERRORS)
        if isinstance(exc, SchemaError):
            response = shape.schema_error(exc)
            response.headers[ERROR_CODE_HEADER] = "validation_error"
        else:
            response = shape.pool_error(exc)
            response.headers[ERROR_CODE_HEADER] = exc.code
        return response


@dataclass(slots=True)
class PipelineRequest:
    """The HTTP request (or WebSocket handshake) the pipeline is answering."""

    headers: dict[str, str]  # names in lower case
    body: bytes
    request_id: str
    tenant: str | None = None  # see acting_tenant()


# Set by the request pipeline for every request: the accessors below read it, and
# Quart's own request only where none is set (a view called outside the pipeline).
pipeline_request: ContextVar[PipelineRequest | None] = ContextVar("pipeline_request", default=None)
# Whether the current request's X-Tenant-ID counts (service.tenancy.multi_tenant), set
# with its caller by `require`.
_MULTI_TENANT: ContextVar[bool] = ContextVar("llm_pool_multi_tenant", default=True)


class SchemaError(Exception):
    """A body that fails the schema: 422 ``validation_error`` with the details.

    Each error's ``loc`` is a path of the client's own field names and indexes
    (:func:`client_loc`), so ``param`` and the message never name pydantic's internals.

    Args:
        body: the JSON that failed, against which the paths are read.
        at: where ``body`` sits in the request body (prefixed to each path).
    """

    def __init__(self, exc: ValidationError, body: Any = None, at: tuple[str, ...] = ()) -> None:
        super().__init__(str(exc))
        errors = exc.errors(include_url=False, include_context=False, include_input=False)
        errors = [
            {**e, "loc": (*at, *client_loc(e.get("loc", ()), body, e.get("type") == "missing"))}
            for e in errors
        ]
        # Deepest first (stable): where a value fails every member of a union, the member
        # that matched furthest says the most (`content.0.text`, not "not a string").
        self.errors = sorted(errors, key=lambda e: -len(e["loc"]))


def client_loc(
    loc: tuple[int | str, ...], body: Any, missing: bool = False
) -> tuple[int | str, ...]:
    """``loc`` of a pydantic error as the client's path through ``body``.

    Pydantic's ``loc`` also holds the labels of what it tried: a union member
    (``constrained-str``, ``list[str]``), a tagged union's tag, a validator's name. They
    name no part of the body, so only the parts that do are kept: a key of the object
    the path has reached, an index of its list, and the last part of a ``missing``
    error (the field the object lacks).
    """
    path: list[int | str] = []
    node = body
    for position, part in enumerate(loc):
        key = isinstance(node, dict) and isinstance(part, str) and part in node
        index = isinstance(node, list) and type(part) is int and 0 <= part < len(node)
        if key or index:
            node = node[part]
        elif not (missing and position == len(loc) - 1 and isinstance(node, dict)):
            continue
        path.append(part)
    return tuple(path)


def dumps(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def json_response(
    payload: Any, status: int = 200, headers: dict[str, str] | None = None
) -> Response:
    return Response(dumps(payload), status=status, headers=headers, content_type=JSON_TYPE)


# Error details travel in the pool's own names; the runner API spells these in camelCase.
_DETAIL_NAMES = {
    "queue_depth": "queueDepth",
    "max_depth": "maxDepth",
    "avg_wait_ms": "avgWaitMs",
    "reset_at": "resetAt",
}


def error_body(exc: PoolError) -> dict[str, Any]:
    """``{"error": {"code", "message", ...details}}``."""
    details = {_DETAIL_NAMES.get(k, k): v for k, v in exc.details.items()}
    return {"error": {"code": exc.code, "message": exc.message, **details}}


# What a 503 ``queue_full`` and a 429 ``rate_limit_exceeded`` say about the backpressure
# (spec: model-runner-api, "Backpressure and Rate Limiting"), in the runner's names.
_BACKPRESSURE = ("queue_depth", "avg_wait_ms", "limit", "remaining", "reset_at")


def backpressure_fields(exc: PoolError) -> dict[str, Any]:
    """The backpressure details of ``exc`` (``queueDepth``, ``avgWaitMs``; ``limit``,
    ``remaining``, ``resetAt``) for dialects whose error object has no room for the
    pool's other details; empty for other errors."""
    return {_DETAIL_NAMES.get(k, k): exc.details[k] for k in _BACKPRESSURE if k in exc.details}


def retry_after(exc: PoolError) -> dict[str, str]:
    """``Retry-After`` (whole seconds, at least 1) for an error that says when to retry."""
    if exc.retry_after_s is None:
        return {}
    return {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}


def error_response(exc: PoolError) -> Response:
    return json_response(error_body(exc), exc.status, retry_after(exc))


def schema_error_response(exc: SchemaError) -> Response:
    return json_response(schema_error_body(exc), 422)


# The pool's own error shape: routes outside the dialects' blueprints answer in it.
POOL_ERRORS = ErrorShape(error_response, schema_error_response)


def internal_error_response() -> Response:
    """A 500 that says no more than to read the server's log."""
    return json_response(
        {"error": {"code": "internal_error", "message": "internal error; see the server log"}},
        500,
    )


def schema_error_body(exc: SchemaError) -> dict[str, Any]:
    first = exc.errors[0] if exc.errors else {"loc": (), "msg": "invalid body"}
    where = ".".join(str(p) for p in first.get("loc", ())) or "body"
    body = {
        "error": {
            "code": "validation_error",
            "message": f"{where}: {first.get('msg')}",
            "errors": [
                {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
                for e in exc.errors
            ],
        }
    }
    return body


# Integral numbers written with a fraction or exponent (`3.0`, `1e3`) that fit a 64-bit
# integer are read as integers: JSON Schema counts them as integers, and the strict
# schema check (validate) takes an integer wherever a number is allowed.
_INTEGRAL_LIMIT = 2**63


def _json_number(text: str) -> float | int:
    value = float(text)
    if value.is_integer() and abs(value) < _INTEGRAL_LIMIT:
        return int(value)
    return value


def parse_json(raw: bytes | str) -> Any:
    """Parse a request body; anything but JSON, and JSON with an integer too long to
    read, is a 400 ``invalid_request``."""
    try:
        return json.loads(raw, parse_float=_json_number)
    except UnicodeDecodeError as exc:
        raise PoolError("invalid_request", f"the body is not UTF-8: {exc.reason}") from None
    except json.JSONDecodeError as exc:
        raise PoolError(
            "invalid_request",
            f"the body is not JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})",
        ) from None
    except RecursionError:
        raise PoolError("invalid_request", "the body is nested too deeply") from None
    except ValueError:
        # Not a decode error: Python's limit on reading integers (a denial-of-service
        # guard), the only other ValueError json.loads raises.
        raise PoolError(
            "invalid_request",
            f"the body has an integer of more than {sys.get_int_max_str_digits()} digits",
        ) from None


def validate(model: type[T], data: Any, *, at: tuple[str, ...] = ()) -> T:
    """``data`` as ``model``, or a 422 :class:`SchemaError`.

    Args:
        at: where ``data`` sits in the request body (prefixed to each error's ``loc``).
    """
    try:
        # Strict: the body means what its JSON types say, as the OpenAPI document promises
        # (`0` is not `false`, `"1"` not `1`); an integer still passes for a number.
        return model.model_validate(data, strict=True)
    except ValidationError as exc:
        raise SchemaError(exc, data, at) from None


def chat_request(model: str, turns: list[Turn], **fields: Any) -> InferenceRequest:
    """The neutral request of a chat surface's turns (OpenAI, Ollama).

    One user turn is sent as a single prompt, so models without multi-turn support
    still work with chat clients; a longer conversation needs a multi-turn model.
    """
    if not turns or turns[-1].role not in ("user", "tool"):
        # (or be a tool result; the wording predates tools and is pinned by golden tests)
        raise PoolError("invalid_conversation", "the last message must come from the user")
    return InferenceRequest(model=model, turns=tuple(turns), multi_turn=len(turns) > 1, **fields)


async def raw_body() -> bytes | str:
    """The request body's bytes, unparsed."""
    current = pipeline_request.get()
    return current.body if current is not None else await request.get_data()


async def read_body(model: type[T], *, optional: bool = False) -> T:
    """The request body as ``model``: 400 for non-JSON, 422 for a schema failure.

    A route that authenticates calls this after :func:`require`, so a caller without a
    valid token learns nothing about the body (401 before 400 or 422).
    """
    raw = await raw_body()
    if optional and not raw.strip():
        return model()
    # The content type is not checked: curl -d and Ollama clients send JSON as form data.
    return validate(model, parse_json(raw))


def headers() -> Headers | Mapping[str, str]:
    """Headers of the current HTTP request or WebSocket handshake (ask in lower case)."""
    current = pipeline_request.get()
    if current is not None:
        return current.headers
    return request.headers if has_request_context() else websocket.headers


def new_request_id(sent: str) -> str:
    """The client's ``X-Request-Id`` when it is a sane one, else a fresh id."""
    return sent if _REQUEST_ID.match(sent) else uuid.uuid4().hex


def request_id() -> str:
    current = pipeline_request.get()
    if current is not None:
        return current.request_id
    rid: str = g.get("request_id") or ""
    if not rid:
        rid = new_request_id(headers().get("x-request-id", ""))
        g.request_id = rid
    return rid


_PRIORITY_RANK = {"low": 0, "normal": 1, "high": 2}


def tenant_and_priority() -> tuple[str, str]:
    """The request's tenant and priority: ``X-Tenant-ID`` and ``X-Priority`` (400 when
    malformed), within what the caller's key allows (:func:`require` found it).

    A key that names a tenant makes it the request's tenant; ``X-Tenant-ID`` may repeat
    it, and naming another is 403 ``tenant_forbidden``; with
    ``service.tenancy.multi_tenant`` off the header is not read at all. A key's priority
    is the default and the ceiling: ``X-Priority`` may lower it, and a higher one is
    lowered to it.
    """
    sent = headers().get("x-tenant-id", "").strip() if _MULTI_TENANT.get() else ""
    if len(sent) > 128 or not sent.isprintable():
        raise PoolError(
            "invalid_request", "X-Tenant-ID must be printable and at most 128 characters"
        )
    asked = headers().get("x-priority", "").strip().lower()
    if asked not in ("", "high", "normal", "low"):
        raise PoolError("invalid_request", "X-Priority must be high, normal or low")
    caller = CALLER.get()
    tenant = sent or "default"
    priority = asked or "normal"
    if caller is not None and caller.tenant is not None:
        if sent and sent != caller.tenant:
            raise PoolError(
                "tenant_forbidden",
                f"key {caller.key_name!r} belongs to tenant {caller.tenant!r};"
                " X-Tenant-ID may not name another",
            )
        tenant = caller.tenant
    if caller is not None and caller.priority is not None:
        ceiling = caller.priority
        priority = min(asked or ceiling, ceiling, key=_PRIORITY_RANK.__getitem__)
    _act_for(tenant)
    return tenant, priority


def require(ctx: AppContext, access: Access, *, api_key: bool = False) -> Caller | None:
    """Authenticate the request for ``access`` (401 ``unauthorized`` otherwise) and
    attach its caller, for every later step of the request (:data:`CALLER`).

    Args:
        api_key: the route also takes the key in ``x-api-key`` (Anthropic's Messages).

    Returns:
        The caller its key makes; None for a plain token or an open route.
    """
    sent = headers()
    caller = ctx.auth.authenticate(
        sent.get("authorization"), access, api_key=sent.get("x-api-key") if api_key else None
    )
    # Set on every authenticated request, so nothing carries over from another.
    CALLER.set(caller)
    _MULTI_TENANT.set(ctx.settings.service.tenancy.multi_tenant)
    return caller


def revoked_error(caller: Caller) -> PoolError:
    return PoolError("unauthorized", f"key {caller.key_name!r} was revoked")


def _act_for(tenant: str) -> None:
    current = pipeline_request.get()
    if current is not None:
        current.tenant = tenant
    elif has_request_context():
        g.acting_tenant = tenant


def acting_tenant() -> str | None:
    """The tenant the current HTTP request acts for, once its route read it with
    :func:`tenant_and_priority` (None before, and for routes that act for none)."""
    current = pipeline_request.get()
    if current is not None:
        return current.tenant
    if not has_request_context():
        return None
    tenant: str | None = g.get("acting_tenant")
    return tenant


def rate_limit_headers(
    headers_of: Callable[[str], dict[str, str]], tenant: str | None
) -> dict[str, str]:
    """The ``X-RateLimit-*`` headers of an answer to ``tenant`` (docs/api.md).

    Every answer of a route that acts for a tenant carries them, JSON or streamed,
    success or error: the request pipeline (pool/http/_pipeline.py) adds them as the
    answer's head goes out, so the figures include the request itself. None where the
    tenant has no request limit.
    """
    return {} if tenant is None else headers_of(tenant)


_CACHE_MODES: dict[str, CacheMode] = {"prefix": "prefix", "none": "none", "auto": "auto"}


def cache_headers_in() -> tuple[CacheMode, str | None]:
    """``X-Cache-Mode`` and ``X-Cache-Tag`` (400 when malformed).

    ``prefix`` and ``auto`` (the default) both reuse a cached prefix where the runtime
    keeps one; ``none`` reuses nothing. The tag scopes entries within the tenant.
    """
    raw = headers().get("x-cache-mode")
    mode: CacheMode = "auto"
    if raw is not None:
        found = _CACHE_MODES.get(raw.strip().lower())
        if found is None:
            raise PoolError("invalid_request", "X-Cache-Mode must be prefix, none or auto")
        mode = found
    tag = headers().get("x-cache-tag")
    if tag is not None and (len(tag) > 64 or not tag.isprintable()):
        raise PoolError(
            "invalid_request", "X-Cache-Tag must be printable and at most 64 characters"
        )
    return mode, tag or None


def with_cache(request: InferenceRequest, cache: tuple[CacheMode, str | None]) -> InferenceRequest:
    """``request`` with the cache mode and tag read by :func:`cache_headers_in`."""
    mode, tag = cache
    if mode == request.cache_mode and tag == request.cache_tag:
        return request
    return dataclasses.replace(request, cache_mode=mode, cache_tag=tag)


@dataclass(frozen=True)
class Opened(Generic[T]):
    """A model route's request as every dialect reads it (:func:`open_model_route`)."""

    body: T
    tenant: str
    priority: str
    cache: tuple[CacheMode, str | None]

    def neutral(self, request: InferenceRequest) -> InferenceRequest:
        """``request`` (parsed from :attr:`body`) with the cache headers applied."""
        return with_cache(request, self.cache)


async def open_model_route(ctx: AppContext, model: type[T], *, api_key: bool = False) -> Opened[T]:
    """The opening of every route that runs a model, in one order on every dialect: the
    caller (401), its tenant and priority (400/403), the cache headers (400), then the
    body (422). So a request that fails several checks fails the same one everywhere.

    Args:
        api_key: the route also takes the key in ``x-api-key`` (Anthropic's Messages).
    """
    require(ctx, "inference", api_key=api_key)
    tenant, priority = tenant_and_priority()
    cache = cache_headers_in()
    body = await read_body(model)
    return Opened(body, tenant, priority, cache)


def inference_headers(
    queue_wait_ms: float, gpu_ms: float | None, cached_tokens: int | None = None
) -> dict[str, str]:
    """The runner API's answer headers; the cache figures are what the runtime reused."""
    reused = cached_tokens or 0
    return {
        "X-Queue-Wait-Ms": str(round(queue_wait_ms)),
        "X-GPU-Time-Ms": str(round(gpu_ms or 0)),
        "X-Cache-Hit": "true" if reused > 0 else "false",
        "X-Cache-Tokens-Reused": str(reused),
    }


def logit_bias(
    asked: dict[str, float] | None, where: str = "logit_bias"
) -> tuple[tuple[int, float], ...]:
    """OpenAI's ``logit_bias`` map (token id strings) as pairs; a bad key is a 400."""
    if not asked:
        return ()
    pairs = []
    for key, bias in asked.items():
        try:
            token = int(key)
        except ValueError:
            raise PoolError(
                "invalid_request",
                f"{where}: keys are token ids, not {key[:40]!r}",
                details={"param": where},
            ) from None
        if token < 0:
            raise PoolError("invalid_request", f"{where}: token ids are not negative")
        pairs.append((token, float(bias)))
    return tuple(pairs)
