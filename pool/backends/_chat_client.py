"""Streaming OpenAI-compatible Chat Completions: what llama-server, vllm serve and remote
APIs speak. Shared by every backend that forwards requests over HTTP."""

from __future__ import annotations

import json
import time
from typing import Any

from pool.backends._protocol import (
    GenerationRequest,
    GenerationStats,
    ImagePart,
    TokenSink,
    TokensUsed,
)
from pool.backends._tools import ToolCallDelta
from pool.backends._upstream import (
    Transport,
    UpstreamError,
    UpstreamTimeout,
    sse_batches,
    upstream_message,
)
from pool.errors import BackendError, PoolError

_FINISH = {"stop": "stop", "length": "length"}
# What an upstream answers for a request it will not take as it is.
REFUSED_REQUEST = frozenset({400, 413, 422})


def chat_messages(request: GenerationRequest) -> list[dict[str, Any]]:
    """The request as Chat Completions messages (images as ``image_url`` parts)."""
    messages: list[dict[str, Any]] = []
    if request.instructions:
        messages.append({"role": "system", "content": request.instructions})
    for turn in request.turns:
        if turn.has_images:
            content: Any = [
                {
                    "type": "image_url",
                    "image_url": {"url": p.url, **({"detail": p.detail} if p.detail else {})},
                }
                if isinstance(p, ImagePart)
                else {"type": "text", "text": p.text}
                for p in turn.parts
            ]
        else:
            content = turn.text
        message: dict[str, Any] = {"role": turn.role, "content": content}
        if turn.tool_calls:
            message["content"] = content or None
            message["tool_calls"] = [
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": call.arguments},
                }
                for call in turn.tool_calls
            ]
        if turn.tool_call_id is not None:
            message["tool_call_id"] = turn.tool_call_id
        messages.append(message)
    return messages


def tool_fields(request: GenerationRequest) -> dict[str, Any]:
    """Tools, ``tool_choice`` and ``response_format`` in OpenAI's own fields (what
    llama-server with ``--jinja``, vLLM and remote APIs read)."""
    fields: dict[str, Any] = {}
    if request.tools:
        fields["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": tool.name,
                    **({"description": tool.description} if tool.description else {}),
                    "parameters": dict(tool.parameters),
                    **({"strict": True} if tool.strict else {}),
                },
            }
            for tool in request.tools
        ]
        choice = request.tool_choice
        fields["tool_choice"] = (
            {"type": "function", "function": {"name": choice.name}}
            if choice.mode == "function"
            else choice.mode
        )
        fields["parallel_tool_calls"] = request.parallel_tool_calls
    output = request.output_format
    if output is not None:
        if output.kind == "json_object" or output.schema is None:
            fields["response_format"] = {"type": "json_object"}
        else:
            fields["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": output.name or "reply",
                    "schema": dict(output.schema),
                    "strict": output.strict,
                },
            }
    return fields


def _call_pieces(deltas: Any) -> list[ToolCallDelta]:
    """OpenAI's streamed ``delta.tool_calls`` entries as neutral pieces."""
    pieces = []
    for entry in deltas or ():
        function = entry.get("function") or {}
        pieces.append(
            ToolCallDelta(
                int(entry.get("index", 0)),
                entry.get("id") or None,
                function.get("name") or None,
                function.get("arguments") or "",
            )
        )
    return pieces


def usage_cached_tokens(usage: dict[str, Any], timings: Any) -> int | None:
    """Prompt tokens the upstream served from its prefix cache (None: it does not say).

    OpenAI-style servers (vLLM, llama-server) put them in
    ``usage.prompt_tokens_details.cached_tokens``; llama-server also in ``timings.cache_n``.
    """
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
        return int(details["cached_tokens"])
    if isinstance(timings, dict) and isinstance(timings.get("cache_n"), int):
        return int(timings["cache_n"])
    return None


def _count_so_far(used: TokensUsed, usage: Any, timings: Any) -> None:
    """Keep ``used`` current from a chunk's counts, where the upstream sends them while
    it streams: vLLM's usage in every chunk (``continuous_usage_stats``), llama-server's
    ``timings`` (``timings_per_token``: ``prompt_n`` computed plus ``cache_n`` reused)."""
    if isinstance(usage, dict):
        if isinstance(usage.get("prompt_tokens"), int):
            used.prompt_tokens = usage["prompt_tokens"]
        if isinstance(usage.get("completion_tokens"), int):
            used.output_tokens = usage["completion_tokens"]
    elif isinstance(timings, dict) and isinstance(timings.get("prompt_n"), int):
        cached = timings.get("cache_n") if isinstance(timings.get("cache_n"), int) else 0
        used.prompt_tokens = timings["prompt_n"] + cached
        used.cached_tokens = cached
        if isinstance(timings.get("predicted_n"), int):
            used.output_tokens = timings["predicted_n"]


