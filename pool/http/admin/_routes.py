"""The admin routes: models (rows, load, unload), residency decisions, GPU memory, keys,
usage, the event stream; and ``GET /v1/models``."""

from __future__ import annotations

import logging
from typing import Any, cast

from quart import Blueprint, Quart, Response, request

from pool.actors import USAGE_BUCKETS, USAGE_GROUPS, UsageBucket, UsageGroupBy
from pool.backends import LoadRequest
from pool.config import KeyFields
from pool.http._common import (
    POOL_ERRORS,
    AppContext,
    json_response,
    read_body,
    request_id,
    require,
)
from pool.http._streaming import streamed_answer
from pool.http.admin._events import state_events
from pool.http.admin._parse import choice, flag, parse_time, positive_limit
from pool.http.admin._render import gpu_memory_body, model_list, model_row, usage_row
from pool.schemas import KeyCreateRequest

log = logging.getLogger("pool.http")


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    keys = ctx.auth.keys
    blueprint = Blueprint("admin", __name__)
    ctx.error_shapes[blueprint.name] = POOL_ERRORS

    @blueprint.get("/v1/models")
    async def list_models() -> Response:
        """Servable model ids in the OpenAI list format (loaded, or loaded on demand)."""
        require(ctx, "inference")
        return json_response(model_list(pool))

    @blueprint.get("/v1/admin/models")
    async def admin_models() -> Response:
        """Every configured model with its live runtime state (and, in a cluster, every
        peer's models under ``cluster``)."""
        require(ctx, "admin")
        body: dict[str, Any] = {"models": [model_row(s) for s in pool.snapshots()]}
        if pool.clustered:
            body["cluster"] = pool.peer_models()
        return json_response(body)

    @blueprint.get("/v1/admin/models/<name>")
    async def admin_model(name: str) -> Response:
        """One model's row."""
        require(ctx, "admin")
        return json_response(model_row(pool.snapshot(name)))

    @blueprint.post("/v1/admin/models/<name>/load")
    async def admin_load(name: str) -> Response:
        """Load a configured model, with optional replicas and live-only overrides;
        ``?dry_run=true``: what the load would do now, changing nothing."""
        require(ctx, "admin")
        pool.model(name)  # an unknown model is a 404 before the body is read
        dry_run = flag(request.args.get("dry_run"), "dry_run")
        body = await read_body(LoadRequest, optional=True)
        if dry_run:
            return json_response(pool.preview_load(name, body))
        # The pool owns the load (through its residency owner: placement, eviction); a
        # client that disconnects does not cancel it.
        return json_response(model_row(await pool.detached(pool.load, name, body)))

    @blueprint.post("/v1/admin/models/<name>/unload")
    async def admin_unload(name: str) -> Response:
        """Unload: queued requests are cancelled, running ones get engine.unload_drain_s."""
        require(ctx, "admin")
        pool.model(name)
        return json_response(model_row(await pool.detached(pool.unload, name)))

    @blueprint.get("/v1/admin/decisions")
    async def admin_decisions() -> Response:
        """The latest residency decisions (placements, evictions, waits, refusals) with
        their reasons, newest first; ``?model=`` those about one model, ``?limit=``."""
        require(ctx, "admin")
        model = request.args.get("model") or None
        decisions = pool.decisions(model, positive_limit(request.args.get("limit")))
        return json_response({"decisions": [d.as_json() for d in decisions]})

    @blueprint.get("/v1/admin/gpu-memory")
    async def gpu_memory() -> Response:
        """GPU memory in use (NVML) and each model's VRAM estimate."""
        require(ctx, "admin")
        return json_response(gpu_memory_body(pool.gpu_view(), pool.snapshots()))

    # Key changes are in force once the call answers, on every route: a revoked key's
    # next request is refused and a WebSocket it opened is closed
    # (pool/http/responses/_routes.py).
    @blueprint.get("/v1/admin/keys")
    async def list_keys() -> Response:
        """The keys in force, without their secrets."""
        require(ctx, "admin")
        return json_response({"keys": keys.rows()})

    @blueprint.post("/v1/admin/keys")
    async def add_key() -> Response:
        """Add a key; a generated key is answered this once."""
        require(ctx, "admin")
        body = await read_body(KeyCreateRequest)
        fields = KeyFields.model_validate(body.model_dump(exclude={"key_sha256"}))
        record, clear = await keys.add(fields, body.key_sha256)
        log.info(
            "request_id=%s key added: name=%s tenant=%s role=%s source=runtime",
            request_id(),
            record.name,
            record.caller.tenant,
            record.caller.role,
        )
        return json_response({**record.row(), "key": clear or None}, 201)

    @blueprint.delete("/v1/admin/keys/<name>")
    async def revoke_key(name: str) -> Response:
        """Revoke a key (settings keys too): refused from now on, across restarts."""
        require(ctx, "admin")
        record = await keys.revoke(name)
        log.warning(
            "request_id=%s key revoked: name=%s source=%s", request_id(), name, record.source
        )
        return json_response({**record.row(), "revoked": True})

    @blueprint.get("/v1/admin/usage")
    async def admin_usage() -> Response:
        """Recorded usage (the usage database, pool/actors/accounting/_usage_store.py) summed by
        ``group_by`` (key, tenant or model) over ``[since, until)``, per UTC hour or day
        with ``bucket``."""
        require(ctx, "admin")
        args = request.args
        group_by = cast(
            UsageGroupBy, choice("group_by", args.get("group_by"), USAGE_GROUPS) or "tenant"
        )
        bucket = cast(UsageBucket | None, choice("bucket", args.get("bucket"), USAGE_BUCKETS))
        since = parse_time(args["since"], "since") if args.get("since") else None
        until = parse_time(args["until"], "until") if args.get("until") else None
        # A window that ends before it starts holds no request: no rows, as for any
        # window without one.
        totals = await pool.usage_totals(group_by, since=since, until=until, bucket=bucket)
        return json_response({"usage": [usage_row(group_by, t) for t in totals]})

    @blueprint.get("/v1/admin/events")
    async def admin_events() -> Response:
        """The admin state as Server-Sent Events (pool/http/admin/_events.py)."""
        require(ctx, "admin")
        return streamed_answer(state_events(pool), None)

    app.register_blueprint(blueprint)
