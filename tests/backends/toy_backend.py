"""A backend that exists only in the tests, to show what a new backend needs.

This module and one registry line (``register_backend("toy", __name__)`` in
``test_registry.py``) are all of it: the settings, the admin rows, the load body's
schema and checks, the context-length field and the pool take it from here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import PositiveInt

from pool.backends import (
    Backend,
    Capabilities,
    GenerationRequest,
    GenerationStats,
    LoadContext,
    LoadOverrides,
    TokenSink,
)
from pool.config import CommonModelFields


class ToyModel(CommonModelFields):
    backend: Literal["toy"] = "toy"
    toy_reply: str = "toy says hi"
    toy_ctx: PositiveInt = 128


class ToyLoadOverrides(LoadOverrides):
    toy_ctx: PositiveInt | None = None


LOAD_CONSTRAINTS: dict[str, dict[str, Any]] = {
    "toy_ctx": {"kind": "integer", "minimum": 64, "step": 64},
}
LOAD_RECOMMENDATIONS: dict[str, dict[str, Any]] = {
    "toy_ctx_presets": {"kind": "presets", "values": [128, 256]},
}


class ToyRuntime:
    def __init__(self, definition: ToyModel) -> None:
        self._definition = definition

    @property
    def vram_mib(self) -> int | None:
        return None

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        words = f"{self._definition.toy_reply} (ctx {self._definition.toy_ctx})".split(" ")
        for index, word in enumerate(words):
            await sink.send(word if index == 0 else " " + word)
        return GenerationStats(prompt_tokens=1, output_tokens=len(words))

    async def close(self) -> None:
        pass


class ToyBackend(Backend[ToyModel]):
    config = ToyModel
    load_overrides = ToyLoadOverrides
    load_constraints = LOAD_CONSTRAINTS
    load_recommendations = LOAD_RECOMMENDATIONS
    context_field = "toy_ctx"

    def capabilities(self, definition: ToyModel) -> Capabilities:
        return Capabilities(modalities=("text",), multi_turn=True)

    def effective_target_inflight(self, definition: ToyModel) -> int:
        return 1

    async def load(self, definition: ToyModel, context: LoadContext) -> ToyRuntime:
        return ToyRuntime(definition)


BACKEND = ToyBackend()
