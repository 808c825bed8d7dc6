"""Suite-wide isolation: no test writes the pool's learned state into the user's cache."""

from __future__ import annotations

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
