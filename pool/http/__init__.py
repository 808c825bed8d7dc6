"""The HTTP surface: a Quart-Trio app served by Hypercorn's trio worker."""

from pool.http._app import create_app
from pool.http._server import ServerInfo, serve

__all__ = ["ServerInfo", "create_app", "serve"]
