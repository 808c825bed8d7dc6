"""The Quart-Trio application: routes by surface, JSON errors, request ids."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from pool.actors import RELAY_HEADER, RELAYED, Pool
from pool.config import Settings
from pool.errors import PoolError
from pool.http import (
    _admin,
    _admin_keys,
    _events,
    _messages,
    _ollama,
    _openai,
    _openai_responses,
    _responses,
    _runner,
    _status,
    _ui,
    _usage,
)
from pool.http._auth import Authenticator
from pool.http._common import (
    AppContext,
    SchemaError,
    acting_tenant,
    error_response,
    headers,
    json_response,
    rate_limit_headers,
    request_id,
    schema_error_response,
)
from pool.http._hosts import HostAllowList
from pool.http._openapi import PLACEHOLDER_MODEL, Served, docs_page, openapi_document

log = logging.getLogger("pool.http")


def allow_header(methods: Iterable[str]) -> str:
    """The ``Allow`` value of a 405: the methods of the route, as its OPTIONS lists them."""
    return ", ".join(sorted({m.upper() for m in methods}))


# Werkzeug's HTTP errors that reach us, as the pool's codes.
_HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    415: "unsupported_media_type",
}


def served_by(settings: Settings, auth: Authenticator) -> Served:
    """What the OpenAPI document says of this pool: model names for its examples (an
    enabled generation model first) and which routes it leaves open."""
    models = settings.engine.models
    embedding = [n for n, m in models.items() if getattr(m, "embedding", False)]
    generation = [n for n in models if n not in embedding]
    preferred = [n for n in generation if models[n].enabled] + generation + list(models)
    model = preferred[0] if preferred else PLACEHOLDER_MODEL
    pullable = [n for n, m in models.items() if getattr(m, "source", None)]
    return Served(
        model=model,
        embedding=embedding[0] if embedding else model,
        pullable=pullable[0] if pullable else model,
        inference_open=not auth.guards("inference"),
        admin_open=not auth.guards("admin"),
        lifecycle_open=not auth.guards("admin") and not auth.op_tokens_enabled,
    )


def create_app(
    pool: Pool,
    settings: Settings,
    auth: Authenticator | None = None,
    hosts: HostAllowList | None = None,
) -> QuartTrio:
    """Build the app for ``pool``; every route module registers its own routes.

    Args:
        hosts: the ``Host``/``Origin`` policy; ``serve`` passes one that learns the bound
            port after binding. Default: ``service.allowed_hosts`` for ``service.host``
            and ``service.port``.
    """
    # No static folder: every route the app serves is one of ours, in the OpenAPI document.
    app = QuartTrio("llm-pool", static_folder=None)
    hosts = hosts or HostAllowList(
        settings.service.allowed_hosts,
        bound_host=settings.service.host,
        port=settings.service.port,
    )

    # First of all hooks, before auth and routing: a refused name learns nothing else.
    # A route's blueprint renders the error, so Ollama and OpenAI clients get their shape;
    # a refused WebSocket handshake is answered with the HTTP error, never accepted.
    async def check_host_and_origin() -> None:
        try:
            sent = headers()
            hosts.check(sent.get("host", ""), sent.get("origin"))
        except PoolError as exc:
            log.warning("request_id=%s refused: %s %s", request_id(), exc.code, exc.message)
            raise

    app.before_request(check_host_and_origin)
    app.before_websocket(check_host_and_origin)

    app.config["MAX_CONTENT_LENGTH"] = settings.service.max_body_bytes
    # Generations may run for minutes; the pool's own timeouts bound them.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["BODY_TIMEOUT"] = settings.service.body_timeout_s
    app.config["JSON_SORT_KEYS"] = False
    ctx = AppContext(
        pool=pool, settings=settings, auth=auth or Authenticator(settings.service.auth)
    )
    for module in (
        _responses,
        _openai,
        _openai_responses,
        _messages,
        _ollama,
        _admin,
        _admin_keys,
        _usage,
        _events,
        _runner,
        _status,
        _ui,
    ):
        module.register(app, ctx)
    # The hot routes the lean ASGI layer (pool/http/_lean.py) serves in front of Quart.
    app.extensions["pool.hot_routes"] = ctx.hot_routes
    app.extensions["pool.rate_limiter"] = pool.rate_limiter
    document = openapi_document(served=served_by(settings, ctx.auth))

    @app.get("/openapi.json")
    async def openapi() -> Response:
        """The OpenAPI 3.1 document of this service."""
        return json_response(document)

    @app.get("/docs")
    async def docs() -> Response:
        return Response(docs_page(document), content_type="text/html; charset=utf-8")

    @app.before_request
    async def read_whole_body() -> None:
        # A route that answers without reading the body (unload, an early 401 or 404)
        # would leave its late-arriving bytes unread, and the keep-alive connection then
        # never answered its next request (found by the soak). Every body is read first;
        # Quart caches it for the route, and MAX_CONTENT_LENGTH still gives 413.
        await request.get_data()

    @app.before_request
    async def note_relayed() -> None:
        # A peer relayed this request (docs/cluster.md): serve it here, never onwards.
        # Set for every request: a keep-alive connection's next one may not be relayed.
        RELAYED.set(bool(request.headers.get(RELAY_HEADER)))

    @app.after_request
    async def add_request_id(response: Response) -> Response:
        response.headers["X-Request-Id"] = request_id()
        response.headers.update(rate_limit_headers(pool.rate_limiter, acting_tenant()))
        return response

    @app.errorhandler(PoolError)
    async def pool_error(exc: PoolError) -> Response:
        return error_response(exc)

    @app.errorhandler(SchemaError)
    async def schema_error(exc: SchemaError) -> Response:
        return schema_error_response(exc)

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        code = _HTTP_CODES.get(status, "invalid_request" if status < 500 else "internal_error")
        message = exc.description or exc.name
        headers: dict[str, str] = {}
        if isinstance(exc, MethodNotAllowed):
            # RFC 9110: a 405 names the methods the resource supports. Only Quart answers
            # 405s: the lean layer (pool/http/_lean.py) hands it every method it does not
            # serve itself, so this is the one place that sets Allow.
            headers["Allow"] = allow_header(exc.valid_methods or ())
        if status == 413:
            message = f"the body is larger than {settings.service.max_body_bytes} bytes"
        elif status == 404:
            message = f"no route {request.path}"
        elif status == 405:
            message = f"{request.method} is not allowed on {request.path}"
        if request.path.startswith("/openai/"):
            # The base URL that is OpenAI's API answers in OpenAI's error object throughout.
            return json_response(_openai.openai_error(status, code, message), status, headers)
        return json_response({"error": {"code": code, "message": message}}, status, headers)

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        log.exception(
            "request_id=%s unhandled error on %s %s", request_id(), request.method, request.path
        )
        return json_response(
            {"error": {"code": "internal_error", "message": "internal error; see the server log"}},
            500,
        )

    return app
