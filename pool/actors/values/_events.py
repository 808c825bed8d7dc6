"""What a running request yields: text as it is generated, then how it ended.

These are the values :meth:`Admission.events` yields and :meth:`Pool.respond` returns;
every API surface renders them in its own wire format (``pool/http``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pool.backends import FinishReason, RelayPath, TaskUsage, ToolCall, ToolCallDelta
from pool.errors import PoolError


@dataclass(slots=True)
class Delta:
    """New output text. The replica's hand-over type too: the stream yields it as is."""

    text: str


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts; ``None`` where the backend could not tell.

    ``cached_tokens``: prompt tokens the runtime's prefix cache served (``None``: it
    keeps no cache or could not tell).
    """

    prompt_tokens: int | None
    output_tokens: int | None
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class Timings:
    """The nested timers of one request, in milliseconds (``None`` where unknown).

    ``pool_ms`` spans the whole request in the pool; ``engine_ms`` the time since
    dispatch to a replica; ``backend_ms`` the backend's own call inside it.

    Each interval has this one name in every layer: the runtime's ``GenerationStats``
    (``time_to_first_token_ms``, ``generate_ms``, ``backend_queue_ms``), the replica's
    report (``backend_ms``, ``time_to_first_token_ms``) and here. Only the wire spells
    them otherwise, each renderer in one place: ``/v1/responses``' ``metrics`` object
    (``response_metrics``: ``gpu_generate_total_ms``, ``backend_inference_wall_ms``, ...),
    Ollama's ``*_duration`` fields, and the usage table's ``queue_ms`` and
    ``generation_ms`` columns (pool/actors/accounting/_usage_store.py).
    """

    backend_ms: float | None = None
    engine_ms: float | None = None
    engine_outside_backend_ms: float | None = None
    pool_ms: float | None = None
    queue_wait_ms: float | None = None
    tokenize_ms: float | None = None
    time_to_first_token_ms: float | None = None
    generate_ms: float | None = None
    decode_after_first_token_ms: float | None = None
    tokens_per_second: float | None = None
    # Inside backend_ms: the wait in the engine's own scheduler, where the backend
    # reports it (vLLM). Not part of the HTTP metrics.
    backend_queue_ms: float | None = None


@dataclass(frozen=True, slots=True)
class Finished:
    """The request completed: the whole text, why it stopped, usage and timings.

    ``tool_calls`` are the calls the model made (their pieces came as
    :class:`ToolCallDelta` events); with any, ``finish_reason`` is ``tool_calls``.
    ``stop_sequence``: the stop string that ended it, where the backend tells.
    ``relay_path``: ``pass_through`` when the upstream's own bytes went to the client
    (then ``text`` is empty, and ``body`` holds a reply that was not streamed).
    """

    text: str
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    tool_calls: tuple[ToolCall, ...] = ()
    stop_sequence: str | None = None
    relay_path: RelayPath = "translated"
    body: bytes | None = None


@dataclass(frozen=True, slots=True)
class Failed:
    """The request failed after it was admitted (the stream ends with this)."""

    error: PoolError


@dataclass(frozen=True, slots=True)
class Embedded:
    """An embedding request completed: one vector per text, in order."""

    vectors: tuple[tuple[float, ...], ...]
    usage: Usage
    timings: Timings


@dataclass(frozen=True, slots=True)
class Completed:
    """A task request (rerank, transcription, speech, a forwarded route) completed:
    the job's own answer, its usage in tokens and in the task's units, its timings."""

    value: Any
    usage: Usage
    task_usage: TaskUsage
    timings: Timings


@dataclass(frozen=True, slots=True)
class Paused:
    """The stream is paused for a swap (docs/vram.md, "Pause and resume"): nothing new
    until its model is back. Repeated while the pause lasts, so each surface shows the
    client it is alive (an SSE comment, a ping); the text then goes on where it stopped."""

    paused_s: float


# ToolCallDelta (from pool.backends) is the neutral piece of a tool call; bytes are an
# upstream's own events, forwarded on the pass-through path (pool/backends/_pass_through.py).
Event = Delta | ToolCallDelta | bytes | Finished | Failed | Paused

# What a request that has not started yet waits for: room on the GPUs (the VRAM gate,
# or its model making way for another), its model's load, or a free replica slot.
WaitReason = Literal["vram", "load", "replica"]


@dataclass(frozen=True, slots=True)
class Queued:
    """The request waits: its place among the model's waiting requests (1: next) and why.

    Reported again whenever either changes, until the request runs.
    """

    position: int
    waiting_for: WaitReason


@dataclass(frozen=True, slots=True)
class Loading:
    """The model the request waits for is loading; ``progress`` 0..1 where the backend
    reports it, else None. Reported again when the progress moves."""

    progress: float | None


Waiting = Queued | Loading
