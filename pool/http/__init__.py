"""The HTTP surface: a Quart-Trio app served by Hypercorn's trio worker.

Every wire format (Responses, Chat Completions, Ollama, the runner API, admin rows) is
rendered here from the actors' typed values.
"""

from pool.http._app import create_app
from pool.http._auth import Authenticator, NonceStore, nonce_file_path, sign_op_token
from pool.http._pipeline import RequestPipeline
from pool.http._server import ServerInfo, serve
from pool.http.openai._parse import request_from_chat_completions
from pool.http.responses._parse import request_from_responses

__all__ = [
    "Authenticator",
    "NonceStore",
    "RequestPipeline",
    "ServerInfo",
    "create_app",
    "nonce_file_path",
    "request_from_chat_completions",
    "request_from_responses",
    "serve",
    "sign_op_token",
]
