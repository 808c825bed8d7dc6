"""``/metrics`` alone on a port of its own (``service.metrics_port``, the runner spec's
``METRICS_PORT``), for a Prometheus that scrapes a port that serves nothing else.

A bare ASGI app: one route, the same text as the main port's ``/metrics``, under the same
token rule (the admin token where one is configured), and 404 for everything else, so
opening the port to a scraper opens no other route.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from pool.actors import Pool
from pool.errors import ListenError, PoolError
from pool.http._auth import Authenticator

log = logging.getLogger("pool.server")

PROMETHEUS_TYPE = b"text/plain; version=0.0.4; charset=utf-8"

Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


def metrics_app(pool: Pool, auth: Authenticator) -> Callable[..., Awaitable[None]]:
    """The ASGI app of the metrics port."""

    async def app(scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if scope["type"] != "http":
            return
        status, body, content_type = _answer(pool, auth, scope)
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", content_type)],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def _answer(pool: Pool, auth: Authenticator, scope: dict[str, Any]) -> tuple[int, bytes, bytes]:
    try:
        if scope["path"] != "/metrics" or scope["method"] != "GET":
            raise PoolError("not_found", "this port serves GET /metrics only")
        headers = dict(scope["headers"])
        authorization = headers.get(b"authorization")
        auth.authenticate(authorization.decode("latin-1") if authorization else None, "admin")
    except PoolError as exc:
        body = {"error": {"code": exc.code, "message": exc.message}}
        return exc.status, json.dumps(body).encode(), b"application/json"
    return 200, pool.render_metrics(), PROMETHEUS_TYPE


async def serve_metrics(
    pool: Pool,
    auth: Authenticator,
    host: str,
    port: int,
    *,
    task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the metrics port until cancelled; reports the port once it listens.

    Raises:
        ListenError: the port cannot be bound.
    """
    config = Config()
    config.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    config.errorlog = logging.getLogger("hypercorn.error")
    config.accesslog = None
    try:
        sockets = config.create_sockets()
    except OSError as exc:
        raise ListenError(f"cannot listen on {config.bind[0]} (metrics_port): {exc}") from exc
    bound = int(sockets.insecure_sockets[0].getsockname()[1])
    config.bind = [f"fd://{sock.detach()}" for sock in sockets.insecure_sockets]
    log.info("serving /metrics on %s:%d", host, bound)

    # Hypercorn reports its binds through task_status; this reports the port instead.
    class _Status:
        def started(self, value: object = None) -> None:
            task_status.started(bound)

    await hypercorn_serve(metrics_app(pool, auth), config, task_status=_Status())
