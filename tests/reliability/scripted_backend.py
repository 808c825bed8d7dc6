"""A backend for fault tests: it hangs, crashes its engine thread, or counts what it sent.

Registered under ``scripted`` by the ``scripted`` fixture (tests/reliability/conftest.py).
Modes:

- ``tokens``: trio-native; sends ``scripted_reply`` word by word (paced by
  ``scripted_tokens_per_second``) and, with ``scripted_hang_after`` set, goes silent for
  ever after that many words when the prompt contains ``hang``. ``runtime.sent`` counts
  the words the sink accepted.
- ``thread``: an engine thread started at load (as vLLM's loop thread or ExLlama's
  generator are) produces the words; a prompt containing ``crash`` makes the thread raise
  after ``scripted_crash_after`` words. The thread dies, the request fails and
  ``wait_failed`` reports the reason, so the replica fails its model.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Literal

import trio
from pydantic import NonNegativeFloat, NonNegativeInt

from pool.backends import (
    Backend,
    Capabilities,
    GenerationRequest,
    GenerationStats,
    LoadContext,
    TokenSink,
)
from pool.config import CommonModelFields
from pool.errors import BackendError

_END = object()
_CRASHED = object()


class ScriptedModel(CommonModelFields):
    backend: Literal["scripted"] = "scripted"
    scripted_mode: Literal["tokens", "thread"] = "tokens"
    scripted_reply: str = " ".join(f"w{i}" for i in range(20))
    scripted_tokens_per_second: NonNegativeFloat = 0.0
    scripted_hang_after: NonNegativeInt | None = None
    scripted_crash_after: NonNegativeInt = 2


class TokensRuntime:
    def __init__(self, definition: ScriptedModel) -> None:
        self._definition = definition
        self.sent = 0
        self.generations = 0

    @property
    def vram_mib(self) -> int | None:
        return None

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        self.generations += 1
        words = self._definition.scripted_reply.split(" ")
        rate = self._definition.scripted_tokens_per_second
        hang = "hang" in request.turns[-1].text
        for index, word in enumerate(words):
            if hang and index == self._definition.scripted_hang_after:
                await trio.sleep_forever()
            if rate:
                await trio.sleep(1.0 / rate)
            await sink.send(word if index == 0 else " " + word)
            self.sent += 1
        return GenerationStats(prompt_tokens=1, output_tokens=len(words))

    async def close(self) -> None:
        pass


Job = tuple[list[str], Callable[[object], None], bool]


class ThreadRuntime:
    """An engine on its own thread; tokens cross to Trio one at a time (rendezvous)."""

    def __init__(self, definition: ScriptedModel, name: str) -> None:
        self._definition = definition
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._token = trio.lowlevel.current_trio_token()
        self._died = trio.Event()
        self.failure: str | None = None
        self.thread = threading.Thread(target=self._engine, name=f"scripted-engine-{name}")
        self.thread.start()

    @property
    def vram_mib(self) -> int | None:
        return None

    def _engine(self) -> None:
        deliver: Callable[[object], None] | None = None
        try:
            while (job := self._jobs.get()) is not None:
                words, deliver, crash = job
                try:
                    for index, word in enumerate(words):
                        if crash and index == self._definition.scripted_crash_after:
                            raise RuntimeError("simulated device fault in the engine thread")
                        deliver(word)
                    deliver(_END)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    continue  # the request was cancelled: next job
        except RuntimeError as exc:
            self.failure = f"{type(exc).__name__}: {exc}"
            if deliver is not None:
                # The requester may be gone already.
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    deliver(_CRASHED)
            with contextlib.suppress(trio.RunFinishedError):
                self._token.run_sync_soon(self._died.set)

    async def wait_failed(self) -> str:
        await self._died.wait()
        return f"engine thread died: {self.failure}"

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        if not self.thread.is_alive():
            raise BackendError(f"engine thread is dead: {self.failure}")
        send, receive = trio.open_memory_channel[object](0)
        token = self._token

        def deliver(item: object) -> None:
            trio.from_thread.run(send.send, item, trio_token=token)

        words = [w if i == 0 else " " + w for i, w in enumerate(request.turns[-1].text.split())]
        crash = "crash" in request.turns[-1].text
        self._jobs.put((words or ["(empty)"], deliver, crash))
        sent = 0
        with receive:
            async for item in receive:
                if item is _END:
                    break
                if item is _CRASHED:
                    raise BackendError(f"engine thread died: {self.failure}")
                assert isinstance(item, str)
                await sink.send(item)
                sent += 1
        return GenerationStats(prompt_tokens=len(words), output_tokens=sent)

    async def close(self) -> None:
        self._jobs.put(None)
        await trio.to_thread.run_sync(self.thread.join, 5.0)


class ScriptedBackend(Backend[ScriptedModel]):
    config = ScriptedModel

    def capabilities(self, definition: ScriptedModel) -> Capabilities:
        return Capabilities(modalities=("text",), multi_turn=True)

    def effective_target_inflight(self, definition: ScriptedModel) -> int:
        return definition.target_inflight if definition.scripted_mode == "tokens" else 1

    async def load(
        self, definition: ScriptedModel, context: LoadContext
    ) -> TokensRuntime | ThreadRuntime:
        if definition.scripted_mode == "thread":
            return ThreadRuntime(definition, context.model_name)
        return TokensRuntime(definition)


BACKEND = ScriptedBackend()
