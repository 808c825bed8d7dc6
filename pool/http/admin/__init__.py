"""The operator's API: every model's row, load and unload, the residency decisions, GPU
memory, keys, recorded usage and the admin state as Server-Sent Events (the dashboard's
feed); and ``GET /v1/models``, the servable models in OpenAI's list format."""

from pool.http.admin._routes import ROUTES, register

__all__ = ["ROUTES", "register"]
