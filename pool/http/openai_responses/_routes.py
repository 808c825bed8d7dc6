"""The routes of the dialect (its parsing and rendering stay beside them until they move
into ``_parse.py`` and ``_render.py``)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from quart import Blueprint, Quart, Response, request

from pool.actors import (
    Admission,
    DecodingOverrides,
    Delta,
    Failed,
    Finished,
    InferenceRequest,
    Pool,
    ToolCallDelta,
)
from pool.backends import ImagePart, TextPart, ToolCall, Turn
from pool.config import state_dir
from pool.errors import PoolError
from pool.http._admin import model_list
from pool.http._common import (
    AppContext,
    HotRoute,
    cache_headers_in,
    chat_request,
    dumps,
    inference_headers,
    json_response,
    read_body,
    request_id,
    require,
    tenant_and_priority,
    with_cache,
)
from pool.http._streaming import admitted_stream
from pool.http._tools import invalid, responses_output_format, responses_tools, tool_choice
from pool.http.openai._render import ERRORS
from pool.http.openai_responses._render import OutputBuilder, ResponseFrame, new_id
from pool.http.openai_responses._store import FILE_NAME, ResponseStore
from pool.schemas import (
    FunctionCallInput,
    FunctionCallOutputInput,
    FunctionChoice,
    FunctionTool,
    MessageInput,
    OpenAIResponseRequest,
    ReasoningInput,
)

log = logging.getLogger("pool.http")

BASE = "/openai/v1"
_MAX_LIST = 100


# -- input items ---------------------------------------------------------------------------
def input_items(body: OpenAIResponseRequest) -> list[dict[str, Any]]:
    """The request's input as the items OpenAI lists (``input_items``): every item with
    an ``id``, message content as parts."""
    if body.input is None:
        return []
    if isinstance(body.input, str):
        text = {"type": "input_text", "text": body.input}
        return [_message_item(new_id("msg"), "user", [text])]
    items: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, MessageInput):
            content = item.content
            if isinstance(content, str):
                kind = "output_text" if item.role == "assistant" else "input_text"
                parts = [{"type": kind, "text": content}]
            else:
                parts = [p.model_dump(exclude_none=True) for p in content]
            items.append(_message_item(item.id or new_id("msg"), item.role, parts))
        elif isinstance(item, FunctionCallInput):
            items.append(
                {
                    "type": "function_call",
                    "id": item.id or "fc_" + item.call_id,
                    "call_id": item.call_id,
                    "name": item.name,
                    "arguments": item.arguments,
                    "status": "completed",
                }
            )
        elif isinstance(item, FunctionCallOutputInput):
            output = item.output
            items.append(
                {
                    "type": "function_call_output",
                    "id": item.id or new_id("fco"),
                    "call_id": item.call_id,
                    "output": (
                        output
                        if isinstance(output, str)
                        else [p.model_dump(exclude_none=True) for p in output]
                    ),
                    "status": "completed",
                }
            )
        else:
            assert isinstance(item, ReasoningInput)
            items.append({**item.model_dump(exclude_none=True), "id": item.id or new_id("rs")})
    return items


def _message_item(item_id: str, role: str, parts: list[dict[str, Any]]) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": role, "content": parts, "status": "completed"}


def _parts(content: Any) -> tuple[TextPart | ImagePart, ...]:
    if isinstance(content, str):
        return (TextPart(content),)
    parts: list[TextPart | ImagePart] = []
    for part in content:
        kind = part.get("type")
        if kind == "input_image":
            parts.append(ImagePart(part["image_url"], part.get("detail")))
        elif kind == "refusal":
            parts.append(TextPart(part.get("refusal", "")))
        else:
            parts.append(TextPart(part.get("text", "")))
    return tuple(parts) or (TextPart(""),)


def _text_of(content: Any) -> str:
    return "".join(p.text for p in _parts(content) if isinstance(p, TextPart))


def conversation(items: list[dict[str, Any]]) -> tuple[list[str], list[Turn]]:
    """System texts and turns of input and output items, in order.

    Calls join the assistant turn before them (or open one of their own); each output
    becomes a ``tool`` turn; reasoning items stay out of the prompt.
    """
    system: list[str] = []
    turns: list[Turn] = []
    for item in items:
        kind = item.get("type", "message")
        if kind == "message":
            role = item["role"]
            if role in ("system", "developer"):
                system.append(_text_of(item["content"]))
            else:
                turns.append(Turn(role, _parts(item["content"])))
        elif kind == "function_call":
            call = ToolCall(item["call_id"], item["name"], item.get("arguments", "{}"))
            last = turns[-1] if turns else None
            if last is not None and last.role == "assistant":
                turns[-1] = Turn("assistant", last.parts, (*last.tool_calls, call))
            else:
                turns.append(Turn("assistant", (TextPart(""),), (call,)))
        elif kind == "function_call_output":
            turns.append(Turn("tool", _parts(item["output"]), tool_call_id=item["call_id"]))
    return system, turns


# -- the request ---------------------------------------------------------------------------
def _tools(body: OpenAIResponseRequest) -> list[FunctionTool]:
    tools = []
    for index, tool in enumerate(body.tools or ()):
        if tool.type != "function":
            raise invalid(
                f"tools[{index}].type",
                f'only "function" tools are supported, not {tool.type[:40]!r}',
            )
        tools.append(
            FunctionTool(
                type="function",
                name=tool.name,
                description=tool.description,
                parameters=tool.parameters,
                strict=tool.strict,
            )
        )
    return tools


def _choice(body: OpenAIResponseRequest) -> str | FunctionChoice | None:
    value = body.tool_choice
    if value is None or isinstance(value, str):
        return value
    if value.type != "function" or not value.name:
        raise invalid("tool_choice", 'only {"type": "function", "name": ...} names a tool')
    return FunctionChoice(type="function", name=value.name)


def _refuse_unsupported(body: OpenAIResponseRequest) -> None:
    if body.background:
        raise invalid("background", "background responses are not supported; leave it out")
    if body.conversation is not None:
        raise invalid("conversation", "conversations are not supported; use previous_response_id")
    if body.input is None and body.previous_response_id is None:
        raise invalid("input", "give input (or continue a response with previous_response_id)")


def inference_request(
    body: OpenAIResponseRequest, history: list[dict[str, Any]], items: list[dict[str, Any]]
) -> InferenceRequest:
    """The neutral request: ``history`` (a stored conversation) then ``items``."""
    system, turns = conversation([*history, *items])
    instructions = [body.instructions] if body.instructions else []
    instructions += system
    tools = responses_tools(_tools(body))
    return chat_request(
        body.model,
        turns,
        instructions="\n\n".join(instructions) if instructions else None,
        decoding=DecodingOverrides(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            max_tokens=body.max_output_tokens,
            seed=body.seed,
        ),
        thinking=body.thinking,
        allow_remote=body.allow_remote,
        keep_alive=body.keep_alive,
        tools=tools,
        tool_choice=tool_choice(_choice(body), tools),
        parallel_tool_calls=body.parallel_tool_calls,
        output_format=responses_output_format(body.text.format if body.text else None),
    )


def response_frame(body: OpenAIResponseRequest) -> ResponseFrame:
    """The request's settings as the response object echoes them."""
    tools = [
        {
            "type": "function",
            "name": t.name,
            "description": t.description,
            "parameters": t.parameters,
            "strict": t.strict if t.strict is not None else False,
        }
        for t in body.tools or ()
    ]
    choice: Any = body.tool_choice or "auto"
    if not isinstance(choice, str):
        choice = {"type": choice.type, "name": choice.name}
    text_format = body.text.format if body.text else None
    return ResponseFrame(
        id=new_id("resp"),
        model=body.model,
        created_at=int(time.time()),
        instructions=body.instructions,
        max_output_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        text={
            "format": (
                text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format
                else {"type": "text"}
            )
        },
        metadata=dict(body.metadata or {}),
        previous_response_id=body.previous_response_id,
        store=body.store,
        reasoning=body.reasoning.model_dump() if body.reasoning else None,
        truncation=body.truncation,
        user=body.user,
    )


