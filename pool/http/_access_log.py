"""One request line per HTTP request and WebSocket handshake, whatever route served it.

Hypercorn reports each exchange when it ends (a stream when its last chunk is sent); the
line carries the same ``key=value`` facts as the pool's other lines, so ``LOG_FORMAT=json``
gives them as fields. Routes that know more (the model, the tenant) log their own line.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from hypercorn.logging import Logger

if TYPE_CHECKING:
    from hypercorn.typing import ResponseSummary, WWWScope

log = logging.getLogger("pool.access")


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
        sent = {bytes(name).lower(): bytes(value) for name, value in response.get("headers", ())}
        log.info(
            "request_id=%s method=%s path=%s status=%s ms=%.1f",
            sent.get(b"x-request-id", b"-").decode("latin-1"),
            method,
            request["path"],
            response["status"],
            request_time * 1000.0,
        )
