"""One request line per HTTP request and WebSocket handshake, whatever route served it.

Hypercorn reports each exchange when it ends (a stream when its last chunk is sent); the
line carries the same ``key=value`` facts as the pool's other lines, so ``LOG_FORMAT=json``
gives them as fields. Where the pool traces, an admitted request's line ends with its
``trace_id`` (read from the ``traceparent`` response header), to find its trace by.
Routes that know more (the model, the tenant) log their own line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from hypercorn.logging import Logger

if TYPE_CHECKING:
    from hypercorn.typing import ResponseSummary, WWWScope

log = logging.getLogger("pool.access")

# The ASGI scope key of the exchange's request id (pool/http/_pipeline.py sets it). The
# line reads ``X-Request-Id`` from the answer's head, but Hypercorn reports a WebSocket
# handshake's 101 without its headers.
REQUEST_ID_KEY = "pool.request_id"


class AccessLog(Logger):
    """Hypercorn's logger with the access line in the pool's words (set as
    ``Config.logger_class``); its error lines go where Hypercorn sends them."""

    async def access(
        self, request: WWWScope, response: ResponseSummary | None, request_time: float
    ) -> None:
        method = request["method"] if request["type"] == "http" else "WEBSOCKET"
        if response is None:
            # The connection closed before the exchange was done. Hypercorn also reports
            # this when a client closes at once after the last byte of a whole answer,
            # just before that answer's own line: so a debug line, not a request line.
            log.debug("method=%s path=%s closed before the answer ended", method, request["path"])
            return
        if not log.isEnabledFor(logging.INFO):
            # No line to write (service.log_level above info): the answer's head is not
            # read either (18-28 us per request, most of this method's cost).
            return
        sent = {bytes(name).lower(): bytes(value) for name, value in response.get("headers", ())}
        rid = sent.get(b"x-request-id", b"").decode("latin-1") or _scope_request_id(request)
        path, status, ms = request["path"], response["status"], request_time * 1000.0
        # A traced request answers with its span's traceparent: version-trace_id-span_id-flags.
        traceparent = sent.get(b"traceparent")
        if traceparent is None:
            log.info(
                "request_id=%s method=%s path=%s status=%s ms=%.1f", rid, method, path, status, ms
            )
            return
        trace_id = traceparent.decode("latin-1").split("-")[1:2] or ["-"]
        log.info(
            "request_id=%s method=%s path=%s status=%s ms=%.1f trace_id=%s",
            rid,
            method,
            path,
            status,
            ms,
            trace_id[0],
        )


def _scope_request_id(request: WWWScope) -> str:
    found = cast(Mapping[str, Any], request).get(REQUEST_ID_KEY)
    return found if isinstance(found, str) else "-"
