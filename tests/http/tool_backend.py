"""A test-only backend that calls the first tool it is offered: the pool's plumbing of
tool calls (assembly, every surface's rendering) without a model.

With tools it says ``Checking.`` and then calls the first tool with ``{"n": 1}``, the
arguments in two pieces; without tools it echoes the last turn.
"""

from __future__ import annotations

from typing import Literal

from pool.backends import (
    Backend,
    Capabilities,
    GenerationRequest,
    GenerationStats,
    LoadContext,
    TokenSink,
    ToolCallDelta,
)
from pool.config import CommonModelFields


class ToolCallerModel(CommonModelFields):
    backend: Literal["toolcaller"] = "toolcaller"


class ToolCallerRuntime:
    @property
    def vram_mib(self) -> int | None:
        return None

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        if not request.offers_tools:
            await sink.send(request.turns[-1].text)
            return GenerationStats(prompt_tokens=1, output_tokens=1)
        await sink.send("Checking.")
        await sink.send(ToolCallDelta(0, "call_toy1", request.tools[0].name, ""))
        await sink.send(ToolCallDelta(0, arguments='{"n":'))
        await sink.send(ToolCallDelta(0, arguments=" 1}"))
        return GenerationStats(prompt_tokens=1, output_tokens=4)

    async def close(self) -> None:
        pass


class ToolCallerBackend(Backend[ToolCallerModel]):
    config = ToolCallerModel

    def capabilities(self, definition: ToolCallerModel) -> Capabilities:
        return Capabilities(multi_turn=True, tools=True)

    def effective_target_inflight(self, definition: ToolCallerModel) -> int:
        return 1

    async def load(self, definition: ToolCallerModel, context: LoadContext) -> ToolCallerRuntime:
        return ToolCallerRuntime()


BACKEND = ToolCallerBackend()
