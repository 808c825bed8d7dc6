"""Whether the pool traces, and where to: ``service.tracing`` and the standard OTEL_* variables.

Nothing here imports OpenTelemetry: a pool that does not trace never loads it (the
packages are the optional ``tracing`` extra). :func:`open_tracing` imports it only
once tracing is asked for, and says at startup which setting asked when it is missing.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from pool.config import TracingSettings
from pool.errors import ConfigError
from pool.tracing._target import TracingTarget

if TYPE_CHECKING:
    from pool.actors import Tracing

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACES_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"
DISABLED_ENV = "OTEL_SDK_DISABLED"
DEFAULT_SERVICE_NAME = "llm-pool"
INSTALL_HINT = "pip install 'llm-pool[tracing]'"


def _traces_url(base: str) -> str:
    # As the OTLP exporter specification says for the generic endpoint variable: the
    # signal's path is appended to the base URL (a traces-specific URL is used as is).
    return base.rstrip("/") + "/v1/traces"


def tracing_target(
    settings: TracingSettings, environ: Mapping[str, str] = os.environ
) -> TracingTarget | None:
    """The target of ``settings`` and ``environ``; None where tracing is off.

    ``service.tracing.endpoint`` wins over the environment; then
    ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` (the whole URL), then
    ``OTEL_EXPORTER_OTLP_ENDPOINT`` (a base URL). ``OTEL_SDK_DISABLED=true`` turns
    tracing off whatever asks for it, as it does for every OpenTelemetry SDK.
    """
    if environ.get(DISABLED_ENV, "").strip().lower() == "true":
        return None
    if settings.endpoint:
        url, asked_by = _traces_url(settings.endpoint), "service.tracing.endpoint"
    elif environ.get(TRACES_ENDPOINT_ENV, "").strip():
        url, asked_by = environ[TRACES_ENDPOINT_ENV].strip(), f"${TRACES_ENDPOINT_ENV}"
    elif environ.get(ENDPOINT_ENV, "").strip():
        url, asked_by = _traces_url(environ[ENDPOINT_ENV].strip()), f"${ENDPOINT_ENV}"
    else:
        return None
    name = settings.service_name or environ.get(SERVICE_NAME_ENV, "").strip()
    return TracingTarget(url, name or DEFAULT_SERVICE_NAME, settings.sample_ratio, asked_by)


def open_tracing(
    settings: TracingSettings, environ: Mapping[str, str] = os.environ
) -> Tracing | None:
    """The pool's :class:`Tracing` where tracing is on, else None (and nothing imported).

    Raises:
        ConfigError: tracing is asked for, but the OpenTelemetry packages are missing.
    """
    target = tracing_target(settings, environ)
    if target is None:
        return None
    try:
        from pool.tracing._spans import OtelTracing
    except ImportError as exc:
        raise ConfigError(
            [
                f"{target.asked_by} turns tracing on, but the OpenTelemetry packages are not"
                f" installed ({exc.name or exc}): {INSTALL_HINT}, or unset {target.asked_by}"
            ]
        ) from exc
    return OtelTracing(target)
