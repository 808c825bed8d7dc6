"""scripts/install-debian-packages: the Debian packages the tests drive, only when missing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASH = shutil.which("bash") or "/bin/bash"


def _run(bin_dir: Path) -> tuple[str, list[str]]:
    """Run the script with only ``bin_dir`` on PATH; its output and the apt-get calls."""
    log = bin_dir / "apt-get.calls"
    (bin_dir / "apt-get").write_text(f'#!{BASH}\necho "$@" >> {log}\n')
    (bin_dir / "apt-get").chmod(0o755)
    for tool in ("id", "env"):  # what the script needs besides bash builtins
        found = shutil.which(tool)
        assert found is not None
        (bin_dir / tool).symlink_to(found)
    ran = subprocess.run(
        [BASH, str(ROOT / "scripts/install-debian-packages"), "redis-server", "chromium"],
        env={**os.environ, "PATH": str(bin_dir)},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert ran.returncode == 0, ran.stderr
    return ran.stdout, log.read_text().splitlines() if log.exists() else []


def _present(bin_dir: Path, command: str) -> None:
    (bin_dir / command).write_text("#!/bin/sh\n")
    (bin_dir / command).chmod(0o755)


def test_missing_packages_are_installed_with_apt_get(tmp_path: Path) -> None:
    out, calls = _run(tmp_path)
    if os.geteuid() == 0:
        assert calls == ["update -qq", "install -y -qq redis-server chromium"]
        assert out == "installing redis-server chromium (apt-get)\n"
    else:  # no root and (here) no sudo: it says so; the tests that need them decide
        assert calls == [] and "needs root" in out


def test_only_the_missing_one_is_installed(tmp_path: Path) -> None:
    _present(tmp_path, "chromium")
    out, calls = _run(tmp_path)
    if os.geteuid() == 0:
        assert calls == ["update -qq", "install -y -qq redis-server"]
    else:
        assert calls == [] and out.startswith("redis-server missing")


def test_present_packages_cost_nothing(tmp_path: Path) -> None:
    _present(tmp_path, "chromium")
    _present(tmp_path, "redis-server")
    out, calls = _run(tmp_path)
    assert (out, calls) == ("", [])
