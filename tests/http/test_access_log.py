"""The access line (pool/http/_access_log.py) when the pool writes none."""

from __future__ import annotations

import logging
from typing import Any

from hypercorn.config import Config

from pool.http._access_log import AccessLog


class _Unread:
    """An answer's headers that fail the test if the access line reads them."""

    def __iter__(self) -> Any:
        raise AssertionError("the access line read the head with no line to write")


async def test_no_access_line_below_info_reads_nothing(caplog: Any) -> None:
    scope: Any = {"type": "http", "method": "POST", "path": "/v1/chat/completions"}
    answer: Any = {"status": 200, "headers": _Unread()}
    with caplog.at_level(logging.WARNING, logger="pool.access"):
        await AccessLog(Config()).access(scope, answer, 0.002)
    assert not [r for r in caplog.records if r.name == "pool.access"]
    answer = {"status": 200, "headers": [(b"x-request-id", b"abc")]}
    with caplog.at_level(logging.INFO, logger="pool.access"):
        await AccessLog(Config()).access(scope, answer, 0.002)
    lines = [r.getMessage() for r in caplog.records if r.name == "pool.access"]
    assert lines == ["request_id=abc method=POST path=/v1/chat/completions status=200 ms=2.0"]
