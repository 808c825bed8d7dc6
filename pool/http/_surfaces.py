"""The modules that register the app's routes, each with the ``ROUTES`` it declares
(pool/http/_route.py): pool/http/_app.py registers them, and the OpenAPI document
(pool/http/_openapi.py) lists their routes, in this order."""

from __future__ import annotations

from pool.http import (
    _ui,
    admin,
    anthropic,
    ollama,
    openai,
    openai_responses,
    rerank,
    responses,
    runner,
)

SURFACES = (responses, openai, openai_responses, rerank, anthropic, ollama, admin, runner, _ui)
