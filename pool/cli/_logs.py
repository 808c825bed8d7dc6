"""Log output of ``llm-pool serve``: text lines, or one JSON object per line."""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from typing import Any

# The pool's log lines carry their facts as `key=value` words (request_id=, model=, ...).
_FIELD = re.compile(r"(?<![\w.])([a-z_][a-z0-9_]*)=(\S+)")
_RESERVED = frozenset({"time", "level", "logger", "message", "exception"})
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: ``time``, ``level``, ``logger``, ``message``, the
    message's ``key=value`` fields as their own keys, and ``exception`` when there is one.
    """

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": message,
        }
        for key, value in _FIELD.findall(message):
            if key not in _RESERVED:
                entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


# Libraries whose INFO lines are their own bookkeeping: coredis logs every retry of every
# Redis command (each first script call, and about 80 lines in 10 s of a Redis outage,
# which the pool itself reports once). Below ``debug`` they say only warnings and errors.
_CHATTY_LIBRARIES = ("coredis", "httpx", "httpcore")


def configure_logging(level: str, fmt: str = "text") -> None:
    """Log to stderr at ``level``, as text lines or (``fmt="json"``) JSON lines."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in _CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(
            logging.NOTSET if level.lower() == "debug" else logging.WARNING
        )
