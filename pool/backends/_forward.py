"""Forwarding a client's request to a model's own server as it came, and its reply back.

Backend ``server`` runs any OpenAI-compatible server. The routes the pool speaks itself
(chat, embeddings) reach it through the pool's upstream client, so every surface works;
the routes of the other kinds (images, audio, rerank) go through as they are: a
:class:`ForwardJob` carries the client's body (JSON, or a multipart form with its
content type) to the upstream path and relays the reply, streamed piece by piece where
the upstream streams. The job is a :class:`~pool.backends.TaskJob`, so keys, tenant
limits, budgets, the queue, residency, metrics, usage rows and traces apply as to any
request; its usage is the upstream's ``usage`` where the reply has one.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol, runtime_checkable

from pool.backends._protocol import ModelKind, Runtime
from pool.backends._tasks import TaskJob, TaskResult, TaskSink, TaskUsage
from pool.backends._upstream import (
    Transport,
    UpstreamError,
    UpstreamTimeout,
    upstream_message,
)
from pool.errors import BackendError, PoolError

# The upstream routes a server of each kind may serve. Chat and embedding servers are
# spoken to by the pool's own client (the chat path for every chat surface, the
# embeddings path for every embedding surface); the other kinds' routes are forwarded.
KIND_ROUTES: Mapping[ModelKind, tuple[str, ...]] = {
    "chat": ("/v1/chat/completions",),
    "embedding": ("/v1/embeddings",),
    "rerank": ("/v1/rerank", "/v1/score"),
    "transcription": ("/v1/audio/transcriptions", "/v1/audio/translations"),
    "speech": ("/v1/audio/speech",),
    "image": ("/v1/images/generations",),
}
# The kinds whose routes a server model forwards rather than the pool's client serving.
FORWARDED_KINDS: frozenset[ModelKind] = frozenset({"rerank", "transcription", "speech", "image"})

# A reply this large (a non-streamed one, read whole) is refused rather than held.
MAX_REPLY_BYTES = 256 * 1024 * 1024
# Upstream statuses that mean the client's request itself was refused: the client's to
# fix (400 ``invalid_request`` with the upstream's message), not a broken backend.
_REFUSED_REQUEST = frozenset({400, 413, 415, 422})


@dataclass(slots=True)
class ReplyHead:
    """The upstream reply's status and content type, known once its head arrived: set
    before the first streamed piece, so whoever relays the pieces can send them under
    the right head."""

    status: int = 0
    content_type: str = ""


@dataclass(frozen=True, slots=True)
class Forwarded:
    """A forwarded request's reply: its status and content type, and its body where it
    was read whole (``streamed``: the pieces went to the job's sink instead)."""

    status: int
    content_type: str
    body: bytes = b""
    streamed: bool = False


@runtime_checkable
class ForwardingRuntime(Runtime, Protocol):
    """A runtime that forwards requests to its server (backend ``server``)."""

    async def forward(
        self, route: str, body: bytes, content_type: str, head: ReplyHead, sink: TaskSink
    ) -> tuple[Forwarded, TaskUsage]:
        """Send ``body`` to the upstream path of ``route``; relay the reply.

        Raises:
            BackendError: the server failed or answered an error status.
            PoolError: ``invalid_request`` where the server refused the request itself,
                ``backend_timeout`` where it did not answer in time.
        """
        ...


@dataclass(frozen=True, slots=True)
class ForwardJob(TaskJob):
    """One client request for ``route``, forwarded to the model's server as it came.

    Built by :func:`forward_job` for the route's kind: the pool's intake refuses a model
    of another kind (400 ``wrong_model_kind``) before anything is forwarded.
    """

    served_by: ClassVar[frozenset[ModelKind]] = FORWARDED_KINDS
    operation: ClassVar[str] = "forward"
    model: str
    route: str
    body: bytes = field(repr=False)  # a form with an audio file: not for the logs
    content_type: str = "application/json"
    request_id: str = ""
    # Shared with the route that relays the reply (the job object is copied, not it).
    head: ReplyHead = field(default_factory=ReplyHead, compare=False, repr=False)

    async def run(self, runtime: Runtime, sink: TaskSink) -> TaskResult:
        if not isinstance(runtime, ForwardingRuntime):
            raise BackendError(f"model {self.model!r} does not forward {self.route}")
        reply, usage = await runtime.forward(
            self.route, self.body, self.content_type, self.head, sink
        )
        return TaskResult(reply, usage)


def _job_class(kind: ModelKind) -> type[ForwardJob]:
    name = f"Forward{kind.title()}Job"
    return type(
        name,
        (ForwardJob,),
        {"__slots__": (), "served_by": frozenset({kind}), "__qualname__": name},
    )


_JOBS: Mapping[ModelKind, type[ForwardJob]] = {kind: _job_class(kind) for kind in FORWARDED_KINDS}


def forward_job(
    kind: ModelKind, *, model: str, route: str, body: bytes, content_type: str
) -> ForwardJob:
    """The job that forwards one request for ``route``, served by models of ``kind``
    (one of :data:`FORWARDED_KINDS`: chat and embeddings have the pool's own client)."""
    if kind not in _JOBS:
        raise ValueError(f"kind {kind} is not forwarded")
    return _JOBS[kind](model=model, route=route, body=body, content_type=content_type)


def usage_of(reply: Any) -> TaskUsage:
    """A reply's ``usage`` in the pool's units: OpenAI's ``prompt_tokens`` /
    ``completion_tokens``, the Responses and rerank spellings (``input_tokens``,
    ``output_tokens``, ``total_tokens`` for a prompt-only task), and ``seconds`` of audio."""
    usage = reply.get("usage") if isinstance(reply, dict) else None
    if not isinstance(usage, dict):
        return TaskUsage()

    def count(*names: str) -> int:
        for name in names:
            value = usage.get(name)
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
                return value
        return 0

    prompt = count("prompt_tokens", "input_tokens")
    output = count("completion_tokens", "output_tokens")
    if not prompt and not output:
        # A rerank or embedding reply counts only what it read.
        prompt = count("total_tokens")
    seconds = usage.get("seconds")
    audio = float(seconds) if isinstance(seconds, int | float) and seconds >= 0 else 0.0
    return TaskUsage(prompt_tokens=prompt, output_tokens=output, audio_seconds=audio)


class _EventUsage:
    """The last ``usage`` among a Server-Sent Event stream's events, read as the bytes
    pass by (they are relayed unchanged; only complete events are parsed)."""

    def __init__(self) -> None:
        self._partial = b""
        self.usage = TaskUsage()

    def feed(self, chunk: bytes) -> None:
        self._partial += chunk.replace(b"\r\n", b"\n")
        *events, self._partial = self._partial.split(b"\n\n")
        for event in events:
            self._read(event)

    def end(self) -> None:
        self._read(self._partial)
        self._partial = b""

    def _read(self, event: bytes) -> None:
        for line in event.split(b"\n"):
            if not line.startswith(b"data:") or b'"usage"' not in line:
                continue
            try:
                found = usage_of(json.loads(line[5:]))
            except ValueError:
                continue
            if found != TaskUsage():
                self.usage = found


async def forward_upstream(
    transport: Transport,
    path: str,
    body: bytes,
    *,
    content_type: str,
    head: ReplyHead,
    sink: TaskSink,
    headers: Mapping[str, str] | None = None,
    what: str = "upstream",
) -> tuple[Forwarded, TaskUsage]:
    """POST ``body`` (of ``content_type``) to ``path``; an event stream's pieces go to
    ``sink`` as they arrive, any other reply is read whole.

    Raises:
        PoolError: ``invalid_request`` where the upstream refused the request itself
            (400, 413, 415, 422, its message quoted), ``backend_timeout``.
        BackendError: any other error status, a reply over :data:`MAX_REPLY_BYTES`, or
            a broken connection.
    """
    sent = {**(headers or {}), "Content-Type": content_type}
    try:
        async with transport.request("POST", path, body=body, headers=sent) as response:
            kind = response.headers.get("content-type", "application/octet-stream")
            if not 200 <= response.status < 300:
                message = upstream_message(await response.read())
                if response.status in _REFUSED_REQUEST:
                    raise PoolError("invalid_request", f"{what} refused the request: {message}")
                raise BackendError(f"{what} answered HTTP {response.status}: {message}")
            head.status, head.content_type = response.status, kind
            if kind.split(";", 1)[0].strip().lower() == "text/event-stream":
                events = _EventUsage()
                async for chunk in response.chunks():
                    events.feed(chunk)
                    await sink.send(chunk)
                events.end()
                return Forwarded(response.status, kind, streamed=True), events.usage
            pieces: list[bytes] = []
            size = 0
            async for chunk in response.chunks():
                size += len(chunk)
                if size > MAX_REPLY_BYTES:
                    raise BackendError(f"{what} answered more than {MAX_REPLY_BYTES} bytes")
                pieces.append(chunk)
    except UpstreamTimeout as exc:
        raise PoolError("backend_timeout", f"{what} did not answer in time ({exc})") from exc
    except UpstreamError as exc:
        raise BackendError(f"{what} connection failed: {exc}") from exc
    whole = b"".join(pieces)
    usage = TaskUsage()
    if kind.split(";", 1)[0].strip().lower().endswith("json"):
        with contextlib.suppress(ValueError):  # not JSON after all: no usage to read
            usage = usage_of(json.loads(whole))
    return Forwarded(response.status, kind, whole), usage
