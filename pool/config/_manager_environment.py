"""The environment variables of the embedded-engine spec's manager (its Dockerfile and
compose file), those that have a place in a pool of many models.

``KEEP_ALIVE`` (or the compose file's ``VLLM_KEEP_ALIVE``) is ``engine.keep_alive`` and
``MANAGER_PORT`` is ``service.port``. The Hugging Face token variables are read where
pulls talk to the hub (``pool.pulls``). The manager's one-model variables
(``DEFAULT_MODEL``, ``VLLM_MODEL``, ``VLLM_QUANTIZATION``, ...) are replaced by fields of
each model's definition: docs/operations.md names the field of each.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pool.errors import ConfigError

ENV_KEEP_ALIVE = "KEEP_ALIVE"
ENV_COMPOSE_KEEP_ALIVE = "VLLM_KEEP_ALIVE"
ENV_MANAGER_PORT = "MANAGER_PORT"


def manager_environment_settings(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The settings the manager's variables ask for, as a settings overlay.

    ``KEEP_ALIVE`` wins over ``VLLM_KEEP_ALIVE``; either is seconds (-1: forever, 0:
    unload after each request) or a duration such as ``5m``. Unset or empty variables
    add nothing.

    Raises:
        ConfigError: a port that is not a whole number from 0 to 65535, naming the variable.
    """
    env = os.environ if environ is None else environ
    overlay: dict[str, Any] = {}
    for name in (ENV_KEEP_ALIVE, ENV_COMPOSE_KEEP_ALIVE):
        if value := env.get(name, "").strip():
            try:
                keep_alive: float | str = float(value)
            except ValueError:
                keep_alive = value  # a duration; the setting's own parsing judges it
            overlay["engine"] = {"keep_alive": keep_alive}
            break
    if value := env.get(ENV_MANAGER_PORT, "").strip():
        if not value.isdigit() or int(value) > 65535:
            raise ConfigError([f"${ENV_MANAGER_PORT}: {value!r} is not a port (0 to 65535)"])
        overlay["service"] = {"port": int(value)}
    return overlay