class UpstreamConnectionFailed(BackendError):
    """The connection failed or broke off; a retry is safe while no text was delivered."""


async def stream_chat(
    transport: Transport,
    path: str,
    body: dict[str, Any],
    sink: TokenSink,
    *,
    headers: dict[str, str] | None = None,
    what: str = "upstream",
) -> GenerationStats:
    """POST ``body`` to ``path`` with ``stream: true``; pass every content delta to ``sink``.

    Raises:
        PoolError: ``backend_timeout`` when the upstream is too slow; ``invalid_request``
            when it refuses the request itself (400, 413 or 422).
        UpstreamConnectionFailed: no connection, or it broke off.
        BackendError: for an upstream error status or a broken or malformed stream.
    """
    # A body may ask for more (vLLM's continuous_usage_stats: usage in every chunk).
    options = {"include_usage": True, **body.get("stream_options", {})}
    payload = json.dumps(
        {**body, "stream": True, "stream_options": options}, ensure_ascii=False
    ).encode()
    used = sink.used
    started = time.perf_counter()
    first_ms: float | None = None
    pieces = 0
    finish = "stop"
    prompt_tokens = completion_tokens = cached_tokens = None
    stop_sequence: str | None = None
    done = False
    try:
        async with transport.request("POST", path, body=payload, headers=headers) as response:
            if response.status != 200:
                message = upstream_message(await response.read())
                if response.status in REFUSED_REQUEST:
                    # The request itself was refused (more images than the model takes,
                    # say): the client's to fix, not a broken backend. Other 4xx (auth,
                    # an unknown model, a busy or unloading peer) stay backend errors.
                    raise PoolError("invalid_request", f"{what} refused the request: {message}")
                raise BackendError(f"{what} answered HTTP {response.status}: {message}")
            # Read on past [DONE] to the end of the body, so the connection can be reused.
            async for batch in sse_batches(response.chunks()):
                for data in batch:
                    if done:
                        break
                    if data == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise BackendError(f"{what} failed mid-stream: {upstream_message(data)}")
                    for choice in chunk.get("choices") or ():
                        delta = choice.get("delta") or {}
                        # A completions stream (a resumed reply) carries `text` instead.
                        text = delta.get("content") if "delta" in choice else choice.get("text")
                        if text:
                            if first_ms is None:
                                first_ms = (time.perf_counter() - started) * 1000.0
                            pieces += 1
                            await sink.send(text)
                        for call in _call_pieces(delta.get("tool_calls")):
                            if first_ms is None:
                                first_ms = (time.perf_counter() - started) * 1000.0
                            pieces += 1
                            await sink.send(call)
                        if choice.get("finish_reason"):
                            finish = _FINISH.get(choice["finish_reason"], "stop")
                            # vLLM names the stop string that ended the reply.
                            if isinstance(choice.get("stop_reason"), str):
                                stop_sequence = choice["stop_reason"]
                    usage = chunk.get("usage")
                    if usage:
                        prompt_tokens = usage.get("prompt_tokens")
                        completion_tokens = usage.get("completion_tokens")
                        cached_tokens = usage_cached_tokens(usage, chunk.get("timings"))
                    _count_so_far(used, usage, chunk.get("timings"))
    except UpstreamTimeout as exc:
        raise PoolError("backend_timeout", f"{what} did not answer in time ({exc})") from exc
    except UpstreamError as exc:
        raise UpstreamConnectionFailed(f"{what} connection failed: {exc}") from exc
    except ValueError as exc:
        raise BackendError(f"{what} sent a malformed stream: {exc}") from exc
    return GenerationStats(
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        output_tokens=completion_tokens if completion_tokens is not None else pieces,
        time_to_first_token_ms=None if first_ms is None else round(first_ms, 3),
        generate_ms=round((time.perf_counter() - started) * 1000.0, 3),
        finish_reason=finish,  # type: ignore[arg-type]
        stop_sequence=stop_sequence,
    )
