"""The neutral request every API surface is turned into before it reaches a model.

Each wire format (Responses, Chat Completions, Ollama) parses its own body and builds
an :class:`InferenceRequest`; the actors never see a wire payload. Decoding fields the
client left out stay ``None`` here and take ``engine.decoding`` defaults at intake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pool.backends import OutputFormat, TextPart, ThinkingMode, ToolChoice, ToolSpec, Turn

CacheMode = Literal["prefix", "none", "auto"]


@dataclass(frozen=True, slots=True)
class DecodingOverrides:
    """Decoding values a client asked for; ``None`` means "the pool's default"."""

    beam_size: int | None = None
    top_k: int | None = None
    top_p: float | None = None
    temperature: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()


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
    # The authenticated key's name (service.auth.keys), for usage records and budgets;
    # None where the request came without a named key.
    key_name: str | None = None

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
    # As InferenceRequest.key_name: who to record the usage and budget against.
    key_name: str | None = None
