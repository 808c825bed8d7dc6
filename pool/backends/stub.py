"""The ``stub`` backend: deterministic, in-process, for tests and benchmarks.

Its output is known in advance (``stub_reply`` or an echo of the input) and split on
spaces, one token per word, optionally paced by ``stub_tokens_per_second``. Load and
unload can be slowed or made to fail, so every lifecycle path of the pool can be driven
without a real model.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import trio
from pydantic import Field, NonNegativeFloat

from pool.backends._kinds import KindFields
from pool.backends._protocol import (
    ALL_THINKING_MODES,
    MODEL_KINDS,
    Backend,
    Capabilities,
    EmbeddingJob,
    EmbeddingResult,
    GenerationRequest,
    GenerationStats,
    LoadContext,
    ModelKind,
    TokenSink,
)
from pool.backends._rerank import RankResult
from pool.backends._tasks import TaskSink
from pool.backends._text import StopScanner
from pool.backends._transcription import Segment, Transcript, TranscriptionJob, Word
from pool.config import CommonModelFields
from pool.errors import BackendError, PoolError


class StubModel(CommonModelFields, KindFields):
    """The deterministic in-process backend for tests and benchmarks.

    It takes every kind, so residency, keys and accounting are tested for each; what a
    task job does on a stub runtime is the job's own (pool/backends/_tasks.py).
    """

    KINDS: ClassVar[tuple[ModelKind, ...]] = MODEL_KINDS

    backend: Literal["stub"] = "stub"
    stub_reply: str | None = Field(None, description="Whole output; default echoes the input.")
    stub_tokens_per_second: NonNegativeFloat = Field(0.0, description="0 means no delay.")
    stub_load_seconds: NonNegativeFloat = 0.0
    stub_unload_seconds: NonNegativeFloat = 0.0
    stub_fail_load: bool = False
    stub_vram_mib: Annotated[int, Field(ge=0)] = 0
    stub_degrade_after: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="The runtime answers empty text after this many requests (canaries"
        " included): a runtime alive but wrong, until it is loaded again.",
    )
    stub_hang_after: Annotated[int, Field(ge=0)] | None = Field(
        None,
        description="After this many requests (canaries included) the runtime hangs without"
        " dying: each later request sends its first token, if it has one, and then no"
        " other, until the runtime is closed (a recycle loads a fresh one).",
    )
    stub_embedding_dim: Annotated[int, Field(ge=1, le=4096)] = 8


# Every sampling field a request may set: the stub ignores them, but accepts them so that
# the surfaces' parsing is tested without a real engine.
STUB_SAMPLING = frozenset({"min_p", "seed", "presence_penalty", "frequency_penalty", "logit_bias"})


def stub_embedding(text: str, dimensions: int) -> tuple[float, ...]:
    """A deterministic unit vector for ``text``: SHA-256 blocks of the text as numbers.

    The same text always gives the same vector and different texts differ, which is
    all the pool's tests need; the first ``n`` components renormalized are the vector
    asked for with ``dimensions: n`` (as OpenAI's shortened embeddings behave).
    """
    raw: list[float] = []
    counter = 0
    while len(raw) < dimensions:
        block = hashlib.sha256(f"{counter}:{text}".encode()).digest()
        raw.extend((b - 127.5) / 127.5 for b in block)
        counter += 1
    raw = raw[:dimensions]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return tuple(x / norm for x in raw)


def stub_tokens(text: str) -> list[str]:
    """Split ``text`` into the stub's tokens: each word keeps the space before it."""
    words = text.split(" ")
    return [words[0]] + [" " + w for w in words[1:]] if words else []


class StubRuntime:
    def __init__(self, definition: StubModel, adapters: dict[str, Path] | None = None) -> None:
        self._definition = definition
        self._closed = False
        # LoRA adapters "loaded" (name -> MiB, their files' sizes): a reply with one
        # starts with its name in brackets, and they count in the VRAM it reports.
        self._adapters: dict[str, float] = {}
        for name, path in (adapters or {}).items():
            self._add(name, path)
        # Split once: a benchmark's stub must cost next to nothing per request.
        reply = definition.stub_reply
        self._reply_tokens = stub_tokens(reply) if reply is not None else []
        # Requests this runtime has answered (stub_degrade_after counts them).
        self._answered = 0

    @property
    def vram_mib(self) -> int | None:
        return self._definition.stub_vram_mib + math.ceil(sum(self._adapters.values()))

    def _add(self, name: str, path: Path) -> None:
        if not path.is_file():
            raise BackendError(f"LoRA adapter file {path} does not exist")
        self._adapters[name] = path.stat().st_size / (1024 * 1024)

    async def add_adapter(self, name: str, path: Path, scale: float) -> None:
        self._add(name, path)
        await trio.lowlevel.checkpoint()

    async def remove_adapter(self, name: str) -> None:
        self._adapters.pop(name, None)
        await trio.lowlevel.checkpoint()

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        if self._closed:
            raise BackendError("stub runtime is closed")
        started = time.perf_counter()
        reply = self._definition.stub_reply
        tokens = self._reply_tokens if reply is not None else stub_tokens(request.turns[-1].text)
        if request.adapter is not None:
            use = request.adapter
            if use.name not in self._adapters:
                if use.path is None:
                    raise PoolError("unknown_model", f"LoRA adapter {use.name!r} is not loaded")
                self._add(use.name, Path(use.path))  # evicted alone: back for this request
            tokens = [f"[{use.name}]", *(" " + t.lstrip() for t in tokens[:1]), *tokens[1:]]
        self._answered += 1
        degrade_after = self._definition.stub_degrade_after
        if degrade_after is not None and self._answered > degrade_after:
            tokens = []  # alive but wrong: it ends at once with nothing
        hang_after = self._definition.stub_hang_after
        hangs = hang_after is not None and self._answered > hang_after
        if request.continue_text:
            tokens = _after(tokens, request.continue_text)
        limit = request.decoding.max_tokens
        finish: Any = "length" if len(tokens) > limit else "stop"
        tokens = tokens[:limit]
        delay = (
            1.0 / self._definition.stub_tokens_per_second
            if self._definition.stub_tokens_per_second
            else 0.0
        )
        first_ms: float | None = None
        # Stop strings end the output as a real backend's do (the string is not sent).
        scanner = StopScanner(request.decoding.stop) if request.decoding.stop else None
        produced = 0
        # The stub's prefill is instant: the prompt is used once generation starts.
        prompt_tokens = sum(len(stub_tokens(t.text)) for t in request.turns)
        sink.used.prompt_tokens = prompt_tokens
        for token in tokens:
            if delay:
                await trio.sleep(delay)
            produced += 1
            sink.used.output_tokens = produced
            piece, stopped = scanner.feed(token) if scanner is not None else (token, False)
            if piece:
                await sink.send(piece)
            if first_ms is None:
                first_ms = (time.perf_counter() - started) * 1000.0
            if hangs:
                break
            if stopped:
                finish = "stop"
                break
        else:
            if scanner is not None and (tail := scanner.flush()):
                await sink.send(tail)
        if hangs:
            # Alive but stuck mid-stream (a wedged GPU, a stopped process): no further
            # token and no end, until cancelled (the idle watchdog, an unload).
            await trio.sleep_forever()
        return GenerationStats(
            prompt_tokens=prompt_tokens,
            output_tokens=produced,
            time_to_first_token_ms=first_ms,
            generate_ms=(time.perf_counter() - started) * 1000.0,
            finish_reason=finish,
            stop_sequence=scanner.hit if scanner is not None else None,
        )

    async def embed(self, job: EmbeddingJob) -> EmbeddingResult:
        if self._closed:
            raise BackendError("stub runtime is closed")
        width = self._definition.stub_embedding_dim
        if job.dimensions is not None and job.dimensions > width:
            raise PoolError(
                "dimensions_unsupported",
                f"dimensions {job.dimensions} is larger than the model's {width}",
                details={"param": "dimensions"},
            )
        vectors = tuple(stub_embedding(t, job.dimensions or width) for t in job.texts)
        await trio.lowlevel.checkpoint()
        return EmbeddingResult(vectors, sum(len(stub_tokens(t)) for t in job.texts))

    async def transcribe(self, job: TranscriptionJob, sink: TaskSink) -> Transcript:
        """A transcript known in advance (``kind: transcription``): ``stub_reply``, else
        the audio's length in words, one segment per word (paced as its tokens), the
        segments sharing the audio's time evenly. For the routes' tests; the real
        transcriber is the ``whisper`` backend."""
        if self._closed:
            raise BackendError("stub runtime is closed")
        seconds = job.seconds
        pieces = self._reply_tokens or stub_tokens(f"{seconds:.1f} seconds of audio")
        rate = self._definition.stub_tokens_per_second
        step = seconds / len(pieces)
        segments = []
        for index, piece in enumerate(pieces):
            if rate:
                await trio.sleep(1.0 / rate)
            start, end = round(index * step, 3), round((index + 1) * step, 3)
            words = (Word(piece, start, end, 1.0),) if job.word_timestamps else ()
            segments.append(
                Segment(
                    id=index,
                    seek=round(start * 100),
                    start=start,
                    end=end,
                    text=piece,
                    tokens=(index,),
                    temperature=0.0,
                    avg_logprob=-0.1,
                    compression_ratio=1.0,
                    no_speech_prob=0.0,
                    words=words,
                )
            )
            await sink.send(piece)
        return Transcript("".join(pieces), job.language or "en", round(seconds, 3), tuple(segments))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._definition.stub_unload_seconds:
            await trio.sleep(self._definition.stub_unload_seconds)


def stub_relevance(query: str, document: str) -> float:
    """The stub's rank head: the share of the query's words (lower-cased) that the
    document holds, so a test knows which document comes first."""
    asked = set(query.lower().split())
    held = set(document.lower().split())
    return len(asked & held) / len(asked) if asked else 0.0


class StubRankingRuntime(StubRuntime):
    """The stub of a ``kind: rerank`` model: it scores pairs (:func:`stub_relevance`)."""

    # Every call's documents, for tests of the pool's batching.
    calls: list[int]

    def __init__(self, definition: StubModel, adapters: dict[str, Path] | None = None) -> None:
        super().__init__(definition, adapters)
        self.calls = []

    @property
    def ranks(self) -> bool:
        return True

    async def rank(self, query: str, documents: Sequence[str]) -> RankResult:
        if self._closed:
            raise BackendError("stub runtime is closed")
        self.calls.append(len(documents))
        await trio.lowlevel.checkpoint()
        tokens = sum(len(stub_tokens(query)) + len(stub_tokens(d)) for d in documents)
        return RankResult(tuple(stub_relevance(query, d) for d in documents), tokens)


def _after(tokens: list[str], done: str) -> list[str]:
    """The tokens that follow the reply so far, ``done`` (a resumed generation): the
    stub's reply is fixed, so continuing it is skipping what was said."""
    said = ""
    for index, token in enumerate(tokens):
        if len(said) >= len(done):
            return tokens[index:] if said == done else []
        said += token
    return []


class StubBackend(Backend[StubModel]):
    config = StubModel
    # A test double: its reload cost is whatever a test sets, so is its window.
    stay_warm_s = 0.0
    # Adapters as the pool sees them (files, memory, names in replies), for its tests.
    adapter_support = "runtime"
    resumes_through_prompt = True

    def capabilities(self, definition: StubModel) -> Capabilities:
        return Capabilities(
            modalities=tuple(definition.modalities),
            multi_turn=True,
            thinking_modes=ALL_THINKING_MODES,
            kind=definition.kind,
            embedding_dimensions=definition.embedding,
            sampling=STUB_SAMPLING,
        )

    def effective_target_inflight(self, definition: StubModel) -> int:
        # The stub holds no per-request state, so any configured target is honest.
        return definition.target_inflight

    async def load(self, definition: StubModel, context: LoadContext) -> StubRuntime:
        if definition.stub_load_seconds:
            # In quarters, each reported: the pool's load progress is driven by this.
            for quarter in range(1, 5):
                await trio.sleep(definition.stub_load_seconds / 4)
                if context.report_progress is not None:
                    context.report_progress(quarter / 4)
        if definition.stub_fail_load:
            raise BackendError(
                f"stub_fail_load is set for model {context.model_name!r}"
                f" (replica {context.replica_index})"
            )
        adapters = {a.name: context.model_path(a.path) for a in definition.lora_adapters}
        if definition.kind == "rerank":
            return StubRankingRuntime(definition, adapters)
        return StubRuntime(definition, adapters)

    def declared_vram_mib(self, definition: StubModel) -> int | None:
        return definition.stub_vram_mib or None


BACKEND = StubBackend()
