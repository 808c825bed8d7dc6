"""The ``openai_remote`` backend: an upstream OpenAI-compatible Chat Completions API.

Nothing runs locally: a "replica" is an HTTP client. Only ``temperature``, ``top_p``,
``max_tokens`` and ``stop`` go upstream; connection failures are retried up to
``remote_max_retries`` times (before any text was sent), a slow upstream becomes
``backend_timeout`` and an upstream error ``backend_error``. The pool refuses requests
without ``allow_remote: true`` before they get here. A model with ``embedding: true``
passes embeddings through to the upstream's ``/embeddings`` (``embedding_batch_size``
texts per request) and serves no generation; one of ``kind: rerank`` passes rerank and
score requests through to the upstream's ``/rerank`` (Cohere's, Jina's, vLLM's shape).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal

import trio
from pydantic import Field

from pool.backends._chat_client import (
    UpstreamConnectionFailed,
    chat_messages,
    stream_chat,
    tool_fields,
)
from pool.backends._embedding import DIMENSIONS_DESCRIPTION, EmbeddingFields, embed_upstream
from pool.backends._managed import SERVER_SAMPLING, sampling_fields
from pool.backends._pass_through import relay_reply, relay_stream
from pool.backends._protocol import (
    ALL_THINKING_MODES,
    Backend,
    Capabilities,
    EmbeddingJob,
    EmbeddingResult,
    GenerationRequest,
    GenerationStats,
    LoadContext,
    ModelKind,
    TokenSink,
    takes_raw,
)
from pool.backends._rerank import RankResult, rank_upstream
from pool.backends._tools import ToolCallDelta
from pool.backends._upstream import UpstreamError, open_transport, with_trace
from pool.config import CommonModelFields
from pool.errors import BackendError, PoolError


class OpenAIRemoteModel(CommonModelFields, EmbeddingFields):
    """An upstream OpenAI-compatible Chat Completions API."""

    KINDS: ClassVar[tuple[ModelKind, ...]] = ("chat", "embedding", "rerank")

    backend: Literal["openai_remote"] = "openai_remote"
    remote_api_kind: Literal["chat_completions"] = "chat_completions"
    remote_base_url: str
    remote_api_key_env: str | None = None
    remote_model: str
    remote_timeout_s: Annotated[float, Field(gt=0.0)] = 120.0
    remote_health_check: Literal["config_only", "models_endpoint"] = "config_only"
    remote_max_retries: Annotated[int, Field(ge=0, le=10)] = 0
    remote_thinking: Literal["enabled", "disabled"] | None = None
    embedding_dimensions: bool = Field(False, description=DIMENSIONS_DESCRIPTION)
    allow_remote: bool = Field(
        False,
        description="The operator's consent: every surface serves this model without the"
        " client's per-request allow_remote (requests still leave this machine).",
    )


class _CountingSink:
    def __init__(self, sink: TokenSink) -> None:
        self.sink = sink
        self.used = sink.used
        self.sent = 0
        self.takes_raw = takes_raw(sink)

    async def send(self, text: str | bytes | ToolCallDelta) -> None:
        self.sent += 1
        if isinstance(text, bytes):
            assert takes_raw(self.sink), "bytes only go to a sink that takes them"
            await self.sink.send(text)
        else:
            await self.sink.send(text)


class OpenAIRemoteRuntime:
    def __init__(self, definition: OpenAIRemoteModel, api_key: str | None) -> None:
        self._definition = definition
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self.upstream = open_transport(
            definition.remote_base_url, timeout_s=definition.remote_timeout_s
        )

    @property
    def vram_mib(self) -> int | None:
        return None

    def body(self, request: GenerationRequest) -> dict[str, Any]:
        d = request.decoding
        body: dict[str, Any] = {
            "model": self._definition.remote_model,
            "messages": chat_messages(request),
            "temperature": d.temperature,
            "top_p": d.top_p,
            "max_tokens": d.max_tokens,
        }
        if d.stop:
            body["stop"] = list(d.stop)
        body.update(sampling_fields(d))
        body.update(tool_fields(request))
        thinking = {"enabled": "enabled", "disabled": "disabled"}.get(request.thinking)
        thinking = thinking or self._definition.remote_thinking
        if thinking is not None:
            body["thinking"] = {"type": thinking}
        return body

    def headers(self, request: GenerationRequest) -> dict[str, str] | None:
        """The headers of ``request``'s call (a relay to a peer pool adds its own)."""
        return self._headers

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        counting = _CountingSink(sink)
        ask = request.pass_through if counting.takes_raw else None
        attempts = 0
        while True:
            try:
                headers = with_trace(self.headers(request), request.trace_parent)
                # The whole call, connection included, is bounded by remote_timeout_s.
                with trio.fail_after(self._definition.remote_timeout_s):
                    if ask is not None:
                        # The client speaks the upstream's dialect: its bytes go through.
                        relay = relay_stream if ask.stream else relay_reply
                        return await relay(
                            self.upstream,
                            "/chat/completions",
                            self.body(request),
                            counting,
                            ask,
                            headers=headers,
                            what="remote API",
                        )
                    return await stream_chat(
                        self.upstream,
                        "/chat/completions",
                        self.body(request),
                        counting,
                        headers=headers,
                        what="remote API",
                    )
            except trio.TooSlowError:
                raise PoolError(
                    "backend_timeout",
                    f"the remote API did not finish within {self._definition.remote_timeout_s:g}s",
                ) from None
            except UpstreamConnectionFailed:
                if counting.sent or attempts >= self._definition.remote_max_retries:
                    raise
                attempts += 1
                await trio.sleep(min(2.0, 0.25 * attempts))

    async def embed(self, job: EmbeddingJob) -> EmbeddingResult:
        """Pass-through to the upstream's ``/embeddings``, within ``remote_timeout_s``."""
        try:
            with trio.fail_after(self._definition.remote_timeout_s):
                return await embed_upstream(
                    self.upstream,
                    "/embeddings",
                    job,
                    model=self._definition.remote_model,
                    batch_size=self._definition.embedding_batch_size,
                    headers=self._headers,
                    what="remote API",
                )
        except trio.TooSlowError:
            raise PoolError(
                "backend_timeout",
                f"the remote API did not finish within {self._definition.remote_timeout_s:g}s",
            ) from None

    @property
    def ranks(self) -> bool:
        return self._definition.kind == "rerank"

    async def rank(self, query: str, documents: Sequence[str]) -> RankResult:
        """Pass-through to the upstream's ``/rerank``, within ``remote_timeout_s``."""
        try:
            with trio.fail_after(self._definition.remote_timeout_s):
                return await rank_upstream(
                    self.upstream,
                    "/rerank",
                    query,
                    documents,
                    model=self._definition.remote_model,
                    headers=self._headers,
                    what="remote API",
                )
        except trio.TooSlowError:
            raise PoolError(
                "backend_timeout",
                f"the remote API did not finish within {self._definition.remote_timeout_s:g}s",
            ) from None

    async def close(self) -> None:
        await self.upstream.aclose()


