"""The admin routes: models (rows, load, unload), residency decisions, GPU memory, keys,
usage, the event stream; and ``GET /v1/models``."""

from __future__ import annotations

import logging
from typing import Any, cast

from quart import Blueprint, Quart, Response, request

from pool.actors import USAGE_BUCKETS, USAGE_GROUPS, UsageBucket, UsageGroupBy
from pool.backends import LoadRequest
from pool.config import KeyFields, LoraAdapter
from pool.http._common import (
    POOL_ERRORS,
    AppContext,
    json_response,
    read_body,
    request_id,
    require,
)
from pool.http._route import LOAD_REFUSALS, SSE, Route, serves
from pool.http._streaming import streamed_answer
from pool.http.admin._events import state_events
from pool.http.admin._parse import choice, flag, parse_time, positive_limit
from pool.http.admin._render import gpu_memory_body, model_list, model_row, usage_row
from pool.schemas import (
    Decisions,
    GpuMemory,
    KeyCreated,
    KeyCreateRequest,
    KeyList,
    KeyRevoked,
    LoadAnswer,
    ModelList,
    ModelRow,
    ModelRows,
    UsageReport,
)

log = logging.getLogger("pool.http")


# A time in a query: RFC 3339 or seconds since the epoch (pool/http/admin/_parse.py).
_INSTANT: dict[str, Any] = {
    "anyOf": [
        {"type": "string", "format": "date-time"},
        {"const": "", "description": "No bound."},
        {"type": "string", "pattern": "^[+-]?[0-9]{1,15}(\\.[0-9]{1,9})?$"},
    ]
}
# -- the documented routes (pool/http/_route.py) ----------------------------------------
LIST_MODELS = Route(
    "get",
    "/v1/models",
    "inference",
    "List servable models",
    "OpenAI list format of the model ids that accept requests now: loaded models,"
    " on-demand models and models the pool evicted (a request loads them again). In a"
    " cluster (`engine.cluster`, docs/cluster.md) the peers'"
    " models too, each entry with `nodes`: the nodes that have it loaded.",
    reply=ModelList,
)
ADMIN_MODELS = Route(
    "get",
    "/v1/admin/models",
    "admin",
    "List configured models",
    "Every model of the merged config with its runtime state, queue and replica figures,"
    " VRAM (`vram_estimate_mib`; its `vram_estimate_source`, the spec's"
    " observed_load_delta, model_artifact_size or unavailable; `vram_estimate_basis`, the"
    " step of the pool's chain: configured_vram_mb, observed_load_delta, artifact_metadata,"
    " model_artifact_size, name_heuristic or unavailable; `observed_load_delta`: MiB"
    " measured for this load, or kept from the same earlier load, null when never"
    " measured; `gpus`: the GPUs of each replica, `gpu_split_mib`: the MiB planned on"
    " each of them), `unload_reason` (why it is unloaded: `evicted` by the pool, so its"
    " next request loads it again; `requested`; `keep_alive`), capabilities, load"
    " constraints and"
    " recommendations, load override and definition. In a cluster, `cluster` lists every"
    " peer's models (`node`, `name`, `state`, `replicas`, `in_flight`, `queue_depth`,"
    " `on_demand`, `vram_mib`).",
    reply=ModelRows,
)
ADMIN_MODEL = Route(
    "get",
    "/v1/admin/models/{name}",
    "admin",
    "One model's row",
    "As in the list.",
    reply=ModelRow,
    refusals=(404,),
)
ADMIN_LOAD = Route(
    "post",
    "/v1/admin/models/{name}/load",
    "admin",
    "Load a model",
    "Optional body: `replicas`, `stay_warm_s` and the backend's live-only load overrides"
    " (see the row's `load_constraints`). Answers when the load has finished: 200 with"
    " the row, or 500 `load_failed` with `last_error`. On GPUs the load must fit its VRAM"
    " budget: idle models it may evict (docs/vram.md) are unloaded first, else 500"
    " `load_failed` at once. Idempotent while loaded or loading (overrides then give 400);"
    " 409 `model_unloading` while unloading. A schema failure is 422, a value the"
    " backend does not accept is 400 `invalid_load_request`. With `dry_run=true` nothing"
    " changes: 200 with what the load would do now (`LoadPreview`: `fits`, `gpus` and"
    " `gpu_split_mib` per replica, the models it would `evict`, those it spares for their"
    " stay-warm windows (`spared_warm`), what it would `wait_for`,"
    " `expected_load_s` from measurements, and the `error` with its `reason` it would"
    " answer).",
    LoadRequest,
    reply=LoadAnswer,
    body_required=False,
    query=(("dry_run", "boolean", "Answer what the load would do, changing nothing."),),
    refusals=(400, 404, 409),
    valid_input_codes=LOAD_REFUSALS,
)
ADMIN_UNLOAD = Route(
    "post",
    "/v1/admin/models/{name}/unload",
    "admin",
    "Unload a model",
    "Graceful: new requests are refused at once, queued ones get `model_unloading`, running"
    " ones finish (within `engine.unload_drain_s`; past it they end with `model_unloading`),"
    " then the runtime is released. 200 if already unloaded. The model stays unloaded"
    " (`unload_reason` `requested`), even one the pool had evicted.",
    reply=ModelRow,
    refusals=(404,),
)
ADD_ADAPTER = Route(
    "post",
    "/v1/admin/models/{name}/adapters",
    "admin",
    "Add a LoRA adapter to a model",
    "Serves the LoRA adapter at `path` on model `{name}` (its base) under the model name"
    " `name`, with `scale`: requests name it as their `model` on every surface, and model"
    " lists show it with `parent`. A loaded base takes it at once, without a reload:"
    " requests running on the base or its other adapters go on untouched (an in-process"
    " llama.cpp replica loads it at its next turn). An unloaded base takes it at its next"
    " load; it stays until removed or the pool restarts (settings: `lora_adapters`). An"
    " adapter of that name on this base is replaced. Answers the base's row. 400"
    " `invalid_request`: the name is another model's or adapter's, or the file does not"
    " exist or does not load; 400 `invalid_load_request`: the backend serves no adapters,"
    " or (llama_server) only those it was started with; 500 `load_failed`: its file does"
    " not fit on the base's GPUs. With `dry_run=true` nothing changes: 200 with what the"
    " add would do now, as a load preview (`fits`, the base's `gpus`, the adapter's MiB"
    " on each in `gpu_split_mib`, `need_mib` per replica, `error` and `reason`).",
    LoraAdapter,
    reply=LoadAnswer,
    query=(("dry_run", "boolean", "Answer what the add would do, changing nothing."),),
    refusals=(400, 404, 409),
    valid_input_codes=(*LOAD_REFUSALS, "invalid_request"),
)
REMOVE_ADAPTER = Route(
    "delete",
    "/v1/admin/models/{name}/adapters/{adapter}",
    "admin",
    "Remove a LoRA adapter from a model",
    "Stops serving adapter `{adapter}` of model `{name}` without reloading the base: new"
    " requests for it get 404 `unknown_model`, a request running with it finishes first,"
    " requests on the base and its other adapters go on untouched. Answers the base's row;"
    " 404 `unknown_model` for a base or adapter that is not there.",
    reply=ModelRow,
    refusals=(404, 409),
)
ADMIN_DECISIONS = Route(
    "get",
    "/v1/admin/decisions",
    "admin",
    "Residency decisions, with their reasons",
    "The latest decisions of the residency owner (docs/vram.md), newest first, at most 500"
    " kept: `place` (a load let through, with `gpus` and `gpu_split_mib`), `evict` (whom,"
    " `for` whom, and why the policy chose it), `wait` (a load that found no room),"
    " `yield` (a busy model asked to make way), `refuse` (with `need_mib` and `room_mib`"
    " per GPU), `comeback` (an evicted enabled model loading again). `?model=` keeps those"
    " about one model (as `model` or `for`), `?limit=` the newest N.",
    reply=Decisions,
    query=(
        ("model", "string", "Only decisions about this model."),
        ("limit", {"type": "integer", "minimum": 1}, "At most this many (the newest)."),
    ),
    refusals=(400, 404),
)
GPU_MEMORY = Route(
    "get",
    "/v1/admin/gpu-memory",
    "admin",
    "GPU memory and VRAM estimates",
    "NVML readings per GPU (or the virtual GPUs of `engine.gpu_budget_mib`) and each"
    " model's VRAM estimate, measured delta and GPUs; with no GPU, `gpus` is empty and"
    " `error` says why.",
    reply=GpuMemory,
)
LIST_KEYS = Route(
    "get",
    "/v1/admin/keys",
    "admin",
    "List keys",
    "The keys in force, from `service.auth.keys` (`source: settings`) and added through"
    " this API (`source: runtime`), with the identity each gives its requests: `tenant`"
    " (null: `X-Tenant-ID` decides), `role`, `priority`, `rate_limit_rpm`, `preemptible`,"
    " `created_at`."
    " Never a key nor its digest.",
    reply=KeyList,
)
ADD_KEY = Route(
    "post",
    "/v1/admin/keys",
    "admin",
    "Add a key",
    "Adds a key, in force at once and kept across restarts (`keys.json` in the state"
    " directory, which holds only SHA-256 digests). Without `key_sha256` the pool"
    " generates the key (`sk-pool-` and 43 random characters) and answers it in `key` this"
    " once: it cannot be shown again. 409 `key_exists` when a key of that name or with"
    " that secret is in force.",
    KeyCreateRequest,
    status=201,
    reply=KeyCreated,
    refusals=(409,),
)
REVOKE_KEY = Route(
    "delete",
    "/v1/admin/keys/{name}",
    "admin",
    "Revoke a key",
    "Revokes a key, a settings key too (kept across restarts, until the settings give the"
    " name another key). From the answer on, the key is refused (401) on every route, and"
    " a WebSocket opened with it is closed with code 1008 after an `error` event. 404"
    " `unknown_key` when no key of that name is in force.",
    reply=KeyRevoked,
    refusals=(404,),
)
ADMIN_USAGE = Route(
    "get",
    "/v1/admin/usage",
    "admin",
    "Token usage by key, tenant or model",
    "Sums of the usage database (`usage.sqlite3` in the state directory; docs/operations.md):"
    " one row per `group_by` value (`key`, `tenant` or `model`; default `tenant`) with"
    " `requests` (finished requests of any status), `prompt_tokens`, `cached_tokens` and"
    " `output_tokens`, over the requests that finished in `[since, until)`; with `bucket`,"
    " one row per group and UTC hour or day, whose start is `bucket` (RFC 3339). Times are"
    " RFC 3339 or seconds since the epoch; either bound may be left out. Records reach the"
    " database within `service.usage.flush_ms`. 400 `invalid_request` for a bad parameter,"
    " 409 `usage_disabled` when `service.usage.enabled` is off.",
    reply=UsageReport,
    query=(
        ("group_by", "string", "`key`, `tenant` (default) or `model`."),
        ("since", _INSTANT, "From this time on (RFC 3339 or epoch seconds)."),
        (
            "until",
            _INSTANT,
            "Before this time (RFC 3339 or epoch seconds); a window that"
            " ends before it starts holds nothing.",
        ),
        ("bucket", "string", "`hour` or `day`: one row per UTC hour or day."),
    ),
    refusals=(400, 409),
)
ADMIN_EVENTS = Route(
    "get",
    "/v1/admin/events",
    "admin",
    "Admin state as Server-Sent Events",
    "A long response of `state` events: the first at once, then one whenever a model's state"
    " changes (at once) or a counter, pull or GPU reading does (looked at once a second; at"
    " most four events a second); a `: keep-alive` comment every 15 s otherwise. Each event's"
    " data is one JSON object: `models` (the rows of `/v1/admin/models`), `gpus` and"
    " `gpu_error` (as `/v1/admin/gpu-memory`), `pulls` (each model's current or last pull,"
    " as `/api/pull/status/{model}`), `shutting_down`. Each residency decision made while"
    " the stream is open follows as a `decision` event (one entry of `/v1/admin/decisions`)."
    " The stream ends when the pool shuts"
    " down. The dashboard (`/ui/`) and `llm-pool events` follow it.",
    text=(SSE, {"type": "string", "description": "Server-Sent Events"}),
)
ROUTES = (
    LIST_MODELS,
    ADMIN_MODELS,
    ADMIN_MODEL,
    ADMIN_LOAD,
    ADMIN_UNLOAD,
    ADD_ADAPTER,
    REMOVE_ADAPTER,
    ADMIN_DECISIONS,
    GPU_MEMORY,
    LIST_KEYS,
    ADD_KEY,
    REVOKE_KEY,
    ADMIN_USAGE,
    ADMIN_EVENTS,
)


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    keys = ctx.auth.keys
    blueprint = Blueprint("admin", __name__)
    ctx.error_shapes[blueprint.name] = POOL_ERRORS

    @serves(blueprint, LIST_MODELS)
    async def list_models() -> Response:
        """Servable model ids in the OpenAI list format (loaded, or loaded on demand)."""
        require(ctx, "inference")
        return json_response(model_list(pool))

    @serves(blueprint, ADMIN_MODELS)
    async def admin_models() -> Response:
        """Every configured model with its live runtime state (and, in a cluster, every
        peer's models under ``cluster``)."""
        require(ctx, "admin")
        body: dict[str, Any] = {"models": [model_row(s) for s in pool.snapshots(adapters=True)]}
        if pool.clustered:
            body["cluster"] = pool.peer_models()
        return json_response(body)

    @serves(blueprint, ADMIN_MODEL)
    async def admin_model(name: str) -> Response:
        """One model's row."""
        require(ctx, "admin")
        return json_response(model_row(pool.snapshot(name)))

    @serves(blueprint, ADMIN_LOAD)
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

    @serves(blueprint, ADMIN_UNLOAD)
    async def admin_unload(name: str) -> Response:
        """Unload: queued requests are cancelled, running ones get engine.unload_drain_s."""
        require(ctx, "admin")
        pool.model(name)
        return json_response(model_row(await pool.detached(pool.unload, name)))

    @serves(blueprint, ADD_ADAPTER)
    async def admin_add_adapter(name: str) -> Response:
        """Serve a LoRA adapter on ``name`` (docs/backends.md, "LoRA adapters")."""
        require(ctx, "admin")
        pool.model(name)
        dry_run = flag(request.args.get("dry_run"), "dry_run")
        body = await read_body(LoraAdapter)
        if dry_run:
            return json_response(pool.preview_adapter(name, body))
        # The pool owns the change; a client that disconnects does not cancel it midway.
        return json_response(model_row(await pool.detached(pool.add_adapter, name, body)))

    @serves(blueprint, REMOVE_ADAPTER)
    async def admin_remove_adapter(name: str, adapter: str) -> Response:
        """Stop serving adapter ``adapter`` of ``name``."""
        require(ctx, "admin")
        pool.model(name)
        return json_response(model_row(await pool.detached(pool.remove_adapter, name, adapter)))

    @serves(blueprint, ADMIN_DECISIONS)
    async def admin_decisions() -> Response:
        """The latest residency decisions (placements, evictions, waits, refusals) with
        their reasons, newest first; ``?model=`` those about one model, ``?limit=``."""
        require(ctx, "admin")
        model = request.args.get("model") or None
        decisions = pool.decisions(model, positive_limit(request.args.get("limit")))
        return json_response({"decisions": [d.as_json() for d in decisions]})

    @serves(blueprint, GPU_MEMORY)
    async def gpu_memory() -> Response:
        """GPU memory in use (NVML) and each model's VRAM estimate."""
        require(ctx, "admin")
        return json_response(gpu_memory_body(pool.gpu_view(), pool.snapshots()))

    # Key changes are in force once the call answers, on every route: a revoked key's
    # next request is refused and a WebSocket it opened is closed
    # (pool/http/responses/_routes.py).
    @serves(blueprint, LIST_KEYS)
    async def list_keys() -> Response:
        """The keys in force, without their secrets."""
        require(ctx, "admin")
        return json_response({"keys": keys.rows()})

    @serves(blueprint, ADD_KEY)
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

    @serves(blueprint, REVOKE_KEY)
    async def revoke_key(name: str) -> Response:
        """Revoke a key (settings keys too): refused from now on, across restarts."""
        require(ctx, "admin")
        record = await keys.revoke(name)
        log.warning(
            "request_id=%s key revoked: name=%s source=%s", request_id(), name, record.source
        )
        return json_response({**record.row(), "revoked": True})

    @serves(blueprint, ADMIN_USAGE)
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

    @serves(blueprint, ADMIN_EVENTS)
    async def admin_events() -> Response:
        """The admin state as Server-Sent Events (pool/http/admin/_events.py)."""
        require(ctx, "admin")
        return streamed_answer(state_events(pool), None)

    app.register_blueprint(blueprint)
