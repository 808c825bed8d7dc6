"""Settings files: merging, environment paths, and error messages for bad config."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pool.backends.llama_cpp import LlamaCppModel
from pool.backends.stub import StubModel
from pool.config import (
    build_settings,
    load_settings,
    merge,
    resolve_model_path,
)
from pool.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def _write(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_merge_is_recursive_and_local_wins() -> None:
    base = {"a": {"b": 1, "c": [1, 2]}, "d": 1}
    over = {"a": {"c": [3], "e": None}, "f": 2}
    assert merge(base, over) == {"a": {"b": 1, "c": [3], "e": None}, "d": 1, "f": 2}


def test_local_json_overrides_per_key(tmp_path: Path) -> None:
    settings = _write(
        tmp_path / "settings.json",
        {"engine": {"models": {"m": {"backend": "stub", "replicas": 2, "replica_max": 4}}}},
    )
    _write(tmp_path / "local.json", {"engine": {"models": {"m": {"enabled": True}}}})
    loaded = load_settings(settings)
    model = loaded.engine.models["m"]
    assert isinstance(model, StubModel)
    assert model.enabled and model.replicas == 2 and model.replica_max == 4


def test_environment_variables_name_the_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = _write(tmp_path / "base.json", {"service": {"port": 9000}})
    local = _write(tmp_path / "mine.json", {"service": {"port": 9001}})
    monkeypatch.setenv("LLM_POOL_SETTINGS_PATH", str(base))
    monkeypatch.setenv("LLM_POOL_LOCAL_SETTINGS_PATH", str(local))
    assert load_settings().service.port == 9001


def test_backend_defaults_from_engine(tmp_path: Path) -> None:
    loaded = build_settings({"engine": {"backend": "llama_cpp", "models": {"g": {}}}})
    assert isinstance(loaded.engine.models["g"], LlamaCppModel)
    assert loaded.engine.models["g"].gguf_n_ctx == 4096


def test_bad_json_names_file_line_and_column(tmp_path: Path) -> None:
    path = _write(tmp_path / "settings.json", '{\n  "engine": {\n    "models": {,}\n  }\n}')
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert info.value.problems == [
        f"{path}:3:16: invalid JSON: Expecting property name enclosed in double quotes"
    ]


def test_an_integer_too_long_to_read_is_a_settings_problem(tmp_path: Path) -> None:
    """Past Python's limit on reading integers (4300 digits): one line naming the file,
    not the traceback of json's ValueError."""
    path = _write(tmp_path / "settings.json", '{"service": {"port": ' + "9" * 5000 + "}}")
    with pytest.raises(ConfigError) as info:
        load_settings(path)
    assert info.value.problems == [f"{path}: an integer has more than 4300 digits"]


def test_every_problem_is_reported_once_with_model_and_field(tmp_path: Path) -> None:
    settings = _write(
        tmp_path / "settings.json",
        {
            "service": {"port": 70000},
            "engine": {
                "models": {
                    "a": {"backend": "warp_drive"},
                    "b": {"backend": "llama_cpp", "gguf_n_ctx": 0},
                    "c": {"backend": "stub"},
                }
            },
        },
    )
    _write(tmp_path / "local.json", {"engine": {"models": {"c": {"stub_colour": "red"}}}})
    with pytest.raises(ConfigError) as info:
        load_settings(settings)
    problems = info.value.problems
    assert len(problems) == 4
    assert any("service.port" in p and "settings.json" in p for p in problems)
    assert any("engine.models.a.backend: unknown backend 'warp_drive'" in p for p in problems)
    assert any("engine.models.b.gguf_n_ctx" in p for p in problems)
    assert any(
        p.startswith(str(tmp_path / "local.json")) and "models.c.stub_colour" in p for p in problems
    )


def test_replicas_above_replica_max_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        build_settings(
            {"engine": {"models": {"m": {"backend": "stub", "replicas": 3, "replica_max": 2}}}}
        )
    assert "replica_max" in info.value.problems[0]


def test_virtual_gpus_need_budgets() -> None:
    with pytest.raises(ConfigError) as info:
        build_settings({"engine": {"virtual_gpus": True}})
    assert "virtual_gpus needs gpu_budget_mib" in str(info.value)
    settings = build_settings({"engine": {"virtual_gpus": True, "gpu_budget_mib": [1000]}})
    assert settings.engine.virtual_gpus


def test_every_backend_has_its_fields() -> None:
    loaded = build_settings(
        {
            "engine": {
                "models": {
                    "ls": {
                        "backend": "llama_server",
                        "llama_server_n_gpu_layers": "-1",
                        "llama_server_spec_type": "draft",
                    },
                    "vs": {
                        "backend": "vllm_serve",
                        "vllm_model": "/m",
                        "vllm_serve_env": {"A": "1"},
                        "vllm_limit_mm_per_prompt": {"image": 1},
                    },
                    "v": {"backend": "vllm", "vllm_mm_processor_kwargs": {"max_pixels": 4014080}},
                    "x": {"backend": "exllamav3", "exllama_cache_quant": "8,4"},
                    "r": {
                        "backend": "openai_remote",
                        "remote_base_url": "http://127.0.0.1:1/v1",
                        "remote_model": "up",
                    },
                    "c": {"backend": "ct2", "compute_type": "int8_float16"},
                }
            }
        }
    )
    assert {m.backend for m in loaded.engine.models.values()} == {
        "llama_server",
        "vllm_serve",
        "vllm",
        "exllamav3",
        "openai_remote",
        "ct2",
    }


def test_shipped_settings_are_valid() -> None:
    loaded = load_settings(ROOT / "config" / "settings.json", ROOT / "config" / "absent.json")
    assert "smollm2-135m-instruct" in loaded.engine.models
    assert loaded.engine.models["smollm2-135m-instruct"].enabled


def test_package_paths_resolve_from_installed_packages(tmp_path: Path) -> None:
    path = resolve_model_path("pkg://pool/py.typed")
    assert path.is_file()
    with pytest.raises(FileNotFoundError):
        resolve_model_path("pkg://no_such_package_here/x.gguf")
    loaded = build_settings({})
    loaded.source_files = [str(tmp_path / "settings.json")]
    assert resolve_model_path("models/a.gguf", loaded.base_dir) == tmp_path / "models" / "a.gguf"
