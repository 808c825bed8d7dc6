"""OpenAI's audio routes: ``POST /v1/audio/transcriptions`` and ``/v1/audio/translations``
(and the same under ``/openai/v1``).

The views read the multipart form (:func:`read_form`) and the limits that need no
decoding; :func:`transcription_answer` is the core, from a parsed :class:`AudioAsk`
to the answer: it decodes the upload on a worker thread (PyAV, bounded by
``service.audio``), runs a :class:`~pool.backends.TranscriptionJob` through the pool
(keys, budgets, the queue, residency and the usage row, as any request) and renders the
result. A streamed transcription sends each decoded segment as a
``transcript.text.delta`` event; a client that leaves cancels the job, which stops the
decoding at the next segment.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

import trio
from pydantic import BaseModel, ValidationError
from quart import Blueprint, Response, request

from pool.actors import Admission, Completed, Delta, Failed, Pool, TaskRequest
from pool.backends import Transcript, TranscriptionJob, TranscriptionTask, decode_audio
from pool.config import AudioSettings
from pool.errors import PoolError
from pool.http._common import (
    AppContext,
    SchemaError,
    dumps,
    inference_headers,
    json_response,
    require,
    tenant_and_priority,
)
from pool.http._forwarding import forwarded
from pool.http._route import AUDIO_REFUSALS, PLAIN_TEXT, SSE, Route, serves
from pool.http._streaming import streamed_answer
from pool.http.openai._audio_render import (
    delta_event,
    done_event,
    srt_text,
    transcription_body,
    verbose_body,
    vtt_text,
)
from pool.http.openai._render import openai_error
from pool.schemas import (
    TranscriptFormat,
    TranscriptionForm,
    TranscriptionReply,
    TranscriptionStreamEvent,
    TranslationForm,
)

Form = TypeVar("Form", bound=BaseModel)
MULTIPART = "multipart/form-data"

_TRANSCRIPTIONS_TEXT = (
    "Speech to text with a model of kind `transcription` (the `whisper` backend), as"
    " OpenAI's API: a multipart form with the audio `file` (any container and codec"
    " FFmpeg's libraries read; decoded in-process by PyAV), `model`, `language`, `prompt`,"
    " `temperature`, `response_format` (`json`, `text`, `srt`, `vtt`, `verbose_json`) and"
    " `timestamp_granularities[]` (`segment`, `word`; with `verbose_json` only)."
    " `stream=true` (with `json` or `text`) answers Server-Sent Events:"
    " `transcript.text.delta` per decoded segment, then `transcript.text.done` with the"
    " text and `usage`. A file larger than `service.audio.max_bytes` is a 413"
    " `audio_too_large`, longer than `service.audio.max_seconds` a 400 `audio_too_long`,"
    " one that holds no decodable audio a 400 `invalid_audio`; a model of another kind"
    " answers 400 `wrong_model_kind`. The request goes through the same keys, budgets"
    " (`audio_seconds_per_day`), queue and residency as generation; its usage row carries"
    " `audio_seconds`."
)
_TRANSLATIONS_TEXT = (
    "Speech in any language Whisper knows to English text, as OpenAI's API: the form of"
    " `/v1/audio/transcriptions` without `language`, `timestamp_granularities[]` and"
    " `stream`; the same formats, limits and errors."
)


def _route(path: str, summary: str, text: str, form: type[BaseModel], stream: bool) -> Route:
    return Route(
        "post",
        path,
        "openai",
        summary,
        text,
        form,
        request_media=MULTIPART,
        reply=TranscriptionReply,
        text=PLAIN_TEXT,
        stream=SSE if stream else None,
        events=TranscriptionStreamEvent if stream else None,
        errors="openai",
        valid_input_codes=AUDIO_REFUSALS,
    )


TRANSCRIPTIONS = _route(
    "/v1/audio/transcriptions",
    "Transcriptions (OpenAI)",
    _TRANSCRIPTIONS_TEXT,
    TranscriptionForm,
    stream=True,
)
OPENAI_TRANSCRIPTIONS = _route(
    "/openai/v1/audio/transcriptions",
    "Transcriptions (OpenAI base URL)",
    "`POST /v1/audio/transcriptions` under the base URL `/openai/v1`.",
    TranscriptionForm,
    stream=True,
)
TRANSLATIONS = _route(
    "/v1/audio/translations",
    "Translations (OpenAI)",
    _TRANSLATIONS_TEXT,
    TranslationForm,
    stream=False,
)
OPENAI_TRANSLATIONS = _route(
    "/openai/v1/audio/translations",
    "Translations (OpenAI base URL)",
    "`POST /v1/audio/translations` under the base URL `/openai/v1`.",
    TranslationForm,
    stream=False,
)
AUDIO_ROUTES = (TRANSCRIPTIONS, OPENAI_TRANSCRIPTIONS, TRANSLATIONS, OPENAI_TRANSLATIONS)


@dataclass(frozen=True, slots=True)
class AudioAsk:
    """One parsed audio request, whatever route it came by: what the core needs."""

    task: TranscriptionTask
    model: str
    audio: bytes
    tenant: str
    priority: str
    language: str | None = None
    prompt: str | None = None
    temperature: float = 0.0
    response_format: TranscriptFormat = "json"
    granularities: tuple[str, ...] = ()
    stream: bool = False


async def read_form(model: type[Form]) -> Form:
    """The request's multipart (or URL-encoded) form as ``model``: a 422 for a form
    that does not match it. A field named with ``[]`` keeps every value; any other
    its first."""
    form = await request.form
    files = await request.files
    data: dict[str, Any] = {}
    for name in form:
        values = form.getlist(name)
        data[name] = values if name.endswith("[]") else values[0]
    upload = files.get("file")
    if upload is not None:
        data["file"] = upload.read()
    elif isinstance(data.get("file"), str):
        data["file"] = data["file"].encode()
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        # The fields as sent, against which the error paths are read; not the file's
        # bytes (megabytes of audio to carry for nothing).
        sent = {name: "" if name == "file" else value for name, value in data.items()}
        raise SchemaError(exc, sent) from None


def check_ask(ask: AudioAsk, limits: AudioSettings) -> None:
    """The rules of one request that need no decoding.

    Raises:
        PoolError: ``audio_too_large`` (413), ``invalid_request`` (400).
    """
    if len(ask.audio) > limits.max_bytes:
        raise PoolError(
            "audio_too_large",
            f"the audio file is larger than {limits.max_bytes} bytes (service.audio.max_bytes)",
            details={"param": "file"},
        )
    if ask.granularities and ask.response_format != "verbose_json":
        raise PoolError(
            "invalid_request",
            "timestamp_granularities[] needs response_format verbose_json",
            details={"param": "timestamp_granularities[]"},
        )
    if ask.stream and ask.response_format not in ("json", "text"):
        raise PoolError(
            "invalid_request",
            "a streamed transcription answers text events: response_format json or text",
            details={"param": "response_format"},
        )


async def transcription_answer(
    pool: Pool, limits: AudioSettings, decoding: trio.CapacityLimiter, ask: AudioAsk
) -> Response:
    """Decode ``ask``'s audio, transcribe it on its model and answer in its format.

    Raises:
        PoolError: the request's refusal (limits, kind, admission, the backend).
    """
    check_ask(ask, limits)
    audio = await trio.to_thread.run_sync(
        decode_audio, ask.audio, limits.max_seconds, limiter=decoding
    )
    job = TranscriptionJob(
        model=ask.model,
        audio=audio,
        task=ask.task,
        language=ask.language,
        prompt=ask.prompt,
        # 0 leaves the decoder its fallback ladder, as OpenAI's API describes it.
        temperature=ask.temperature or None,
        word_timestamps="word" in ask.granularities,
    )
    task_request = TaskRequest(ask.model, job)
    if ask.stream:
        admission, chunks = await _streamed(pool, task_request, ask, job.seconds)
        return streamed_answer(chunks, admission)
    done = await pool.run_task(task_request, tenant=ask.tenant, priority=ask.priority)
    transcript: Transcript = done.value
    headers = inference_headers(done.timings.queue_wait_ms or 0.0, done.timings.backend_ms)
    usage = ask.task == "transcribe"
    if ask.response_format == "json":
        return json_response(transcription_body(transcript, job.seconds, usage), headers=headers)
    if ask.response_format == "verbose_json":
        body = verbose_body(transcript, ask.task, job.seconds, ask.granularities, usage)
        return json_response(body, headers=headers)
    text = transcript.text
    if ask.response_format == "srt":
        text = srt_text(transcript)
    elif ask.response_format == "vtt":
        text = vtt_text(transcript)
    return Response(text, content_type="text/plain; charset=utf-8", headers=headers)


def _sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + dumps(payload) + b"\n\n"


async def _events(
    pool: Pool, task_request: TaskRequest, ask: AudioAsk
) -> AsyncGenerator[Admission | Delta | bytes | Completed | Failed, None]:
    async with pool.admit(task_request, tenant=ask.tenant, priority=ask.priority) as admission:
        yield admission
        async for event in admission.task_events():
            yield event


async def _streamed(
    pool: Pool, task_request: TaskRequest, ask: AudioAsk, seconds: float
) -> tuple[Admission, AsyncIterator[bytes]]:
    """Admit the job (its refusals are still plain errors), then its events as SSE."""
    events = _events(pool, task_request, ask)
    admission = await anext(events)
    assert isinstance(admission, Admission)

    async def chunks() -> AsyncIterator[bytes]:
        # Leaving early (the client went) closes the admission, which cancels the job.
        async with contextlib.aclosing(events):
            async for event in events:
                if isinstance(event, Delta):
                    yield _sse(delta_event(event.text))
                elif isinstance(event, Completed):
                    transcript: Transcript = event.value
                    yield _sse(done_event(transcript.text, seconds))
                elif isinstance(event, Failed):
                    error = event.error
                    yield _sse(openai_error(error.status, error.code, error.message))

    return admission, chunks()


def register_audio(blueprint: Blueprint, ctx: AppContext) -> None:
    """Serve the audio routes on ``blueprint`` (OpenAI's, whose error shape they answer in)."""
    limits = ctx.settings.service.audio
    decoding = trio.CapacityLimiter(limits.decode_threads)

    @serves(blueprint, TRANSCRIPTIONS, OPENAI_TRANSCRIPTIONS)
    async def transcriptions() -> Response:
        """OpenAI's transcriptions: the audio's text in its language."""
        require(ctx, "inference")
        tenant, priority = tenant_and_priority()
        form = await read_form(TranscriptionForm)
        # A `server` model answers by its own server: the form goes as it came.
        served = await forwarded(ctx, TRANSCRIPTIONS.path, form.model, tenant, priority)
        if served is not None:
            return served
        ask = AudioAsk(
            task="transcribe",
            model=form.model,
            audio=form.file,
            tenant=tenant,
            priority=priority,
            language=form.language,
            prompt=form.prompt,
            temperature=form.temperature,
            response_format=form.response_format,
            granularities=tuple(dict.fromkeys(form.timestamp_granularities)),
            stream=form.stream,
        )
        return await transcription_answer(ctx.pool, limits, decoding, ask)

    @serves(blueprint, TRANSLATIONS, OPENAI_TRANSLATIONS)
    async def translations() -> Response:
        """OpenAI's translations: the audio's speech as English text."""
        require(ctx, "inference")
        tenant, priority = tenant_and_priority()
        form = await read_form(TranslationForm)
        # A `server` model answers by its own server: the form goes as it came.
        served = await forwarded(ctx, TRANSLATIONS.path, form.model, tenant, priority)
        if served is not None:
            return served
        ask = AudioAsk(
            task="translate",
            model=form.model,
            audio=form.file,
            tenant=tenant,
            priority=priority,
            prompt=form.prompt,
            temperature=form.temperature,
            response_format=form.response_format,
        )
        return await transcription_answer(ctx.pool, limits, decoding, ask)
