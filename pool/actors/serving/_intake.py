"""Turning an :class:`InferenceRequest` into a backend's :class:`GenerationRequest` (and an
embedding or task request into its job).

This is where the per-model capability rules live (multi-turn, images, thinking,
remote gate), and where images become inline data under the media policy, so every
surface (responses, OpenAI, Ollama, WebSocket, embedded) enforces them the same way
and a rejected request never reaches a queue.
"""

from __future__ import annotations

import dataclasses

from pool.actors.serving._request import (
    DecodingOverrides,
    EmbeddingRequest,
    InferenceRequest,
    TaskRequest,
)
from pool.backends import (
    CacheScope,
    Capabilities,
    Decoding,
    EmbeddingJob,
    GenerationRequest,
    ImagePart,
    TaskJob,
)
from pool.config import DecodingDefaults, merge_decoding
from pool.errors import PoolError
from pool.media import MediaLoader

# The neutral request's fields a runtime receives as they are: those both types name
# (decoding becomes the effective values; the cache scope adds the tenant). A field added
# to both is handed on without a line here.
HANDED_ON = tuple(
    f.name
    for f in dataclasses.fields(GenerationRequest)
    if f.name in {g.name for g in dataclasses.fields(InferenceRequest)} and f.name != "decoding"
)


def effective_decoding(asked: DecodingOverrides, defaults: DecodingDefaults) -> Decoding:
    """The request's decoding: each asked field over its ``engine.decoding`` default (the
    loop over the declared fields lives with the declaration, pool/config/_sampling.py)."""
    return merge_decoding(asked.asked, defaults)


def check_sampling(name: str, decoding: Decoding, capabilities: Capabilities) -> None:
    """The one place that decides whether a backend can honour the sampling asked for.

    Raises:
        PoolError: ``sampling_unsupported`` (400) naming the first field it cannot honour.
    """
    for field in decoding.asked_extras():
        if field not in capabilities.sampling:
            supported = sorted(capabilities.sampling) or "none of the optional fields"
            raise PoolError(
                "sampling_unsupported",
                f"model {name!r} cannot honour {field} (its backend supports: {supported})",
                details={"param": field},
            )


def check_tools(request: InferenceRequest, capabilities: Capabilities) -> None:
    """The one place that decides whether a model can take the tools and format asked for.

    Raises:
        PoolError: ``tools_unsupported`` or ``structured_output_unsupported`` (400) where
            the backend cannot honour them (rather than ignoring them), and
            ``invalid_request`` for a ``tool_choice`` naming no offered tool.
    """
    name = request.model
    uses_tools = bool(request.tools) or any(t.role == "tool" or t.tool_calls for t in request.turns)
    if uses_tools and not capabilities.tools:
        raise PoolError(
            "tools_unsupported",
            f"model {name!r} cannot call tools (its backend or prompt format has no tool"
            " support): leave tools out",
            details={"param": "tools"},
        )
    choice = request.tool_choice
    if choice.mode in ("required", "function") and not request.tools:
        raise PoolError(
            "tool_choice_unmatched",
            "tool_choice asks for a tool call, but no tools are given",
            details={"param": "tool_choice"},
        )
    if choice.mode == "function" and choice.name not in {t.name for t in request.tools}:
        raise PoolError(
            "tool_choice_unmatched",
            f"tool_choice names function {choice.name!r}, which is not among the tools",
            details={"param": "tool_choice"},
        )
    if request.output_format is not None and not capabilities.structured_output:
        raise PoolError(
            "structured_output_unsupported",
            f"model {name!r} cannot constrain its output to JSON: leave response_format out",
            details={"param": "response_format"},
        )


def wrong_model_kind(name: str, kind: str, wanted: str) -> PoolError:
    """The error of a request for a model of another kind, naming both kinds."""
    return PoolError(
        "wrong_model_kind",
        f"model {name!r} is of kind {kind}; this request needs a model of kind {wanted}",
        details={"kind": kind, "wanted": wanted},
    )


def _check_remote(name: str, allow_remote: bool, capabilities: Capabilities) -> None:
    if capabilities.remote and not (allow_remote or capabilities.remote_allowed):
        raise PoolError(
            "remote_not_allowed",
            f"model {name!r} calls a remote API; set allow_remote: true in the request, or"
            " consent for every request with allow_remote: true on the model in the settings",
        )


