"""The ``exllamav3`` backend: EXL3 models in-process, CUDA only (its runtime is not built yet).

Its models validate, list and show their tables; a load fails with ``load_failed``
and says the backend is not available. The KV cache quantization is one setting,
``exllama_cache_quant`` (``"<bits>"`` or ``"<k_bits>,<v_bits>"``); a load may instead
send ``exllama_cache_k_bits`` and ``exllama_cache_v_bits`` together, which become it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, PositiveInt

from pool.backends._protocol import LoadOverrides
from pool.backends._unavailable import UnavailableBackend
from pool.config import CommonModelFields, invalid_load_request


class ExLlamaV3Model(CommonModelFields):
    """An ExLlamaV3 (EXL3) model in-process; CUDA only."""

    backend: Literal["exllamav3"] = "exllamav3"
    device: str = "cuda"
    exllama_cache_size: PositiveInt = 8192
    exllama_cache_quant: str | None = None
    exllama_gpu_split: list[float] | None = None
    exllama_tensor_parallel: bool = False
    exllama_tp_backend: str | None = None
    exllama_max_batch_size: PositiveInt | None = None
    exllama_max_chunk_size: PositiveInt | None = None
    exllama_max_q_size: PositiveInt | None = None
    exllama_max_rq_tokens: PositiveInt | None = None


class ExLlamaV3LoadOverrides(LoadOverrides):
    exllama_cache_size: PositiveInt | None = None
    exllama_cache_quant: str | None = None
    exllama_cache_k_bits: Annotated[int, Field(ge=0, le=64)] | None = None
    exllama_cache_v_bits: Annotated[int, Field(ge=0, le=64)] | None = None
    exllama_max_rq_tokens: PositiveInt | None = None


def _exllama_bits() -> dict[str, Any]:
    return {
        "kind": "integer_or_null",
        "minimum": 2,
        "maximum": 8,
        "default": None,
        "null_means": "fp16",
        "allowed_values": [2, 3, 4, 5, 6, 7, 8],
    }


LOAD_CONSTRAINTS: dict[str, dict[str, Any]] = {
    "exllama_cache_size": {"kind": "integer", "minimum": 256, "step": 256},
    "exllama_max_rq_tokens": {"kind": "integer", "minimum": 1, "step": 1},
    "exllama_cache_k_bits": _exllama_bits(),
    "exllama_cache_v_bits": _exllama_bits(),
    "exllama_cache_quant": {"kind": "string_or_null", "format": "<bits>|<k_bits>,<v_bits>"},
}

LOAD_RECOMMENDATIONS: dict[str, dict[str, Any]] = {
    "exllama_cache_bit_pairs": {
        "kind": "pair_presets",
        "fields": ["exllama_cache_k_bits", "exllama_cache_v_bits"],
        "recommended_pairs": [
            {"label": "fp16", "exllama_cache_k_bits": None, "exllama_cache_v_bits": None},
            {"label": "8/8", "exllama_cache_k_bits": 8, "exllama_cache_v_bits": 8},
            {"label": "8/4", "exllama_cache_k_bits": 8, "exllama_cache_v_bits": 4},
        ],
    }
}

_CACHE_QUANT = re.compile(r"^([2-8])(?:,([2-8]))?$")


class ExLlamaV3Backend(UnavailableBackend[ExLlamaV3Model]):
    config = ExLlamaV3Model
    load_overrides = ExLlamaV3LoadOverrides
    load_constraints = LOAD_CONSTRAINTS
    load_recommendations = LOAD_RECOMMENDATIONS
    context_field = "exllama_cache_size"

    def check_load_override(self, patch: Mapping[str, Any]) -> None:
        super().check_load_override(patch)
        quant = patch.get("exllama_cache_quant")
        if quant is not None and not _CACHE_QUANT.match(str(quant)):
            raise invalid_load_request(
                f"exllama_cache_quant must be '<bits>' or '<k_bits>,<v_bits>' with bits 2-8"
                f" (got {quant!r})",
                "exllama_cache_quant",
            )
        has_k, has_v = "exllama_cache_k_bits" in patch, "exllama_cache_v_bits" in patch
        if has_k != has_v:
            raise invalid_load_request(
                "exllama_cache_k_bits and exllama_cache_v_bits must be sent together"
            )
        if has_k and "exllama_cache_quant" in patch:
            raise invalid_load_request(
                "exllama_cache_quant cannot be combined with"
                " exllama_cache_k_bits/exllama_cache_v_bits"
            )
        if has_k and (patch["exllama_cache_k_bits"] is None) != (
            patch["exllama_cache_v_bits"] is None
        ):
            raise invalid_load_request(
                "exllama_cache_k_bits and exllama_cache_v_bits must both be null or both set"
            )

    def apply_load_override(
        self, definition: ExLlamaV3Model, patch: Mapping[str, Any]
    ) -> ExLlamaV3Model:
        update = dict(patch)
        if "exllama_cache_k_bits" in update:
            k, v = update.pop("exllama_cache_k_bits"), update.pop("exllama_cache_v_bits")
            update["exllama_cache_quant"] = None if k is None else f"{k},{v}"
        return super().apply_load_override(definition, update)


BACKEND = ExLlamaV3Backend()
