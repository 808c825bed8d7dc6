"""scripts/serve: the README's run command, which syncs its own environment with uv.lock."""

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
    assert ran.stdout.splitlines() == [
        "would run: scripts/sync-env serve llama-cpp",
        f"would run: {tmp_path}/env-serve-py{VERSION}/bin/python -m pool serve --port 9",
    ]
    assert list(tmp_path.iterdir()) == []


def test_it_serves_from_the_environment_sync_env_made(tmp_path: Path) -> None:
    # scripts/sync-env's own behaviour is tested in test_sync_env.py; here a stand-in
    # sync-env (scripts/ copied beside a stand-in) shows serve runs the Python it prints.
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    (tree / "scripts/serve").write_text((ROOT / "scripts/serve").read_text())
    log = tmp_path / "calls"
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    python.chmod(0o755)
    (tree / "scripts/sync-env").write_text(f'#!/bin/sh\necho "sync $*" >> {log}\necho {python}\n')
    env = {**os.environ, "LLM_POOL_CACHE_DIR": str(tmp_path), "PYTHON": sys.executable}
    ran = subprocess.run(
        ["bash", str(tree / "scripts/serve"), "--port", "9"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    assert log.read_text().splitlines() == ["sync serve llama-cpp", "-m pool serve --port 9"]
