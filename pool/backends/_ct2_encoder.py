"""A sentence-embedding model on CTranslate2's encoder: the ``ct2`` backend's
``embedding: true``.

CTranslate2 runs the transformer (a BERT such as all-MiniLM-L6-v2, built by
``llm-pool convert encoder``) and hands back a vector per token; the model's own
sentence-transformers config, copied into the folder by the conversion, says how they
become one vector per text (:mod:`pool.backends._sentence_pooling`).
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import trio

from pool.backends._protocol import (
    EmbeddingJob,
    EmbeddingResult,
    GenerationRequest,
    GenerationStats,
    TokenSink,
)
from pool.backends._sentence_pooling import SentenceConfig, pool_and_normalize
from pool.errors import BackendError, PoolError


class Ct2EncoderRuntime:
    """Embeds texts with a ``ctranslate2.Encoder``, one batch at a time on one thread."""

    def __init__(
        self, encoder: Any, tokenizer: Any, config: SentenceConfig, batch_size: int
    ) -> None:
        self._encoder = encoder
        self._tokenizer = tokenizer
        self._config = config
        self._batch_size = batch_size
        self._limiter = trio.CapacityLimiter(1)
        self._closed = False

    @property
    def vram_mib(self) -> int | None:
        return None

    @property
    def sentence_config(self) -> SentenceConfig:
        return self._config

    async def generate(self, request: GenerationRequest, sink: TokenSink) -> GenerationStats:
        # Never reached: an embedding model's capabilities refuse generation at admission.
        raise PoolError(
            "wrong_model_kind",
            "an encoder model only embeds",
            details={"kind": "embedding", "wanted": "chat"},
        )

    async def embed(self, job: EmbeddingJob) -> EmbeddingResult:
        if self._closed:
            raise BackendError("the ct2 runtime is closed")
        return await trio.to_thread.run_sync(self._embed_blocking, job, limiter=self._limiter)

    def _embed_blocking(self, job: EmbeddingJob) -> EmbeddingResult:
        import numpy as np

        # The tokenizer cuts at the model's max_seq_length, keeping [CLS] and [SEP]; what
        # it cut is in `overflowing`, which makes the text a 400 when truncate is off.
        encodings = self._tokenizer.encode_batch(list(job.texts))
        if not job.truncate and (cut := [i for i, e in enumerate(encodings) if e.overflowing]):
            raise PoolError(
                "invalid_request",
                f"model {job.model!r}: input {cut[0]} is longer than the model's"
                f" {self._config.max_tokens} tokens (send shorter texts or truncate: true)",
            )
        ids = [list(e.ids) for e in encodings]
        vectors: list[Any] = [None] * len(ids)
        # Texts of similar length share a batch, so little of it is padding.
        order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
        for start in range(0, len(order), self._batch_size):
            batch = order[start : start + self._batch_size]
            try:
                output = self._encoder.forward_batch([ids[i] for i in batch])
            except (RuntimeError, ValueError) as exc:
                raise BackendError(f"CTranslate2's encoder failed: {exc}") from exc
            hidden = output.last_hidden_state
            if hidden.device != "cpu":
                import ctranslate2

                hidden = hidden.to_device(ctranslate2.Device.cpu)
            pooled = pool_and_normalize(
                np.asarray(hidden, dtype=np.float32), [len(ids[i]) for i in batch], self._config
            )
            for row, index in enumerate(batch):
                vectors[index] = tuple(float(x) for x in pooled[row])
        return EmbeddingResult(tuple(vectors), sum(len(i) for i in ids))

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        encoder, self._encoder = self._encoder, None

        def release() -> None:
            nonlocal encoder
            del encoder
            gc.collect()

        await trio.to_thread.run_sync(release, limiter=self._limiter)


def load_encoder_blocking(
    path: Path, config: SentenceConfig, options: dict[str, Any], batch_size: int
) -> Ct2EncoderRuntime:
    """Open the encoder and its tokenizer in ``path`` (``options``: ``ctranslate2.Encoder``'s
    device, compute type and device index). Blocking: call it on a worker thread."""
    import ctranslate2
    import tokenizers

    if not (path / "tokenizer.json").is_file():
        raise BackendError(f"{path} has no tokenizer.json")
    try:
        encoder = ctranslate2.Encoder(str(path), **options)
        tokenizer = tokenizers.Tokenizer.from_file(str(path / "tokenizer.json"))
    except (RuntimeError, ValueError, OSError) as exc:
        raise BackendError(f"CTranslate2 could not load {path}: {exc}") from exc
    # A checkout's tokenizer.json may pad every text to a fixed length (all-MiniLM-L6-v2's
    # pads to 128) and cut at another bound than the model's: the encoder would then
    # attend to the padding. Each text is encoded on its own; the bound is the model's.
    tokenizer.no_padding()
    tokenizer.enable_truncation(config.max_tokens)
    return Ct2EncoderRuntime(encoder, tokenizer, config, batch_size)
