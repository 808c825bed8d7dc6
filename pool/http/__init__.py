"""The HTTP surface: a Quart-Trio app served by Hypercorn's trio worker.

Every wire format (Responses, Chat Completions, Ollama, the runner API, admin rows) is
rendered here from the actors' typed values.
"""

from pool.http._app import create_app
from pool.http._responses import request_from_responses
from pool.http._server import ServerInfo, serve

__all__ = ["ServerInfo", "create_app", "request_from_responses", "serve"]
