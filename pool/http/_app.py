"""The Quart-Trio application: the routes of every surface behind the one request
pipeline (pool/http/_pipeline.py), and the errors Quart itself answers."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from quart import (
    Blueprint,
    Response,
    has_request_context,
    has_websocket_context,
    request,
    websocket,
)
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, MethodNotAllowed

from pool.actors import Pool
from pool.config import Settings
from pool.errors import STATUS_BY_CODE, PoolError
from pool.http._auth import Authenticator
from pool.http._common import (
    AppContext,
    SchemaError,
    internal_error_response,
    json_response,
    request_id,
)
from pool.http._hosts import HostAllowList
from pool.http._openapi import (
    DOCS_PAGE,
    OPENAPI_JSON,
    PLACEHOLDER_MODEL,
    Served,
    docs_page,
    openapi_document,
)
from pool.http._pipeline import RequestPipeline
from pool.http._route import serves
from pool.http._surfaces import SURFACES
from pool.http.openai._render import openai_error

log = logging.getLogger("pool.http")


def allow_header(methods: Iterable[str]) -> str:
    """The ``Allow`` value of a 405: the methods of the route, as its OPTIONS lists them."""
    return ", ".join(sorted({m.upper() for m in methods}))


# Werkzeug's HTTP errors that reach us, as the pool's codes.
_HTTP_CODES = {
    404: "not_found",
    405: "method_not_allowed",
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
    """Build the app for ``pool``; every route module registers its own routes. Every
    request reaches them through the request pipeline (:func:`pipeline_of`).

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

    # The body's size and arrival time are the pipeline's to bound; Quart gets it whole.
    # Generations may run for minutes; the pool's own timeouts bound them.
    app.config["RESPONSE_TIMEOUT"] = None
    app.config["JSON_SORT_KEYS"] = False
    # Quart's own bound (16 MiB) would refuse a multipart upload (the audio routes' forms)
    # that service.max_body_bytes allows; the pipeline has already bounded the body.
    app.config["MAX_CONTENT_LENGTH"] = settings.service.max_body_bytes
    ctx = AppContext(
        pool=pool, settings=settings, auth=auth or Authenticator(settings.service.auth)
    )
    for surface in SURFACES:
        surface.register(app, ctx)
    pipeline = RequestPipeline(
        app.asgi_app,
        ctx,
        lambda: app.url_map.bind(settings.service.host),
        hosts,
        settings.service,
        pool.rate_limit_headers,
        traced=pool.traced,
    )
    app.asgi_app = pipeline  # type: ignore[method-assign,assignment]
    app.extensions["pool.pipeline"] = pipeline
    _register_document(app, openapi_document(served=served_by(settings, ctx.auth)))

    # A view's error, in the shape of the blueprint that serves it (the pipeline answers
    # the hot routes' errors with the same shapes).
    @app.errorhandler(PoolError)
    async def pool_error(exc: PoolError) -> Response:
        return ctx.error_answer(exc, _blueprint())

    @app.errorhandler(SchemaError)
    async def schema_error(exc: SchemaError) -> Response:
        return ctx.error_answer(exc, _blueprint())

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        code = _HTTP_CODES.get(status, "invalid_request" if status < 500 else "internal_error")
        message = exc.description or exc.name
        headers: dict[str, str] = {}
        if isinstance(exc, MethodNotAllowed):
            # RFC 9110: a 405 names the methods the resource supports. Only Quart answers
            # 405s: the pipeline hands it every method a hot route does not serve, so
            # this is the one place that sets Allow.
            headers["Allow"] = allow_header(exc.valid_methods or ())
        if status == 404:
            message = f"no route {request.path}"
        elif status == 405:
            message = f"{request.method} is not allowed on {request.path}"
        if STATUS_BY_CODE.get(code) == status:
            # In the shape of the dialect the path belongs to (a 405: its routes', a 404:
            # the owner of its prefix), as the dialect's clients read errors.
            dialect = pipeline.dialect(request.path, request.method)
            answer = ctx.error_answer(PoolError(code, message), dialect)
            answer.headers.update(headers)
            return answer
        if request.path.startswith("/openai/"):
            # The base URL that is OpenAI's API answers in OpenAI's error object throughout.
            return json_response(openai_error(status, code, message), status, headers)
        return json_response({"error": {"code": code, "message": message}}, status, headers)

    @app.errorhandler(Exception)
    async def unexpected(exc: Exception) -> Response:
        if has_request_context():
            log.exception(
                "request_id=%s unhandled error on %s %s",
                request_id(),
                request.method,
                request.path,
            )
            return internal_error_response()
        # A WebSocket's: its route accepted the handshake, so the client learns of it from
        # the close code, 1011 "internal error" (Quart would close with 1000, normal).
        log.exception("request_id=%s unhandled error on WEBSOCKET %s", request_id(), websocket.path)
        await websocket.accept()  # idempotent; a socket not yet accepted is closed the same
        with contextlib.suppress(RuntimeError):  # Quart's: the route had closed it already
            await websocket.close(1011, "internal error; see the server log")
        return internal_error_response()

    return app


def _register_document(app: QuartTrio, document: dict[str, Any]) -> None:
    """The OpenAPI document and its docs page, open to all (they hold no secrets)."""
    blueprint = Blueprint("document", __name__)

    @serves(blueprint, OPENAPI_JSON)
    async def openapi() -> Response:
        """The OpenAPI 3.1 document of this service."""
        return json_response(document)

    @serves(blueprint, DOCS_PAGE)
    async def docs() -> Response:
        return Response(docs_page(document), content_type="text/html; charset=utf-8")

    app.register_blueprint(blueprint)


def _blueprint() -> str | None:
    """The blueprint serving the current request or WebSocket (None: the app's own)."""
    if has_request_context():
        return request.blueprint
    return websocket.blueprint if has_websocket_context() else None


def pipeline_of(app: QuartTrio) -> RequestPipeline:
    """The request pipeline :func:`create_app` put in front of ``app``'s routes."""
    pipeline: RequestPipeline = app.extensions["pool.pipeline"]
    return pipeline
