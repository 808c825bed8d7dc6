"""The pool's answers in Ollama's wire format: NDJSON lines, JSON bodies, the error shape.

Durations are nanoseconds as Ollama reports them; every line carries the model and its
``created_at``, and a generation's last one (``done: true``) its statistics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from quart import Response

from pool.actors import Admission, Delta, Embedded, Finished, ModelSnapshot, Waiting
from pool.config import DecodingDefaults
from pool.errors import PoolError
from pool.http._common import ErrorShape, SchemaError, dumps, json_response, retry_after
from pool.http._streaming import StreamRenderer
from pool.http._tools import ollama_call
from pool.http.admin._render import definition_body
from pool.http.ollama._artifacts import Artifact
from pool.schemas import (
    OllamaChatReply,
    OllamaEmbeddingsReply,
    OllamaEmbedReply,
    OllamaGenerateReply,
    OllamaModelDetails,
    OllamaRunningModel,
    OllamaShowReply,
    OllamaTag,
    PullState,
    renders,
)

NDJSON = "application/x-ndjson"
_FAR_FUTURE = "2318-01-01T00:00:00Z"  # what Ollama shows for a model kept forever

# What a piece of generated text is in a line: a chat message or a generate response.
Piece = Callable[[str], dict[str, Any]]


def chat_piece(text: str) -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": text}}


def generate_piece(text: str) -> dict[str, Any]:
    return {"response": text}


@renders(OllamaChatReply | OllamaGenerateReply)
def generation_body(model: str, piece: Piece, finished: Finished) -> dict[str, Any]:
    """The one object of a generation with ``stream: false``."""
    body = _done(model, piece(finished.text), finished)
    if finished.tool_calls and "message" in body:
        body["message"]["tool_calls"] = [ollama_call(c) for c in finished.tool_calls]
    return body


@dataclass(frozen=True, slots=True)
class GenerationLines(StreamRenderer[bytes]):
    """The NDJSON lines of a streamed ``/api/chat`` or ``/api/generate``: its methods are
    :func:`~pool.http._streaming.admitted_stream`'s ``render_delta``,
    ``render_finished``, ``render_error`` and ``render_wait``."""

    reports_waits = True

    model: str
    piece: Piece

    def render_delta(self, admission: Admission, delta: Delta) -> bytes:
        return _line(
            {"model": self.model, "created_at": _now(), **self.piece(delta.text), "done": False}
        )

    def render_finished(self, admission: Admission, event: Finished) -> bytes:
        line = _done(self.model, self.piece(""), event)
        if event.tool_calls and "message" in line:
            # Ollama sends whole calls in a message of their own before the end.
            calls = {
                "model": self.model,
                "created_at": _now(),
                "message": {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [ollama_call(c) for c in event.tool_calls],
                },
                "done": False,
            }
            return _line(calls) + _line(line)
        return _line(line)

    def render_error(self, admission: Admission, exc: PoolError) -> bytes:
        return _line({"error": exc.message})

    def render_wait(self, admission: Admission, waiting: Waiting) -> bytes:
        # NDJSON has no comment: Ollama's client parses every line as a chunk (a blank
        # one raises), so a wait is shown as a chunk with nothing in it.
        return _line({"model": self.model, "created_at": _now(), **self.piece(""), "done": False})


@renders(OllamaChatReply | OllamaGenerateReply)
def load_body(model: str, piece: Piece, reason: str) -> dict[str, Any]:
    """The answer to an empty chat or generate, whose ``done_reason`` says what it did:
    ``load`` or ``unload``."""
    return {
        "model": model,
        "created_at": _now(),
        **piece(""),
        "done": True,
        "done_reason": reason,
    }


def _done(model: str, piece: dict[str, Any], finished: Finished) -> dict[str, Any]:
    """A generation's last line (or its one object): the rest of its text, its stats."""
    return {"model": model, "created_at": _now(), **piece, "done": True, **_stats(finished)}


