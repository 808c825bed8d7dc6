"""The Ollama API: ``/api/chat``, ``/api/generate``, ``/api/embed``, ``/api/tags``,
``/api/show``, ``/api/ps``, ``/api/copy``, ``/api/version`` and the ``GET /`` probe;
NDJSON streams by default and Ollama's error shape.

Durations are nanoseconds as Ollama reports them; a request with no messages (chat)
or an empty prompt (generate) loads the model, and with ``keep_alive: 0`` unloads it.
``/api/tags`` describes each model's artifact (the file's size, mtime and SHA-256,
hashed once per file version on a worker thread); a model without a file (stub,
remote) shows the settings file's mtime and the digest of its definition.
``/api/copy`` is a 400 ``copy_unsupported``: models are named by the settings files,
and a name that exists only in memory would vanish at the next restart.
"""

from pool.http.ollama._routes import ROUTES, register

__all__ = ["ROUTES", "register"]
