"""Pydantic models of the settings file: ``service``, ``engine`` and the fields every model has.

Each backend's own model class lives in its module under pool/backends and extends
:class:`CommonModelFields`. Every model definition class forbids unknown fields, so a typo
in ``settings.json`` is a startup error that names the field instead of a silently
ignored key.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveInt,
    SerializeAsAny,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pool.config._cluster import ClusterSettings
from pool.config._sampling import defaults_fields

# The prompt formats of pool/backends/prompt_formats.py, one class each (typed by this list).
PromptFormatName = Literal[
    "generic",
    "mistral_template",
    "qwen3_template",
    "gemma4_template",
    "translategemma_template",
    "model_template",
]
Modality = Literal["text", "image"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class TenantLimits(_Strict):
    """Rate limits of one tenant (``X-Tenant-ID``); unset means unlimited."""

    requests_per_minute: Annotated[float, Field(gt=0.0)] | None = None
    tokens_per_minute: Annotated[float, Field(gt=0.0)] | None = Field(
        None, description="Prompt plus output tokens; charged when a request finishes."
    )
    burst: Annotated[int, Field(ge=1)] = Field(
        1, description="Requests allowed at once above the sustained rate."
    )
    preemptible: bool = Field(
        False,
        description="Its generations may be paused for a swap whatever their priority, as"
        ' `low` ones are (engine.preemption; docs/vram.md, "Pause and resume").',
    )


class TenancySettings(_Strict):
    """``service.tenants``: per-tenant limits; ``default`` applies to unnamed tenants."""

    default: TenantLimits = Field(default_factory=TenantLimits)
    tenants: dict[str, TenantLimits] = Field(default_factory=dict)
    max_tenants_tracked: Annotated[int, Field(ge=1)] = Field(
        10_000, description="Rate-limit state kept for at most this many tenants (LRU)."
    )
    multi_tenant: bool = Field(
        True,
        description="Read `X-Tenant-ID` (the runner spec's ENABLE_MULTI_TENANT); false: the"
        " header is ignored and requests are the `default` tenant's, or their key's tenant.",
    )


KeyRole = Literal["inference", "admin"]
PriorityName = Literal["high", "normal", "low"]
# A key's name is part of admin URLs (DELETE /v1/admin/keys/{name}) and log lines.
KEY_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# Printable ASCII without leading or trailing blanks: what an X-Tenant-ID (stripped) can
# carry, so a client of another key can name the same tenant.
TENANT_PATTERN = r"^[!-~]([ -~]{0,126}[!-~])?$"
SHA256_HEX_PATTERN = r"^[0-9a-fA-F]{64}$"


class KeyFields(_Strict):
    """What a key says about its caller (shared by the settings and the admin API)."""

    name: str = Field(pattern=KEY_NAME_PATTERN, description="The key's name (unique).")
    tenant: str | None = Field(
        None,
        pattern=TENANT_PATTERN,
        description="The tenant of its requests; a request naming another one with"
        " `X-Tenant-ID` is refused (403 `tenant_forbidden`). None: `X-Tenant-ID` decides.",
    )
    role: KeyRole = Field(
        "inference", description="`inference`: the inference routes; `admin`: every route."
    )
    priority: PriorityName | None = Field(
        None,
        description="The default and highest priority of its requests (`X-Priority` may"
        " lower it). None: `X-Priority` decides, as without a key.",
    )
    rate_limit_rpm: Annotated[float, Field(gt=0.0, le=1_000_000.0)] | None = Field(
        None,
        description="Requests per minute this key may send (up to that many at once, then"
        " evenly refilled); past it 429 `rate_limit_exceeded`. None: no limit of its own.",
    )
    preemptible: bool = Field(
        False,
        description="Its generations may be paused for a swap whatever their priority, as"
        ' `low` ones are (engine.preemption; docs/vram.md, "Pause and resume").',
    )


class KeySettings(KeyFields):
    """One entry of ``service.auth.keys``: a key with an identity, given in the clear or
    as the SHA-256 of the clear key (so the secret need not sit in the settings)."""

    key: Annotated[str, Field(min_length=1, max_length=4096)] | None = Field(
        None, description="The key in the clear."
    )
    key_sha256: str | None = Field(
        None, pattern=SHA256_HEX_PATTERN, description="SHA-256 of the key, 64 hex digits."
    )

    @model_validator(mode="after")
    def _one_secret(self) -> KeySettings:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError(f"key {self.name!r}: give exactly one of `key` and `key_sha256`")
        if self.key is not None and self.key != self.key.strip():
            raise ValueError(f"key {self.name!r}: `key` has leading or trailing blanks")
        return self


class AuthSettings(_Strict):
    """``service.auth``: bearer tokens and signed operation tokens (all optional).

    Tokens may also come from the environment: ``LLM_POOL_API_TOKENS`` (comma-separated
    inference tokens), ``LLM_POOL_ADMIN_TOKEN`` and ``LLM_POOL_OP_TOKEN_KEY_PATH``.
    """

    inference_tokens: list[str] = Field(
        default_factory=list, description="Bearer tokens accepted on inference routes."
    )
    admin_token: str | None = Field(
        None, description="Bearer token for admin and lifecycle routes (also valid for inference)."
    )
    op_token_key_path: str | None = Field(
        None, description="File with the HMAC key of `verifiedOpToken` (runner lifecycle routes)."
    )
    op_token_window_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        300.0, description="How far an op token's issuedAt may be from now."
    )
    op_token_min_signers: Annotated[int, Field(ge=1)] = Field(
        1, description="Signers an op token must list (M of N)."
    )
    op_token_signers: list[str] | None = Field(
        None, description="If set, only these signers count towards the minimum."
    )
    keys: list[KeySettings] = Field(
        default_factory=list,
        description="Keys with identities (name, tenant, role, priority, rate limit);"
        " more can be added and any revoked at runtime (`/v1/admin/keys`).",
    )

    @field_validator("keys")
    @classmethod
    def _unique_keys(cls, keys: list[KeySettings]) -> list[KeySettings]:
        names = [k.name for k in keys]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"key names must be unique: {', '.join(twice)} given twice")
        return keys


class AudioSettings(_Strict):
    """``service.audio``: the bounds of an upload to the audio routes
    (``/v1/audio/transcriptions``, ``/v1/audio/translations``)."""

    max_bytes: PositiveInt = Field(
        15 * 1024 * 1024,
        description="Largest audio file; larger is 413 `audio_too_large` (the whole body"
        " is bounded by `max_body_bytes` first: raise both for larger files).",
    )
    max_seconds: Annotated[float, Field(gt=0.0, le=86_400.0)] = Field(
        1800.0,
        description="Longest audio, decoded; longer is 400 `audio_too_long` (decoding stops"
        " there, so a small file that expands to hours costs no more).",
    )
    decode_threads: Annotated[int, Field(ge=1, le=64)] = Field(
        2, description="Uploads decoded at once (each on a worker thread, before admission)."
    )


class UsageSettings(_Strict):
    """``service.usage``: the usage database (``usage.sqlite3`` in the state directory).

    Records are written in batches by one writer task, off the request path; when its
    queue is full (a slow disk) records are dropped and counted, never waited for. Batches
    the database refuses (a full disk) are held in memory and retried with backoff.
    """

    enabled: bool = Field(True, description="Record every finished request's usage.")
    retention_days: Annotated[int, Field(ge=1, le=36_500)] = Field(
        90, description="Usage records older than this many days are deleted by the writer."
    )
    queue_size: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        4096, description="Records waiting for the writer; past it new records are dropped."
    )
    batch_size: Annotated[int, Field(ge=1, le=100_000)] = Field(
        256, description="The writer flushes once this many records wait."
    )
    flush_ms: Annotated[float, Field(gt=0.0, le=60_000.0)] = Field(
        500.0, description="The writer flushes a partial batch after this many milliseconds."
    )
    hold_records: Annotated[int, Field(ge=0, le=10_000_000)] = Field(
        50_000,
        description="Records the database refused (a full disk) held in memory and retried"
        " until they are written; past it the oldest are dropped (`hold_full`).",
    )
    metrics_max_tenants: Annotated[int, Field(ge=1, le=10_000)] = Field(
        100,
        description="Distinct tenants labelled in the per-tenant token counters; later"
        ' tenants are counted under `tenant="other"`.',
    )


class BudgetRule(_Strict):
    """One budget: what a key or a tenant may spend per UTC day and/or month, in tokens,
    requests, seconds of audio, characters of speech or seconds of loading caused."""

    key: str | None = Field(None, description="The name of the key the budget binds.")
    tenant: str | None = Field(None, description="The tenant the budget binds.")
    tokens_per_day: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Prompt plus output tokens per UTC day."
    )
    tokens_per_month: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Prompt plus output tokens per UTC calendar month."
    )
    requests_per_day: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="Requests per UTC day: every request that reached a model, whatever"
        " it used (the measure of routes where no tokens apply, such as images).",
    )
    requests_per_month: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Requests per UTC calendar month (as `requests_per_day`)."
    )
    audio_seconds_per_day: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Seconds of audio transcribed per UTC day."
    )
    audio_seconds_per_month: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Seconds of audio transcribed per UTC calendar month."
    )
    characters_per_day: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Characters of text said by speech models per UTC day."
    )
    characters_per_month: Annotated[int, Field(ge=1)] | None = Field(
        None, description="Characters of text said by speech models per UTC calendar month."
    )
    load_seconds_per_day: Annotated[float, Field(gt=0.0)] | None = Field(
        None,
        description="Seconds of model loading its requests may cause per UTC day (each"
        " load a request started: an on-demand model, an evicted one coming back).",
    )

    @model_validator(mode="after")
    def _one_subject_and_a_limit(self) -> BudgetRule:
        if (self.key is None) == (self.tenant is None):
            raise ValueError("a budget names exactly one of key and tenant")
        limits = {
            name: getattr(self, name)
            for name in type(self).model_fields
            if name.endswith(("_per_day", "_per_month"))
        }
        if all(limit is None for limit in limits.values()):
            raise ValueError(f"a budget sets at least one of {', '.join(limits)}")
        return self


class TracingSettings(_Strict):
    """``service.tracing``: OpenTelemetry traces over OTLP/HTTP (docs/operations.md, "Tracing").

    Tracing is on when ``endpoint`` is set here or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``
    / ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set in the environment, and off (no cost) otherwise.
    """

    endpoint: str | None = Field(
        None,
        pattern=r"^https?://",
        description="OTLP/HTTP base URL of the collector (`/v1/traces` is appended, as for"
        " $OTEL_EXPORTER_OTLP_ENDPOINT); unset: the OTEL_* variables decide, else tracing off.",
    )
    service_name: str | None = Field(
        None,
        min_length=1,
        description="`service.name` of the spans (default: $OTEL_SERVICE_NAME, else llm-pool).",
    )
    sample_ratio: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        1.0,
        description="Share of new traces recorded; a request with a `traceparent` follows"
        " its caller's sampling decision.",
    )


class ServiceSettings(_Strict):
    """The ``service`` section: how the HTTP server runs."""

    host: str = Field("127.0.0.1", description="Address to bind; 127.0.0.1 unless you add auth.")
    port: Annotated[int, Field(ge=0, le=65535)] = 8011
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    shutdown_grace_s: NonNegativeFloat = Field(
        10.0, description="How long open streams may run on after a shutdown signal."
    )
    max_body_bytes: PositiveInt = Field(
        16 * 1024 * 1024, description="Largest accepted request body; larger gets 413."
    )
    body_timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        60.0, description="Time a client has to send a request's whole body; slower gets 408."
    )
    keep_alive_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        75.0, description="How long an idle kept-alive HTTP connection stays open."
    )
    listen_backlog: Annotated[int, Field(ge=1, le=65535)] = Field(
        2048,
        description="Connections the kernel queues for the pool before it accepts them; past"
        " that a burst's handshakes are dropped (retried by the client a second later, or"
        " reset). The kernel caps it at net.core.somaxconn.",
    )
    websocket_ping_s: Annotated[float, Field(gt=0.0, le=3600.0)] | None = Field(
        5.0,
        description="The server pings each WebSocket this often, so a socket whose stream is"
        ' paused for a swap (docs/vram.md, "Pause and resume") or otherwise quiet stays'
        " open through proxies and client idle timeouts; null: no pings.",
    )
    pass_through: bool = Field(
        True,
        description="Chat Completions requests to a Chat Completions upstream (llama_server,"
        " vllm_serve, openai_remote, a cluster peer) get the upstream's own bytes with"
        " `model` rewritten when nothing needs the tokens; false renders every reply again.",
    )
    model_store: str | None = Field(None, description="Folder that pulled models are written to.")
    hf_endpoint: str | None = Field(
        None, description="Hugging Face endpoint for pulls (default: $HF_ENDPOINT or the hub)."
    )
    pull_progress_buffer: Annotated[int, Field(ge=1, le=10_000)] = Field(
        16, description="Progress events buffered per pull watcher (a slow one skips some)."
    )
    pull_retries: Annotated[int, Field(ge=0, le=100)] = Field(
        5, description="Resumed attempts after a cut connection before a pull fails."
    )
    pull_concurrency: Annotated[int, Field(ge=1, le=64)] = Field(
        2, description="Pulls that download at once (and worker threads for their file work)."
    )
    pull_timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        30.0, description="A pull's connect (at most 10 s) and read timeout per request."
    )
    pull_heartbeat_s: Annotated[float, Field(gt=0.0, le=3600.0)] = Field(
        30.0,
        description="A streamed /api/pull repeats the pull's state after this long without"
        " progress (queued, or a stalled download), so no idle timeout cuts it.",
    )
    tenancy: TenancySettings = Field(default_factory=TenancySettings)
    auth: AuthSettings = Field(default_factory=AuthSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    runner_id: str | None = Field(None, description="Name in /v1/capabilities; default: host name.")
    metrics: bool = Field(
        True, description="Serve `/metrics` (the runner spec's ENABLE_METRICS); false: 404."
    )
    metrics_port: Annotated[int, Field(ge=1, le=65535)] | None = Field(
        None,
        description="Also serve `/metrics` alone on this port of `host` (the runner spec's"
        " METRICS_PORT), with the same token rule as on the main port.",
    )
    max_load_tasks: Annotated[int, Field(ge=1, le=100_000)] = Field(
        256, description="Finished async load tasks kept for polling."
    )
    stats_window: Annotated[int, Field(ge=16, le=1_000_000)] = Field(
        1024, description="Recent requests per model kept for queue-wait and drain-rate figures."
    )
    health_oom_window_s: Annotated[float, Field(gt=0.0, le=7 * 86400.0)] = Field(
        600.0,
        description="/health reports `degraded` (`gpu_oom`) for this long after a runtime"
        " reported a GPU out of memory.",
    )
    # Issue #19: the Host/Origin allow-list (DNS rebinding) and the image policy.
    allowed_hosts: list[
        # "*", a name or IPv4 address, or a bracketed IPv6 address; an optional port.
        Annotated[str, Field(pattern=r"^(?i)(\*|(\[[0-9a-f:.]+\]|[a-z0-9._-]+)(:[0-9]{1,5})?)$")]
    ] = Field(
        default_factory=list,
        description="Host (and browser Origin) names accepted besides the bound address,"
        ' localhost, 127.0.0.1 and [::1] with the port: `name` (any port) or `name:port`; "*"'
        " accepts any.",
    )
    media_dirs: list[str] = Field(
        default_factory=list,
        description="Folders whose files `file://` image URLs may name (symlinks resolved).",
    )
    media_fetch: bool = Field(
        False, description="Fetch http(s) image URLs (never from non-public addresses)."
    )
    media_max_bytes: Annotated[int, Field(ge=1, le=1 << 30)] = Field(
        10 * 1024 * 1024, description="Largest image (decoded bytes) of any source."
    )
    media_max_images: Annotated[int, Field(ge=0, le=1024)] = Field(
        32, description="Most images one request may carry."
    )
    media_fetch_timeout_s: Annotated[float, Field(gt=0.0, le=600.0)] = Field(
        10.0, description="Time for fetching the http(s) images of one request, redirects included."
    )
    media_max_redirects: Annotated[int, Field(ge=0, le=10)] = Field(
        3, description="Redirects followed per image fetch (each target is checked again)."
    )
    # Issue #33: stored responses of /openai/v1/responses (SQLite in the state dir).
    responses_retention_s: Annotated[float, Field(gt=0.0, le=10 * 365 * 86400.0)] = Field(
        30 * 86400.0,
        description="How long a stored response (`store: true`) is kept; older ones are gone.",
    )
    responses_max_stored: Annotated[int, Field(ge=1, le=10_000_000)] = Field(
        10_000, description="Most stored responses kept, all tenants together; the oldest go."
    )
    # Issue #29: usage records and token budgets (docs/operations.md).
    usage: UsageSettings = Field(default_factory=UsageSettings)
    audio: AudioSettings = Field(default_factory=AudioSettings)
    budgets: list[BudgetRule] = Field(
        default_factory=list,
        description="Token budgets per key or tenant and UTC day/month; past one, 429"
        " `budget_exceeded` until the window resets.",
    )


# Dynamic base: the fields come from the one declaration (pool/config/_sampling.py), so a
# sampling field added there is an ``engine.decoding`` setting with its limits and default.
class DecodingDefaults(
    create_model("DecodingDefaults", __base__=_Strict, **defaults_fields())  # type: ignore[misc]
):
    """``engine.decoding``: defaults for every request field a client may omit."""


# An adapter's name: requested as a model, so spelled as model names are.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@+-]{0,127}$"


class LoraAdapter(_Strict):
    """A LoRA adapter served on a base model under a model name of its own (docs/backends.md,
    "LoRA adapters")."""

    name: str = Field(
        pattern=ADAPTER_NAME_PATTERN,
        description="The model name requests use for the base with this adapter applied;"
        " unique among models and adapters.",
    )
    path: str = Field(
        min_length=1,
        description="The adapter's file (a LoRA GGUF for llama_cpp and llama_server) or"
        " folder (a PEFT adapter for vLLM); relative paths start where model paths do.",
    )
    scale: Annotated[float, Field(ge=-100.0, le=100.0)] = Field(
        1.0, description="How strongly the adapter applies (1: as trained, 0: not at all)."
    )


class CommonModelFields(_Strict):
    """Fields every model definition has, whatever its backend."""

    backend: str
    model_path: str | None = None
    prompt_format: PromptFormatName = "generic"
    enable_thinking: bool | None = None
    enabled: bool = False
    replicas: PositiveInt = 1
    replica_max: PositiveInt | None = Field(
        None, description="Most replicas one load may ask for; defaults to `replicas`."
    )
    target_inflight: PositiveInt = 1
    modalities: list[Modality] = Field(default_factory=lambda: list[Modality](["text"]))
    description: str | None = None
    # Scheduling, on-demand and eviction (DESIGN section 6); None means "engine default".
    max_queue: Annotated[int, Field(ge=0)] | None = None
    queue_timeout_s: Annotated[float, Field(gt=0.0)] | None = None
    on_demand: bool = False
    keep_alive: float | str | None = None
    keep_alive_pinned: bool = False
    source: str | None = None
    pinned: bool = False
    priority: int = Field(
        0,
        description="Eviction rank: a larger number is more important and is evicted later."
        " The coordinator spec counts the other way (a lower number is the higher"
        " priority); the pool keeps its order so existing settings keep their meaning"
        ' (docs/vram.md, "Eviction").',
    )
    stay_warm_s: NonNegativeFloat | None = Field(
        None,
        description="Seconds after the model last served during which it is evicted only when"
        ' no model outside its own window can make the room (docs/vram.md, "Stay warm");'
        " default by kind: 300 for generation models, 900 for vLLM's, 60 for embedding"
        " models, 0 for the stub and remote models. Also a load override.",
    )
    vram_mb: PositiveInt | None = Field(
        None,
        description="MiB of VRAM one replica needs; first in the estimate chain (docs/vram.md).",
    )
    # Output canaries (docs/reliability.md, "Output canaries"); None: engine default.
    canary_interval_s: NonNegativeFloat | None = Field(
        None,
        description="Seconds between output canaries while the model is loaded and idle"
        " (besides one after every load and wake); 0 turns them off. Default"
        " `engine.canary_interval_s`, except 0 for models whose requests leave the machine"
        " (openai_remote).",
    )
    canary_prompt: str | None = Field(
        None,
        min_length=1,
        description="The canary's prompt (greedy, `engine.canary_max_tokens`); default"
        " `engine.canary_prompt`.",
    )
    canary_reference: str | None = Field(
        None,
        min_length=1,
        description="The answer the canary must give (pinned by the operator); default: the"
        " first answer after a load of the model's current definition.",
    )

    lora_adapters: list[LoraAdapter] = Field(
        default_factory=list,
        description="LoRA adapters served on this model, each requested as a model of its"
        " own name (llama_cpp, llama_server, vllm, vllm_serve; other backends refuse them).",
    )
    adapter_group_wait_ms: NonNegativeFloat | None = Field(
        None,
        description="Longest extra wait (ms) the scheduler may give a queued request so that"
        " requests for the adapter a replica has applied run first, where a backend applies"
        " one adapter set at a time (llama_cpp); 0: strict queue order. Default"
        " `engine.adapter_group_wait_ms`.",
    )

    @model_validator(mode="after")
    def _check_replicas(self) -> CommonModelFields:
        if self.replica_max is not None and self.replicas > self.replica_max:
            raise ValueError(
                f"replicas ({self.replicas}) is larger than replica_max ({self.replica_max})"
            )
        if "text" not in self.modalities:
            raise ValueError("modalities must include 'text'")
        names = [adapter.name for adapter in self.lora_adapters]
        if len(set(names)) != len(names):
            raise ValueError("lora_adapters: two adapters have the same name")
        return self

    @property
    def effective_replica_max(self) -> int:
        return self.replica_max if self.replica_max is not None else self.replicas


class UnknownBackendError(ValueError):
    """A ``backend`` name that no registered backend has."""

    def __init__(self, name: object, known: Iterable[str]) -> None:
        self.known = tuple(known)
        super().__init__(f"unknown backend {name!r} (known: {', '.join(self.known)})")


# Any backend's model definition. Each backend module of pool/backends subclasses
# CommonModelFields; which class a settings entry becomes is looked up by its
# ``backend`` name in the backend registry (see :func:`definition_class`).
ModelDefinition = CommonModelFields


_definition_classes: Callable[[object], type[CommonModelFields]] | None = None


def use_definition_classes(lookup: Callable[[object], type[CommonModelFields]]) -> None:
    """Where :func:`definition_class` looks model classes up: the backend registry hands
    its lookup in when it is imported (the backend modules import this package for
    :class:`CommonModelFields`, so this package may not import them)."""
    global _definition_classes
    _definition_classes = lookup


def definition_class(backend: object) -> type[CommonModelFields]:
    """The model definition class of the backend named ``backend``.

    Raises:
        UnknownBackendError: no backend has that name; the message lists the known ones.
        RuntimeError: no backend registry was imported (``import pool`` imports it).
    """
    if _definition_classes is None:
        raise RuntimeError("no backend registry: import pool.backends before reading settings")
    return _definition_classes(backend)


def model_definition(raw: Mapping[str, Any], default_backend: str) -> CommonModelFields:
    """One ``engine.models`` entry as its backend's class (``backend`` defaults to the engine's).

    Raises:
        UnknownBackendError: an unknown backend.
        pydantic.ValidationError: a field its backend does not accept.
    """
    backend = raw.get("backend", default_backend)
    return definition_class(backend).model_validate({**raw, "backend": backend})


def _model_definition(raw: Any, info: ValidationInfo) -> Any:
    if isinstance(raw, Mapping) and isinstance(backend := info.data.get("backend"), str):
        return model_definition(raw, backend)
    return raw


class RerankLimits(_Strict):
    """Bounds of one rerank or score request (``engine.rerank``), checked before it is
    queued so that a large request is a 400 naming the bound, never a runtime's
    out-of-memory error; and how its documents are split into runtime calls."""

    max_documents: Annotated[int, Field(ge=1, le=100_000)] = Field(
        1000,
        description="Most documents (score: pairs) in one request; past it 400"
        " `too_many_documents`.",
    )
    max_document_chars: Annotated[int, Field(ge=1, le=4_000_000)] = Field(
        32_768,
        description="Longest document (and query) in characters; past it 400 `document_too_long`.",
    )
    max_request_chars: Annotated[int, Field(ge=1, le=100_000_000)] = Field(
        2_000_000,
        description="The query's and documents' characters together (the query counted"
        " once per document, as each pair is read so); past it 400 `rerank_too_long`.",
    )
    batch_documents: Annotated[int, Field(ge=1, le=4096)] = Field(
        32,
        description="Most documents the pool hands a runtime in one call; the documents of"
        " a request are evaluated in such batches, one after the other.",
    )
    batch_chars: Annotated[int, Field(ge=1, le=100_000_000)] = Field(
        65_536,
        description="Most characters (query and documents) in one such call, so that a"
        " batch fits the runtime's context and micro-batch; a single longer pair goes"
        " alone.",
    )


class EngineSettings(BaseModel):
    """The ``engine`` section: defaults shared by all models, then the models."""

    model_config = ConfigDict(extra="forbid")

    backend: str = Field("llama_cpp", description="Backend of a model that names none.")
    decoding: DecodingDefaults = Field(default_factory=DecodingDefaults)
    max_queue: Annotated[int, Field(ge=0, le=1_000_000)] = Field(
        64, description="Queued requests per model beyond the running ones."
    )
    queue_timeout_s: Annotated[float, Field(gt=0.0)] = Field(
        300.0, description="Longest time a request waits in a model's queue."
    )
    model_base_path: str | None = Field(
        None,
        description="Folder that relative model files (`model_path`, a projector, a draft"
        " model, a chat template file) and local pull sources start from (the runner"
        " spec's MODEL_BASE_PATH); default: the settings file's folder.",
    )
    max_queue_total: Annotated[int, Field(ge=0, le=1_000_000)] | None = Field(
        None,
        description="Queued requests of all models together (the runner spec's"
        " MAX_QUEUE_DEPTH); past it a request that cannot start at once gets 503"
        " `queue_full`. Null: only each model's `max_queue`.",
    )
    prefix_affinity: bool = Field(
        True,
        description="Send a request to the free replica that was given the longest part of"
        " its prompt in its cache scope (a conversation's next turn finds its prefix"
        " cache), the least loaded among equals; false: least loaded only. It chooses among"
        " free replicas only, so no request waits for it.",
    )
    stream_buffer_tokens: Annotated[int, Field(ge=0, le=4096)] = Field(
        32, description="Text chunks buffered between a running generation and its client."
    )
    command_inbox_size: Annotated[int, Field(ge=1, le=4096)] = Field(
        16, description="Pending load/unload commands per model before callers wait."
    )
    unload_timeout_s: Annotated[float, Field(gt=0.0)] = Field(
        30.0, description="Bound on releasing one replica's resources."
    )
    unload_drain_s: Annotated[float, Field(ge=0.0)] = Field(
        30.0, description="Running requests an unload waits for are cut after this."
    )
    generation_idle_timeout_s: Annotated[float, Field(gt=0.0)] = Field(
        300.0,
        description="Longest wait for a running generation's next token (time the client"
        " takes to read does not count); past it the request fails with `backend_timeout`"
        " and the watchdog recycles the replica (docs/faults.md).",
    )
    keep_alive: float | str = Field(
        300.0, description="Idle time before an on-demand model unloads ('5m'; -1 forever)."
    )
    max_loaded_models: Annotated[int, Field(ge=0)] = Field(
        0,
        description="Most models loaded at once (0: no limit). An on-demand load past it"
        " unloads idle, unpinned models first, or waits for one to become idle.",
    )
    gpu_budget_mib: list[PositiveInt] | None = Field(
        None,
        description="MiB per GPU that models may use (caps each GPU's budget); with no NVIDIA"
        " GPU present it declares that many virtual GPUs (docs/vram.md).",
    )
    virtual_gpus: bool = Field(
        False,
        description="Run on the virtual GPUs of `gpu_budget_mib` even where NVML sees NVIDIA"
        " GPUs: the VRAM policy plans with the budgets alone and runtimes are not pinned to"
        " GPUs (tests that must not depend on the machine, rehearsing a configuration).",
    )
    gpu_reserve_mib: Annotated[int, Field(ge=0)] = Field(
        512, description="MiB kept free on each real GPU for the CUDA context and driver."
    )
    min_resident_s: NonNegativeFloat = Field(
        10.0, description="A model loaded this recently is not evicted (stops thrash)."
    )
    warm_wait_s: NonNegativeFloat = Field(
        30.0,
        description="How long a load that needs room lets busy loaded models serve their"
        " queues first (warm promotion) before the best victim stops taking new requests.",
    )
    preemption: Literal["pause", "drain", "cut"] = Field(
        "pause",
        description="What a load for a request above `low` does when the room it needs is"
        " held by a model that runs only `low` streams: `pause` them (they resume after"
        ' the swap, docs/vram.md "Pause and resume"), `cut` them (they end with'
        " `preempted`), or `drain` (wait for them, asking the model to make way after"
        " `warm_wait_s`).",
    )
    preempt_max_pause_s: Annotated[float, Field(gt=0.0)] = Field(
        120.0,
        description="Longest pause of a paused stream; past it the stream ends with a"
        " `preempted` error event and is charged only what it generated.",
    )
    canary_interval_s: NonNegativeFloat = Field(
        0.0,
        description="Seconds between output canaries of a loaded, idle generation model"
        " (besides one after every load and wake); 0: no canaries. A model's"
        " `canary_interval_s` overrides it; remote models default to 0"
        ' (docs/reliability.md, "Output canaries").',
    )
    canary_prompt: str = Field(
        "What is the capital of France? Answer in one sentence.",
        min_length=1,
        description="The canary's prompt where a model sets none.",
    )
    canary_max_tokens: Annotated[int, Field(ge=1, le=256)] = Field(
        16, description="Tokens a canary asks for (greedy decoding)."
    )
    canary_min_similarity: Annotated[float, Field(ge=0.0, le=1.0)] = Field(
        0.5,
        description="How close a canary's answer must stay to the reference (difflib's"
        " ratio of the two texts, 1 identical); below it the model is degraded.",
    )
    canary_reloads_per_hour: Annotated[int, Field(ge=0, le=100)] = Field(
        3,
        description="Reloads of a degraded model within an hour; past it the model is marked"
        ' failed (`llm_pool_model_canary{status="failed"}`).',
    )
    watchdog_recycles_per_hour: Annotated[int, Field(ge=0, le=100)] = Field(
        3,
        description="Recycles of a model's replicas within an hour when one hangs (no token"
        " within `generation_idle_timeout_s`) or its process exits on its own; past it the"
        " model is marked failed (docs/faults.md).",
    )
    eviction_policy: Literal["swap_cost", "lru"] = Field(
        "swap_cost",
        description="How the pool chooses whom to evict among the idle models it may evict"
        " (lowest priority first either way): `swap_cost` the cheapest to bring back and"
        " least asked for lately, `lru` the least recently used (docs/vram.md).",
    )
    rerank: RerankLimits = Field(
        default_factory=RerankLimits,
        description='Bounds and batching of /v1/rerank and /v1/score (docs/api.md, "Rerank'
        ' and score").',
    )
    cluster: ClusterSettings = Field(
        default_factory=ClusterSettings,
        description="Several pools as one through Redis (docs/cluster.md).",
    )
    adapter_group_wait_ms: NonNegativeFloat = Field(
        250.0,
        description="Default of a model's `adapter_group_wait_ms`: the longest extra wait"
        " grouping requests of one LoRA adapter may add to another request.",
    )
    # Settings files go through build_settings, which reports every bad model at once;
    # the validator serves settings built in code. Each entry dumps as its own class.
    models: dict[
        str, Annotated[SerializeAsAny[ModelDefinition], BeforeValidator(_model_definition)]
    ] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _virtual_gpus_have_budgets(self) -> EngineSettings:
        if self.virtual_gpus and not self.gpu_budget_mib:
            raise ValueError("virtual_gpus needs gpu_budget_mib: one budget per virtual GPU")
        return self

    @model_validator(mode="after")
    def _adapter_names_are_free(self) -> EngineSettings:
        seen: dict[str, str] = {}
        for base, definition in self.models.items():
            for adapter in definition.lora_adapters:
                if adapter.name in self.models:
                    raise ValueError(
                        f"adapter {adapter.name!r} of model {base!r} has the name of a model"
                    )
                if adapter.name in seen:
                    raise ValueError(
                        f"adapter {adapter.name!r} is on both {seen[adapter.name]!r} and {base!r}"
                    )
                seen[adapter.name] = base
        return self

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        try:
            definition_class(value)
        except UnknownBackendError as exc:
            # The error this field gave while it was a Literal of the names.
            *others, last = (repr(name) for name in exc.known)
            expected = f"{', '.join(others)} or {last}"
            raise PydanticCustomError(
                "literal_error", "Input should be {expected}", {"expected": expected}
            ) from None
        return value


class Settings(BaseModel):
    """The merged settings (``settings.json`` with ``local.json`` over it)."""

    model_config = ConfigDict(extra="forbid")

    service: ServiceSettings = Field(default_factory=ServiceSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)
    # Where the files came from, for relative paths and error messages.
    source_files: list[str] = Field(default_factory=list, exclude=True)

    @property
    def base_dir(self) -> str | None:
        """Where relative model paths start: ``engine.model_base_path``, else the folder
        of the settings file."""
        if self.engine.model_base_path:
            return os.path.abspath(os.path.expanduser(self.engine.model_base_path))
        if not self.source_files:
            return None
        return os.path.dirname(os.path.abspath(self.source_files[0]))