def _stats(finished: Finished) -> dict[str, Any]:
    t = finished.timings
    ns = 1_000_000

    def to_ns(ms: float | None) -> int:
        return round((ms or 0.0) * ns)

    return {
        "done_reason": "length" if finished.finish_reason == "length" else "stop",
        "total_duration": to_ns(t.pool_ms),
        "load_duration": to_ns(t.queue_wait_ms),
        "prompt_eval_count": finished.usage.prompt_tokens or 0,
        "prompt_eval_duration": to_ns(t.time_to_first_token_ms),
        "eval_count": finished.usage.output_tokens or 0,
        "eval_duration": to_ns(t.decode_after_first_token_ms),
    }


@renders(OllamaEmbedReply)
def embed_body(model: str, done: Embedded) -> dict[str, Any]:
    """``/api/embed``: one list per text, with the durations."""
    t = done.timings
    return {
        "model": model,
        "embeddings": [list(v) for v in done.vectors],
        "total_duration": round((t.pool_ms or 0.0) * 1_000_000),
        "load_duration": round((t.queue_wait_ms or 0.0) * 1_000_000),
        "prompt_eval_count": done.usage.prompt_tokens or 0,
    }


@renders(OllamaEmbeddingsReply)
def embeddings_body(done: Embedded) -> dict[str, Any]:
    """``/api/embeddings``: the one ``embedding`` of its one prompt."""
    return {"embedding": list(done.vectors[0])}


@renders(PullState)
def pull_line(event: dict[str, Any]) -> dict[str, Any]:
    """A pull state as Ollama's progress line (``status``, ``total``, ``completed``, ...)."""
    if event.get("status") == "error":
        return {"error": event.get("error", "pull failed"), **event}
    return event


def pull_progress(event: dict[str, Any]) -> bytes:
    """One NDJSON line of a streamed ``/api/pull``."""
    return _line(pull_line(event))


@renders(OllamaTag)
def tag(snapshot: ModelSnapshot, artifact: Artifact) -> dict[str, Any]:
    """A model in ``/api/tags``."""
    return {
        "name": snapshot.name,
        "model": snapshot.name,
        "kind": snapshot.capabilities.kind,
        "modified_at": _modified_at(artifact),
        "size": artifact.size,
        "digest": artifact.digest,
        "details": _details(snapshot),
        "loaded": snapshot.state == "loaded",
    }


@renders(OllamaRunningModel)
def running(snapshot: ModelSnapshot, artifact: Artifact) -> dict[str, Any]:
    """A loaded model in ``/api/ps``: its tag, when its keep-alive runs out, its memory.

    ``size`` is the loaded footprint: the measured or estimated VRAM of its replicas,
    and at least the artifact's size (``/api/tags``'), as the weights of a model on CPU
    take host memory that no VRAM figure counts; ``size_vram`` the VRAM: all of the
    estimate when the pool placed the replicas on GPUs, 0 for a model on CPU or remote.
    """
    remaining = snapshot.expires_in_s
    expires = (
        _iso(datetime.now(UTC) + timedelta(seconds=remaining))
        if remaining is not None
        else _FAR_FUTURE
    )
    vram = (snapshot.vram.mib or 0) * 1024 * 1024
    on_gpus = bool(snapshot.gpus) and not snapshot.capabilities.remote
    return tag(snapshot, artifact) | {
        "size": max(vram, artifact.size),
        "expires_at": expires,
        "size_vram": vram if on_gpus else 0,
    }


