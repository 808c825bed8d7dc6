"""The neutral request every API surface is turned into before it reaches a model.

Each wire format (Responses, Chat Completions, Ollama) parses its own body and builds
an :class:`InferenceRequest`; the actors never see a wire payload. Decoding fields the
client left out stay ``None`` here and take ``engine.decoding`` defaults at intake.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

from pool.backends import (
    OutputFormat,
    PassThrough,
    TaskJob,
    TextPart,
    ThinkingMode,
    ToolChoice,
    ToolSpec,
    Turn,
)
from pool.config import SAMPLING_NAMES

CacheMode = Literal["prefix", "none", "auto"]


class DecodingOverrides:
    """Decoding values a client asked for, by field name; a field left out (or ``None``)
    takes the pool's default at intake.

    It takes any field of the one declaration (``pool.config.Decoding``), so a sampling
    field added there needs no change here. An unknown name is a ``TypeError``, as a
    wrong keyword of a dataclass would be.
    """

    __slots__ = ("asked",)

    def __init__(self, **asked: Any) -> None:
        unknown = sorted(asked.keys() - SAMPLING_NAMES)
        if unknown:
            raise TypeError(f"not a sampling field: {', '.join(unknown)}")
        self.asked: Mapping[str, Any] = MappingProxyType(
            # Lists become tuples: the request stays immutable (and hashable).
            {
                name: tuple(value) if isinstance(value, list) else value
                for name, value in asked.items()
                if value is not None
            }
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DecodingOverrides) and dict(self.asked) == dict(other.asked)

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.asked.items(), key=lambda item: item[0])))

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={value!r}" for name, value in self.asked.items())
        return f"DecodingOverrides({fields})"


@dataclass(frozen=True, slots=True)
class InferenceRequest:
    """One generation request, whatever API it arrived on.

    ``multi_turn`` is true when the client sent a conversation (which needs a model
    that accepts several turns) rather than one prompt; a chat surface with a single
    user turn sends it as one prompt, so single-turn models still work with chat clients.
    """

    model: str
    turns: tuple[Turn, ...]
    multi_turn: bool = False
    instructions: str | None = None
    decoding: DecodingOverrides = field(default_factory=DecodingOverrides)
    thinking: ThinkingMode = "default"
    allow_remote: bool = False
    keep_alive: float | str | None = None
    source_lang_code: str | None = None
    target_lang_code: str | None = None
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    output_format: OutputFormat | None = None
    # X-Cache-Mode ("none" turns prefix reuse off) and X-Cache-Tag (a finer scope
    # within the tenant); the tenant itself comes with the admission.
    cache_mode: CacheMode = "auto"
    cache_tag: str | None = None
    # The name of the key that sent it (service.auth.keys), for whoever accounts per
    # key: admission sets it from the authenticated caller (pool/actors/serving/_caller.py);
    # an embedded user of the pool may name one itself.
    key_name: str | None = None
    # The client speaks the upstream's dialect and asks for nothing that needs the
    # tokens (set by the Chat Completions route): see pool.backends.PassThrough.
    pass_through: PassThrough | None = None

    @classmethod
    def prompt(cls, model: str, text: str, **fields: object) -> InferenceRequest:
        """A single-turn text request (the embedded API's shortest form)."""
        return cls(model, (Turn("user", (TextPart(text),)),), **fields)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class EmbeddingRequest:
    """Texts to embed with one model, whatever API they arrived on.

    It goes through the same admission as generation (rate limits, queue, replicas,
    on-demand loads); ``dimensions`` is honoured only by models that can shorten
    their vectors.
    """

    model: str
    texts: tuple[str, ...]
    dimensions: int | None = None
    truncate: bool = True
    allow_remote: bool = False
    keep_alive: float | str | None = None
    key_name: str | None = None  # as InferenceRequest.key_name


@dataclass(frozen=True, slots=True)
class TaskRequest:
    """A request that is one task for one model (rerank, transcription, speech, a
    forwarded route), whatever API it arrived on: the backend's job, with its
    ``request_id`` left for the pool to set.

    It goes through the same admission as generation (keys, rate limits, budgets, the
    queue, replicas, on-demand loads and usage rows); the model's kind must be one of
    the job's ``served_by`` (else 400 ``wrong_model_kind``).
    """

    model: str
    job: TaskJob
    allow_remote: bool = False
    keep_alive: float | str | None = None
    key_name: str | None = None  # as InferenceRequest.key_name


# Whatever a surface hands the pool to admit.
PoolRequest = InferenceRequest | EmbeddingRequest | TaskRequest
