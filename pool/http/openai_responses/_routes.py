"""The routes of ``/openai/v1``'s Responses API (and its model listing): each reads its
body (:mod:`._parse`), runs the pool, keeps what is stored (:mod:`._store`), and
answers in OpenAI's shapes (:mod:`._render`)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint, Quart, Response, request

from pool.config import state_dir
from pool.errors import PoolError
from pool.http._collected import collected
from pool.http._common import (
    AppContext,
    HotRoute,
    json_response,
    open_model_route,
    request_id,
    require,
    tenant_and_priority,
)
from pool.http._responses_core import sse
from pool.http._route import GENERATION_REFUSALS, SSE, Route, serves
from pool.http._streaming import admitted_stream, streamed_answer
from pool.http._tools import invalid
from pool.http.admin._render import model_list
from pool.http.openai._render import ERRORS
from pool.http.openai_responses._parse import (
    inference_request,
    input_items,
    refuse_unsupported,
    response_frame,
)
from pool.http.openai_responses._render import (
    OutputBuilder,
    ResponseStream,
    deleted_body,
    input_items_page,
)
from pool.http.openai_responses._store import FILE_NAME, ResponseStore
from pool.schemas import (
    InputItemList,
    ModelCard,
    ModelList,
    OpenAIResponse,
    OpenAIResponseRequest,
    OpenAIResponseStreamEvent,
    ResponseDeleted,
)

log = logging.getLogger("pool.http")

BASE = "/openai/v1"
_MAX_LIST = 100


# -- the documented routes (pool/http/_route.py) ----------------------------------------
CREATE_OPENAI_RESPONSE = Route(
    "post",
    "/openai/v1/responses",
    "openai",
    "Create a response (OpenAI Responses API)",
    "OpenAI's Responses API as OpenAI's SDKs, the Agents SDK and Codex speak it (the pool's"
    " own shape is `/v1/responses`). `input` is text or items: messages (`system` and"
    " `developer` ones join `instructions`), `function_call`, `function_call_output` and"
    " `reasoning` items (left out of the prompt). `output` holds `reasoning` items (the"
    " `<think>` block a thinking model opens its reply with), `message` items with one"
    " `output_text` part (`annotations: []`) and `function_call` items. `status` is"
    " `completed`, or `incomplete` with `incomplete_details.reason: max_output_tokens`;"
    " `usage` has `input_tokens` (`input_tokens_details.cached_tokens`: reused from the"
    " runtime's prefix cache), `output_tokens` (`output_tokens_details.reasoning_tokens`),"
    " `total_tokens`. Fields: `instructions`, `max_output_tokens`, `temperature`, `top_p`,"
    " `tools` (function tools only; others are a 400 naming `tools[i].type`),"
    " `tool_choice`, `parallel_tool_calls`, `text.format` (json_object, json_schema),"
    " `metadata` (echoed), `store` (default true: kept per tenant for"
    " `service.responses_retention_s`), `previous_response_id` (a stored response of the"
    " same `X-Tenant-ID`; 404 otherwise); the pool adds `top_k`, `seed`, `thinking`,"
    " `keep_alive`, `allow_remote`. `stream: true` answers Server-Sent Events, each with"
    " `sequence_number`: `response.created`, `response.in_progress`, per item"
    " `response.output_item.added`, `response.content_part.added`,"
    " `response.output_text.delta`/`response.reasoning_text.delta` (or"
    " `response.function_call_arguments.delta`), `response.output_text.done`"
    " (`response.reasoning_text.done`, `response.function_call_arguments.done`),"
    " `response.content_part.done`, `response.output_item.done`, and last"
    " `response.completed`, `response.incomplete` or, for a failure after the stream"
    " started, `response.failed` (`response.error`). Errors are OpenAI's error object."
    " A response to store (`store: true`) when the state directory's disk is full is"
    " generated and charged but cannot be kept: without `stream` the answer is 507"
    " `insufficient_storage` (no response object, which no id could fetch or continue;"
    " retry with `store: false`); a stream, whose text has gone out, sends its last event"
    " and then an `error` event with `code: insufficient_storage`.",
    OpenAIResponseRequest,
    reply=OpenAIResponse,
    stream=SSE,
    events=OpenAIResponseStreamEvent,
    errors="openai",
    valid_input_codes=GENERATION_REFUSALS,
)
GET_OPENAI_RESPONSE = Route(
    "get",
    "/openai/v1/responses/{response_id}",
    "openai",
    "Retrieve a stored response",
    "The response object as it was answered, for the tenant (`X-Tenant-ID`) that created"
    " it; 404 for an unknown, expired, deleted or other tenant's id.",
    reply=OpenAIResponse,
    errors="openai",
)
DELETE_OPENAI_RESPONSE = Route(
    "delete",
    "/openai/v1/responses/{response_id}",
    "openai",
    "Delete a stored response",
    "Removes it (404 when this tenant has no such response); a continuation of it can no"
    " longer see it.",
    reply=ResponseDeleted,
    errors="openai",
)
OPENAI_RESPONSE_INPUT_ITEMS = Route(
    "get",
    "/openai/v1/responses/{response_id}/input_items",
    "openai",
    "Input items of a stored response",
    "The items the response was created with (each with an `id`; text input as one user"
    " `message`), a page at a time: `limit` 1 to 100 (20), `order` `desc` (default) or"
    " `asc`, `after` an item id.",
    reply=InputItemList,
    errors="openai",
)
LIST_OPENAI_MODELS = Route(
    "get",
    "/openai/v1/models",
    "openai",
    "List models (OpenAI base URL)",
    "As `GET /v1/models`, with OpenAI's error object.",
    reply=ModelList,
    errors="openai",
)
GET_OPENAI_MODEL = Route(
    "get",
    "/openai/v1/models/{model}",
    "openai",
    "One model (OpenAI base URL)",
    "The entry of `GET /openai/v1/models` for `model`; 404 `unknown_model` for a name that"
    " is not servable.",
    reply=ModelCard,
    errors="openai",
)
ROUTES = (
    CREATE_OPENAI_RESPONSE,
    GET_OPENAI_RESPONSE,
    DELETE_OPENAI_RESPONSE,
    OPENAI_RESPONSE_INPUT_ITEMS,
    LIST_OPENAI_MODELS,
    GET_OPENAI_MODEL,
)


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    service = ctx.settings.service
    store = ResponseStore(
        state_dir() / FILE_NAME, service.responses_retention_s, service.responses_max_stored
    )
    app.after_serving(store.aclose)
    blueprint = Blueprint("openai_responses", __name__)
    # OpenAI's error object, as everywhere under /openai/.
    ctx.error_shapes[blueprint.name] = ERRORS
    ctx.path_dialects["/openai/"] = blueprint.name

    @serves(blueprint, CREATE_OPENAI_RESPONSE)
    async def create_openai_response() -> Response:
        """OpenAI's Responses API: one response object, or its stream of events."""
        opened = await open_model_route(ctx, OpenAIResponseRequest)
        body, tenant = opened.body, opened.tenant
        refuse_unsupported(body)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            chain = await store.chain(tenant, body.previous_response_id)
            if chain is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            for turn in chain:
                history += turn.input + turn.output
        items = input_items(body)
        neutral = opened.neutral(inference_request(body, history, items))
        builder = OutputBuilder(response_frame(body))
        started = time.perf_counter()
        rid = request_id()

        def logged(status: str) -> None:
            log.info(
                "request_id=%s model=%s tenant=%s openai_response=%s stream=%s status=%s ms=%.1f",
                rid,
                body.model,
                tenant,
                builder.frame.id,
                str(body.stream).lower(),
                status,
                (time.perf_counter() - started) * 1000,
            )

        async def keep() -> None:
            if body.store and builder.response is not None:
                await store.save(tenant, builder.response, items)

        if not body.stream:
            done = await collected(pool, opened, neutral, renderer=builder)
            await keep()
            logged(str(builder.response["status"] if builder.response else "?"))
            return json_response(builder.response, headers=done.headers())

        stream = ResponseStream(builder)
        admission, chunks = await admitted_stream(pool, opened, neutral, stream)

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]
            if stream.ending:
                refused: PoolError | None = None
                if builder.response is not None and builder.response["status"] != "failed":
                    try:
                        await keep()
                    except PoolError as exc:
                        if exc.code != "insufficient_storage":
                            raise
                        refused = exc
                logged(str(builder.response["status"] if builder.response else "?"))
                yield stream.ending[0]
                if refused is not None:
                    # The answer reached the client whole; the error event after its
                    # end says it was not stored (no continuing or fetching it by id).
                    yield sse(builder.error_event(refused))

        return streamed_answer(events(), admission)

    ctx.hot_routes[BASE + "/responses"] = HotRoute(create_openai_response, blueprint.name)

    @serves(blueprint, GET_OPENAI_RESPONSE)
    async def get_openai_response(response_id: str) -> Response:
        """A stored response of this tenant (404 when there is none)."""
        require(ctx, "inference")
        tenant, _ = tenant_and_priority()
        found = await store.get(tenant, response_id)
        if found is None:
            raise _not_found(response_id)
        return json_response(found)

    @serves(blueprint, DELETE_OPENAI_RESPONSE)
    async def delete_openai_response(response_id: str) -> Response:
        """Remove a stored response of this tenant."""
        require(ctx, "inference")
        tenant, _ = tenant_and_priority()
        if not await store.delete(tenant, response_id):
            raise _not_found(response_id)
        return json_response(deleted_body(response_id))

    @serves(blueprint, OPENAI_RESPONSE_INPUT_ITEMS)
    async def openai_response_input_items(response_id: str) -> Response:
        """The input items a stored response was created with, a page at a time."""
        require(ctx, "inference")
        tenant, _ = tenant_and_priority()
        limit, order, after = _page_args()
        found = await store.input_items(tenant, response_id)
        if found is None:
            raise _not_found(response_id)
        if order == "desc":
            found.reverse()
        if after is not None:
            ids = [item.get("id") for item in found]
            if after not in ids:
                raise invalid("after", f"no input item {after[:100]!r} in this response")
            found = found[ids.index(after) + 1 :]
        return json_response(input_items_page(found[:limit], len(found) > limit))

    @serves(blueprint, LIST_OPENAI_MODELS)
    async def list_openai_models() -> Response:
        """As ``GET /v1/models``."""
        require(ctx, "inference")
        return json_response(model_list(pool))

    @serves(blueprint, GET_OPENAI_MODEL, converters={"model": "path"})
    async def get_openai_model(model: str) -> Response:
        """One servable model (404 for any other name)."""
        require(ctx, "inference")
        for entry in model_list(pool)["data"]:
            if entry["id"] == model:
                return json_response(entry)
        raise PoolError("unknown_model", f"model {model[:200]!r} is not servable here")

    app.register_blueprint(blueprint)


def _not_found(response_id: str, param: str = "response_id") -> PoolError:
    return PoolError(
        "not_found",
        f"no stored response {response_id[:100]!r} (of this tenant)",
        details={"param": param},
    )


def _page_args() -> tuple[int, str, str | None]:
    """``limit`` (1 to 100, default 20), ``order`` (asc or desc, default desc), ``after``."""
    raw = request.args.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= _MAX_LIST:
        raise invalid("limit", f"must be a whole number from 1 to {_MAX_LIST}")
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", "must be asc or desc")
    return int(raw), order, request.args.get("after")