@renders(OllamaShowReply)
def show(snapshot: ModelSnapshot, artifact: Artifact, parameters: str) -> dict[str, Any]:
    """``/api/show``: the model's details, definition and capabilities."""
    caps = snapshot.capabilities
    if not caps.generation:
        # An embedding model takes text and gives vectors: no tools, thinking or images
        # (whatever its backend could do for a generation model).
        capabilities = ["embedding"]
    else:
        capabilities = ["completion"]
        if caps.tools:
            capabilities.append("tools")
        if "image" in caps.modalities:
            capabilities.append("vision")
        if "enabled" in caps.thinking_modes:
            capabilities.append("thinking")
    definition = snapshot.active_definition
    return {
        "modelfile": "",
        "parameters": parameters,
        # The pool renders prompts itself: the template is its prompt format's name.
        "template": definition.prompt_format,
        "details": _details(snapshot),
        "model_info": _model_info(snapshot),
        "capabilities": capabilities,
        "modified_at": _modified_at(artifact),
    }


def parameters(defaults: DecodingDefaults, context_length: int | None) -> str:
    """The decoding defaults as Ollama's ``parameters`` text (``name value`` lines)."""
    lines = [
        f"temperature {defaults.temperature:g}",
        f"top_k {defaults.top_k}",
        f"top_p {defaults.top_p:g}",
        f"repeat_penalty {defaults.repetition_penalty:g}",
        f"num_predict {defaults.max_tokens}",
        *(f'stop "{s}"' for s in defaults.stop),
    ]
    if context_length is not None:
        lines.append(f"num_ctx {context_length}")
    return "\n".join(lines)


@renders(OllamaModelDetails)
def _details(snapshot: ModelSnapshot) -> dict[str, Any]:
    """Ollama's ``details``, from the artifact's metadata (empty where it says nothing)."""
    path = snapshot.active_definition.model_path or ""
    facts = snapshot.details
    return {
        # An adapter's base, as Ollama names the model an adapter was made on.
        "parent_model": snapshot.parent or "",
        "format": facts.format
        or ("gguf" if path.endswith(".gguf") else snapshot.definition.backend),
        "family": facts.family or "",
        "families": [facts.family] if facts.family else None,
        "parameter_size": facts.parameter_size or "",
        "quantization_level": facts.quantization_level or "",
    }


def _model_info(snapshot: ModelSnapshot) -> dict[str, Any]:
    """The definition, with the metadata keys Ollama clients read (as Ollama names
    them: ``general.architecture``, ``general.parameter_count``,
    ``<family>.context_length``) and the embedded-engine spec's plain ones
    (``context_length``, ``hidden_size``, ``num_layers``, ``vocab_size``) where the
    artifact has them."""
    info = definition_body(snapshot)
    facts = snapshot.details
    if facts.family:
        info["general.architecture"] = facts.family
        if facts.context_length:
            info[f"{facts.family}.context_length"] = facts.context_length
    if facts.parameter_count:
        info["general.parameter_count"] = facts.parameter_count
    shape = {
        "context_length": facts.context_length,
        "hidden_size": facts.hidden_size,
        "num_layers": facts.num_layers,
        "vocab_size": facts.vocab_size,
    }
    info.update({key: value for key, value in shape.items() if value is not None})
    return info


def _modified_at(artifact: Artifact) -> str:
    if artifact.mtime is None:
        return _now()
    return _iso(datetime.fromtimestamp(artifact.mtime, UTC))


def _now() -> str:
    return _iso(datetime.now(UTC))


def _iso(moment: datetime) -> str:
    return moment.isoformat().replace("+00:00", "Z")


def _line(payload: dict[str, Any]) -> bytes:
    return dumps(payload) + b"\n"


def _pool_error(exc: PoolError) -> Response:
    # A full queue (503) or a rate limit (429) says when to come back, as on OpenAI routes.
    return json_response({"error": exc.message}, exc.status, retry_after(exc))


def _schema_error(exc: SchemaError) -> Response:
    first = exc.errors[0] if exc.errors else None
    where = ".".join(str(p) for p in first["loc"]) if first else "body"
    return json_response({"error": f"{where}: {first['msg'] if first else 'invalid'}"}, 400)


# Ollama's error shape, ``{"error": "message"}``, for every route of the dialect.
ERRORS = ErrorShape(_pool_error, _schema_error)
