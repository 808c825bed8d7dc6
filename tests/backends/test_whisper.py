"""The ``whisper`` backend on a real model: faster-whisper on CTranslate2, in-process.

Speech comes from espeak-ng (a robotic voice, which the small model still reads), so
each test knows the words that must come back. Besides the round trip: the decoding
runs on the replica's thread while the event loop serves others, a client that leaves
stops the decoding, an unload drains or cuts a running transcription as it does a
generation, and the request is charged its audio seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import trio

from pool import Delta, Failed, PoolError, open_pool
from pool.actors import Completed, TaskRequest
from pool.backends import SAMPLE_RATE, Transcript, TranscriptionJob, decode_audio
from pool.backends.whisper import WhisperRuntime
from pool.config import build_settings
from tests.actors.helpers import ask, wait_until
from tests.backends.whisper_audio import (
    PARAGRAPH,
    SENTENCE,
    recall,
    speak,
    whisper_dir,
    whisper_model,
)

pytestmark = pytest.mark.real_model


@pytest.fixture(scope="module")
def sentence_audio() -> Any:
    return decode_audio(speak(SENTENCE), 600)


@pytest.fixture(scope="module")
def long_audio() -> Any:
    return decode_audio(speak(PARAGRAPH, words_per_minute=170), 600)


def _settings(models: dict[str, dict[str, Any]], **engine: Any) -> Any:
    return build_settings(
        {"service": {"usage": {"flush_ms": 10}}, "engine": {**engine, "models": models}}
    )


def _runtime(pool: Any, name: str = "whisper") -> WhisperRuntime:
    (replica,) = pool.model(name).replicas
    runtime = replica.runtime
    assert isinstance(runtime, WhisperRuntime)
    return runtime


def test_the_model_ships_in_its_package() -> None:
    folder = whisper_dir()
    assert {"model.bin", "config.json", "tokenizer.json"} <= {p.name for p in folder.iterdir()}


@pytest.mark.usefixtures("private_state")
async def test_the_words_come_back_with_their_times(sentence_audio: Any) -> None:
    settings = _settings({"whisper": whisper_model()})
    async with open_pool(settings) as pool:
        job = TranscriptionJob("whisper", sentence_audio, word_timestamps=True)
        done = await pool.run_task(TaskRequest("whisper", job), tenant="acme")
        assert isinstance(done, Completed)
        transcript: Transcript = done.value
        await wait_until(lambda: pool.parts_for_tests().usage.written == 1)  # type: ignore[union-attr]
        metrics = pool.render_metrics().decode()
        (by_tenant,) = await pool.usage_totals("tenant")
    print(transcript.text)
    assert recall(SENTENCE, transcript.text) >= 0.8, transcript.text
    assert transcript.language == "en"
    seconds = len(sentence_audio) / SAMPLE_RATE
    assert transcript.duration == pytest.approx(seconds, abs=0.01)
    assert transcript.segments and transcript.segments[0].start >= 0
    times = [(w.start, w.end) for w in transcript.words]
    assert len(times) >= 7 and all(a <= b for a, b in times)
    assert [s for s, _ in times] == sorted(s for s, _ in times)
    # Charged its audio: the usage, the usage row, the metric.
    assert done.task_usage.audio_seconds == pytest.approx(seconds, abs=0.001)
    assert done.usage.output_tokens == sum(len(s.tokens) for s in transcript.segments) > 0
    assert (by_tenant.group, by_tenant.requests) == ("acme", 1)
    assert by_tenant.audio_seconds == pytest.approx(seconds, abs=0.001)
    assert f'llm_pool_audio_seconds_total{{model="whisper"}} {seconds:.3f}'[:-2] in metrics


async def test_a_stream_sends_each_segment_and_a_leaving_client_stops_the_decoding(
    long_audio: Any,
) -> None:
    async with open_pool(_settings({"whisper": whisper_model()})) as pool:
        runtime = _runtime(pool)
        # The whole file first: its segments, and the streamed deltas that make its text.
        request = TaskRequest("whisper", TranscriptionJob("whisper", long_audio, temperature=0.0))
        deltas: list[str] = []
        async with pool.admit(request) as admission:
            async for event in admission.task_events():
                if isinstance(event, Delta):
                    deltas.append(event.text)
                elif isinstance(event, Completed):
                    whole: Transcript = event.value
        assert len(whole.segments) >= 4 and len(deltas) == len(whole.segments)
        assert "".join(deltas) == whole.text
        assert recall(PARAGRAPH, whole.text) >= 0.7, whole.text
        decoded_before = runtime.segments_decoded
        # Again, leaving after the first delta: the worker stops at its next segment.
        async with pool.admit(request) as admission:
            async for event in admission.task_events():
                assert isinstance(event, Delta), event
                break
        await wait_until(lambda: runtime.busy is False)
        decoded = runtime.segments_decoded - decoded_before
        assert decoded < len(whole.segments), (decoded, len(whole.segments))
        await wait_until(lambda: pool.snapshot("whisper").running == 0)


async def test_the_loop_serves_others_while_a_long_file_is_decoded(long_audio: Any) -> None:
    models = {"whisper": whisper_model(), "chat": {"backend": "stub", "enabled": True}}
    async with open_pool(_settings(models)) as pool:
        finished = trio.Event()
        answered_meanwhile = 0

        async def transcribe() -> None:
            job = TranscriptionJob("whisper", long_audio, temperature=0.0)
            await pool.run_task(TaskRequest("whisper", job))
            finished.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(transcribe)
            await wait_until(lambda: pool.snapshot("whisper").running == 1)
            while not finished.is_set():
                done = await pool.respond(ask("chat"))
                assert done.text
                if not finished.is_set():
                    answered_meanwhile += 1
    # Each chat answer is a few event-loop turns: a decoder that held the loop would let
    # none through until it was done.
    assert answered_meanwhile >= 20, answered_meanwhile


async def test_an_unload_drains_a_running_transcription(sentence_audio: Any) -> None:
    async with open_pool(_settings({"whisper": whisper_model()})) as pool:
        result: list[Completed] = []

        async def transcribe() -> None:
            job = TranscriptionJob("whisper", sentence_audio)
            result.append(await pool.run_task(TaskRequest("whisper", job)))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(transcribe)
            await wait_until(lambda: pool.snapshot("whisper").running == 1)
            nursery.start_soon(pool.unload, "whisper")
            await wait_until(lambda: pool.snapshot("whisper").state == "unloading")
            # New work is refused while the running one drains, as for a generation.
            with pytest.raises(PoolError) as refused:
                await pool.run_task(
                    TaskRequest("whisper", TranscriptionJob("whisper", sentence_audio))
                )
            assert refused.value.code == "model_unloading"
        assert recall(SENTENCE, result[0].value.text) >= 0.8
        assert pool.snapshot("whisper").state == "unloaded"


async def test_an_unload_cuts_a_transcription_at_the_drain_deadline(long_audio: Any) -> None:
    settings = _settings({"whisper": whisper_model()}, unload_drain_s=0.5)
    async with open_pool(settings) as pool:
        runtime = _runtime(pool)
        events: list[Any] = []

        async def transcribe() -> None:
            job = TranscriptionJob("whisper", long_audio, temperature=0.0)
            async with pool.admit(TaskRequest("whisper", job)) as admission:
                async for event in admission.task_events():
                    events.append(event)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(transcribe)
            await wait_until(lambda: pool.snapshot("whisper").running == 1)
            row = await pool.unload("whisper")
        assert row.state == "unloaded"
        assert isinstance(events[-1], Failed), events[-1:]
        assert events[-1].error.code == "model_unloading"
        assert "unload_drain_s" in events[-1].error.message
        # The worker was stopped, not left decoding into a closed model.
        assert runtime.busy is False


async def test_a_missing_model_folder_fails_the_load(tmp_path: Path) -> None:
    settings = _settings({"whisper": whisper_model(model_path=str(tmp_path))})
    async with open_pool(settings) as pool:
        await wait_until(lambda: pool.snapshot("whisper").state == "failed")
        assert "no model.bin" in (pool.snapshot("whisper").last_error or "")
