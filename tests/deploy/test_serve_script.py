"""scripts/serve: the README's run command, which makes its own virtual environment."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _serve(cache: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LLM_POOL_CACHE_DIR": str(cache), "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(ROOT / "scripts/serve"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_dry_run_on_a_fresh_machine(tmp_path: Path) -> None:
    ran = _serve(tmp_path, "--dry-run", "--port", "9")
    assert ran.returncode == 0, ran.stderr
    venv = tmp_path / f"venv-py{VERSION}"
    assert ran.stdout.splitlines() == [
        f"would run: {sys.executable} -m venv {venv}",
        f"would run: {venv}/bin/python -m pip install --quiet --disable-pip-version-check "
        "-e .[llama-cpp]",
        f"would run: {venv}/bin/python -m pool serve --port 9",
    ]
    assert not venv.exists()


def test_an_existing_venv_is_installed_into_then_serves(tmp_path: Path) -> None:
    # A stand-in interpreter that logs its arguments; `-c` (the "installed?" check) fails.
    log = tmp_path / "calls"
    python = tmp_path / f"venv-py{VERSION}/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\necho "$@" >> {log}\n[ "$1" = "-c" ] && exit 1\nexit 0\n')
    python.chmod(0o755)
    ran = _serve(tmp_path, "--port", "9")
    assert ran.returncode == 0, ran.stderr
    calls = log.read_text().splitlines()
    # Has pip (so it is not made again), is not installed yet: install, then start.
    assert calls[0] == "-m pip --version" and calls[1].startswith("-c ")
    assert [line for line in calls[2:] if line.startswith("-m ")] == [
        "-m pip install --quiet --disable-pip-version-check -e .[llama-cpp]",
        "-m pool serve --port 9",
    ]


def test_a_venv_without_pip_is_made_again(tmp_path: Path) -> None:
    # What `python3 -m venv` leaves on Debian when python3-venv (ensurepip) is missing:
    # an interpreter without pip. Once the package is installed, the next run repairs it.
    python = tmp_path / f"venv-py{VERSION}/bin/python"
    python.parent.mkdir(parents=True)
    python.write_text('#!/bin/sh\n[ "$2" = pip ] && exit 1\nexit 0\n')
    python.chmod(0o755)
    ran = _serve(tmp_path, "--dry-run")
    assert ran.returncode == 0, ran.stderr
    venv = python.parent.parent
    assert ran.stdout.splitlines()[0] == f"would run: {sys.executable} -m venv {venv}"
