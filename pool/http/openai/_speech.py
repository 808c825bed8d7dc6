"""OpenAI's text-to-speech routes: ``POST /v1/audio/speech`` and ``GET /v1/audio/voices``.

:func:`speech_answer` is the route's core: it takes the parsed request and answers the
audio, so another way of serving speech (a model behind a forwarding backend) can sit
beside it. The audio is made by a :class:`SpeechJob` on a replica of a ``speech`` model,
through the same admission, queue, budgets and usage rows as a generation.

Streamed (the default, as OpenAI streams its audio), the head leaves once the first
sentence is made, so an error before any audio (an unknown voice, a load that failed)
is still a plain error answer; a client that leaves stops the synthesis at the next
sentence.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import trio
from quart import Response

from pool.actors import Admission, Completed, Failed, Pool, TaskRequest
from pool.backends import (
    MEDIA_TYPES,
    AudioFormat,
    SpeechAudio,
    SpeechJob,
    VoiceListing,
    check_input,
    get_backend,
    speech_formats,
)
from pool.errors import BackendError, PoolError
from pool.http._common import Opened, inference_headers, json_response
from pool.http._route import Route
from pool.http._streaming import streamed_answer
from pool.schemas import SpeechRequest, VoiceList, renders

_BINARY = {"type": "string", "format": "binary"}
_AUDIO_MEDIA = tuple((media, _BINARY) for media in MEDIA_TYPES.values())
SPEECH_REFUSALS = (
    "input_too_long",
    "remote_not_allowed",
    "response_format_unsupported",
    "unknown_voice",
    "wrong_model_kind",
)
_SPEECH_DESCRIPTION = (
    "Text to speech with a model of kind `speech` (the `piper` backend): `input` said in"
    " `voice` (`GET /v1/audio/voices`; unset: the model's first) at `speed`, answered as"
    " `audio/wav` (16-bit mono) or `audio/pcm` (raw 16-bit little-endian mono at the"
    " voice's `sample_rate`), or encoded in-process by PyAV: `mp3` (`audio/mpeg`), `opus`"
    " (Ogg, 48 kHz, `audio/ogg`), `aac` (ADTS, `audio/aac`), `flac` (`audio/flac`); a"
    " format whose encoder this PyAV lacks is a 400 `response_format_unsupported`. The"
    " audio is sent as it is made, sentence by"
    " sentence (a streamed WAV header has open sizes); `stream: false` answers the whole"
    " file with exact sizes, `X-Sample-Rate` and `X-Audio-Seconds`. An input longer than"
    " the model's `max_input_characters` is a 400 `input_too_long`; a model of another"
    " kind answers 400 `wrong_model_kind`. Usage rows count the input's `characters`."
)
SPEECH = Route(
    "post",
    "/v1/audio/speech",
    "openai",
    "Speech (OpenAI)",
    _SPEECH_DESCRIPTION,
    SpeechRequest,
    media=_AUDIO_MEDIA,
    errors="openai",
    valid_input_codes=SPEECH_REFUSALS,
)
OPENAI_SPEECH = Route(
    "post",
    "/openai/v1/audio/speech",
    "openai",
    "Speech (OpenAI base URL)",
    "`POST /v1/audio/speech` under the base URL `/openai/v1`.",
    SpeechRequest,
    media=_AUDIO_MEDIA,
    errors="openai",
    valid_input_codes=SPEECH_REFUSALS,
)
_VOICES_QUERY = (("model", "string", "Only this model's voices (a speech model's name)."),)
VOICES = Route(
    "get",
    "/v1/audio/voices",
    "openai",
    "Voices",
    "The voices of every configured speech model (read from the models' files, without"
    " loading them), or of `model`'s only; a name that is no model is a 404.",
    reply=VoiceList,
    errors="openai",
    query=_VOICES_QUERY,
    refusals=(404,),
)
OPENAI_VOICES = Route(
    "get",
    "/openai/v1/audio/voices",
    "openai",
    "Voices (OpenAI base URL)",
    "`GET /v1/audio/voices` under the base URL `/openai/v1`.",
    reply=VoiceList,
    errors="openai",
    query=_VOICES_QUERY,
    refusals=(404,),
)
ROUTES = (SPEECH, OPENAI_SPEECH, VOICES, OPENAI_VOICES)


def speech_job(body: SpeechRequest) -> SpeechJob:
    """The job of a speech request.

    Raises:
        PoolError: ``response_format_unsupported`` for a format the pool cannot encode.
    """
    supported = speech_formats()
    if body.response_format not in supported:
        raise PoolError(
            "response_format_unsupported",
            f"response_format {body.response_format!r} needs an encoder this pool's PyAV"
            f" lacks; ask for one of {', '.join(supported)}",
            details={"param": "response_format", "supported": list(supported)},
        )
    fmt: AudioFormat = body.response_format
    return SpeechJob(
        model=body.model,
        input=body.input,
        voice=body.voice,
        response_format=fmt,
        speed=body.speed,
        stream=body.stream,
    )


async def _task_events(
    pool: Pool, request: TaskRequest, tenant: str, priority: str
) -> AsyncGenerator[Admission | bytes | Completed | Failed, None]:
    async with pool.admit(request, tenant=tenant, priority=priority) as admission:
        yield admission
        async with contextlib.aclosing(admission.task_events()) as events:
            async for event in events:
                if isinstance(event, bytes | Completed | Failed):
                    yield event


async def speech_answer(pool: Pool, opened: Opened[SpeechRequest]) -> Response:
    """Say ``opened.body`` with the speech model it names: the whole file, or the audio
    streamed as it is made.

    Raises:
        PoolError: the request is refused (its own code), before any audio is sent.
    """
    body = opened.body
    job = speech_job(body)
    definition = pool.settings.engine.models.get(body.model)
    if definition is not None:
        check_input(body.model, definition, body.input)
    request = TaskRequest(
        body.model, job, allow_remote=body.allow_remote, keep_alive=body.keep_alive
    )
    if not body.stream:
        done = await pool.run_task(request, tenant=opened.tenant, priority=opened.priority)
        audio: SpeechAudio = done.value
        assert audio.audio is not None
        headers = inference_headers(done.timings.queue_wait_ms or 0.0, done.timings.backend_ms)
        headers |= {
            "X-Sample-Rate": str(audio.sample_rate),
            "X-Audio-Seconds": f"{audio.audio_seconds:.3f}",
        }
        return Response(audio.audio, content_type=audio.media_type, headers=headers)
    events = _task_events(pool, request, opened.tenant, opened.priority)
    admission = await anext(events)
    assert isinstance(admission, Admission)
    # The head waits for the first sentence: an error before any audio is an error answer.
    first = await anext(events)
    if isinstance(first, Failed):
        await events.aclose()
        raise first.error

    async def chunks() -> AsyncIterator[bytes]:
        async with contextlib.aclosing(events):
            if isinstance(first, bytes):
                yield first
            async for event in events:
                if isinstance(event, bytes):
                    yield event
                # A failure after audio was sent can only end the stream early (its
                # usage row keeps the error's code).

    return streamed_answer(chunks(), admission, media_type=MEDIA_TYPES[job.response_format])


@renders(VoiceList)
def voices_body(voices: list[tuple[str, Any]]) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"id": voice.id, "model": model, "language": voice.language} for model, voice in voices
        ],
    }


async def voices_answer(pool: Pool, model: str | None) -> Response:
    """The voices of the configured speech models (or of ``model``).

    Raises:
        PoolError: ``unknown_model`` (404) for a ``model`` that is not configured.
    """
    definitions = pool.settings.engine.models
    if model is not None and model not in definitions:
        raise PoolError("unknown_model", f"model {model!r} is not configured")
    listed: list[tuple[str, Any]] = []
    for name, definition in definitions.items():
        if model is not None and name != model:
            continue
        backend = get_backend(definition.backend)
        if backend.capabilities(definition).kind != "speech":
            continue
        if not isinstance(backend, VoiceListing):
            continue
        try:
            voices = await trio.to_thread.run_sync(
                backend.voices, definition, pool.settings.base_dir
            )
        except BackendError:
            continue  # a model whose files are missing has no voices to offer yet
        listed.extend((name, voice) for voice in voices)
    return json_response(voices_body(listed))
