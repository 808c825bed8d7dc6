"""The Ollama API: ``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/show``,
``/api/ps``, ``/api/version``; NDJSON streams by default and Ollama's error shape.

Durations are nanoseconds as Ollama reports them; a request with no messages (chat)
or an empty prompt (generate) loads the model, and with ``keep_alive: 0`` unloads it.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from typing import Any

from quart import Blueprint, Quart, Response

from pool._version import __version__
from pool.actors import Admission, ModelActor
from pool.actors._keep_alive import parse_keep_alive
from pool.backends import context_field
from pool.errors import PoolError
from pool.http._common import (
    AppContext,
    SchemaError,
    conversation_request,
    dumps,
    json_response,
    read_body,
    require,
    tenant_and_priority,
    validate,
)
from pool.http._streaming import admitted_stream
from pool.schemas import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaModelRequest,
    ResponseRequest,
)
from pool.schemas._compat import OllamaOptions

NDJSON = "application/x-ndjson"
_FAR_FUTURE = "2318-01-01T00:00:00Z"  # what Ollama shows for a model kept forever
_IMAGE_MAGIC = {b"\x89PNG": "image/png", b"\xff\xd8\xff": "image/jpeg", b"GIF8": "image/gif",
                b"RIFF": "image/webp"}  # fmt: skip


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _image_url(data: str) -> str:
    try:
        head = base64.b64decode(data[:24] + "=" * (-len(data[:24]) % 4), validate=False)
    except (binascii.Error, ValueError):
        raise PoolError("invalid_request", "images must be base64") from None
    mime = next((m for magic, m in _IMAGE_MAGIC.items() if head.startswith(magic)), "image/png")
    return f"data:{mime};base64,{data}"


def _decoding(options: OllamaOptions) -> dict[str, Any]:
    decoding = {
        "temperature": options.temperature,
        "top_p": options.top_p,
        "top_k": options.top_k,
        "repetition_penalty": options.repeat_penalty,
        "stop": options.stop,
        # Ollama's -1 (no limit) and -2 (fill the context) keep the pool's default cap.
        "max_tokens": options.num_predict
        if options.num_predict and options.num_predict > 0
        else None,
    }
    return {k: v for k, v in decoding.items() if v is not None}


def _thinking(think: bool | None) -> str:
    return "default" if think is None else ("enabled" if think else "disabled")


def _load_hint(actor: ModelActor, options: OllamaOptions) -> dict[str, Any] | None:
    field = context_field(actor.definition.backend)
    if options.num_ctx is None or field is None:
        return None
    return {field: options.num_ctx}


def _stats(admission: Admission) -> dict[str, Any]:
    m = admission.metrics
    if m is None:
        return {}
    ns = 1_000_000

    def to_ns(ms: float | None) -> int:
        return round((ms or 0.0) * ns)

    return {
        "done_reason": "length" if admission.finish_reason == "length" else "stop",
        "total_duration": to_ns(m.pool_total_wall_ms),
        "load_duration": to_ns(m.engine_queue_wait_ms),
        "prompt_eval_count": m.engine_prompt_tokens or 0,
        "prompt_eval_duration": to_ns(m.gpu_time_to_first_token_ms),
        "eval_count": m.engine_output_tokens or 0,
        "eval_duration": to_ns(m.gpu_decode_after_first_token_ms),
    }


def _pull_line(event: dict[str, Any]) -> dict[str, Any]:
    """A pull state as Ollama's progress line (``status``, ``total``, ``completed``, ...)."""
    if event.get("status") == "error":
        return {"error": event.get("error", "pull failed"), **event}
    return event


def _details(actor: ModelActor) -> dict[str, Any]:
    path = actor.definition.model_path or ""
    return {
        "parent_model": "",
        "format": "gguf" if path.endswith(".gguf") else actor.definition.backend,
        "family": "",
        "families": None,
        "parameter_size": "",
        "quantization_level": "",
    }


