"""The routes of the dialect (its parsing and rendering stay beside them until they move
into ``_parse.py`` and ``_render.py``)."""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import trio
from quart import Blueprint, Quart, Response

from pool._version import __version__
from pool.actors import (
    Admission,
    DecodingOverrides,
    Delta,
    Embedded,
    EmbeddingRequest,
    Finished,
    InferenceRequest,
    ModelActor,
    ModelSnapshot,
    Waiting,
    parse_keep_alive,
)
from pool.backends import (
    ImagePart,
    TextPart,
    ThinkingMode,
    ToolCall,
    Turn,
    context_field,
    new_call_id,
)
from pool.config import resolve_model_path
from pool.errors import PoolError
from pool.http._common import (
    AppContext,
    ErrorShape,
    SchemaError,
    chat_request,
    dumps,
    json_response,
    read_body,
    require,
    retry_after,
    tenant_and_priority,
)
from pool.http._streaming import HEARTBEAT_S, admitted_stream
from pool.http._tools import arguments_text, chat_tools, ollama_call, ollama_output_format
from pool.http.admin._render import definition_body
from pool.media import sniff_image_type
from pool.pulls import FileDigests
from pool.schemas import (
    OllamaChatRequest,
    OllamaCopyRequest,
    OllamaEmbeddingsRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaModelRequest,
    OllamaOptions,
    OllamaStoreRequest,
)

NDJSON = "application/x-ndjson"
_FAR_FUTURE = "2318-01-01T00:00:00Z"  # what Ollama shows for a model kept forever


