"""``POST /v1/responses`` (JSON and SSE) and the WebSocket on the same path."""

from pool.http.responses._routes import ROUTES, register

__all__ = ["ROUTES", "register"]
