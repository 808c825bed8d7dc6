"""A runtime that is an OpenAI-compatible server process the pool starts and stops.

Shared by ``llama_server`` and ``vllm_serve``: start the child, wait for readiness (a
health endpoint, then a one-token generation) under the backend's start timeout,
forward requests as streamed Chat Completions, and stop the process group on close.
``wait_failed`` returns when the child exits on its own, with the tail of its output;
the replica then fails the model.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import trio

from pool.backends._chat_client import (
    UpstreamConnectionFailed,
    chat_messages,
    stream_chat,
    tool_fields,
)
from pool.backends._embedding import embed_upstream
from pool.backends._forced_calls import ScanningSink, force_with_grammar
from pool.backends._pass_through import relay_reply, relay_stream
from pool.backends._process import ManagedProcess
from pool.backends._protocol import (
    AdapterUse,
    CacheFlushed,
    CacheUsage,
    EmbeddingJob,
    EmbeddingResult,
    GenerationRequest,
    GenerationStats,
    MemorySplit,
    TokenSink,
    TokensUsed,
    resumes_as_text,
    takes_raw,
)
from pool.backends._rerank import RankResult, rank_upstream
from pool.backends._server_cache import ServerCache, conversation_text
from pool.backends._tool_calls import ToolCallFamily
from pool.backends._tools import ToolCallDelta
from pool.backends._upstream import UpstreamError, open_transport, post_json, with_trace
from pool.config import Decoding
from pool.errors import BackendError

# A server's split of its GPU memory, read from the output lines its process kept.
MemoryReader = Callable[[Sequence[str]], MemorySplit | None]
# The body fields that make a server apply a request's LoRA adapter (None: the base alone).
AdapterFields = Callable[[AdapterUse | None], dict[str, Any]]

log = logging.getLogger("pool.process")

STOP_GRACE_S = 10.0
# How long a failed call looks for the server's exit before it blames the connection.
_EXIT_NOTICE_S = 0.5


# The optional sampling fields both managed servers (and OpenAI-style upstreams) take
# in a Chat Completions body under these names.
SERVER_SAMPLING = frozenset(
    {"min_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias"}
)


def sampling_fields(d: Decoding) -> dict[str, Any]:
    """The optional sampling fields a request set, as a Chat Completions body spells them
    (the pool's names, but for ``logit_bias``: a map from token id strings)."""
    fields: dict[str, Any] = {name: getattr(d, name) for name in d.asked_extras()}
    if d.logit_bias:
        fields["logit_bias"] = {str(token): bias for token, bias in d.logit_bias}
    return fields


# How a server turns a chat into prompt token ids, for a stream resumed through its
# prompt (docs/vram.md, "Pause and resume"): llama-server renders with /apply-template
# and tokenizes text with /tokenize; vLLM's /tokenize takes the messages themselves.
PromptTokenizer = Literal["llama_server", "vllm"]

# Chat Completions fields a completions body has no place for (the prompt holds the chat).
_CHAT_ONLY = frozenset(
    {
        "messages",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "response_format",
        "chat_template_kwargs",
    }
)


def _token_ids(answer: dict[str, Any], what: str) -> list[int]:
    """The ``tokens`` of a /tokenize answer (ids; with pieces, ``{"id": ...}`` each)."""
    tokens = answer.get("tokens")
    if not isinstance(tokens, list):
        raise BackendError(f"{what} answered /tokenize without tokens: {answer!r:.200}")
    try:
        return [int(t["id"]) if isinstance(t, dict) else int(t) for t in tokens]
    except (KeyError, TypeError, ValueError) as exc:
        raise BackendError(f"{what} answered /tokenize with bad tokens: {exc}") from exc


def server_url(host: str, port: int) -> str:
    """The base URL of a server listening on ``host`` (an IPv6 address in brackets)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


class ManagedServerRuntime:
    # Where the server answers Chat Completions and embeddings (backend `server` may
    # map them elsewhere).
    chat_path = "/v1/chat/completions"
    embeddings_path = "/v1/embeddings"
    # The body fields that apply a request's LoRA adapter (None: the server has none).
    _adapter_fields: AdapterFields | None = None

    def __init__(
        self,
        process: ManagedProcess,
        base_url: str,
        *,
        served_model: str,
        request_timeout_s: float,
        api_key: str | None = None,
        extra_body: dict[str, Any] | None = None,
        repetition_field: str = "repeat_penalty",
        enable_thinking: bool | None = None,
        embedding_batch: int | None = None,
        embedding_truncate: dict[str, Any] | None = None,
        rerank_path: str | None = None,
        grammar_calls: ToolCallFamily | None = None,
        cache: ServerCache | None = None,
        memory_reader: MemoryReader | None = None,
        adapter_fields: AdapterFields | None = None,
        runtime_adapters: bool = False,
        prompt_tokenizer: PromptTokenizer | None = None,
    ) -> None:
        self.process = process
        # Set where the backend resumes paused streams through the prompt.
        self._prompt_tokenizer = prompt_tokenizer
        # The server loads and unloads adapters while it runs (vLLM's LoRA endpoints).
        self._runtime_adapters = runtime_adapters
        self._adapter_fields = adapter_fields
        # Reads the server's own split of its GPU memory from the lines the process
        # kept (None: the server does not say).
        self._memory_reader = memory_reader
        # Set for an embedding model: the most texts per /v1/embeddings request, and
        # what tells the server it may cut texts longer than its context.
        self._embedding_batch = embedding_batch
        self._embedding_truncate = embedding_truncate
        # Set for a rerank model: the server's rerank route (it answers nothing else).
        self._rerank_path = rerank_path
        # llama-server: forced tool calls by the pool's grammar (see _forced_calls).
        self._grammar_calls = grammar_calls
        # The server's prefix-cache strategy: scopes requests and flushes (None: none).
        self._cache = cache
        # llama-server reads `repeat_penalty`; vLLM reads `repetition_penalty` and
        # ignores the other silently.
        self._repetition_field = repetition_field
        self._enable_thinking = enable_thinking
        self.base_url = base_url
        self._model = served_model
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        self._extra = extra_body or {}
        self._upstream = open_transport(base_url, timeout_s=request_timeout_s)
        self._closed = False

    @property
    def vram_mib(self) -> int | None:
        return None

    def memory_split(self) -> MemorySplit | None:
        if self._memory_reader is None:
            return None
        return self._memory_reader(self.process.kept)

    def body(self, request: GenerationRequest) -> dict[str, Any]:
        d = request.decoding
        body: dict[str, Any] = {
            "model": self._model,
            "messages": chat_messages(request),
            "max_tokens": d.max_tokens,
            "temperature": d.temperature,
            "top_p": d.top_p,
            "top_k": d.top_k,
            self._repetition_field: d.repetition_penalty,
            **self._extra,
        }
        if d.stop:
            body["stop"] = list(d.stop)
        body.update(sampling_fields(d))
        body.update(tool_fields(request))
        thinking = {"enabled": True, "disabled": False}.get(request.thinking)
        if thinking is None:
            thinking = self._enable_thinking
        if thinking is not None:
            # Both servers hand these to the model's Jinja chat template.
            body["chat_template_kwargs"] = {"enable_thinking": thinking}
        if self._adapter_fields is not None:
            # Said for the base model too: the server's default set is not trusted to be
            # none (llama-server versions differ on --lora-init-without-apply).
            body.update(self._adapter_fields(request.adapter))
        elif request.adapter is not None:
            raise BackendError(f"{self.process.label} serves no LoRA adapters")
        return body

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        if self._closed or not self.process.alive:
            raise BackendError(f"{self.process.label} is not running: {self.process.tail()[-500:]}")
        body = self.body(request)
        scanning: ScanningSink | None = None
        if self._grammar_calls is not None and force_with_grammar(
            body, request, self._grammar_calls
        ):
            scanning = ScanningSink(sink, self._grammar_calls, parallel=True)
        lease = None
        if self._cache is not None:
            lease = self._cache.lease(request, conversation_text(body))
            body.update(lease.fields)
        headers = with_trace(self._headers, request.trace_parent)
        ask = request.pass_through
        try:
            if request.continue_text:
                return await self._resume(request, body, sink, headers)
            if ask is not None and scanning is None and takes_raw(sink):
                # The client speaks the server's dialect and nothing here needs the
                # tokens (the pool's forced tool calls do): its bytes go through.
                relay = relay_stream if ask.stream else relay_reply
                return await relay(
                    self._upstream,
                    "/v1/chat/completions",
                    body,
                    sink,
                    ask,
                    headers=headers,
                    what=self.process.label,
                )
            stats = await stream_chat(
                self._upstream,
                self.chat_path,
                body,
                scanning or sink,
                headers=headers,
                what=self.process.label,
            )
            if scanning is not None:
                await scanning.finish()
            return stats
        except BackendError as exc:
            # A server killed mid-stream cuts the connection a moment before its exit is
            # reaped: a short look lets the error name the exit rather than the cut.
            if isinstance(exc, UpstreamConnectionFailed):
                await self.process.exits_within(_EXIT_NOTICE_S)
            if (exited := self._exited_error()) is not None:
                raise exited from exc
            raise
        finally:
            if lease is not None and self._cache is not None:
                self._cache.release(lease)

    async def _resume(
        self,
        request: GenerationRequest,
        body: dict[str, Any],
        sink: TokenSink,
        headers: dict[str, str] | None,
    ) -> GenerationStats:
        """A stream resumed after a pause (docs/vram.md, "Pause and resume"): the chat's
        prompt as the server renders it, then the reply so far, both as token ids, go to
        the completions route with the same sampling fields and the tokens left; the
        server prefills them (its prefix cache holds most) and continues the reply."""
        if self._prompt_tokenizer is None or not resumes_as_text(request):
            raise BackendError(f"{self.process.label} cannot resume this request")
        prompt = await self._prompt_ids(body, request.continue_text, headers)
        completion = {k: v for k, v in body.items() if k not in _CHAT_ONLY}
        completion["prompt"] = prompt
        return await stream_chat(
            self._upstream,
            "/v1/completions",
            completion,
            sink,
            headers=headers,
            what=self.process.label,
        )

    async def _prompt_ids(
        self, body: dict[str, Any], reply: str, headers: dict[str, str] | None
    ) -> list[int]:
        """The token ids of the chat in ``body`` rendered for a reply (the generation
        prompt included), then of ``reply``: tokenized alone, as plain text, so nothing
        in it reads as a special token and nothing merges with the prompt's end."""
        kwargs = {k: body[k] for k in ("chat_template_kwargs",) if k in body}
        if self._prompt_tokenizer == "llama_server":
            rendered = await self._post(
                "/apply-template", {"messages": body["messages"], **kwargs}, headers
            )
            # As the server tokenizes a prompt it is sent: BOS added, special tokens read.
            head = await self._post(
                "/tokenize",
                {"content": rendered["prompt"], "add_special": True, "parse_special": True},
                headers,
            )
            tail = await self._post(
                "/tokenize",
                {"content": reply, "add_special": False, "parse_special": False},
                headers,
            )
        else:
            head = await self._post(
                "/tokenize",
                {
                    "model": body["model"],
                    "messages": body["messages"],
                    "add_generation_prompt": True,
                    **kwargs,
                },
                headers,
            )
            tail = await self._post(
                "/tokenize",
                {"model": body["model"], "prompt": reply, "add_special_tokens": False},
                headers,
            )
        return [*_token_ids(head, self.process.label), *_token_ids(tail, self.process.label)]

    async def _post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None
    ) -> dict[str, Any]:
        """POST ``body`` as JSON (the transport names the content type) and read the
        JSON object the server answers."""
        raw = await post_json(self._upstream, path, body, headers, self.process.label, self._model)
        try:
            answer = json.loads(raw)
        except ValueError as exc:
            raise BackendError(f"{self.process.label} answered {path} with bad JSON") from exc
        if not isinstance(answer, dict):
            raise BackendError(f"{self.process.label} answered {path} with {answer!r:.200}")
        return answer

    async def add_adapter(self, name: str, path: Path, scale: float) -> None:
        """vLLM's ``/v1/load_lora_adapter``: the adapter serves under ``name``."""
        await self._adapter_call(
            "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)}
        )

    async def remove_adapter(self, name: str) -> None:
        """vLLM's ``/v1/unload_lora_adapter``."""
        await self._adapter_call("/v1/unload_lora_adapter", {"lora_name": name})

    async def _adapter_call(self, path: str, body: dict[str, Any]) -> None:
        if not self._runtime_adapters:
            raise BackendError(f"{self.process.label} takes no LoRA adapter while it runs")
        try:
            async with self._upstream.request(
                "POST",
                path,
                body=json.dumps(body).encode(),
                headers=self._json_headers(),
                timeout_s=120.0,
            ) as response:
                answer = await response.read()
        except UpstreamError as exc:
            raise BackendError(f"{self.process.label}: POST {path} failed: {exc}") from exc
        if response.status != 200:
            raise BackendError(
                f"{self.process.label}: POST {path} answered HTTP {response.status}:"
                f" {answer[:300].decode('utf-8', 'replace')}"
            )

    def _json_headers(self) -> dict[str, str]:
        return {**(self._headers or {}), "Content-Type": "application/json"}

    def _exited_error(self) -> BackendError | None:
        """What a failed call really means when the server died under it."""
        if self.process.alive:
            return None
        return BackendError(
            f"{self.process.label} exited (status {self.process.returncode});"
            f" last output: {self.process.tail()[-500:]}"
        )

    async def embed(self, job: EmbeddingJob) -> EmbeddingResult:
        """The job's texts through the server's ``/v1/embeddings``, in batches."""
        if self._closed or not self.process.alive:
            raise BackendError(f"{self.process.label} is not running: {self.process.tail()[-500:]}")
        try:
            return await embed_upstream(
                self._upstream,
                self.embeddings_path,
                job,
                model=self._model,
                batch_size=self._embedding_batch or 1,
                headers=self._headers,
                what=self.process.label,
                truncate_fields=self._embedding_truncate,
            )
        except BackendError as exc:
            if (exited := self._exited_error()) is not None:
                raise exited from exc
            raise

    @property
    def ranks(self) -> bool:
        """Whether this server was started in its reranking mode (kind ``rerank``)."""
        return self._rerank_path is not None

    async def rank(self, query: str, documents: Sequence[str]) -> RankResult:
        """The documents scored by the server's rerank route, in one request."""
        if self._rerank_path is None:
            raise BackendError(f"{self.process.label} was not started to rerank")
        if self._closed or not self.process.alive:
            raise BackendError(f"{self.process.label} is not running: {self.process.tail()[-500:]}")
        try:
            return await rank_upstream(
                self._upstream,
                self._rerank_path,
                query,
                documents,
                model=self._model,
                headers=self._headers,
                what=self.process.label,
            )
        except BackendError as exc:
            if (exited := self._exited_error()) is not None:
                raise exited from exc
            raise

    async def flush_cache(
        self, *, scope: str, tenant: str | None = None, tag: str | None = None
    ) -> CacheFlushed:
        """Forget the scope's cached prefixes and have the server drop them."""
        if self._cache is None or self._closed:
            return CacheFlushed()
        plan = self._cache.flush(scope, tenant, tag)
        for path in plan.posts:
            try:
                async with self._upstream.request(
                    "POST", path, body=b"{}", headers=self._headers, timeout_s=30.0
                ) as response:
                    answer = await response.read()
                if response.status != 200:
                    log.warning(
                        "%s: POST %s answered HTTP %d: %s",
                        self.process.label,
                        path,
                        response.status,
                        answer[:300],
                    )
            except UpstreamError as exc:
                # Scoped requests no longer reuse what was flushed whatever the server did.
                log.warning("%s: POST %s failed: %s", self.process.label, path, exc)
        return CacheFlushed(plan.entries)

    def cache_usage(self) -> CacheUsage | None:
        return None

    async def wait_failed(self) -> str:
        """Returns when the server exits on its own (the replica then fails the model)."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.process.pump_output)
            status = await self.process.wait()
            nursery.cancel_scope.cancel()
        return (
            f"{self.process.label} exited with status {status}; last output:\n{self.process.tail()}"
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._upstream.aclose()
        await self.process.stop(STOP_GRACE_S)

    async def wait_ready(self, health_path: str, timeout_s: float, probe: bool = True) -> None:
        """Health endpoint, then one generated token, within ``timeout_s``.

        Raises:
            BackendError: the process exited, or it was not ready in time (it is stopped).
        """
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.process.pump_output)
            try:
                with trio.move_on_after(timeout_s) as waiting:
                    await self._poll_health(health_path)
                    if probe:
                        await self._probe()
                if waiting.cancelled_caught:
                    raise BackendError(
                        f"{self.process.label} was not ready within {timeout_s:g}s;"
                        f" last output:\n{self.process.tail()[-1500:]}"
                    )
            except BaseException:
                await self.close()
                raise
            finally:
                nursery.cancel_scope.cancel()

    async def _poll_health(self, path: str) -> None:
        # The server only announces readiness by answering: nothing to await but it.
        async with trio.open_nursery() as nursery:

            async def exited() -> None:
                status = await self.process.wait()
                await self.process.output_read(timeout_s=2.0)
                raise BackendError(
                    f"{self.process.label} exited with status {status} while starting;"
                    f" last output:\n{self.process.tail()[-1500:]}"
                )

            nursery.start_soon(exited)
            while True:
                try:
                    async with self._upstream.request("GET", path, timeout_s=2.0) as response:
                        await response.read()
                    if response.status == 200:
                        break
                except UpstreamError:
                    pass
                await trio.sleep(0.2)
            nursery.cancel_scope.cancel()

    async def _probe(self) -> None:
        if self._rerank_path is not None:
            # A reranking server has no chat endpoint either: one score proves it ready.
            await self.rank("Hi", ("Hello",))
            return
        if self._embedding_batch is not None:
            # An embedding server has no chat endpoint: one vector proves it ready.
            await self.embed(EmbeddingJob("probe", self._model, ("Hi",)))
            return

        class _Discard:
            used = TokensUsed()

            async def send(self, text: str | ToolCallDelta) -> None:
                pass

        probe = {
            "model": self._model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
        }
        await stream_chat(
            self._upstream,
            self.chat_path,
            probe,
            _Discard(),
            headers=self._headers,
            what=self.process.label,
        )


async def find_binary(configured: str, what: str) -> str:
    """``configured`` as an executable path (looked up on PATH); BackendError if absent."""
    binary = shutil.which(configured) or configured
    if not await trio.to_thread.run_sync(Path(binary).is_file):
        raise BackendError(f"{what} binary {configured!r} not found")
    return binary


async def launch(
    label: str,
    command: list[str],
    env: dict[str, str],
    *,
    host: str,
    port: int,
    served_model: str,
    health_path: str,
    start_timeout_s: float,
    request_timeout_s: float,
    api_key: str | None = None,
    repetition_field: str = "repeat_penalty",
    counting_fields: dict[str, Any] | None = None,
    enable_thinking: bool | None = None,
    embedding_batch: int | None = None,
    embedding_truncate: dict[str, Any] | None = None,
    rerank_path: str | None = None,
    grammar_calls: ToolCallFamily | None = None,
    cache: ServerCache | None = None,
    memory_lines: re.Pattern[str] | None = None,
    memory_reader: MemoryReader | None = None,
    adapter_fields: AdapterFields | None = None,
    runtime_adapters: bool = False,
    prompt_tokenizer: PromptTokenizer | None = None,
) -> ManagedServerRuntime:
    """Start the server process and return its runtime once it is ready.

    ``counting_fields``: body fields that make the server send its token counts while
    it streams, so a request cut short is charged what it used (``TokensUsed``).

    ``embedding_batch``: set for an embedding model (the most texts per request); its
    readiness probe is then one embedding rather than one generated token.
    ``embedding_truncate``: body fields that let the server cut over-long texts.
    ``rerank_path``: set for a rerank model (the server's rerank route); its readiness
    probe is then one score.
    ``prompt_tokenizer``: how the server tokenizes a chat, for a stream resumed through
    its prompt after a pause; None: the backend does not resume.
    """
    process = ManagedProcess(label, command, env, keep=memory_lines)
    process.spawn()
    runtime = ManagedServerRuntime(
        process,
        server_url(host, port),
        served_model=served_model,
        request_timeout_s=request_timeout_s,
        api_key=api_key,
        repetition_field=repetition_field,
        extra_body=counting_fields,
        enable_thinking=enable_thinking,
        embedding_batch=embedding_batch,
        embedding_truncate=embedding_truncate,
        rerank_path=rerank_path,
        grammar_calls=grammar_calls,
        cache=cache,
        memory_reader=memory_reader,
        adapter_fields=adapter_fields,
        runtime_adapters=runtime_adapters,
        prompt_tokenizer=prompt_tokenizer,
    )
    await runtime.wait_ready(health_path, start_timeout_s)
    return runtime
