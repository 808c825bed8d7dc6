"""The routes of Anthropic's Messages API: read the request, run the pool, answer."""

from __future__ import annotations

from quart import Blueprint, Quart, Response

from pool.errors import PoolError
from pool.http._collected import collected
from pool.http._common import (
    AppContext,
    json_response,
    open_model_route,
    request_id,
)
from pool.http._route import GENERATION_REFUSALS, SSE, Route, serves
from pool.http._streaming import HEARTBEAT_S, admitted_stream, streamed_answer
from pool.http.anthropic._parse import inference_request
from pool.http.anthropic._render import ERRORS, MessageStream, message_body, token_count_body
from pool.schemas import (
    MessagesReply,
    MessagesRequest,
    MessagesStreamEvent,
    MessagesTokenCount,
    MessagesTokensRequest,
)

# A waiting stream shows a ping at least this often (docs/api.md, "Messages").
PING_INTERVAL_S = HEARTBEAT_S


# -- the documented routes (pool/http/_route.py) ----------------------------------------
CREATE_MESSAGE = Route(
    "post",
    "/v1/messages",
    "anthropic",
    "Messages (Anthropic)",
    "Anthropic's Messages API on every chat backend. `system` (a string or text blocks),"
    " `messages` with `text`, `image` (`base64` or `url` sources, under the media policy"
    " of `/v1/responses`), `tool_use` and `tool_result` blocks (earlier `thinking` blocks"
    " are accepted and not shown to the model); `max_tokens` (required), `stop_sequences`,"
    " `temperature`, `top_p`, `top_k`, `metadata`, `tools` (client tools with"
    " `input_schema`; server tools are a 400) and `tool_choice` (`auto`, `any`, `tool`,"
    " `none`; `disable_parallel_tool_use`) where the backend has tools, `thinking` where"
    " the model can think. The answer's `content` holds `thinking` (a reply that opens with"
    " `<think>...</think>`), `text` and `tool_use` blocks (`input` parsed); `stop_reason` is"
    " `end_turn`, `max_tokens`, `stop_sequence` (with `stop_sequence`, where the backend"
    " names the string it stopped at: stub, llama_cpp, ct2, exllamav3, vllm, vllm_serve) or"
    " `tool_use`; `usage.input_tokens` counts the prompt tokens not served from the"
    " prefix cache, `cache_read_input_tokens` those that were. `stream: true` answers"
    " Server-Sent Events: `message_start`, `ping`, then per block `content_block_start`,"
    " `content_block_delta` (`text_delta`, `thinking_delta`, `input_json_delta`) and"
    " `content_block_stop`, then `message_delta` (stop reason, usage) and `message_stop`;"
    " an error after the start is an `error` event. A stream that must wait (a busy"
    " replica, a load, room on the GPUs) starts at once and sends a `ping` at least every"
    " 5 s while it waits. Authentication: `x-api-key` or `Authorization: Bearer` with an"
    " inference token; `anthropic-version` is accepted. Errors are"
    ' `{"type": "error", "error": {"type", "message"}}` with the pool\'s'
    " statuses (400 invalid_request_error, also for a body that does not validate; 401"
    " authentication_error; 403 permission_error; 404 not_found_error; 413"
    " request_too_large; 429 rate_limit_error; 503 overloaded_error; 504 timeout_error;"
    " other 5xx api_error). Headers as `/v1/responses` (`X-Tenant-ID`, `X-Priority`,"
    " `X-Cache-Mode`, `X-Cache-Tag`); answers carry `request-id`.",
    MessagesRequest,
    reply=MessagesReply,
    stream=SSE,
    events=MessagesStreamEvent,
    errors="anthropic",
    valid_input_codes=GENERATION_REFUSALS,
)
COUNT_TOKENS = Route(
    "post",
    "/v1/messages/count_tokens",
    "anthropic",
    "Count tokens (Anthropic)",
    "`input_tokens`: the prompt of a Messages request (`model`, `system`, `messages`,"
    " `tools`, `tool_choice`, `thinking`) in the model's own tokens, counted by the model"
    " itself: it renders and prefills the prompt and generates one token, through the same"
    " queue and on-demand load as a request (so the prefix is cached for the request that"
    " follows). Authentication and errors as `/v1/messages`.",
    MessagesTokensRequest,
    reply=MessagesTokenCount,
    errors="anthropic",
    valid_input_codes=GENERATION_REFUSALS,
)
ROUTES = (CREATE_MESSAGE, COUNT_TOKENS)


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    blueprint = Blueprint("anthropic", __name__)
    ctx.error_shapes[blueprint.name] = ERRORS
    ctx.path_dialects["/v1/messages/"] = blueprint.name

    @serves(blueprint, CREATE_MESSAGE)
    async def create_message() -> Response:
        """Anthropic Messages: one message, or its event stream with ``stream: true``."""
        opened = await open_model_route(ctx, MessagesRequest, api_key=True)
        body = opened.body
        request = opened.neutral(inference_request(body))
        stops = tuple(body.stop_sequences or ())
        rid = request_id()
        if not body.stream:
            done = await collected(pool, opened, request)
            reply = message_body(done.admission, body.model, done.finished, stops)
            return json_response(reply, headers=done.headers() | {"request-id": rid})

        stream = MessageStream(body.model, stops, rid)
        admission, chunks = await admitted_stream(
            pool, opened, request, stream, heartbeat_s=PING_INTERVAL_S
        )
        return streamed_answer(chunks, admission, headers={"request-id": rid})

    @serves(blueprint, COUNT_TOKENS)
    async def count_tokens() -> Response:
        """The prompt's tokens, counted by the model itself (it prefills the prompt)."""
        opened = await open_model_route(ctx, MessagesTokensRequest, api_key=True)
        request = opened.neutral(inference_request(opened.body, counting=True))
        done = await collected(pool, opened, request)
        prompt_tokens = done.finished.usage.prompt_tokens
        if prompt_tokens is None:
            raise PoolError(
                "backend_error",
                f"model {opened.body.model!r} did not report how long the prompt is",
            )
        # A count answers no prompt: its headers report no cache reuse, as they always have.
        headers = done.headers(cache=False) | {"request-id": request_id()}
        return json_response(token_count_body(prompt_tokens), headers=headers)

    app.register_blueprint(blueprint)
