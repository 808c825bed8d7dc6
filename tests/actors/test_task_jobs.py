"""Task jobs (pool/backends/_tasks.py): one call to a runtime of the right kind, through
the same admission, queue, replicas and accounting as a generation.

The job here is the test's own: it reads the stub runtime's definition and answers
with it, streams text and bytes, and can block until cancelled, so the pool's part
(kind checks, dispatch, results, usage rows, a departing caller) is what is tested.
The real task kinds (rerank, transcription, speech) have their own tests.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import trio

from pool import Failed, PoolError, open_pool
from pool.actors import Completed, TaskRequest
from pool.actors.accounting._usage_store import FILE_NAME
from pool.backends import ModelKind, Runtime, TaskJob, TaskResult, TaskSink, TaskUsage
from pool.backends.stub import StubRuntime
from pool.config import build_settings

from .helpers import wait_until


@dataclass(frozen=True, slots=True)
class EchoJob(TaskJob):
    """Answers its text upper-cased, after streaming it as text and as bytes."""

    served_by: ClassVar[frozenset[ModelKind]] = frozenset({"rerank", "embedding"})
    operation: ClassVar[str] = "echo"
    model: str
    text: str
    request_id: str = ""
    hang: bool = False

    async def run(self, runtime: Runtime, sink: TaskSink) -> TaskResult:
        assert isinstance(runtime, StubRuntime)
        assert self.request_id, "the pool hands the job its request id"
        await sink.send(self.text)
        await sink.send(self.text.encode())
        if self.hang:
            await trio.sleep_forever()
        return TaskResult(self.text.upper(), TaskUsage(prompt_tokens=len(self.text.split())))


def _settings() -> object:
    return build_settings(
        {
            "service": {"usage": {"flush_ms": 10}},
            "engine": {
                "models": {
                    "ranker": {"backend": "stub", "enabled": True, "kind": "rerank"},
                    "embedder": {"backend": "stub", "enabled": True, "embedding": True},
                    "chat": {"backend": "stub", "enabled": True},
                }
            },
        }
    )


def _rows(state: Path) -> list[tuple[object, ...]]:
    with sqlite3.connect(state / FILE_NAME) as db:
        return db.execute(
            "SELECT tenant, model, prompt_tokens, output_tokens, status FROM usage ORDER BY rowid"
        ).fetchall()


async def test_a_task_runs_on_a_model_of_its_kind_and_is_charged(private_state: Path) -> None:
    async with open_pool(_settings()) as pool:  # type: ignore[arg-type]
        done = await pool.run_task(TaskRequest("ranker", EchoJob("ranker", "two words")))
        assert isinstance(done, Completed)
        assert done.value == "TWO WORDS" and done.usage.prompt_tokens == 2
        assert done.task_usage == TaskUsage(prompt_tokens=2)
        assert done.timings.backend_ms is not None
        # An embedding model is among the job's kinds too.
        embedded = await pool.run_task(TaskRequest("embedder", EchoJob("embedder", "x")))
        assert embedded.value == "X"
        with pytest.raises(PoolError) as refused:
            await pool.run_task(TaskRequest("chat", EchoJob("chat", "x")), tenant="acme")
        assert refused.value.code == "wrong_model_kind"
        assert refused.value.details == {"kind": "chat", "wanted": "embedding or rerank"}
        await wait_until(lambda: pool.parts_for_tests().usage.written == 3)  # type: ignore[union-attr]
    assert _rows(private_state) == [
        ("default", "ranker", 2, 0, "success"),
        ("default", "embedder", 1, 0, "success"),
        ("acme", "chat", 0, 0, "wrong_model_kind"),
    ]


async def test_a_streamed_task_yields_text_and_bytes_then_its_answer() -> None:
    request = TaskRequest("ranker", EchoJob("ranker", "abc"))
    async with open_pool(_settings()) as pool, pool.admit(request) as admission:  # type: ignore[arg-type]
        events = [event async for event in admission.task_events()]
    assert events[:2] == [events[0], b"abc"] and events[0].text == "abc"  # type: ignore[union-attr]
    assert isinstance(events[2], Completed) and events[2].value == "ABC"
    assert len(events) == 3


async def test_a_caller_that_leaves_stops_the_task(private_state: Path) -> None:
    async with open_pool(_settings()) as pool:  # type: ignore[arg-type]
        actor = pool.parts_for_tests().residency.model("ranker")
        request = TaskRequest("ranker", EchoJob("ranker", "wait", hang=True))
        with trio.move_on_after(0.2):
            async with pool.admit(request) as admission:
                async for event in admission.task_events():
                    assert not isinstance(event, Failed)
        # Its replica slot is free again, and the request was recorded as cancelled.
        await wait_until(lambda: actor.snapshot().running == 0)
        await wait_until(lambda: pool.parts_for_tests().usage.written == 1)  # type: ignore[union-attr]
    assert _rows(private_state) == [("default", "ranker", 0, 0, "cancelled")]