def _now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def _timestamp(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class _Artifact:
    """What ``/api/tags`` says about a model's files."""

    modified_at: str
    size: int
    digest: str


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


def _load_hint(actor: ModelActor, options: OllamaOptions) -> dict[str, Any] | None:
    field = context_field(actor.definition.backend)
    if options.num_ctx is None or field is None:
        return None
    return {field: options.num_ctx}


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


def _embed_stats(done: Embedded) -> dict[str, Any]:
    t = done.timings
    return {
        "total_duration": round((t.pool_ms or 0.0) * 1_000_000),
        "load_duration": round((t.queue_wait_ms or 0.0) * 1_000_000),
        "prompt_eval_count": done.usage.prompt_tokens or 0,
    }


def _pull_line(event: dict[str, Any]) -> dict[str, Any]:
    """A pull state as Ollama's progress line (``status``, ``total``, ``completed``, ...)."""
    if event.get("status") == "error":
        return {"error": event.get("error", "pull failed"), **event}
    return event


def _details(snapshot: ModelSnapshot) -> dict[str, Any]:
    """Ollama's ``details``, from the artifact's metadata (empty where it says nothing)."""
    path = snapshot.active_definition.model_path or ""
    facts = snapshot.details
    return {
        "parent_model": "",
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
    ``<family>.context_length``) where the artifact has them."""
    info = definition_body(snapshot)
    facts = snapshot.details
    if facts.family:
        info["general.architecture"] = facts.family
        if facts.context_length:
            info[f"{facts.family}.context_length"] = facts.context_length
    if facts.parameter_count:
        info["general.parameter_count"] = facts.parameter_count
    return info


def _digest(snapshot: ModelSnapshot) -> str:
    # Not a file digest: the identity of the configured definition.
    definition = definition_body(snapshot)
    return hashlib.sha256(json.dumps(definition, sort_keys=True).encode()).hexdigest()


def _tag(snapshot: ModelSnapshot, artifact: _Artifact) -> dict[str, Any]:
    return {
        "name": snapshot.name,
        "model": snapshot.name,
        "modified_at": artifact.modified_at,
        "size": artifact.size,
        "digest": artifact.digest,
        "details": _details(snapshot),
        "loaded": snapshot.state == "loaded",
    }


def _running(snapshot: ModelSnapshot, artifact: _Artifact) -> dict[str, Any]:
    """A loaded model in ``/api/ps``: its tag, when its keep-alive runs out, its memory.

    ``size`` is the loaded footprint (the measured or estimated VRAM of its replicas;
    the artifact's size when there is no estimate), ``size_vram`` the part on GPUs: all
    of it when the pool placed the replicas on GPUs, 0 for a model on CPU or remote.
    """
    remaining = snapshot.expires_in_s
    expires = (
        (datetime.now(UTC) + timedelta(seconds=remaining)).isoformat().replace("+00:00", "Z")
        if remaining is not None
        else _FAR_FUTURE
    )
    footprint = snapshot.vram.mib * 1024 * 1024 if snapshot.vram.mib is not None else artifact.size
    on_gpus = bool(snapshot.gpus) and not snapshot.capabilities.remote
    return _tag(snapshot, artifact) | {
        "size": footprint,
        "expires_at": expires,
        "size_vram": footprint if on_gpus else 0,
    }


def _show(snapshot: ModelSnapshot, artifact: _Artifact, parameters: str) -> dict[str, Any]:
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
        "modified_at": artifact.modified_at,
    }


class _Routes:
    """The Ollama routes; each is a method so the module reads as a list of routes."""

    def __init__(self, ctx: AppContext) -> None:
        self.ctx = ctx
        self.pool = ctx.pool
        self.digests = FileDigests()

    async def _artifact(self, snapshot: ModelSnapshot) -> _Artifact:
        """The model file's mtime, size and SHA-256; the settings file's mtime without one."""
        value = snapshot.active_definition.model_path
        base_dir = self.ctx.settings.base_dir
        facts = None
        if value:

            def resolve() -> Path | None:
                try:
                    return resolve_model_path(value, base_dir)
                except (FileNotFoundError, OSError):
                    return None

            path = await trio.to_thread.run_sync(resolve)
            facts = await self.digests.facts(path) if path is not None else None
        if facts is not None:
            return _Artifact(_timestamp(facts.mtime), facts.size, facts.sha256 or _digest(snapshot))
        sources = self.ctx.settings.source_files
        mtime = await self.digests.mtime(Path(sources[0])) if sources else None
        return _Artifact(
            _timestamp(mtime) if mtime is not None else _now(),
            (snapshot.artifact_mib or 0) * 1024 * 1024,
            _digest(snapshot),
        )

    def _parameters(self, snapshot: ModelSnapshot) -> str:
        """The decoding defaults as Ollama's ``parameters`` text (``name value`` lines)."""
        d = self.ctx.settings.engine.decoding
        lines = [
            f"temperature {d.temperature:g}",
            f"top_k {d.top_k}",
            f"top_p {d.top_p:g}",
            f"repeat_penalty {d.repetition_penalty:g}",
            f"num_predict {d.max_tokens}",
            *(f'stop "{s}"' for s in d.stop),
        ]
        if snapshot.context_length is not None:
            lines.append(f"num_ctx {snapshot.context_length}")
        return "\n".join(lines)

    # -- the probe Ollama clients send first -------------------------------------
    async def root(self) -> Response:
        """``GET /`` and ``HEAD /``: "Ollama is running", as Ollama answers."""
        return Response("Ollama is running", content_type="text/plain; charset=utf-8")

    # -- inference ---------------------------------------------------------------
    async def chat(self) -> Response:
        """Ollama chat: NDJSON stream by default, ``stream: false`` for one object."""
        require(self.ctx, "inference")
        # Read first, so that every answer (a 404 too) carries the tenant's rate limit.
        tenant_priority = tenant_and_priority()
        body = await read_body(OllamaChatRequest)
        actor = self.pool.model(body.model)
        if not body.messages:
            return await self._load_or_unload(
                actor, body.keep_alive, body.options, message={"role": "assistant", "content": ""}
            )
        request = chat_inference_request(body)
        return await self._run(
            request, tenant_priority, actor, body.options, body.stream, _chat_piece
        )

    async def generate(self) -> Response:
        """Ollama completion of one prompt (with an optional system prompt)."""
        require(self.ctx, "inference")
        # Read first, so that every answer (a 404 too) carries the tenant's rate limit.
        tenant_priority = tenant_and_priority()
        body = await read_body(OllamaGenerateRequest)
        actor = self.pool.model(body.model)
        if not body.prompt and not body.images:
            return await self._load_or_unload(actor, body.keep_alive, body.options, response="")
        request = generate_inference_request(body)
        return await self._run(
            request, tenant_priority, actor, body.options, body.stream, _generate_piece
        )

    async def _load_or_unload(
        self,
        actor: ModelActor,
        keep_alive: float | str | None,
        options: OllamaOptions,
        **fields: Any,
    ) -> Response:
        """Ollama's empty request: load the model (with ``num_ctx`` as a load hint), or
        unload it with keep_alive 0.

        The load is the pool's own (``Pool.preload``, then ``Pool.load``): placed by the
        VRAM gate, evicting what the rules allow, else refused with ``load_failed``.
        """
        if keep_alive is not None and parse_keep_alive(keep_alive) == 0:
            await self.pool.detached(self.pool.unload, actor.name)
            reason = "unload"
        else:
            await self.pool.detached(self.pool.preload, actor.name, _load_hint(actor, options))
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

    async def _run(
        self,
        request: InferenceRequest,
        tenant_priority: tuple[str, str],
        actor: ModelActor,
        options: OllamaOptions,
        stream: bool,
        piece: Callable[[str], dict[str, Any]],
    ) -> Response:
        tenant, priority = tenant_priority
        hint = _load_hint(actor, options)
        if not stream:
            async with self.pool.admit(
                request, tenant=tenant, priority=priority, load_hint=hint
            ) as admission:
                finished = await admission.collect()
            body = {
                "model": actor.name,
                "created_at": _now(),
                **piece(finished.text),
                "done": True,
                **_stats(finished),
            }
            if finished.tool_calls and "message" in body:
                body["message"]["tool_calls"] = [ollama_call(c) for c in finished.tool_calls]
            return json_response(body)

        def render(admission: Admission, event: Delta | Finished) -> bytes:
            if type(event) is Delta:
                line = {
                    "model": actor.name,
                    "created_at": _now(),
                    **piece(event.text),
                    "done": False,
                }
            else:
                assert isinstance(event, Finished)
                line = {
                    "model": actor.name,
                    "created_at": _now(),
                    **piece(""),
                    "done": True,
                    **_stats(event),
                }
                if event.tool_calls and "message" in line:
                    # Ollama sends whole calls in a message of their own before the end.
                    calls = {
                        "model": actor.name,
                        "created_at": _now(),
                        "message": {
                            "role": "assistant",
                            "content": "",
                            "tool_calls": [ollama_call(c) for c in event.tool_calls],
                        },
                        "done": False,
                    }
                    return dumps(calls) + b"\n" + dumps(line) + b"\n"
            return dumps(line) + b"\n"

        def render_error(admission: Admission, exc: PoolError) -> bytes:
            return dumps({"error": exc.message}) + b"\n"

        def keep_alive(admission: Admission, waiting: Waiting) -> bytes:
            # NDJSON has no comment: Ollama's client parses every line as a chunk (a
            # blank one raises), so a wait is shown as a chunk with nothing in it.
            line = {"model": actor.name, "created_at": _now(), **piece(""), "done": False}
            return dumps(line) + b"\n"

        _, chunks = await admitted_stream(
            self.pool,
            request,
            tenant=tenant,
            priority=priority,
            render=render,
            render_error=render_error,
            render_wait=keep_alive,
            heartbeat_s=HEARTBEAT_S,
        )
        response = Response(chunks, content_type=NDJSON)
        response.timeout = None
        return response

    # -- embeddings --------------------------------------------------------------
    async def embed(self) -> Response:
        """Ollama embeddings of one text or several: ``embeddings``, one list per text."""
        require(self.ctx, "inference")
        body = await read_body(OllamaEmbedRequest)
        texts = (body.input,) if isinstance(body.input, str) else tuple(body.input)
        request = EmbeddingRequest(
            body.model,
            texts,
            dimensions=body.dimensions,
            truncate=body.truncate,
            keep_alive=body.keep_alive,
            allow_remote=body.allow_remote,
        )
        done = await self._embed(request)
        return json_response(
            {"model": body.model, "embeddings": [list(v) for v in done.vectors]}
            | _embed_stats(done)
        )

    async def embeddings(self) -> Response:
        """Ollama's older endpoint: one ``prompt``, one ``embedding``."""
        require(self.ctx, "inference")
        body = await read_body(OllamaEmbeddingsRequest)
        request = EmbeddingRequest(
            body.model, (body.prompt,), keep_alive=body.keep_alive, allow_remote=body.allow_remote
        )
        done = await self._embed(request)
        return json_response({"embedding": list(done.vectors[0])})

    async def _embed(self, request: EmbeddingRequest) -> Embedded:
        tenant, priority = tenant_and_priority()
        return await self.pool.embed(request, tenant=tenant, priority=priority)

    # -- models ------------------------------------------------------------------
    async def tags(self) -> Response:
        """Every configured model, Ollama's list format."""
        require(self.ctx, "inference")
        snapshots = self.pool.snapshots()
        tags = [_tag(s, await self._artifact(s)) for s in snapshots]
        return json_response({"models": tags})

    async def ps(self) -> Response:
        """Loaded models with the time their keep-alive runs out."""
        require(self.ctx, "inference")
        loaded = [
            _running(s, await self._artifact(s))
            for s in self.pool.snapshots()
            if s.state == "loaded"
        ]
        return json_response({"models": loaded})

    async def show(self) -> Response:
        """A model's definition, details and capabilities."""
        require(self.ctx, "inference")
        body = await read_body(OllamaModelRequest)
        snapshot = self.pool.snapshot(body.target)
        artifact = await self._artifact(snapshot)
        return json_response(_show(snapshot, artifact, self._parameters(snapshot)))

    async def copy(self) -> Response:
        """Refused: models are named by the settings files (see the module docstring)."""
        require(self.ctx, "admin")
        body = await read_body(OllamaCopyRequest)
        self.pool.snapshot(body.source)  # 404 for an unknown source first
        raise PoolError(
            "copy_unsupported",
            f"cannot copy {body.source!r} to {body.destination!r}: models are defined in the"
            " settings files; add an entry for the new name there (or in config/local.json)",
        )

    async def version(self) -> Response:
        return json_response({"version": __version__})

    # -- pulls -------------------------------------------------------------------
    async def pull(self) -> Response:
        """Pull a configured model from its `source`: NDJSON progress unless `stream: false`.

        The pull runs in the background: a client that disconnects stops watching only.
        """
        require(self.ctx, "admin")
        body = await read_body(OllamaStoreRequest)
        pulls = self.pool.pulls
        pulls.pull(body.target)
        if not body.stream:
            async with pulls.watch(body.target) as events:
                final: dict[str, Any] = {}
                async for event in events:
                    final = event
            status = 200 if final.get("status") == "success" else 500
            return json_response(_pull_line(final), status)

        async def lines() -> AsyncIterator[bytes]:
            async with pulls.watch(body.target) as events:
                async for event in events:
                    yield dumps(_pull_line(event)) + b"\n"

        response = Response(lines(), content_type=NDJSON)
        response.timeout = None
        return response

    async def pull_status(self, model: str) -> Response:
        """The current or last pull of a model."""
        require(self.ctx, "admin")
        state = self.pool.pulls.status(model)
        if state is None:
            raise PoolError("not_found", f"no pull of {model!r}")
        return json_response(state)

    async def pull_cancel(self, model: str) -> Response:
        """Cancel a running pull; its partial files are removed."""
        require(self.ctx, "admin")
        if not await self.pool.pulls.cancel(model):
            raise PoolError("not_found", f"no running pull of {model!r}")
        return json_response({"model": model, "cancelled": True})

    async def delete(self) -> Response:
        """Remove a pulled model from the store (409 while it is loaded)."""
        require(self.ctx, "admin")
        body = await read_body(OllamaStoreRequest)
        if not await self.pool.pulls.delete(body.target):
            raise PoolError("not_found", f"model {body.target!r} is not in the model store")
        return json_response({})


def _chat_piece(text: str) -> dict[str, Any]:
    return {"message": {"role": "assistant", "content": text}}


def _generate_piece(text: str) -> dict[str, Any]:
    return {"response": text}


def _pool_error(exc: PoolError) -> Response:
    # A full queue (503) or a rate limit (429) says when to come back, as on OpenAI routes.
    return json_response({"error": exc.message}, exc.status, retry_after(exc))


def _schema_error(exc: SchemaError) -> Response:
    first = exc.errors[0] if exc.errors else None
    where = ".".join(str(p) for p in first["loc"]) if first else "body"
    return json_response({"error": f"{where}: {first['msg'] if first else 'invalid'}"}, 400)


def register(app: Quart, ctx: AppContext) -> None:
    routes = _Routes(ctx)
    blueprint = Blueprint("ollama", __name__)
    ctx.error_shapes[blueprint.name] = ErrorShape(_pool_error, _schema_error)
    for path, view, methods in (
        ("/api/chat", routes.chat, ["POST"]),
        ("/api/generate", routes.generate, ["POST"]),
        ("/api/embed", routes.embed, ["POST"]),
        ("/api/embeddings", routes.embeddings, ["POST"]),
        ("/api/tags", routes.tags, ["GET"]),
        ("/api/ps", routes.ps, ["GET"]),
        ("/api/show", routes.show, ["POST"]),
        ("/api/copy", routes.copy, ["POST"]),
        ("/", routes.root, ["GET", "HEAD"]),
        ("/api/version", routes.version, ["GET"]),
        ("/api/pull", routes.pull, ["POST"]),
        ("/api/pull/status/<model>", routes.pull_status, ["GET"]),
        ("/api/pull/<model>", routes.pull_cancel, ["DELETE"]),
        ("/api/delete", routes.delete, ["DELETE"]),
    ):
        blueprint.add_url_rule(path, view_func=view, methods=methods)
    app.register_blueprint(blueprint)
