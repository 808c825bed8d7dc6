"""Replies are checked against their models where the dicts are built (``renders``):
strictly, with no field the model leaves out, and only in tests, a served pool calling
its renderers as written."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
from pydantic import ValidationError

from pool.schemas import GpuRow, Health, renders

_ROW = {"index": 0, "name": "L4", "used_mib": 1, "total_mib": 2, "used_over_total": "1MiB / 2MiB"}


def test_the_suite_checks_replies_at_their_source() -> None:
    assert os.environ.get("LLM_POOL_CHECK_REPLIES") == "1"

    @renders(GpuRow)
    def row(**changes: Any) -> dict[str, Any]:
        return _ROW | changes

    assert row() == _ROW
    assert row.__reply_model__ is GpuRow  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="used_mib"):
        row(used_mib="1")  # strict: a string where the model says int
    with pytest.raises(AssertionError, match=r"\['spare'\] that GpuRow does not describe"):
        row(spare=True)


def test_a_nested_field_the_model_leaves_out_is_caught() -> None:
    @renders(Health)
    def health() -> dict[str, Any]:
        reason = {"code": "gpu_oom", "model": "m", "gpu": 0, "vendor": "x"}
        return {"status": "degraded", "uptime": 1, "modelsLoaded": 0, "queueDepth": 0} | {
            "reasons": [reason]
        }

    with pytest.raises(AssertionError, match=r"\['vendor'\] that HealthReason"):
        health()


def test_a_served_pool_calls_its_renderers_unwrapped() -> None:
    script = (
        "from pool.schemas import GpuRow, renders\n"
        "def row(): return {}\n"
        "assert renders(GpuRow)(row) is row\n"
        "from pool.http import create_app\n"  # the renderers import cleanly unchecked
    )
    env = {k: v for k, v in os.environ.items() if k != "LLM_POOL_CHECK_REPLIES"}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
