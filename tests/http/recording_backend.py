"""A test-only backend that keeps every request it is given: what a surface parsed is
what the runtime sees, checked on the request itself rather than on a status code.

It echoes the last turn; ``runtime.requests`` holds each :class:`GenerationRequest` in
the order they came. It honours every optional sampling field the stub does.
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
)
from pool.backends.stub import STUB_SAMPLING
from pool.config import CommonModelFields


class RecorderModel(CommonModelFields):
    backend: Literal["recorder"] = "recorder"


class RecorderRuntime:
    def __init__(self) -> None:
        self.requests: list[GenerationRequest] = []

    @property
    def vram_mib(self) -> int | None:
        return None

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        self.requests.append(request)
        await sink.send(request.turns[-1].text)
        return GenerationStats(prompt_tokens=1, output_tokens=1)

    async def close(self) -> None:
        pass


class RecorderBackend(Backend[RecorderModel]):
    config = RecorderModel

    def capabilities(self, definition: RecorderModel) -> Capabilities:
        return Capabilities(multi_turn=True, sampling=STUB_SAMPLING)

    def effective_target_inflight(self, definition: RecorderModel) -> int:
        return 1

    async def load(self, definition: RecorderModel, context: LoadContext) -> RecorderRuntime:
        return RecorderRuntime()


BACKEND = RecorderBackend()
