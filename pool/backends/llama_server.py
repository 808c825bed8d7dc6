"""The ``llama_server`` backend: a managed native ``llama-server`` per replica.

The command line comes from the model's ``llama_server_*`` fields (live overrides
already applied); requests are forwarded to its Chat Completions endpoint and streamed
back token by token. The server's parallel slots are the replica's honest inflight
target. A model whose ``prompt_format`` is ``qwen3_template``, ``mistral_template`` or
``gemma4_template`` gets the pool's own template for that format as
``--chat-template-file`` (:mod:`pool.backends._format_templates`), the same layout as
in-process: the template embedded in SmolLM2-like GGUFs adds a system prompt,
llama-server's built-in ``chatml`` drops tools and past calls, and with ``--jinja`` the
other built-in names are taken as the template's text. The pool's templates show tools,
calls and results in the family's markup, which the server then parses.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import trio
from pydantic import Field, PositiveInt

from pool.backends._embedding import PooledEmbeddingFields
from pool.backends._format_templates import FORMAT_TEMPLATES, format_template_file
from pool.backends._managed import (
    SERVER_SAMPLING,
    AdapterFields,
    ManagedServerRuntime,
    find_binary,
    launch,
)
from pool.backends._placement import GpuPlacement
from pool.backends._process import child_environment, free_port
from pool.backends._protocol import (
    AdapterUse,
    Backend,
    Capabilities,
    GenerationRequest,
    LoadContext,
    LoadOverrides,
    MemoryProfile,
    ModelKind,
    resumes_as_text,
)
from pool.backends._rerank import require_rank_head
from pool.backends._server_cache import SlotCache
from pool.backends._tool_calls import ToolCallFamily, tool_call_family
from pool.backends.llama_cpp import FlashAttn
from pool.backends.prompt_formats import format_tool_family, thinking_modes
from pool.config import CommonModelFields, resolve_model_path
from pool.errors import BackendError


class LlamaServerModel(CommonModelFields, PooledEmbeddingFields):
    """A managed native ``llama-server`` subprocess.

    With ``embedding: true`` it starts with ``--embeddings`` (and ``--pooling``) and
    serves embeddings only; with ``kind: rerank`` it starts with ``--reranking`` (a GGUF
    with a rank head) and serves /v1/rerank and /v1/score only.
    """

    KINDS: ClassVar[tuple[ModelKind, ...]] = ("chat", "embedding", "rerank")

    backend: Literal["llama_server"] = "llama_server"
    llama_server_binary: str = "llama-server"
    llama_server_library_path: list[str] = Field(default_factory=list)
    llama_server_host: str = "127.0.0.1"
    llama_server_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    llama_server_n_ctx: PositiveInt | None = None
    llama_server_n_gpu_layers: int | str | None = None
    llama_server_flash_attn: FlashAttn | None = None
    llama_server_parallel: PositiveInt | None = None
    llama_server_chat_template: str | None = None
    llama_server_chat_template_file: str | None = Field(
        None,
        description="A Jinja chat template file (--chat-template-file), e.g. a tool-capable"
        " template for a model whose own has none; wins over llama_server_chat_template.",
    )
    llama_server_mmproj_path: str | None = None
    llama_server_image_max_tokens: PositiveInt | None = None
    llama_server_draft_model_path: str | None = None
    llama_server_spec_type: str | None = None
    llama_server_spec_draft_n_max: PositiveInt | None = None
    llama_server_spec_draft_p_min: float | None = None
    llama_server_spec_draft_ngl: int | str | None = None
    llama_server_reasoning: str | None = None
    llama_server_api_key: str | None = Field(
        None,
        description="The key the server demands (given in its environment, LLAMA_API_KEY,"
        " not on its command line); the pool sends it as its bearer token. Set it where"
        " other local users must not reach the server's port.",
    )
    llama_server_extra_args: list[str] = Field(default_factory=list)
    tool_call_format: ToolCallFamily | None = Field(
        None,
        description="The model's tool-call markup (hermes, qwen3, mistral, granite), used to"
        " force calls with a grammar; default: picked from the model's file name.",
    )
    llama_server_start_timeout_s: Annotated[float, Field(gt=0.0)] = 120.0


class LlamaServerLoadOverrides(LoadOverrides):
    llama_server_n_ctx: PositiveInt | None = None
    llama_server_image_max_tokens: PositiveInt | None = None
    llama_server_spec_type: str | None = None
    llama_server_spec_draft_n_max: PositiveInt | None = None
    llama_server_spec_draft_p_min: float | None = None


LOAD_CONSTRAINTS: dict[str, dict[str, Any]] = {
    "llama_server_n_ctx": {"kind": "integer", "minimum": 1, "step": 1},
    "llama_server_image_max_tokens": {"kind": "integer", "minimum": 1, "step": 1},
    "llama_server_spec_type": {
        "kind": "enum",
        "default": "draft-mtp",
        "allowed_values": ["draft-mtp"],
        "examples": ["draft-mtp"],
    },
    "llama_server_spec_draft_n_max": {
        "kind": "integer",
        "minimum": 1,
        "maximum": 6,
        "step": 1,
        "default": 2,
    },
    "llama_server_spec_draft_p_min": {
        "kind": "float",
        "minimum": 0.0,
        "maximum": 1.0,
        "default": 0.0,
    },
}


def uses_format_template(definition: LlamaServerModel) -> bool:
    """Whether the server renders with the pool's template for the model's prompt format
    (no template of the model's own configured)."""
    return (
        definition.prompt_format in FORMAT_TEMPLATES
        and not definition.llama_server_chat_template
        and not definition.llama_server_chat_template_file
    )


def tool_family(definition: LlamaServerModel, model_file: str) -> ToolCallFamily:
    """The markup forced calls are written in: the pool's template's, else configured,
    else known by the file's name."""
    if uses_format_template(definition):
        family = format_tool_family(definition.prompt_format)
        if family is not None:
            return family
    return definition.tool_call_format or tool_call_family(model_file)


def slots(definition: LlamaServerModel) -> int:
    return definition.llama_server_parallel or definition.target_inflight


def command_line(
    definition: LlamaServerModel,
    binary: str,
    model_path: str,
    port: int,
    base_dir: str | None = None,
    placement: GpuPlacement | None = None,
) -> list[str]:
    """The ``llama-server`` arguments for ``definition``.

    A replica the pool split over GPUs gets ``--tensor-split`` in the placement's
    proportions (the devices are numbered within its ``CUDA_VISIBLE_DEVICES``), unless
    the extra arguments set their own.
    """
    d = definition
    args = [
        binary,
        "-m",
        model_path,
        "--host",
        d.llama_server_host,
        "--port",
        str(port),
        "--parallel",
        str(slots(d)),
        "--no-webui",
        # Jinja templates render tools and let the server parse tool calls (and apply
        # its grammar when a call is forced); the default of recent builds, said aloud.
        "--jinja",
    ]

    def add(flag: str, value: object) -> None:
        if value is not None:
            args.extend([flag, str(value)])

    add("-c", d.llama_server_n_ctx)
    add("-ngl", d.llama_server_n_gpu_layers)
    add("-fa", d.llama_server_flash_attn)
    if d.llama_server_chat_template_file:
        add("--chat-template-file", resolve_model_path(d.llama_server_chat_template_file, base_dir))
    elif uses_format_template(d):
        add("--chat-template-file", format_template_file(d.prompt_format))
    else:
        add("--chat-template", d.llama_server_chat_template)
    if d.llama_server_mmproj_path:
        add("--mmproj", resolve_model_path(d.llama_server_mmproj_path, base_dir))
    add("--image-max-tokens", d.llama_server_image_max_tokens)
    if d.llama_server_draft_model_path:
        add("-md", resolve_model_path(d.llama_server_draft_model_path, base_dir))
    add("--spec-type", d.llama_server_spec_type)
    add("--spec-draft-n-max", d.llama_server_spec_draft_n_max)
    add("--spec-draft-p-min", d.llama_server_spec_draft_p_min)
    add("--spec-draft-ngl", d.llama_server_spec_draft_ngl)
    add("--reasoning-format", d.llama_server_reasoning)
    if d.kind == "rerank":
        # Rank pooling over the GGUF's rank head; the server then answers /v1/rerank.
        args.append("--reranking")
    elif d.embedding:
        args.append("--embeddings")
        add("--pooling", d.pooling)
    # A pooled text (a reranked pair) must fit in one micro-batch (512 tokens by
    # default): as large as the context, so any text the context takes is read.
    own_ubatch = {"-ub", "--ubatch-size"} & set(d.llama_server_extra_args)
    if d.kind in ("embedding", "rerank") and d.llama_server_n_ctx and not own_ubatch:
        add("-b", d.llama_server_n_ctx)
        add("-ub", d.llama_server_n_ctx)
    for adapter in d.lora_adapters:
        # Repeated --lora keeps the order: adapter i is the `id` i of a request's `lora`.
        add("--lora", resolve_model_path(adapter.path, base_dir))
    if d.lora_adapters:
        # Loaded at scale 0: a request without `lora` gets the base model alone, and one
        # with it gets its own adapter and scale (adapter_fields).
        args.append("--lora-init-without-apply")
    own_split = {"-ts", "--tensor-split"} & set(d.llama_server_extra_args)
    # Virtual GPUs have no devices to split over: only the environment names them.
    split = placement is not None and len(placement.gpus) > 1 and not placement.virtual
    if placement is not None and split and not own_split:
        add("--tensor-split", ",".join(f"{share:.4f}" for share in placement.split))
    args.extend(d.llama_server_extra_args)
    # Prefix caching under the pool's control (pool/backends/_server_cache.py): no RAM
    # prompt cache shared by every slot (it would match across tenants), and a slot
    # save path, without which llama-server refuses the slot erase of a flush.
    if "--cache-ram" not in args and "-cram" not in args:
        args.extend(["--cache-ram", "0"])
    if "--slot-save-path" not in args:
        args.extend(["--slot-save-path", slot_save_dir()])
    return args


def slot_save_dir() -> str:
    """A private directory for ``--slot-save-path`` (the pool never saves slots to it)."""
    path = Path(tempfile.gettempdir()) / f"llm-pool-slots-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    return str(path)


class LlamaServerBackend(Backend[LlamaServerModel]):
    config = LlamaServerModel
    load_overrides = LlamaServerLoadOverrides
    load_constraints = LOAD_CONSTRAINTS
    context_field = "llama_server_n_ctx"
    # llama.cpp pads its context to a multiple of 256 (llama_context: n_ctx_pad).
    context_padding = 256
    # Adapters are loaded as the server starts (--lora); one added later needs a reload.
    adapter_support = "preloaded"
    # Through /v1/completions with token ids (ManagedServerRuntime._resume).
    resumes_through_prompt = True

    def resumes(self, request: GenerationRequest) -> bool:
        return resumes_as_text(request)

    def memory_profile(self, definition: LlamaServerModel) -> MemoryProfile:
        # llama-server's -c is the whole context, shared by its parallel slots.
        return MemoryProfile(
            context=definition.llama_server_n_ctx,
            parallel=slots(definition),
            gpu_layers=definition.llama_server_n_gpu_layers,
        )

    def capabilities(self, definition: LlamaServerModel) -> Capabilities:
        images = "image" in definition.modalities and bool(definition.llama_server_mmproj_path)
        return Capabilities(
            modalities=("text", "image") if images else ("text",),
            multi_turn=True,
            # Sent as chat_template_kwargs.enable_thinking, which only some templates
            # read: offered where the prompt format's does (the pool's own template for
            # qwen3/gemma4; otherwise the family the format names).
            thinking_modes=thinking_modes(definition.prompt_format),
            sampling=SERVER_SAMPLING,
            kind=definition.kind,
            # llama-server has no `dimensions`: a request setting it is a 400.
            # Passed in OpenAI's fields; --jinja renders tools with the model's template
            # (the pool's for a built-in format: refused where it has no tool markup).
            tools=definition.kind == "chat"
            and (
                not uses_format_template(definition)
                or format_tool_family(definition.prompt_format) is not None
            ),
            structured_output=definition.kind == "chat",
            relays_chat=definition.kind == "chat",
        )

    def effective_target_inflight(self, definition: LlamaServerModel) -> int:
        # Each request needs one of the server's parallel slots; more would only queue
        # inside llama-server, out of the scheduler's sight.
        return slots(definition)

    def check_load_override(self, patch: Mapping[str, Any]) -> None:
        # null turns speculative decoding off, though the table lists only the enum.
        super().check_load_override(
            {k: v for k, v in patch.items() if not (k == "llama_server_spec_type" and v is None)}
        )

    async def load(
        self, definition: LlamaServerModel, context: LoadContext
    ) -> ManagedServerRuntime:
        model_path = context.model_path(definition.model_path)
        if not await trio.to_thread.run_sync(model_path.is_file):
            raise BackendError(f"model file {model_path} does not exist")
        if definition.kind == "rerank":
            await trio.to_thread.run_sync(require_rank_head, model_path)
        binary = await find_binary(definition.llama_server_binary, "llama-server")
        port = definition.llama_server_port or free_port(definition.llama_server_host)
        return await launch(
            f"model={context.model_name} llama-server[{context.replica_index}]",
            command_line(
                definition, binary, str(model_path), port, context.settings_dir, context.placement
            ),
            child_environment(
                # The key goes in the environment: a command line is any user's to read.
                {"LLAMA_API_KEY": key} if (key := definition.llama_server_api_key) else None,
                library_path=definition.llama_server_library_path,
                placement=context.placement,
            ),
            host=definition.llama_server_host,
            port=port,
            served_model=context.model_name,
            # Public even with an API key: readiness needs none.
            health_path="/health",
            api_key=definition.llama_server_api_key,
            # Each streamed chunk then carries `timings` (prompt_n, cache_n, predicted_n).
            counting_fields={"timings_per_token": True},
            start_timeout_s=definition.llama_server_start_timeout_s,
            request_timeout_s=max(definition.llama_server_start_timeout_s, 600.0),
            enable_thinking=definition.enable_thinking,
            embedding_batch=definition.embedding_batch_size if definition.embedding else None,
            rerank_path="/v1/rerank" if definition.kind == "rerank" else None,
            grammar_calls=tool_family(definition, model_path.name),
            cache=SlotCache(slots(definition)),
            adapter_fields=adapter_fields(definition),
            # Paused streams resume through the prompt (docs/vram.md, "Pause and resume").
            prompt_tokenizer="llama_server",
        )


def adapter_fields(definition: LlamaServerModel) -> AdapterFields | None:
    """The per-request ``lora`` field over the adapters the server was started with."""
    ids = {adapter.name: index for index, adapter in enumerate(definition.lora_adapters)}
    if not ids:
        return None

    def fields(use: AdapterUse | None) -> dict[str, Any]:
        if use is not None and use.name not in ids:
            raise BackendError(f"LoRA adapter {use.name!r} was not loaded with this server")
        # Every adapter named: the request's at its scale, the others (all, for the
        # base) at 0.
        return {
            "lora": [
                {"id": i, "scale": use.scale if use is not None and name == use.name else 0.0}
                for name, i in ids.items()
            ]
        }

    return fields


BACKEND = LlamaServerBackend()
