"""When tracing is on, where it sends, and what it costs a pool that does not trace."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pool import open_pool
from pool.config import TracingSettings, build_settings
from pool.errors import ConfigError
from pool.tracing import INSTALL_HINT, TracingTarget, tracing_target

ROOT = Path(__file__).resolve().parents[2]


def test_off_unless_an_endpoint_is_given() -> None:
    assert tracing_target(TracingSettings(), {}) is None
    assert tracing_target(TracingSettings(), {"OTEL_SERVICE_NAME": "x"}) is None


def test_the_standard_variables_turn_it_on() -> None:
    base = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318/"}
    assert tracing_target(TracingSettings(), base) == TracingTarget(
        "http://collector:4318/v1/traces", "llm-pool", 1.0, "$OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    # The traces-only variable is a whole URL, and wins over the generic one.
    both = {**base, "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://other:4318/custom"}
    target = tracing_target(TracingSettings(), {**both, "OTEL_SERVICE_NAME": "box-7"})
    assert target is not None
    assert (target.traces_url, target.service_name) == ("http://other:4318/custom", "box-7")
    # OTEL_SDK_DISABLED turns every OpenTelemetry SDK off, this one too.
    assert tracing_target(TracingSettings(), {**both, "OTEL_SDK_DISABLED": "true"}) is None


def test_the_setting_wins_over_the_environment() -> None:
    settings = TracingSettings(
        endpoint="http://127.0.0.1:4318", service_name="pool-a", sample_ratio=0.25
    )
    target = tracing_target(settings, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://elsewhere:1"})
    assert target == TracingTarget(
        "http://127.0.0.1:4318/v1/traces", "pool-a", 0.25, "service.tracing.endpoint"
    )


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ConfigError):
        build_settings({"service": {"tracing": {"endpoint": "collector:4318"}}})
    with pytest.raises(ConfigError):
        build_settings({"service": {"tracing": {"sample_ratio": 2}}})


async def test_missing_packages_are_a_config_error_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # As if the `tracing` extra were not installed: the import of the SDK fails (each
    # of its modules that an earlier test imported too: a cached one would be found).
    for name in [n for n in sys.modules if n.startswith("opentelemetry.sdk.")]:
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setitem(sys.modules, "opentelemetry.sdk", None)
    monkeypatch.delitem(sys.modules, "pool.tracing._spans", raising=False)
    settings = build_settings(
        {
            "service": {"tracing": {"endpoint": "http://127.0.0.1:9"}},
            "engine": {"models": {"echo": {"backend": "stub"}}},
        }
    )
    with pytest.raises(ConfigError) as refused:
        async with open_pool(settings, startup_loads=False):
            pass
    (problem,) = refused.value.problems
    assert "service.tracing.endpoint" in problem and INSTALL_HINT in problem


_UNTRACED = textwrap.dedent(
    """
    import sys, trio
    from pool import open_pool
    from pool.actors import InferenceRequest
    from pool.config import build_settings

    async def main():
        echo = {"backend": "stub", "enabled": True}
        settings = build_settings({"engine": {"models": {"echo": echo}}})
        async with open_pool(settings) as pool:
            done = await pool.respond(InferenceRequest.prompt("echo", "one two"))
            assert done.text == "one two", done
            assert pool.parts_for_tests().tracing is None
        traced = ("opentelemetry", "pool.tracing._spans", "pool.tracing._otlp")
        loaded = sorted(m for m in sys.modules if m.startswith(traced))
        print("LOADED", loaded)

    trio.run(main)
    """
)


def test_a_pool_that_does_not_trace_never_imports_opentelemetry(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_EXPORTER_OTLP")}
    # This checkout first (as the suite runs), then whatever the suite's path holds.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["LLM_POOL_STATE_DIR"] = str(tmp_path / "state")
    result = subprocess.run(
        [sys.executable, "-c", _UNTRACED],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "LOADED []" in result.stdout, result.stdout
