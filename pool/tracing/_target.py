"""Where the pool's spans go, as the settings and the OTEL_* variables decided."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TracingTarget:
    """Where spans go: the OTLP/HTTP traces URL, the service name, the sampling ratio."""

    traces_url: str
    service_name: str
    sample_ratio: float
    # Which setting turned tracing on, to name it in errors.
    asked_by: str
