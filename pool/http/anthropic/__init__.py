"""Anthropic's Messages API over the same pool: ``POST /v1/messages`` (JSON and SSE)
and ``POST /v1/messages/count_tokens``.

The system prompt becomes ``instructions``; user and assistant messages become turns,
``tool_use`` blocks the assistant's calls and ``tool_result`` blocks ``tool`` turns, as
the other chat surfaces build them; earlier ``thinking`` blocks are not shown to the
model again. A reply that opens with a reasoning block (``<think>...</think>``, as
Qwen3-style models write it) answers it as a ``thinking`` block before the text.

``x-api-key`` is an inference token here (as ``Authorization: Bearer`` is), and
``anthropic-version`` / ``anthropic-beta`` are accepted and not needed. Errors use
Anthropic's shape with the pool's statuses; a stream that has to wait (a busy replica,
a load, room on the GPUs) sends its headers at once and ``ping`` events while it waits.
"""

from pool.http.anthropic._routes import ROUTES, register

__all__ = ["ROUTES", "register"]
