"""The routes of the Ollama API: each reads its request, parses it (``_parse``), asks the
pool and answers through ``_render``."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from quart import Blueprint, Quart, Response

from pool._version import __version__
from pool.actors import InferenceRequest, ModelActor, Pool, parse_keep_alive
from pool.errors import PoolError
from pool.http._collected import collected
from pool.http._common import (
    AppContext,
    Opened,
    json_response,
    open_model_route,
    read_body,
    require,
)
from pool.http._route import EMBEDDING_REFUSALS, GENERATION_REFUSALS, Route, serves
from pool.http._streaming import HEARTBEAT_S, admitted_stream, streamed_answer
from pool.http._tools import chat_tools, ollama_output_format
from pool.http.ollama._artifacts import Artifacts
from pool.http.ollama._parse import (
    chat_inference_request,
    embed_request,
    embeddings_request,
    generate_inference_request,
    load_hint,
)
from pool.http.ollama._render import (
    ERRORS,
    NDJSON,
    GenerationLines,
    Piece,
    chat_piece,
    embed_body,
    embeddings_body,
    generate_piece,
    generation_body,
    load_body,
    parameters,
    pull_line,
    pull_progress,
    running,
    show,
    tag,
)
from pool.schemas import (
    OllamaChatReply,
    OllamaChatRequest,
    OllamaChatStreamLine,
    OllamaCopyRequest,
    OllamaEmbeddingsReply,
    OllamaEmbeddingsRequest,
    OllamaEmbedReply,
    OllamaEmbedRequest,
    OllamaError,
    OllamaGenerateReply,
    OllamaGenerateRequest,
    OllamaGenerateStreamLine,
    OllamaModelRequest,
    OllamaRunning,
    OllamaShowReply,
    OllamaStoreRequest,
    OllamaTags,
    OllamaVersion,
    PullCancelled,
    PullState,
    StatusSuccess,
)

# -- the documented routes (pool/http/_route.py) ----------------------------------------
ROOT = Route(
    "get",
    "/",
    "ollama",
    "Ollama probe",
    "`Ollama is running` (text/plain).",
    text=("text/plain", {"const": "Ollama is running"}),
    errors="ollama",
)
ROOT_HEAD = Route(
    "head", "/", "ollama", "Ollama probe (HEAD)", "200 with no body, as Ollama.", errors="ollama"
)
CHAT = Route(
    "post",
    "/api/chat",
    "ollama",
    "Chat (Ollama)",
    "NDJSON stream by default (one line per piece, the last with `done: true` and the"
    " timings), one object with `stream: false`; no messages loads the model"
    " (`keep_alive: 0` unloads it). `tools` and `tool` messages where the backend can call"
    ' tools (`message.tool_calls` in the reply); `format` (`"json"` or a schema)'
    " constrains the reply.",
    OllamaChatRequest,
    reply=OllamaChatReply,
    stream=NDJSON,
    events=OllamaChatStreamLine,
    errors="ollama",
    valid_input_codes=GENERATION_REFUSALS,
)
GENERATE = Route(
    "post",
    "/api/generate",
    "ollama",
    "Generate (Ollama)",
    "One prompt; NDJSON stream by default as `/api/chat`; an empty prompt loads the model.",
    OllamaGenerateRequest,
    reply=OllamaGenerateReply,
    stream=NDJSON,
    events=OllamaGenerateStreamLine,
    errors="ollama",
    valid_input_codes=GENERATION_REFUSALS,
)
EMBED = Route(
    "post",
    "/api/embed",
    "ollama",
    "Embed (Ollama)",
    "`embeddings`: one L2-normalized vector per input.",
    OllamaEmbedRequest,
    reply=OllamaEmbedReply,
    errors="ollama",
    valid_input_codes=EMBEDDING_REFUSALS,
)
EMBEDDINGS = Route(
    "post",
    "/api/embeddings",
    "ollama",
    "Embeddings (Ollama, older)",
    "`embedding`: the vector of one `prompt`.",
    OllamaEmbeddingsRequest,
    reply=OllamaEmbeddingsReply,
    errors="ollama",
    valid_input_codes=EMBEDDING_REFUSALS,
)
TAGS = Route(
    "get",
    "/api/tags",
    "ollama",
    "List models (Ollama)",
    "Every configured (and pulled) model: `loaded`, the artifact's `modified_at`, `size` and"
    " SHA-256 `digest` (a model without a file: the settings file's mtime and the digest of"
    " its definition).",
    reply=OllamaTags,
    errors="ollama",
)
PS = Route(
    "get",
    "/api/ps",
    "ollama",
    "Loaded models (Ollama)",
    "As `/api/tags`, loaded models only, with `expires_at` (when the keep-alive unloads"
    " it), `size` (its memory footprint: the VRAM measurement or estimate) and `size_vram`"
    " (the part on GPUs: 0 for a model on CPU or remote).",
    reply=OllamaRunning,
    errors="ollama",
)
SHOW_MODEL = Route(
    "post",
    "/api/show",
    "ollama",
    "Show a model (Ollama)",
    "Template (the pool's prompt format), parameters (decoding defaults), capabilities"
    " (`completion` or `embedding`, `tools`, `thinking`, `vision`), details and the"
    " definition.",
    OllamaModelRequest,
    reply=OllamaShowReply,
    errors="ollama",
    refusals=(404,),
)
COPY = Route(
    "post",
    "/api/copy",
    "ollama",
    "Copy a model (Ollama): refused",
    "Always 400 `copy_unsupported` (404 for an unknown source): model names come from the"
    " settings files; add an entry there instead.",
    OllamaCopyRequest,
    400,
    reply=OllamaError,
    errors="ollama",
    refusals=(404,),
    valid_input_codes=("copy_unsupported",),
)
VERSION = Route(
    "get",
    "/api/version",
    "ollama",
    "Version (Ollama)",
    "The pool's version.",
    reply=OllamaVersion,
    errors="ollama",
)
PULL = Route(
    "post",
    "/api/pull",
    "ollama",
    "Pull a model (Ollama)",
    "Pulls a configured model from its `source` in the background: NDJSON progress lines"
    " (the pull's state), repeated every `service.pull_heartbeat_s` (30 s) while nothing"
    " moves (queued, or a stalled download); with `stream: false` the final state (400,"
    " with `error`, when the pull failed or was cancelled). A model the store already"
    " holds from the same source succeeds at once, downloading nothing. A client that"
    " disconnects stops watching only. Admin token.",
    OllamaStoreRequest,
    reply=PullState,
    stream=NDJSON,
    events=PullState,
    errors="ollama",
    refusals=(400, 404),
    valid_input_codes=("no_pull_source",),
)
PULL_STATUS = Route(
    "get",
    "/api/pull/status/{model}",
    "ollama",
    "Pull status",
    "The current or last pull of a model (404 when none): its state in the pool's"
    " terms (`status`, `completed`, `total`) and the embedded-engine spec's (`state`,"
    " `progress` in percent, `total_bytes`, `downloaded_bytes`).",
    reply=PullState,
    errors="ollama",
    refusals=(404,),
)
PULL_CANCEL = Route(
    "delete",
    "/api/pull/{model}",
    "ollama",
    "Cancel a pull",
    "Cancels a running pull; its partial files are removed (404 when none runs).",
    reply=PullCancelled,
    errors="ollama",
    refusals=(404,),
)
DELETE = Route(
    "delete",
    "/api/delete",
    "ollama",
    "Delete a pulled model (Ollama)",
    'Removes a pulled model from the store: `{"status": "success"}`; 409 while it is'
    " loaded, 404 when it is not in the store.",
    OllamaStoreRequest,
    reply=StatusSuccess,
    errors="ollama",
    refusals=(404, 409),
)
ROUTES = (
    ROOT,
    ROOT_HEAD,
    CHAT,
    GENERATE,
    EMBED,
    EMBEDDINGS,
    TAGS,
    PS,
    SHOW_MODEL,
    COPY,
    VERSION,
    PULL,
    PULL_STATUS,
    PULL_CANCEL,
    DELETE,
)


def register(app: Quart, ctx: AppContext) -> None:
    pool = ctx.pool
    artifacts = Artifacts(ctx.settings)
    blueprint = Blueprint("ollama", __name__)
    ctx.error_shapes[blueprint.name] = ERRORS
    ctx.path_dialects["/api/"] = blueprint.name  # the runner's /api/status is its own route

    # -- the probe Ollama clients send first -------------------------------------
    @serves(blueprint, ROOT, ROOT_HEAD)
    async def root() -> Response:
        """``GET /`` and ``HEAD /``: "Ollama is running", as Ollama answers."""
        return Response("Ollama is running", content_type="text/plain; charset=utf-8")

    # -- inference ---------------------------------------------------------------
    @serves(blueprint, CHAT)
    async def chat() -> Response:
        """Ollama chat: NDJSON stream by default, ``stream: false`` for one object."""
        opened = await open_model_route(ctx, OllamaChatRequest)
        empty = not opened.body.messages
        return await _chat_or_generate(pool, opened, empty, chat_inference_request, chat_piece)

    @serves(blueprint, GENERATE)
    async def generate() -> Response:
        """Ollama completion of one prompt (with an optional system prompt)."""
        opened = await open_model_route(ctx, OllamaGenerateRequest)
        empty = not opened.body.prompt and not opened.body.images
        return await _chat_or_generate(
            pool, opened, empty, generate_inference_request, generate_piece
        )

    # -- embeddings (the cache headers are read, and mean nothing to an embedding) --
    @serves(blueprint, EMBED)
    async def embed() -> Response:
        """Ollama embeddings of one text or several: ``embeddings``, one list per text."""
        opened = await open_model_route(ctx, OllamaEmbedRequest)
        request = embed_request(opened.body)
        done = await pool.embed(request, tenant=opened.tenant, priority=opened.priority)
        return json_response(embed_body(opened.body.model, done))

    @serves(blueprint, EMBEDDINGS)
    async def embeddings() -> Response:
        """Ollama's older endpoint: one ``prompt``, one ``embedding``."""
        opened = await open_model_route(ctx, OllamaEmbeddingsRequest)
        request = embeddings_request(opened.body)
        done = await pool.embed(request, tenant=opened.tenant, priority=opened.priority)
        return json_response(embeddings_body(done))

    # -- models ------------------------------------------------------------------
    @serves(blueprint, TAGS)
    async def tags() -> Response:
        """Every configured model, Ollama's list format."""
        require(ctx, "inference")
        listed = [tag(s, await artifacts.of(s)) for s in pool.snapshots(adapters=True)]
        return json_response({"models": listed})

    @serves(blueprint, PS)
    async def ps() -> Response:
        """Loaded models with the time their keep-alive runs out."""
        require(ctx, "inference")
        loaded = [
            running(s, await artifacts.of(s))
            for s in pool.snapshots(adapters=True)
            if s.state == "loaded"
        ]
        return json_response({"models": loaded})

    @serves(blueprint, SHOW_MODEL)
    async def show_model() -> Response:
        """A model's definition, details and capabilities."""
        require(ctx, "inference")
        body = await read_body(OllamaModelRequest)
        snapshot = pool.snapshot(body.target)
        artifact = await artifacts.of(snapshot)
        defaults = parameters(ctx.settings.engine.decoding, snapshot.context_length)
        return json_response(show(snapshot, artifact, defaults))

    @serves(blueprint, COPY)
    async def copy() -> Response:
        """Refused: models are named by the settings files (see the package docstring)."""
        require(ctx, "admin")
        body = await read_body(OllamaCopyRequest)
        pool.snapshot(body.source)  # 404 for an unknown source first
        raise PoolError(
            "copy_unsupported",
            f"cannot copy {body.source!r} to {body.destination!r}: models are defined in the"
            " settings files; add an entry for the new name there (or in config/local.json)",
        )

    @serves(blueprint, VERSION)
    async def version() -> Response:
        return json_response({"version": __version__})

    # -- pulls -------------------------------------------------------------------
    @serves(blueprint, PULL)
    async def pull() -> Response:
        """Pull a configured model from its `source`: NDJSON progress unless `stream: false`.

        The pull runs in the background: a client that disconnects stops watching only.
        A stream repeats the pull's state every ``service.pull_heartbeat_s`` while it
        reports nothing (queued, or a stalled download), so that no idle timeout of a
        client or proxy cuts it. Without a stream, a pull that ends other than in
        success is a 400 with its state (the embedded-engine spec's answer).
        """
        require(ctx, "admin")
        body = await read_body(OllamaStoreRequest)
        pool.pull(body.target)
        if not body.stream:
            async with pool.watch_pull(body.target) as events:
                final: dict[str, Any] = {}
                async for event in events:
                    final = event
            status = 200 if final.get("status") == "success" else 400
            return json_response(pull_line(final), status)

        heartbeat_s = ctx.settings.service.pull_heartbeat_s

        async def lines() -> AsyncIterator[bytes]:
            async with pool.watch_pull(body.target, heartbeat_s) as events:
                async for event in events:
                    yield pull_progress(event)

        return streamed_answer(lines(), None, NDJSON)

    @serves(blueprint, PULL_STATUS)
    async def pull_status(model: str) -> Response:
        """The current or last pull of a model."""
        require(ctx, "admin")
        state = pool.pull_status(model)
        if state is None:
            raise PoolError("not_found", f"no pull of {model!r}")
        return json_response(state)

    @serves(blueprint, PULL_CANCEL)
    async def pull_cancel(model: str) -> Response:
        """Cancel a running pull; its partial files are removed."""
        require(ctx, "admin")
        if not await pool.cancel_pull(model):
            raise PoolError("not_found", f"no running pull of {model!r}")
        return json_response({"model": model, "cancelled": True})

    @serves(blueprint, DELETE)
    async def delete() -> Response:
        """Remove a pulled model from the store (409 while it is loaded)."""
        require(ctx, "admin")
        body = await read_body(OllamaStoreRequest)
        if not await pool.delete_pulled(body.target):
            raise PoolError("not_found", f"model {body.target!r} is not in the model store")
        return json_response({"status": "success"})

    app.register_blueprint(blueprint)


