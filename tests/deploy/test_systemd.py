"""deploy/systemd: the install helper against a temporary home, the unit, the health check."""

from __future__ import annotations

import os
import shutil
import socket
import stat
import subprocess
import sys
from pathlib import Path

import trio

from tests.components import missing
from tests.http.conftest import start_server

ROOT = Path(__file__).resolve().parents[2]
INSTALL = ROOT / "deploy/systemd/install.sh"
HEALTHCHECK = ROOT / "deploy/systemd/healthcheck.py"


def _install(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XDG_")}
    env["HOME"] = str(home)
    return subprocess.run(
        ["bash", str(INSTALL), "--no-pip", "--no-start", *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )


def _unit_lines(unit: Path) -> dict[str, str]:
    return dict(
        line.split("=", 1)
        for line in unit.read_text().splitlines()
        if "=" in line and line[0] != "#"
    )


def test_install_into_a_home_then_uninstall(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    done = _install(home)
    assert done.returncode == 0, done.stderr
    venv = home / ".local/share/llm-pool/venv"
    unit = home / ".config/systemd/user/llm-pool.service"
    env_file = home / ".config/llm-pool/llm-pool.env"
    settings = home / ".config/llm-pool/settings.json"
    assert (venv / "bin/python").exists()
    assert settings.read_text() == (ROOT / "config/settings.json").read_text()
    assert stat.S_IMODE(env_file.stat().st_mode) == 0o600
    lines = _unit_lines(unit)
    assert lines["ExecStart"] == f"{venv}/bin/llm-pool serve --settings {settings}"
    assert lines["EnvironmentFile"] == f"-{env_file}"
    assert f"{home}/.local/share/llm-pool/bin/llm-pool-healthcheck" in lines["ExecStartPost"]
    assert "@" not in unit.read_text()
    # Again (an upgrade): the operator's environment file is kept.
    env_file.write_text("LOG_FORMAT=json\n")
    assert _install(home).returncode == 0
    assert env_file.read_text() == "LOG_FORMAT=json\n"
    # Uninstall keeps the settings; --purge removes them.
    assert _install(home, "--uninstall").returncode == 0
    assert not unit.exists() and not venv.exists() and settings.exists()
    assert _install(home, "--uninstall", "--purge").returncode == 0
    assert not settings.exists() and not env_file.exists()


def test_install_respects_prefix(tmp_path: Path) -> None:
    done = _install(tmp_path, "--prefix", str(tmp_path / "opt/pool"))
    assert done.returncode == 0, done.stderr
    lines = _unit_lines(tmp_path / ".config/systemd/user/llm-pool.service")
    assert lines["ExecStart"].startswith(f"{tmp_path}/opt/pool/venv/bin/llm-pool serve")
    assert (tmp_path / "opt/pool/bin/llm-pool-healthcheck").exists()


def test_systemd_analyze_verifies_the_unit(tmp_path: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        missing("systemd-analyze", "Debian's systemd package; scripts/test installs it")
    assert _install(tmp_path).returncode == 0
    # --no-pip left no entry point; verify checks that ExecStart is an executable.
    entry = tmp_path / ".local/share/llm-pool/venv/bin/llm-pool"
    entry.write_text("#!/bin/sh\n")
    entry.chmod(0o755)
    unit = tmp_path / ".config/systemd/user/llm-pool.service"
    verify = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert verify.returncode == 0, verify.stderr
    # The check bites: a unit whose ExecStart is missing fails it.
    entry.unlink()
    broken = subprocess.run(
        ["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60
    )
    assert broken.returncode != 0


async def test_healthcheck_against_a_pool(nursery: trio.Nursery) -> None:
    info = await start_server(nursery)
    ok = await trio.run_process(
        [sys.executable, str(HEALTHCHECK), "--url", info.url], capture_stdout=True, check=False
    )
    assert ok.returncode == 0 and b"is healthy" in ok.stdout
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    down = await trio.run_process(
        [sys.executable, str(HEALTHCHECK), "--url", f"http://127.0.0.1:{port}"],
        capture_stderr=True,
        check=False,
    )
    assert down.returncode == 1 and b"not healthy" in down.stderr