def sse(event: dict[str, Any]) -> bytes:
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + dumps(event) + b"\n\n"


def _not_found(response_id: str, param: str = "response_id") -> PoolError:
    return PoolError(
        "not_found",
        f"no stored response {response_id[:100]!r} (of this tenant)",
        details={"param": param},
    )


# -- routes --------------------------------------------------------------------------------
def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    service = ctx.settings.service
    store = ResponseStore(
        state_dir() / FILE_NAME, service.responses_retention_s, service.responses_max_stored
    )
    app.after_serving(store.aclose)
    blueprint = Blueprint("openai_responses", __name__)
    ctx.error_shapes[blueprint.name] = ERRORS

    @blueprint.post(BASE + "/responses")
    async def create_openai_response() -> Response:
        """OpenAI's Responses API: one response object, or its stream of events."""
        require(ctx, "inference")
        tenant, priority = tenant_and_priority()
        cache = cache_headers_in()
        body = await read_body(OpenAIResponseRequest)
        _refuse_unsupported(body)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            chain = await store.chain(tenant, body.previous_response_id)
            if chain is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            for turn in chain:
                history += turn.input + turn.output
        items = input_items(body)
        neutral = with_cache(inference_request(body, history, items), cache)
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
            response = await _collect(pool, neutral, tenant, priority, builder)
            await keep()
            headers = inference_headers(
                response.queue_wait_ms,
                response.finished.timings.backend_ms,
                response.finished.usage.cached_tokens,
            )
            logged(str(builder.response["status"] if builder.response else "?"))
            return json_response(builder.response, headers=headers)

        ending: list[bytes] = []

        def render(admission: Admission, event: Delta | Finished) -> bytes | None:
            if type(event) is Delta:
                return b"".join(sse(e) for e in builder.delta(event))
            assert isinstance(event, Finished)
            *events, last = builder.finish(event)
            ending.append(sse(last))  # after the response is stored
            return b"".join(sse(e) for e in events)

        def render_error(admission: Admission, exc: PoolError) -> bytes:
            *events, last = builder.fail(exc)
            ending.append(sse(last))
            return b"".join(sse(e) for e in events)

        def render_tool_call(admission: Admission, piece: ToolCallDelta) -> bytes:
            return b"".join(sse(e) for e in builder.tool_call(piece))

        admission, chunks = await admitted_stream(
            pool,
            neutral,
            tenant=tenant,
            priority=priority,
            render=render,
            render_error=render_error,
            opening=lambda _: b"".join(sse(e) for e in builder.opening()),
            render_tool_call=render_tool_call,
        )

        async def events() -> AsyncIterator[bytes]:
            try:
                async for chunk in chunks:
                    yield chunk
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]
            if ending:
                if builder.response is not None and builder.response["status"] != "failed":
                    await keep()
                logged(str(builder.response["status"] if builder.response else "?"))
                yield ending[0]

        headers = inference_headers(admission.queue_wait_ms, None)
        headers.update({"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        streamed = Response(events(), content_type="text/event-stream", headers=headers)
        streamed.timeout = None
        return streamed

    ctx.hot_routes[BASE + "/responses"] = HotRoute(create_openai_response, blueprint.name)

    @blueprint.get(BASE + "/responses/<response_id>")
    async def get_openai_response(response_id: str) -> Response:
        """A stored response of this tenant (404 when there is none)."""
        require(ctx, "inference")
        tenant, _ = tenant_and_priority()
        found = await store.get(tenant, response_id)
        if found is None:
            raise _not_found(response_id)
        return json_response(found)

    @blueprint.delete(BASE + "/responses/<response_id>")
    async def delete_openai_response(response_id: str) -> Response:
        """Remove a stored response of this tenant."""
        require(ctx, "inference")
        tenant, _ = tenant_and_priority()
        if not await store.delete(tenant, response_id):
            raise _not_found(response_id)
        return json_response({"id": response_id, "object": "response", "deleted": True})

    @blueprint.get(BASE + "/responses/<response_id>/input_items")
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
        page = found[:limit]
        return json_response(
            {
                "object": "list",
                "data": page,
                "first_id": page[0].get("id") if page else None,
                "last_id": page[-1].get("id") if page else None,
                "has_more": len(found) > limit,
            }
        )

    @blueprint.get(BASE + "/models")
    async def list_openai_models() -> Response:
        """As ``GET /v1/models``."""
        require(ctx, "inference")
        return json_response(model_list(pool))

    @blueprint.get(BASE + "/models/<path:model>")
    async def get_openai_model(model: str) -> Response:
        """One servable model (404 for any other name)."""
        require(ctx, "inference")
        for entry in model_list(pool)["data"]:
            if entry["id"] == model:
                return json_response(entry)
        raise PoolError("unknown_model", f"model {model[:200]!r} is not servable here")

    app.register_blueprint(blueprint)


def _page_args() -> tuple[int, str, str | None]:
    """``limit`` (1 to 100, default 20), ``order`` (asc or desc, default desc), ``after``."""
    raw = request.args.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= _MAX_LIST:
        raise invalid("limit", f"must be a whole number from 1 to {_MAX_LIST}")
    order = request.args.get("order", "desc")
    if order not in ("asc", "desc"):
        raise invalid("order", "must be asc or desc")
    return int(raw), order, request.args.get("after")


class _Collected:
    def __init__(self, finished: Finished, queue_wait_ms: float) -> None:
        self.finished = finished
        self.queue_wait_ms = queue_wait_ms


async def _collect(
    pool: Pool,
    neutral: InferenceRequest,
    tenant: str,
    priority: str,
    builder: OutputBuilder,
) -> _Collected:
    """Run the request to its end through ``builder`` (its events unsent); a failure is
    raised, so the client gets an HTTP error."""
    async with pool.admit(neutral, tenant=tenant, priority=priority) as admission:
        events = admission.events()
        async with contextlib.aclosing(events):
            async for event in events:
                if type(event) is Delta:
                    builder.delta(event)
                elif isinstance(event, ToolCallDelta):
                    builder.tool_call(event)
                elif isinstance(event, Finished):
                    builder.finish(event)
                    return _Collected(event, admission.queue_wait_ms)
                elif isinstance(event, Failed):
                    raise event.error
    raise AssertionError("events() always ends with Finished or Failed")
