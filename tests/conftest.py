"""Suite-wide isolation: no test writes the pool's learned state into the user's cache."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """What the pool learns across restarts (VRAM footprints, op-token nonces) goes to
    this test's own folder: the stores read it at boot, so one test's state would
    otherwise become another's (and the user's) input."""
    path = tmp_path / "state"
    monkeypatch.setenv("LLM_POOL_STATE_DIR", str(path))
    return path


@pytest.fixture(scope="session")
def llama_server_binary() -> str:
    """The cached llama-server (LLM_POOL_LLAMA_SERVER, which scripts/test exports), else
    built on first use by scripts/build-llama-server (several minutes, once per machine)."""
    if path := os.environ.get("LLM_POOL_LLAMA_SERVER"):
        return path
    result = subprocess.run(
        ["bash", str(Path(__file__).resolve().parents[1] / "scripts" / "build-llama-server")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()
