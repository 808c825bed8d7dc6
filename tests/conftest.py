"""Suite-wide isolation: no test writes the pool's learned state into the user's cache."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def private_footprints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Measured VRAM footprints go to this test's own file (the store reads it at boot,
    so one test's measurement would otherwise become another's estimate)."""
    path = tmp_path / "vram-footprints.json"
    monkeypatch.setenv("LLM_POOL_FOOTPRINTS_PATH", str(path))
    return path
