"""The ``ct2`` backend: CTranslate2 generators in-process, or an encoder that embeds.

Generation is single-turn text only. Greedy and sampled decoding stream token by token through
``generate_tokens`` on a worker thread (:func:`stream_from_thread`); ``beam_size > 1``
is honoured with ``generate_batch``, which returns the finished text at once. Build a
model with ``llm-pool convert ct2`` (from a GGUF via a transformers checkout).

``embedding: true`` loads a sentence-embedding encoder instead (built by ``llm-pool
convert encoder``; :mod:`pool.backends._ct2_encoder`).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Annotated, Any, Literal

import trio
from pydantic import Field

from pool.backends._ct2_encoder import Ct2EncoderRuntime, load_encoder_blocking
from pool.backends._kinds import KindFields
from pool.backends._placement import GpuPlacement
from pool.backends._protocol import (
    Backend,
    Capabilities,
    GenerationRequest,
    GenerationStats,
    LoadContext,
    TokenSink,
    TokensUsed,
)
from pool.backends._sentence_pooling import read_sentence_config
from pool.backends._text import StopScanner
from pool.backends._threaded import stream_from_thread
from pool.backends.prompt_formats import PromptFormat, get_prompt_format, thinking_modes
from pool.config import CommonModelFields
from pool.errors import BackendError, PoolError


class Ct2Model(CommonModelFields, KindFields):
    """A CTranslate2 model in-process.

    ``kind: embedding`` (or ``embedding: true``) serves /v1/embeddings and /api/embed with
    a sentence-embedding encoder (a folder built by ``llm-pool convert encoder``): pooling
    and normalisation follow the model's own sentence-transformers config.
    """

    backend: Literal["ct2"] = "ct2"
    device: str = "cpu"
    compute_type: str = "int8"
    embedding_batch_size: Annotated[int, Field(ge=1, le=2048)] = Field(
        32,
        description="Most texts the encoder runs in one forward pass; a larger request is"
        " split into batches of texts of similar length.",
    )


def device_options(definition: Ct2Model, placement: GpuPlacement | None) -> dict[str, Any]:
    """``device_index`` of the GPU the pool placed the replica on (``device: cuda``,
    real GPUs the process sees); CTranslate2 cannot split one model over GPUs."""
    if definition.device != "cuda" or placement is None or placement.virtual:
        return {}
    devices = placement.local_indices()
    return {"device_index": devices[0]} if devices else {}


class Ct2Runtime:
    def __init__(
        self, generator: Any, tokenizer: Any, definition: Ct2Model, fmt: PromptFormat
    ) -> None:
        self._generator = generator
        self._tokenizer = tokenizer
        self._definition = definition
        self._format = fmt
        self._limiter = trio.CapacityLimiter(1)
        self._closed = False

    @property
    def vram_mib(self) -> int | None:
        return None

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        if self._closed:
            raise BackendError("the ct2 runtime is closed")
        if len(request.turns) != 1:
            raise PoolError("multi_turn_unsupported", "ct2 models take single-turn input only")
        return await stream_from_thread(
            partial(self._generate_blocking, request, sink.used), sink, limiter=self._limiter
        )

    def _generate_blocking(
        self, request: GenerationRequest, used: TokensUsed, send: Callable[[str], None]
    ) -> GenerationStats:
        started = time.perf_counter()
        rendered = self._format.render(request, enable_thinking=self._definition.enable_thinking)
        stops = tuple(dict.fromkeys([*rendered.stop, *request.decoding.stop]))
        encoding = self._tokenizer.encode(rendered.text, add_special_tokens=False)
        prompt_tokens = list(encoding.tokens)
        tokenize_ms = (time.perf_counter() - started) * 1000.0
        # Stop strings that are single tokens end generation inside CTranslate2 itself.
        end_tokens = [s for s in stops if self._tokenizer.token_to_id(s) is not None]
        decoding = request.decoding
        sampling: dict[str, Any] = {
            "max_length": decoding.max_tokens,
            "repetition_penalty": decoding.repetition_penalty,
            "end_token": end_tokens or None,
        }
        if decoding.temperature <= 0:
            sampling["sampling_topk"] = 1
        else:
            sampling.update(
                sampling_topk=decoding.top_k or 0,
                sampling_topp=decoding.top_p,
                sampling_temperature=decoding.temperature,
            )
        gen_started = time.perf_counter()
        if decoding.beam_size > 1:
            result = self._generator.generate_batch(
                [prompt_tokens],
                beam_size=decoding.beam_size,
                include_prompt_in_result=False,
                **{k: v for k, v in sampling.items() if not k.startswith("sampling_")},
            )
            best: list[int] = result[0].sequences_ids[0]
            used.prompt_tokens, used.output_tokens = len(prompt_tokens), len(best)
            text, _ = StopScanner(stops).feed(self._tokenizer.decode(best))
            if text:
                send(text)
            total_ms = round((time.perf_counter() - gen_started) * 1000.0, 3)
            return GenerationStats(
                prompt_tokens=len(prompt_tokens),
                output_tokens=len(best),
                tokenize_ms=round(tokenize_ms, 3),
                time_to_first_token_ms=total_ms,
                generate_ms=total_ms,
                finish_reason="length" if len(best) >= decoding.max_tokens else "stop",
            )
        scanner = StopScanner(stops)
        ids: list[int] = []
        sent = ""
        first_ms: float | None = None
        finish = "length"
        for step in self._generator.generate_tokens(prompt_tokens, **sampling):
            # A step means the prompt was prefilled; it is charged from then on.
            used.prompt_tokens = len(prompt_tokens)
            if step.token in end_tokens:
                finish = "stop"
                break
            ids.append(step.token_id)
            used.output_tokens = len(ids)
            decoded = self._tokenizer.decode(ids)
            if decoded.endswith("\ufffd"):
                continue  # half a multi-byte character: wait for the rest
            piece, stopped = scanner.feed(decoded[len(sent) :])
            sent = decoded
            if piece:
                if first_ms is None:
                    first_ms = (time.perf_counter() - started) * 1000.0
                send(piece)
            if stopped:
                finish = "stop"
                break
        else:
            finish = "length" if len(ids) >= decoding.max_tokens else "stop"
        if finish == "length" and (tail := scanner.flush()):
            send(tail)
        return GenerationStats(
            prompt_tokens=len(prompt_tokens),
            output_tokens=len(ids),
            tokenize_ms=round(tokenize_ms, 3),
            time_to_first_token_ms=None if first_ms is None else round(first_ms, 3),
            generate_ms=round((time.perf_counter() - gen_started) * 1000.0, 3),
            finish_reason=finish,  # type: ignore[arg-type]
            stop_sequence=scanner.hit,
        )

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        generator, self._generator = self._generator, None

        def release() -> None:
            nonlocal generator
            del generator
            gc.collect()

        await trio.to_thread.run_sync(release, limiter=self._limiter)


class Ct2Backend(Backend[Ct2Model]):
    config = Ct2Model

    def capabilities(self, definition: Ct2Model) -> Capabilities:
        if definition.embedding:
            return Capabilities(modalities=("text",), kind="embedding")
        return Capabilities(
            modalities=("text",),
            multi_turn=False,
            thinking_modes=thinking_modes(definition.prompt_format),
        )

    def holds_cuda_context(self, definition: Ct2Model) -> bool:
        return definition.device == "cuda"

    def gpus_per_replica(self, definition: Ct2Model) -> int | None:
        # A list of device indices replicates the model, it does not split it.
        return 1

    def effective_target_inflight(self, definition: Ct2Model) -> int:
        # generate_tokens decodes one sequence per call on this replica's one thread (the
        # encoder too runs one batch at a time).
        return 1

    async def load(
        self, definition: Ct2Model, context: LoadContext
    ) -> Ct2Runtime | Ct2EncoderRuntime:
        if definition.embedding:
            return await self._load_encoder(definition, context)
        path = context.model_path(definition.model_path, " (build one with `llm-pool convert ct2`)")
        try:
            import ctranslate2
            import tokenizers
        except ImportError as exc:
            raise BackendError(
                "CTranslate2 is not installed (pip install 'llm-pool[ct2]')"
            ) from exc
        if definition.prompt_format == "model_template":
            raise BackendError("ct2 models take a named prompt_format, not model_template")
        fmt = get_prompt_format(definition.prompt_format)

        def load_blocking() -> tuple[Any, Any]:
            if not (Path(path) / "model.bin").is_file():
                raise BackendError(f"{path} is not a CTranslate2 model folder (no model.bin)")
            if not (Path(path) / "tokenizer.json").is_file():
                raise BackendError(f"{path} has no tokenizer.json")
            try:
                generator = ctranslate2.Generator(
                    str(path),
                    device=definition.device,
                    compute_type=definition.compute_type,
                    **device_options(definition, context.placement),
                )
                tokenizer = tokenizers.Tokenizer.from_file(str(Path(path) / "tokenizer.json"))
            except (RuntimeError, ValueError, OSError) as exc:
                raise BackendError(f"CTranslate2 could not load {path}: {exc}") from exc
            return generator, tokenizer

        generator, tokenizer = await trio.to_thread.run_sync(
            load_blocking, limiter=trio.CapacityLimiter(1)
        )
        return Ct2Runtime(generator, tokenizer, definition, fmt)

    async def _load_encoder(self, definition: Ct2Model, context: LoadContext) -> Ct2EncoderRuntime:
        path = context.model_path(
            definition.model_path, " (build one with `llm-pool convert encoder`)"
        )
        try:
            import ctranslate2  # noqa: F401
            import numpy  # noqa: F401
            import tokenizers  # noqa: F401
        except ImportError as exc:
            raise BackendError(
                "CTranslate2 is not installed (pip install 'llm-pool[ct2]')"
            ) from exc
        options = {
            "device": definition.device,
            "compute_type": definition.compute_type,
            **device_options(definition, context.placement),
        }

        def load_blocking() -> Ct2EncoderRuntime:
            if not (path / "model.bin").is_file():
                raise BackendError(f"{path} is not a CTranslate2 model folder (no model.bin)")
            config = read_sentence_config(path)
            return load_encoder_blocking(path, config, options, definition.embedding_batch_size)

        return await trio.to_thread.run_sync(load_blocking, limiter=trio.CapacityLimiter(1))


BACKEND = Ct2Backend()