def _digest(actor: ModelActor) -> str:
    # Not a file digest: the identity of the configured definition.
    return hashlib.sha256(json.dumps(actor.definition_dict(), sort_keys=True).encode()).hexdigest()


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    blueprint = Blueprint("ollama", __name__)

    @blueprint.errorhandler(PoolError)
    async def pool_error(exc: PoolError) -> Response:
        return json_response({"error": exc.message}, exc.status)

    @blueprint.errorhandler(SchemaError)
    async def schema_error(exc: SchemaError) -> Response:
        first = exc.errors[0] if exc.errors else None
        where = ".".join(str(p) for p in first["loc"]) if first else "body"
        return json_response({"error": f"{where}: {first['msg'] if first else 'invalid'}"}, 400)

    async def load_or_unload(
        actor: ModelActor, keep_alive: float | str | None, **fields: Any
    ) -> Response:
        """Ollama's empty request: load the model, or unload it with keep_alive 0."""
        if keep_alive is not None and parse_keep_alive(keep_alive) == 0:
            await pool.detached(actor.unload)
            reason = "unload"
        else:
            await pool.detached(actor.load)
            reason = "load"
        return json_response(
            {
                "model": actor.name,
                "created_at": _now(),
                **fields,
                "done": True,
                "done_reason": reason,
            }
        )

    async def run(
        request: ResponseRequest,
        actor: ModelActor,
        options: OllamaOptions,
        stream: bool,
        shape: str,
    ) -> Response:
        tenant, priority = tenant_and_priority()
        hint = _load_hint(actor, options)

        def piece(text: str) -> dict[str, Any]:
            if shape == "chat":
                return {"message": {"role": "assistant", "content": text}}
            return {"response": text}

        if not stream:
            async with pool.admit(
                request, tenant=tenant, priority=priority, load_hint=hint
            ) as admission:
                await admission.collect()
            return json_response(
                {
                    "model": actor.name,
                    "created_at": _now(),
                    **piece(admission.output_text),
                    "done": True,
                    **_stats(admission),
                }
            )

        def render(admission: Admission, event: dict[str, Any]) -> bytes | None:
            kind = event["type"]
            if kind == "response.output_text.delta":
                line = {
                    "model": actor.name,
                    "created_at": _now(),
                    **piece(event["delta"]),
                    "done": False,
                }
            elif kind == "response.completed":
                line = {
                    "model": actor.name,
                    "created_at": _now(),
                    **piece(""),
                    "done": True,
                    **_stats(admission),
                }
            else:
                return None
            return dumps(line) + b"\n"

        def render_error(admission: Admission, exc: PoolError) -> bytes:
            return dumps({"error": exc.message}) + b"\n"

        _, chunks = await admitted_stream(
            pool,
            request,
            tenant=tenant,
            priority=priority,
            render=render,
            render_error=render_error,
        )
        response = Response(chunks, content_type=NDJSON)
        response.timeout = None
        return response

    @blueprint.post("/api/chat")
    async def chat() -> Response:
        """Ollama chat: NDJSON stream by default, ``stream: false`` for one object."""
        require(ctx, "inference")
        body = await read_body(OllamaChatRequest)
        actor = pool.model(body.model)
        if not body.messages:
            return await load_or_unload(
                actor, body.keep_alive, message={"role": "assistant", "content": ""}
            )
        system = [m.content for m in body.messages if m.role == "system"]
        turns: list[dict[str, Any]] = []
        for m in body.messages:
            if m.role == "system":
                continue
            content: Any = m.content
            if m.images:
                content = [{"type": "text", "text": m.content}] + [
                    {"type": "image_url", "image_url": {"url": _image_url(i)}} for i in m.images
                ]
            turns.append({"role": m.role, "content": content})
        payload: dict[str, Any] = {
            "model": body.model,
            "instructions": "\n\n".join(system) or None,
            "thinking": _thinking(body.think),
            "decoding": _decoding(body.options),
            "keep_alive": body.keep_alive,
        }
        request = conversation_request(payload, turns)
        return await run(request, actor, body.options, body.stream, "chat")

    @blueprint.post("/api/generate")
    async def generate() -> Response:
        """Ollama completion of one prompt (with an optional system prompt)."""
        require(ctx, "inference")
        body = await read_body(OllamaGenerateRequest)
        actor = pool.model(body.model)
        if not body.prompt and not body.images:
            return await load_or_unload(actor, body.keep_alive, response="")
        content: Any = body.prompt
        if body.images:
            content = [{"type": "text", "text": body.prompt}] + [
                {"type": "image_url", "image_url": {"url": _image_url(i)}} for i in body.images
            ]
        payload = {
            "model": body.model,
            "input": content,
            "instructions": body.system,
            "thinking": _thinking(body.think),
            "decoding": _decoding(body.options),
            "keep_alive": body.keep_alive,
        }
        return await run(
            validate(ResponseRequest, payload), actor, body.options, body.stream, "generate"
        )

    def tag(actor: ModelActor) -> dict[str, Any]:
        size = (actor.artifact_mib or 0) * 1024 * 1024
        return {"name": actor.name, "model": actor.name, "modified_at": _now(), "size": size,
                "digest": _digest(actor), "details": _details(actor)}  # fmt: skip

    @blueprint.get("/api/tags")
    async def tags() -> Response:
        """Every configured model, Ollama's list format."""
        require(ctx, "inference")
        return json_response({"models": [tag(a) for a in pool.models.values()]})

    @blueprint.get("/api/ps")
    async def ps() -> Response:
        """Loaded models with the time their keep-alive runs out."""
        require(ctx, "inference")
        models = []
        for actor in pool.models.values():
            if actor.state != "loaded":
                continue
            remaining = actor.expires_in_s
            expires = (
                (datetime.now(UTC) + timedelta(seconds=remaining))
                .isoformat()
                .replace("+00:00", "Z")
                if remaining is not None
                else _FAR_FUTURE
            )
            vram, _, _ = actor.vram_estimate()
            models.append(
                tag(actor) | {"expires_at": expires, "size_vram": (vram or 0) * 1024 * 1024}
            )
        return json_response({"models": models})

    @blueprint.post("/api/show")
    async def show() -> Response:
        """A model's definition, details and capabilities."""
        require(ctx, "inference")
        body = await read_body(OllamaModelRequest)
        actor = pool.model(body.target)
        caps = actor.capabilities
        capabilities = ["completion"] + (["vision"] if "image" in caps.modalities else [])
        if "enabled" in caps.thinking_modes:
            capabilities.append("thinking")
        return json_response(
            {
                "modelfile": "",
                "parameters": "",
                "template": "",
                "details": _details(actor),
                "model_info": actor.definition_dict(),
                "capabilities": capabilities,
                "modified_at": _now(),
            }
        )

    @blueprint.post("/api/pull")
    async def pull() -> Response:
        """Pull a configured model from its `source`: NDJSON progress unless `stream: false`.

        The pull runs in the background: a client that disconnects stops watching only.
        """
        require(ctx, "admin")
        body = await read_body(OllamaModelRequest)
        pool.pulls.pull(body.target)
        if not body.stream:
            async with pool.pulls.watch(body.target) as events:
                final: dict[str, Any] = {}
                async for event in events:
                    final = event
            status = 200 if final.get("status") == "success" else 500
            return json_response(_pull_line(final), status)

        async def lines() -> AsyncIterator[bytes]:
            async with pool.pulls.watch(body.target) as events:
                async for event in events:
                    yield dumps(_pull_line(event)) + b"\n"

        response = Response(lines(), content_type=NDJSON)
        response.timeout = None
        return response

    @blueprint.get("/api/pull/status/<model>")
    async def pull_status(model: str) -> Response:
        """The current or last pull of a model."""
        require(ctx, "admin")
        state = pool.pulls.status(model)
        if state is None:
            raise PoolError("not_found", f"no pull of {model!r}")
        return json_response(state)

    @blueprint.delete("/api/pull/<model>")
    async def pull_cancel(model: str) -> Response:
        """Cancel a running pull; its partial files are removed."""
        require(ctx, "admin")
        if not await pool.pulls.cancel(model):
            raise PoolError("not_found", f"no running pull of {model!r}")
        return json_response({"model": model, "cancelled": True})

    @blueprint.delete("/api/delete")
    async def delete() -> Response:
        """Remove a pulled model from the store (409 while it is loaded)."""
        require(ctx, "admin")
        body = await read_body(OllamaModelRequest)
        if not await pool.pulls.delete(body.target):
            raise PoolError("not_found", f"model {body.target!r} is not in the model store")
        return json_response({})

    @blueprint.get("/api/version")
    async def version() -> Response:
        return json_response({"version": __version__})

    app.register_blueprint(blueprint)
