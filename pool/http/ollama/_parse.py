"""Ollama's request bodies as the pool's neutral requests.

Ollama names the sampling fields in ``options`` (``num_predict``, ``repeat_penalty``);
images travel as bare base64 beside a message's text, and ``think`` is a plain switch.
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from pool.actors import DecodingOverrides, EmbeddingRequest, InferenceRequest
from pool.backends import (
    ImagePart,
    TextPart,
    ThinkingMode,
    ToolCall,
    Turn,
    context_field,
    new_call_id,
)
from pool.errors import PoolError
from pool.http._common import chat_request
from pool.http._tools import arguments_text, chat_tools, ollama_output_format
from pool.media import sniff_image_type
from pool.schemas import (
    OllamaChatRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaOptions,
)


def chat_inference_request(body: OllamaChatRequest) -> InferenceRequest:
    """System messages become instructions; the others the conversation."""
    system = [m.content for m in body.messages if m.role == "system"]
    turns = [
        Turn(
            m.role,
            _parts(m.content, m.images),
            tuple(
                ToolCall(new_call_id(), c.function.name, arguments_text(c.function.arguments))
                for c in m.tool_calls or ()
            ),
        )
        for m in body.messages
        if m.role != "system"
    ]
    tools = chat_tools(body.tools)
    return chat_request(
        body.model,
        turns,
        tools=tools,
        output_format=ollama_output_format(body.format),
        instructions="\n\n".join(system) or None,
        thinking=_thinking(body.think),
        decoding=_decoding(body.options),
        keep_alive=body.keep_alive,
        allow_remote=body.allow_remote,
    )


def generate_inference_request(body: OllamaGenerateRequest) -> InferenceRequest:
    """One prompt (with its images) as one user turn; ``system`` as the instructions."""
    return InferenceRequest(
        model=body.model,
        turns=(Turn("user", _parts(body.prompt, body.images)),),
        instructions=body.system,
        thinking=_thinking(body.think),
        decoding=_decoding(body.options),
        keep_alive=body.keep_alive,
        output_format=ollama_output_format(body.format),
        allow_remote=body.allow_remote,
    )


def embed_request(body: OllamaEmbedRequest) -> EmbeddingRequest:
    """``/api/embed``: one text or several, each its own vector."""
    texts = (body.input,) if isinstance(body.input, str) else tuple(body.input)
    return EmbeddingRequest(
        body.model,
        texts,
        dimensions=body.dimensions,
        truncate=body.truncate,
        keep_alive=body.keep_alive,
        allow_remote=body.allow_remote,
    )


def embeddings_request(body: OllamaEmbeddingsRequest) -> EmbeddingRequest:
    """``/api/embeddings``, Ollama's older form: one ``prompt``."""
    return EmbeddingRequest(
        body.model, (body.prompt,), keep_alive=body.keep_alive, allow_remote=body.allow_remote
    )


def load_hint(options: OllamaOptions, backend: str) -> dict[str, Any] | None:
    """``num_ctx`` as the load override of ``backend``'s context field (None where the
    request asks for none or the backend has no such field)."""
    field = context_field(backend)
    if options.num_ctx is None or field is None:
        return None
    return {field: options.num_ctx}


def _image(data: str) -> ImagePart:
    try:
        head = base64.b64decode(data[:24] + "=" * (-len(data[:24]) % 4), validate=False)
    except (binascii.Error, ValueError):
        raise PoolError("invalid_request", "images must be base64") from None
    mime = sniff_image_type(head) or "image/png"
    return ImagePart(f"data:{mime};base64,{data}")


def _decoding(options: OllamaOptions) -> DecodingOverrides:
    return DecodingOverrides(
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        repetition_penalty=options.repeat_penalty,
        stop=tuple(options.stop or ()),
        # Ollama's -1 (no limit) and -2 (fill the context) keep the pool's default cap.
        max_tokens=options.num_predict if options.num_predict and options.num_predict > 0 else None,
        min_p=options.min_p,
        seed=options.seed,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
    )


def _thinking(think: bool | None) -> ThinkingMode:
    return "default" if think is None else ("enabled" if think else "disabled")


def _parts(text: str, images: list[str] | None) -> tuple[TextPart | ImagePart, ...]:
    return (TextPart(text), *(_image(i) for i in images or ()))
