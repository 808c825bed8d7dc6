"""``GET /v1/admin/usage``: recorded usage summed by key, tenant or model.

The rows come from the usage database (``pool/actors/_usage_store.py``); this module
only reads the query parameters and shapes the answer.
"""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any, cast

from quart import Quart, Response, request

from pool.actors import USAGE_BUCKETS, USAGE_GROUPS, UsageBucket, UsageGroupBy, UsageTotal
from pool.errors import PoolError
from pool.http._common import AppContext, json_response, require


def parse_time(value: str, name: str) -> float:
    """An instant given as RFC 3339 (``2026-11-26T00:00:00Z``) or as seconds since the
    epoch; ``invalid_request`` otherwise. An RFC 3339 time without an offset is UTC."""
    text = value.strip()
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if math.isfinite(seconds):
            return seconds
        raise PoolError("invalid_request", f"{name} must be a finite number of seconds")
    try:
        # fromisoformat reads RFC 3339 (a trailing Z included, from Python 3.11 on).
        at = datetime.fromisoformat(text)
    except ValueError:
        raise PoolError(
            "invalid_request",
            f"{name} must be an RFC 3339 time (2026-11-26T00:00:00Z) or seconds since the"
            f" epoch (got {value!r})",
        ) from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=UTC)
    return at.timestamp()


def _choice(name: str, value: str | None, allowed: tuple[str, ...]) -> str | None:
    if value is None or value == "":
        return None
    if value not in allowed:
        raise PoolError(
            "invalid_request", f"{name} must be one of {', '.join(allowed)} (got {value!r})"
        )
    return value


def usage_row(group_by: UsageGroupBy, total: UsageTotal) -> dict[str, Any]:
    row: dict[str, Any] = {group_by: total.group}
    if total.bucket is not None:
        row["bucket"] = datetime.fromtimestamp(total.bucket, UTC).isoformat().replace("+00:00", "Z")
    row["requests"] = total.requests
    row["prompt_tokens"] = total.prompt_tokens
    row["cached_tokens"] = total.cached_tokens
    row["output_tokens"] = total.output_tokens
    return row


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool

    @app.get("/v1/admin/usage")
    async def admin_usage() -> Response:
        """Recorded usage summed by ``group_by`` (key, tenant or model) over
        ``[since, until)``, per UTC hour or day with ``bucket``."""
        require(ctx, "admin")
        args = request.args
        group_by = cast(
            UsageGroupBy, _choice("group_by", args.get("group_by"), USAGE_GROUPS) or "tenant"
        )
        bucket = cast(UsageBucket | None, _choice("bucket", args.get("bucket"), USAGE_BUCKETS))
        since = parse_time(args["since"], "since") if args.get("since") else None
        until = parse_time(args["until"], "until") if args.get("until") else None
        if since is not None and until is not None and until < since:
            raise PoolError("invalid_request", "until must not be before since")
        totals = await pool.usage_totals(group_by, since=since, until=until, bucket=bucket)
        return json_response({"usage": [usage_row(group_by, t) for t in totals]})