# The two bodies that run a generation: the helpers below read only the fields both have
# (model, options, keep_alive, stream).
_Body = TypeVar("_Body", OllamaChatRequest, OllamaGenerateRequest)


async def _chat_or_generate(
    pool: Pool,
    opened: Opened[_Body],
    empty: bool,
    parse: Callable[[_Body], InferenceRequest],
    piece: Piece,
) -> Response:
    """Run a chat or generate request; an ``empty`` one (no messages, no prompt) loads
    the model, or unloads it, as Ollama does.

    The model is looked up first: an unknown one is a 404 whatever else the body says.
    """
    # An adapter's name is served by its base (the one place names resolve).
    actor = pool.serving_model(opened.body.model)
    if empty:
        # The load leaves them unused, but a malformed one is refused as on a request.
        ollama_output_format(opened.body.format)
        chat_tools(getattr(opened.body, "tools", None))
        return await _load_or_unload(pool, opened, actor, piece)
    return await _generation(pool, opened, actor, opened.neutral(parse(opened.body)), piece)


async def _load_or_unload(
    pool: Pool, opened: Opened[_Body], actor: ModelActor, piece: Piece
) -> Response:
    """Ollama's empty request: load the model (with ``num_ctx`` as a load hint), or
    unload it with keep_alive 0.

    The load is the pool's own (``Pool.preload``, then ``Pool.load``): placed by the
    VRAM gate, evicting what the rules allow, else refused with ``load_failed``.
    """
    keep_alive = opened.body.keep_alive
    if keep_alive is not None and parse_keep_alive(keep_alive) == 0:
        await pool.detached(pool.unload, actor.name)
        reason = "unload"
    else:
        hint = load_hint(opened.body.options, actor.definition.backend)
        await pool.detached(pool.preload, actor.name, hint)
        reason = "load"
    return json_response(load_body(opened.body.model, piece, reason))


async def _generation(
    pool: Pool, opened: Opened[_Body], actor: ModelActor, request: InferenceRequest, piece: Piece
) -> Response:
    """Run ``request``: one JSON object with ``stream: false``, else NDJSON lines."""
    hint = load_hint(opened.body.options, actor.definition.backend)
    if not opened.body.stream:
        done = await collected(pool, opened, request, load_hint=hint)
        return json_response(generation_body(opened.body.model, piece, done.finished))
    lines = GenerationLines(opened.body.model, piece)
    admission, chunks = await admitted_stream(
        pool, opened, request, lines, heartbeat_s=HEARTBEAT_S, load_hint=hint
    )
    return streamed_answer(chunks, admission, NDJSON)
