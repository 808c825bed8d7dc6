"""The embedded-engine spec's manager variables: those read map onto settings, and the
docs name each of the others with the model field that replaces it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import pool  # noqa: F401 - the backend registry, for definition_class
from pool.config import definition_class, load_settings
from pool.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]

# Every variable of the spec's ManagerConfig, Dockerfile and compose file.
MANAGER_VARIABLES = {
    "MANAGER_PORT",
    "DEFAULT_MODEL",
    "KEEP_ALIVE",
    "VLLM_KEEP_ALIVE",
    "HUGGING_FACE_HUB_TOKEN",
    "HUGGINGFACE_API_KEY",
    "VLLM_GPU_MEMORY_UTILIZATION",
    "VLLM_TENSOR_PARALLEL_SIZE",
    "VLLM_MAX_MODEL_LEN",
    "VLLM_QUANTIZATION",
    "VLLM_MODEL",
}


def _settings_file(tmp_path: Path) -> Path:
    path = tmp_path / "settings.json"
    path.write_text(json.dumps({"engine": {"models": {"m": {"backend": "stub"}}}}))
    return path


def test_keep_alive_and_the_port_are_read(tmp_path: Path) -> None:
    path = _settings_file(tmp_path)
    default = load_settings(path, environ={})
    assert (default.engine.keep_alive, default.service.port) == (300.0, 8011)
    settings = load_settings(path, environ={"KEEP_ALIVE": "-1", "MANAGER_PORT": "8000"})
    assert (settings.engine.keep_alive, settings.service.port) == (-1.0, 8000)
    assert load_settings(path, environ={"KEEP_ALIVE": "5m"}).engine.keep_alive == "5m"
    # The compose file's name, for a container that gets only that one.
    assert load_settings(path, environ={"VLLM_KEEP_ALIVE": "0"}).engine.keep_alive == 0.0
    both = {"KEEP_ALIVE": "60", "VLLM_KEEP_ALIVE": "0"}
    assert load_settings(path, environ=both).engine.keep_alive == 60.0


@pytest.mark.parametrize("value", ["http", "-1", "70000", "80.5"])
def test_a_port_that_is_not_one_names_the_variable(tmp_path: Path, value: str) -> None:
    with pytest.raises(ConfigError, match=r"\$MANAGER_PORT"):
        load_settings(_settings_file(tmp_path), environ={"MANAGER_PORT": value})


def test_the_docs_name_each_variable_and_what_replaces_it() -> None:
    """A row per variable in docs/operations.md: read, or replaced by a model field that
    exists (in some backend's definition)."""
    text = (ROOT / "docs" / "operations.md").read_text()
    start = text.index("| variable | in the pool |")
    rows = [line for line in text[start:].splitlines()[2:] if line.startswith("|")]
    rows = rows[: next((i for i, r in enumerate(rows) if not r.startswith("| `")), len(rows))]
    named: dict[str, str] = {}
    for row in rows:
        names, meaning = row.strip("|").split("|", 1)
        for name in re.findall(r"`([A-Z_]+)`", names):
            named[name] = meaning.strip()
    assert set(named) == MANAGER_VARIABLES
    fields = {
        field
        for backend in ("vllm", "vllm_serve", "llama_cpp", "stub")
        for field in definition_class(backend).model_fields
    }
    for name, meaning in named.items():
        assert meaning.startswith(("read:", "replaced by")), (name, meaning)
        if meaning.startswith("replaced by"):
            replacement = re.findall(r"`([a-z_]+)[`:]", meaning)[0]
            assert replacement in fields, (name, replacement)
