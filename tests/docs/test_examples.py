"""Run the shell examples of README.md and docs/*.md against a pool on the shipped settings.

Every ```sh block runs, in document order, against a fresh pool per file, unless the line
just before it is ``<!-- not run in CI: reason -->``; the marked blocks must be exactly
``EXPECTED_SKIPPED`` so that a new example is run unless someone marks it on purpose.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.real_model

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```sh\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!-- not run in CI: (.*?) -->\s*$")

# (file, first line of the block) for each block marked not runnable here.
EXPECTED_SKIPPED = {
    ("README.md", "scripts/serve"),
    ("README.md", "scripts/test"),
    ("api.md", "curl -sN localhost:8011/v1/admin/events"),
    ("backends.md", "llm-pool convert ct2"),
    ("operations.md", "scripts/serve"),
    ("operations.md", "deploy/systemd/install.sh"),
    ("operations.md", "docker build -f deploy/docker/Dockerfile.cpu -t llm-pool:cpu ."),
    ("operations.md", "llm-pool pull my-model"),
    ("performance.md", "pip install -e '.[test,llama-cpp,bench]'"),
}


@dataclass(frozen=True)
class Example:
    file: str
    line: int
    code: str
    skip_reason: str | None

    @property
    def name(self) -> str:
        return self.code.splitlines()[0].split("  #")[0].strip()


def examples(path: Path) -> list[Example]:
    text = path.read_text()
    found = []
    for m in BLOCK.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.match(before)
        found.append(
            Example(
                path.name,
                text[: m.start()].count("\n") + 1,
                m.group(1),
                mark.group(1) if mark else None,
            )
        )
    return found


ALL = [ex for path in DOCS for ex in examples(path)]


def test_marked_examples_are_the_expected_ones() -> None:
    skipped = {(ex.file, ex.name) for ex in ALL if ex.skip_reason}
    for ex in ALL:
        if ex.skip_reason:
            print(f"not run: {ex.file}:{ex.line} {ex.name!r}: {ex.skip_reason}")
    assert skipped == EXPECTED_SKIPPED


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    return env


@pytest.fixture
def pool_port() -> Iterator[int]:
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pool", "serve", "--port", str(port)],
        cwd=ROOT,
        env=_env(),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            assert time.monotonic() < deadline, "the pool did not become ready"
            try:
                # Ready once every model loaded at start is loaded.
                rows = httpx.get(f"http://127.0.0.1:{port}/v1/admin/models", timeout=5).json()
                items = rows.get("models", rows.get("data", [])) if isinstance(rows, dict) else rows
                states = {r.get("state") for r in items if isinstance(r, dict)}
                if states and not states & {"loading", "starting"}:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.5)  # polling for readiness, not synchronisation
        yield port
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _json_values(out: str) -> list[object]:
    """Each JSON value printed one after another at the start of ``out``."""
    decoder = json.JSONDecoder()
    values, pos = [], 0
    while True:
        while pos < len(out) and out[pos].isspace():
            pos += 1
        if pos >= len(out) or out[pos] not in "{[":
            return values
        value, pos = decoder.raw_decode(out, pos)
        values.append(value)


FILES = sorted({ex.file for ex in ALL if not ex.skip_reason})


@pytest.mark.parametrize("file", FILES)
def test_examples_run_as_written(file: str, pool_port: int) -> None:
    for ex in [e for e in ALL if e.file == file and not e.skip_reason]:
        code = re.sub(r"\b(localhost|127\.0\.0\.1):8011\b", rf"\1:{pool_port}", ex.code)
        env = _env()
        env["LLM_POOL_URL"] = f"http://127.0.0.1:{pool_port}"
        done = subprocess.run(
            ["bash", "-e", "-o", "pipefail", "-c", code],
            cwd=ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=300,
        )
        where = f"{ex.file}:{ex.line} {ex.name!r}\n{done.stdout}\n{done.stderr}"
        assert done.returncode == 0, where
        if done.stdout.lstrip()[:1] in ("{", "["):
            try:
                values = _json_values(done.stdout)
                assert values, where
                errors = [
                    v for v in values if isinstance(v, dict) and isinstance(v.get("error"), dict)
                ]
                # TASK_ID is a placeholder the reader replaces: its lookup answers not found.
                allowed = 1 if "TASK_ID" in ex.code else 0
                assert len(errors) <= allowed, f"error answers {errors}\n{where}"
            except json.JSONDecodeError as e:
                pytest.fail(f"not JSON: {e}\n{where}")
