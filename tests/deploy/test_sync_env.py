"""scripts/sync-env: an environment holds exactly what the lock says, both ways.

A throwaway project beside a copy of the script, whose dependencies are wheels made here
(so nothing is fetched), locked with the same pinned uv the real environments use.
The last tests run scripts/test and scripts/serve on such a project whose lock takes a
wheel from a local folder (as uv.lock takes torch from /opt/wheels), then take the folder
away: a contributor's machine, which never had it.
"""

from __future__ import annotations

import base64
import hashlib
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.components import missing

ROOT = Path(__file__).resolve().parents[2]
UV_VERSION = next(
    line.split("=", 1)[1]
    for line in (ROOT / "scripts/sync-env").read_text().splitlines()
    if line.startswith("UV_VERSION=")
)
VERSION = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _wheel(folder: Path, name: str, source: str = "VALUE = 1\n") -> Path:
    """A minimal pure-Python wheel holding module ``name`` (``source``)."""
    path = folder / f"{name}-1.0-py3-none-any.whl"
    files = {
        f"{name}.py": source,
        f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
        f"{name}-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [
        f"{file},sha256="
        + base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        + f",{len(text.encode())}"
        for file, text in files.items()
    ]
    record.append(f"{name}-1.0.dist-info/RECORD,,")
    with zipfile.ZipFile(path, "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)
        archive.writestr(f"{name}-1.0.dist-info/RECORD", "\n".join(record) + "\n")
    return path


PYPROJECT = """\
[project]
name = "demo"
version = "0"
requires-python = ">=3.11"
dependencies = [{dependencies}]

[project.optional-dependencies]
extra = ["beta"]

[tool.uv]
package = false

[tool.uv.sources]
alpha = {{ path = "wheels/alpha-1.0-py3-none-any.whl" }}
beta = {{ path = "wheels/beta-1.0-py3-none-any.whl" }}
gamma = {{ path = "wheels/gamma-1.0-py3-none-any.whl" }}
"""


def _pinned_uv() -> Path:
    real_cache = Path(os.environ.get("LLM_POOL_CACHE_DIR", Path.home() / ".cache/llm-pool"))
    uv_home = real_cache / f"uv-{UV_VERSION}"
    if not (uv_home / "bin/uv").exists():
        missing(f"uv {UV_VERSION}", "scripts/sync-env installs it; scripts/test runs that")
    return uv_home


def _locked(tree: Path, cache: Path) -> dict[str, str]:
    """Lock ``tree`` with the pinned uv; the environment that runs its scripts offline."""
    uv_home = _pinned_uv()
    cache.mkdir()
    (cache / f"uv-{UV_VERSION}").symlink_to(uv_home)  # the pinned uv, not a new install
    env = {**os.environ, "LLM_POOL_CACHE_DIR": str(cache), "PYTHON": sys.executable,
           "UV_OFFLINE": "1"}  # fmt: skip
    locked = subprocess.run(
        [str(uv_home / "bin/uv"), "lock", "--python", sys.executable],
        cwd=tree, env={**env, "UV_CACHE_DIR": str(cache / "uv-cache")},
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert locked.returncode == 0, locked.stderr
    return env


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    (tree / "scripts/sync-env").write_text((ROOT / "scripts/sync-env").read_text())
    (tree / "wheels").mkdir()
    for name in ("alpha", "beta", "gamma"):
        _wheel(tree / "wheels", name)
    (tree / "pyproject.toml").write_text(PYPROJECT.format(dependencies='"alpha"'))
    return tree, _locked(tree, tmp_path / "cache")


def _sync(tree: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(tree / "scripts/sync-env"), "serve", "extra"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip


def _installed(python: str) -> set[str]:
    listed = subprocess.run(
        [python, "-c", "import importlib.metadata as m; "
         "print(*sorted(d.metadata['Name'] for d in m.distributions()))"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return set(listed.stdout.split())


def _uv_pip(tree: Path, env: dict[str, str], python: str, *args: str) -> None:
    uv = Path(env["LLM_POOL_CACHE_DIR"]) / f"uv-{UV_VERSION}/bin/uv"
    subprocess.run(
        [str(uv), "pip", *args, "--python", python],
        cwd=tree, env={**env, "UV_CACHE_DIR": env["LLM_POOL_CACHE_DIR"] + "/uv-cache"},
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip


def test_the_environment_holds_exactly_the_lock(project: tuple[Path, dict[str, str]]) -> None:
    tree, env = project
    first = _sync(tree, env)
    assert first.returncode == 0, first.stderr
    python = first.stdout.strip()
    assert python == f"{env['LLM_POOL_CACHE_DIR']}/env-serve-py{VERSION}/bin/python"
    assert {"alpha", "beta"} <= _installed(python) and "gamma" not in _installed(python)

    # By hand: one package more, one locked dependency less.
    _uv_pip(tree, env, python, "install", str(tree / "wheels/gamma-1.0-py3-none-any.whl"))
    _uv_pip(tree, env, python, "uninstall", "alpha")
    assert "gamma" in _installed(python) and "alpha" not in _installed(python)

    again = _sync(tree, env)
    assert again.returncode == 0, again.stderr
    assert {"alpha", "beta"} <= _installed(python) and "gamma" not in _installed(python)


def test_a_lock_behind_the_project_stops_the_run(project: tuple[Path, dict[str, str]]) -> None:
    tree, env = project
    (tree / "pyproject.toml").write_text(PYPROJECT.format(dependencies='"alpha", "gamma"'))
    ran = _sync(tree, env)
    assert ran.returncode == 1
    assert "needs to be updated" in ran.stderr  # uv's own words for a stale lock
    assert "uv.lock failed" in ran.stderr and "uv lock" in ran.stderr  # and how to refresh it


# The test and serve commands on a machine without the lock's local wheel folder.

WHEEL_FOLDER_PYPROJECT = """\
[project]
name = "demo"
version = "0"
requires-python = ">=3.11"
dependencies = ["pool"]

[project.optional-dependencies]
llama-cpp = ["beta"]
convert = ["delta"]  # as the real convert extra takes torch from /opt/wheels
test = ["beta"]
ct2 = ["beta"]
cluster = ["beta"]
whisper = ["beta"]
speech = ["beta"]

[tool.uv]
package = false
find-links = ["{links}"]

[tool.uv.sources]
pool = {{ path = "wheels/pool-1.0-py3-none-any.whl" }}
beta = {{ path = "wheels/beta-1.0-py3-none-any.whl" }}
"""


@pytest.fixture
def without_the_folder(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The real scripts on a project locked with a wheel folder, which is then removed."""
    tree = tmp_path / "tree"
    (tree / "scripts").mkdir(parents=True)
    for script in ("sync-env", "test", "serve"):
        (tree / "scripts" / script).write_text((ROOT / "scripts" / script).read_text())
    (tree / "wheels").mkdir()
    # `python -m pool serve ...` in the synced environment says what it was asked.
    _wheel(tree / "wheels", "pool", "import sys\nprint('served', *sys.argv[1:])\n")
    _wheel(tree / "wheels", "beta")
    links = tmp_path / "links"
    links.mkdir()
    _wheel(links, "delta")
    (tree / "pyproject.toml").write_text(WHEEL_FOLDER_PYPROJECT.format(links=links))
    env = _locked(tree, tmp_path / "cache")
    assert f'registry = "{links}"' in (tree / "uv.lock").read_text()
    (links / "delta-1.0-py3-none-any.whl").unlink()
    links.rmdir()
    return tree, env


def test_serve_needs_no_wheel_folder(without_the_folder: tuple[Path, dict[str, str]]) -> None:
    tree, env = without_the_folder
    ran = subprocess.run(
        ["bash", str(tree / "scripts/serve"), "--port", "9"],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines() == ["served serve --port 9"]


def test_the_test_command_names_the_missing_wheel_at_once(
    without_the_folder: tuple[Path, dict[str, str]],
) -> None:
    tree, env = without_the_folder
    ran = subprocess.run(
        ["bash", str(tree / "scripts/test")],
        env=env, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert ran.returncode == 1
    (line,) = ran.stderr.splitlines()  # one line, saying what to provide
    links = tree.parent / "links"
    assert f"uv.lock takes delta==1.0 for Python {VERSION} from {links}/delta-1.0-py3" in line
    assert "put that file there" in line
    # It stopped before syncing anything (no downloads or builds first).
    assert not (Path(env["LLM_POOL_CACHE_DIR"]) / f"env-py{VERSION}").exists()
