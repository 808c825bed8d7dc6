"""The runner API (docs/api.md): what an orchestrator that drives many runners asks of
one: its capabilities, model loads as async tasks (with signed operation tokens), unloads,
cache flushes, health and metrics; and ``GET /api/status``, the whole status in one
answer."""

from pool.http.runner._routes import ROUTES, register

__all__ = ["ROUTES", "register"]