def build_embedding_job(
    request: EmbeddingRequest, *, request_id: str, capabilities: Capabilities
) -> EmbeddingJob:
    """Check ``request`` against the model's capabilities and build the backend job.

    Raises:
        PoolError: ``wrong_model_kind`` for a model of another kind, ``invalid_request``
            for no input, ``dimensions_unsupported`` for a ``dimensions`` the model cannot
            give, ``remote_not_allowed``.
    """
    name = request.model
    if not capabilities.embeddings:
        raise wrong_model_kind(name, capabilities.kind, "embedding")
    _check_remote(name, request.allow_remote, capabilities)
    if not request.texts:
        raise PoolError("invalid_request", "input must hold at least one text")
    if request.dimensions is not None:
        if not capabilities.embedding_dimensions:
            raise PoolError(
                "dimensions_unsupported",
                f"model {name!r} cannot shorten its embeddings: leave dimensions out",
                details={"param": "dimensions"},
            )
        if request.dimensions < 1:
            raise PoolError("invalid_request", "dimensions must be at least 1")
    return EmbeddingJob(
        request_id=request_id,
        model=name,
        texts=request.texts,
        dimensions=request.dimensions,
        truncate=request.truncate,
    )


def build_task_job(request: TaskRequest, *, request_id: str, capabilities: Capabilities) -> TaskJob:
    """Check ``request`` against the model's kind and hand its job the request id.

    Raises:
        PoolError: ``wrong_model_kind`` for a model of a kind the job is not served by,
            ``remote_not_allowed``.
    """
    job = request.job
    if capabilities.kind not in job.served_by:
        raise wrong_model_kind(request.model, capabilities.kind, job.wanted)
    _check_remote(request.model, request.allow_remote, capabilities)
    return dataclasses.replace(job, request_id=request_id)  # type: ignore[type-var]


def build_generation_request(
    request: InferenceRequest,
    *,
    request_id: str,
    capabilities: Capabilities,
    decoding_defaults: DecodingDefaults,
    tenant: str = "default",
    trace_parent: str | None = None,
) -> GenerationRequest:
    """Check ``request`` against the model's capabilities and build the backend request.

    ``trace_parent`` is the ``traceparent`` of the request's span where the pool traces.

    Raises:
        PoolError: ``wrong_model_kind``, ``remote_not_allowed``,
            ``multi_turn_unsupported``, ``modality_unsupported``,
            ``thinking_unsupported`` or ``sampling_unsupported`` (all 400).
    """
    name = request.model
    if not capabilities.generation:
        raise wrong_model_kind(name, capabilities.kind, "chat")
    _check_remote(name, request.allow_remote, capabilities)
    if request.multi_turn and not capabilities.multi_turn:
        raise PoolError(
            "multi_turn_unsupported",
            f"model {name!r} accepts single-turn `input` only, not `messages`",
        )
    if "image" not in capabilities.modalities and any(t.has_images for t in request.turns):
        raise PoolError(
            "modality_unsupported",
            f"model {name!r} accepts {', '.join(capabilities.modalities)} input only",
        )
    if request.thinking not in capabilities.thinking_modes:
        raise PoolError(
            "thinking_unsupported",
            f"model {name!r} accepts thinking values {list(capabilities.thinking_modes)}",
        )
    check_tools(request, capabilities)
    decoding = effective_decoding(request.decoding, decoding_defaults)
    check_sampling(name, decoding, capabilities)
    return GenerationRequest(
        request_id=request_id,
        decoding=decoding,
        cache=cache_scope(request, tenant),
        trace_parent=trace_parent,
        **{name: getattr(request, name) for name in HANDED_ON},
    )


def cache_scope(request: InferenceRequest, tenant: str) -> CacheScope:
    """Whose cached prompt state ``request`` may reuse (``X-Cache-Mode``, ``X-Cache-Tag``)."""
    return CacheScope(tenant, request.cache_tag, request.cache_mode != "none")


async def inline_images(request: GenerationRequest, media: MediaLoader) -> GenerationRequest:
    """``request`` with every image as an inline ``data:`` URL (the same object if none).

    Raises:
        PoolError: ``image_refused`` (400) from the media policy.
    """
    urls = [p.url for t in request.turns for p in t.parts if isinstance(p, ImagePart)]
    if not urls:
        return request
    inlined = await media.inline(urls)
    if inlined == urls:
        return request
    replacements = iter(inlined)
    turns = tuple(
        dataclasses.replace(
            turn,
            parts=tuple(
                ImagePart(next(replacements), part.detail) if isinstance(part, ImagePart) else part
                for part in turn.parts
            ),
        )
        for turn in request.turns
    )
    return dataclasses.replace(request, turns=turns)
