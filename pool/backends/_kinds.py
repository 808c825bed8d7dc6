"""The ``kind`` setting of a backend that serves more than one kind of model.

A model's kind (``chat``, ``embedding``, ``rerank``, ...) comes from its backend and its
settings. A backend that can serve several takes ``kind``; the older ``embedding: true``
still means ``kind: embedding``, and the two are kept in agreement both ways, so code
and config written before kinds existed read the same model.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import BaseModel, Field, model_validator

from pool.backends._protocol import ModelKind

KIND_DESCRIPTION = (
    "What the model serves: `chat` (generation), `embedding` (/v1/embeddings, /api/embed),"
    " `rerank` (/v1/rerank, /v1/score), `transcription`, `speech` or `image`; each backend"
    " takes the kinds its runtime can serve. A request for another kind is a 400"
    " `wrong_model_kind`."
)


class KindFields(BaseModel):
    """``kind`` and its older spelling ``embedding``; a backend lists what it serves in
    ``KINDS``."""

    KINDS: ClassVar[tuple[ModelKind, ...]] = ("chat", "embedding")

    kind: ModelKind = Field("chat", description=KIND_DESCRIPTION)
    embedding: bool = Field(
        False, description="The older spelling of `kind: embedding`, still accepted."
    )

    @model_validator(mode="after")
    def _one_kind(self) -> KindFields:
        if self.embedding and self.kind not in ("chat", "embedding"):
            raise ValueError(f"embedding: true contradicts kind: {self.kind}")
        if self.embedding:
            self.kind = "embedding"
        self.embedding = self.kind == "embedding"
        if self.kind not in self.KINDS:
            served = ", ".join(self.KINDS)
            raise ValueError(
                f"kind {self.kind!r} is not served by this backend (it serves: {served})"
            )
        return self
