"""What every backend provides, and the neutral request/metrics types they speak.

A backend module has the same shape for every runtime (like hypercorn's per-worker
folders): a pydantic model of its config fields, its ``load_constraints`` and
``load_recommendations`` tables, how it derives capabilities and an honest inflight
target, and ``load()`` which returns a :class:`Runtime` for one replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from pool.config._files import resolve_model_path
from pool.errors import BackendError

if TYPE_CHECKING:
    from pool.config import ModelDefinition

ThinkingMode = Literal["default", "enabled", "disabled"]
# The request's `thinking` values of a model that can switch thinking per request.
ALL_THINKING_MODES: tuple[ThinkingMode, ...] = ("default", "enabled", "disabled")
Role = Literal["user", "assistant"]
FinishReason = Literal["stop", "length", "cancelled"]


@dataclass(frozen=True, slots=True)
class TextPart:
    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    url: str
    detail: str | None = None


@dataclass(frozen=True, slots=True)
class Turn:
    """One message of a conversation, already validated by the request schema."""

    role: Role
    parts: tuple[TextPart | ImagePart, ...]

    @property
    def text(self) -> str:
        """The text parts joined by newlines (how text backends see a content array)."""
        return "\n".join(p.text for p in self.parts if isinstance(p, TextPart))

    @property
    def has_images(self) -> bool:
        return any(isinstance(p, ImagePart) for p in self.parts)


@dataclass(frozen=True, slots=True)
class Decoding:
    """Effective decoding settings: request values over ``engine.decoding`` defaults."""

    beam_size: int = 1
    top_k: int = 40
    top_p: float = 0.95
    temperature: float = 0.8
    repetition_penalty: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What a runtime is asked to generate; built by the pool from an API request."""

    request_id: str
    model: str
    turns: tuple[Turn, ...]
    decoding: Decoding
    instructions: str | None = None
    multi_turn: bool = False
    thinking: ThinkingMode = "default"
    source_lang_code: str | None = None
    target_lang_code: str | None = None


@dataclass(slots=True)
class GenerationStats:
    """What a runtime could measure about one generation; ``None`` where unknown."""

    prompt_tokens: int | None = None
    output_tokens: int | None = None
    tokenize_ms: float | None = None
    time_to_first_token_ms: float | None = None
    generate_total_ms: float | None = None
    finish_reason: FinishReason = "stop"


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a model accepts; checked before a request is queued.

    ``remote`` marks a model whose requests leave this machine: they need the client's
    ``allow_remote: true``. It is a gate, not a row field, so ``as_dict`` leaves it out.
    """

    modalities: tuple[str, ...] = ("text",)
    multi_turn: bool = False
    thinking_modes: tuple[ThinkingMode, ...] = ("default",)
    remote: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "modalities": list(self.modalities),
            "multi_turn": self.multi_turn,
            "thinking_modes": list(self.thinking_modes),
        }


class TokenSink(Protocol):
    """Where a runtime delivers text as it is generated.

    ``send`` may block (backpressure) and raises ``trio.Cancelled`` when the request
    is cancelled; runtimes that generate on a worker thread call it through
    ``trio.from_thread.run`` so that cancellation stops them within one token.
    """

    async def send(self, text: str) -> None: ...


class Runtime(Protocol):
    """One loaded replica of a model."""

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        """Generate for ``request``, sending text to ``sink`` as it is produced."""
        ...

    async def close(self) -> None:
        """Release every resource of this replica. Called once, even after a failure."""
        ...

    @property
    def vram_mib(self) -> int | None:
        """VRAM this replica holds, when the runtime can tell."""
        ...


@dataclass(frozen=True, slots=True)
class LoadContext:
    """Per-replica facts a backend needs at load time."""

    model_name: str
    replica_index: int
    settings_dir: str | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)

    def model_path(self, value: str | None, hint: str = "") -> Path:
        """The configured ``model_path`` as a path; BackendError if unset or unresolvable."""
        if not value:
            raise BackendError(f"model_path is not set{hint}")
        try:
            return resolve_model_path(value, self.settings_dir)
        except FileNotFoundError as exc:
            raise BackendError(str(exc)) from exc


class Backend(Protocol):
    """A runtime family. One instance per backend name lives in the registry."""

    name: ClassVar[str]

    @property
    def load_constraints(self) -> Mapping[str, Mapping[str, Any]]:
        """The admin ``load_constraints`` table of this backend."""
        ...

    @property
    def load_recommendations(self) -> Mapping[str, Mapping[str, Any]]: ...

    def capabilities(self, definition: ModelDefinition) -> Capabilities: ...

    def effective_target_inflight(self, definition: ModelDefinition) -> int:
        """How many requests one replica can honestly run at once."""
        ...

    async def load(self, definition: ModelDefinition, context: LoadContext) -> Runtime:
        """Load one replica; raise :class:`pool.errors.BackendError` with a clear message."""
        ...
