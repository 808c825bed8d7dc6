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
from pool.http._streaming import HEARTBEAT_S, admitted_stream, streamed_answer
from pool.http.anthropic._parse import inference_request
from pool.http.anthropic._render import ERRORS, MessageStream, message_body, token_count_body
from pool.schemas import MessagesRequest, MessagesTokensRequest

# A waiting stream shows a ping at least this often (docs/api.md, "Messages").
PING_INTERVAL_S = HEARTBEAT_S


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    blueprint = Blueprint("anthropic", __name__)
    ctx.error_shapes[blueprint.name] = ERRORS
    ctx.path_dialects["/v1/messages/"] = blueprint.name

    @blueprint.post("/v1/messages")
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

    @blueprint.post("/v1/messages/count_tokens")
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