class OpenAIRemoteBackend(Backend[OpenAIRemoteModel]):
    config = OpenAIRemoteModel
    # Holds no GPU memory: never evicted, nothing to keep warm.
    stay_warm_s = 0.0

    def capabilities(self, definition: OpenAIRemoteModel) -> Capabilities:
        return Capabilities(
            modalities=tuple(definition.modalities),
            multi_turn=True,
            thinking_modes=ALL_THINKING_MODES,
            # OpenAI's Chat Completions has no min_p.
            sampling=SERVER_SAMPLING - {"min_p"},
            remote=True,
            remote_allowed=definition.allow_remote,
            kind=definition.kind,
            embedding_dimensions=definition.embedding and definition.embedding_dimensions,
            # Passed through in OpenAI's own fields; the upstream decides.
            tools=True,
            structured_output=True,
            relays_chat=not definition.embedding,
        )

    def effective_target_inflight(self, definition: OpenAIRemoteModel) -> int:
        # Local submission concurrency; the provider's own capacity is its business.
        return definition.target_inflight

    async def load(
        self, definition: OpenAIRemoteModel, context: LoadContext
    ) -> OpenAIRemoteRuntime:
        api_key = None
        if definition.remote_api_key_env:
            api_key = os.environ.get(definition.remote_api_key_env)
            if not api_key:
                raise BackendError(
                    f"environment variable {definition.remote_api_key_env} is not set"
                )
        runtime = OpenAIRemoteRuntime(definition, api_key)
        if definition.remote_health_check == "models_endpoint":
            url = definition.remote_base_url.rstrip("/") + "/models"
            try:
                with trio.fail_after(definition.remote_timeout_s):
                    async with runtime.upstream.request(
                        "GET", "/models", headers=runtime._headers
                    ) as response:
                        await response.read()
            except (UpstreamError, trio.TooSlowError) as exc:
                await runtime.close()
                raise BackendError(f"remote API at {url} is unreachable: {exc!r}") from exc
            if response.status != 200:
                await runtime.close()
                raise BackendError(f"remote API at {url} answered HTTP {response.status}")
        return runtime


BACKEND = OpenAIRemoteBackend()
