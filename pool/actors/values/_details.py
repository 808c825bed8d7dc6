"""What clients show of a model (Ollama's ``details``, ``/v1/models``, the dashboard):
its family, parameter size, quantization and context length, read from the artifact's
own metadata, the GGUF header or the ``config.json`` of a transformers or ExLlamaV3
folder. A model without an artifact (stub, remote) has none of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from pool.backends import GgufHeader


class ReadArtifact(Protocol):
    """What the details read of an artifact (``Artifact``, pool/actors/residency/_estimate.py),
    named here because the values floor imports nothing above it."""

    @property
    def kind(self) -> str: ...
    @property
    def gguf(self) -> GgufHeader | None: ...
    @property
    def hf_config(self) -> Mapping[str, Any] | None: ...


# llama.cpp's ``general.file_type`` (enum llama_ftype) as the names its quantizer uses.
_GGUF_FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
}
_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float8_e4m3fn": "FP8"}


@dataclass(frozen=True, slots=True)
class ModelDetails:
    """A model's facts from its artifact; ``None`` where the metadata does not say.

    ``parameter_size`` is written as Ollama writes it (``134.52M``, ``8.0B``);
    ``context_length`` is the context the model was trained for, not the one a load
    configures (the snapshot's ``context_length``). ``hidden_size`` (the embedding
    width), ``num_layers`` and ``vocab_size`` describe the network's shape.
    """

    format: str | None = None
    family: str | None = None
    parameter_count: int | None = None
    parameter_size: str | None = None
    quantization_level: str | None = None
    context_length: int | None = None
    hidden_size: int | None = None
    num_layers: int | None = None
    vocab_size: int | None = None


# The runner spec's spelling of the plain float types (``fp16``, ``bf16``).
_FLOAT_NAMES = {"f16": "fp16", "f32": "fp32", "bf16": "bf16", "fp8": "fp8"}


def quantization_name(level: str | None) -> str | None:
    """A quantization level as the runner spec spells one (``awq-4bit``, ``gptq-4bit``,
    ``fp16``, ``bf16``): lower case, the bits joined by a dash; a GGUF type keeps its
    name (``q4_k_m``)."""
    if not level:
        return None
    text = level.strip().lower()
    if text in _FLOAT_NAMES:
        return _FLOAT_NAMES[text]
    method, _, bits = text.partition(" ")
    return f"{method}-{bits.replace('-', '')}" if bits else text


def same_quantization(asked: str, level: str | None) -> bool:
    """Whether ``asked`` (a runner load's ``quantization``) names the model's ``level``,
    whatever the case and separators (``AWQ 4-bit``, ``awq-4bit``, ``awq_4bit``)."""
    name = quantization_name(level)
    if name is None:
        return False

    def bare(text: str) -> str:
        return "".join(c for c in text.lower() if c.isalnum())

    return bare(quantization_name(asked) or "") == bare(name)


def human_parameters(count: int) -> str:
    """A parameter count as Ollama shows it: one decimal for billions and more, two
    for millions and thousands."""
    for scale, unit, places in ((1e12, "T", 1), (1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 2)):
        if count >= scale:
            return f"{count / scale:.{places}f}{unit}"
    return str(count)


def artifact_details(artifact: ReadArtifact | None) -> ModelDetails:
    """The details of a read artifact (nothing for a model without one)."""
    if artifact is None:
        return ModelDetails()
    if artifact.gguf is not None:
        return _gguf_details(artifact.gguf.metadata, artifact.gguf.parameter_count)
    if artifact.hf_config is not None:
        return _config_details(artifact.hf_config, artifact.kind)
    return ModelDetails(format="gguf" if artifact.kind == "gguf" else None)


def _gguf_details(metadata: Mapping[str, Any], parameters: int) -> ModelDetails:
    family = metadata.get("general.architecture")
    family = family if isinstance(family, str) and family else None

    def arch(key: str) -> int | None:
        # Shape keys are named after the architecture: ``llama.block_count``.
        return _int(metadata, f"{family}.{key}") if family else None

    size = human_parameters(parameters) if parameters else metadata.get("general.size_label")
    file_type = metadata.get("general.file_type")
    return ModelDetails(
        format="gguf",
        family=family,
        parameter_count=parameters or None,
        parameter_size=size if isinstance(size, str) else None,
        quantization_level=_GGUF_FILE_TYPES.get(file_type) if isinstance(file_type, int) else None,
        context_length=arch("context_length"),
        hidden_size=arch("embedding_length"),
        num_layers=arch("block_count"),
        # Not every converter writes it; the tokenizer's list of tokens (read as its
        # length) is the vocabulary too.
        vocab_size=arch("vocab_size") or _int(metadata, "tokenizer.ggml.tokens"),
    )


def _int(config: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def config_parameter_count(config: Mapping[str, Any]) -> int | None:
    """The weights a decoder of this ``config.json`` holds: embeddings (and an untied
    output head), per layer the attention projections, a gated MLP (per expert, for a
    mixture of experts) and two norms, and the final norm. Biases are left out."""
    hidden = _int(config, "hidden_size", "n_embd", "d_model")
    layers = _int(config, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _int(config, "vocab_size")
    heads = _int(config, "num_attention_heads", "n_head")
    if hidden is None or layers is None or vocab is None or heads is None:
        return None
    kv_heads = _int(config, "num_key_value_heads") or heads
    head_dim = _int(config, "head_dim") or hidden // heads
    intermediate = _int(config, "intermediate_size", "n_inner") or 4 * hidden
    experts = _int(config, "num_local_experts", "num_experts", "n_routed_experts") or 1
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    mlp = 3 * hidden * intermediate * experts
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2)
    return embeddings + layers * (attention + mlp + 2 * hidden) + hidden


def _config_details(config: Mapping[str, Any], kind: str) -> ModelDetails:
    # Multimodal configs keep the language model's figures in ``text_config``.
    text = config.get("text_config")
    text = text if isinstance(text, Mapping) else config
    family = config.get("model_type")
    quantization = config.get("quantization_config")
    fmt = "safetensors" if kind == "safetensors" else "transformers"
    level: str | None = None
    if isinstance(quantization, Mapping):
        method = str(quantization.get("quant_method") or "").lower()
        bits = quantization.get("bits")
        if method == "exl3":
            fmt = "exl3"
        if method:
            level = method.upper() + (f" {bits:g}-bit" if isinstance(bits, int | float) else "")
    else:
        dtype = config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype")
        level = _DTYPES.get(str(dtype)) if dtype else None
    parameters = config_parameter_count(text)
    return ModelDetails(
        format=fmt,
        family=family if isinstance(family, str) and family else None,
        parameter_count=parameters,
        parameter_size=human_parameters(parameters) if parameters else None,
        quantization_level=level,
        context_length=_int(text, "max_position_embeddings", "n_positions", "max_seq_len"),
        hidden_size=_int(text, "hidden_size", "n_embd", "d_model"),
        num_layers=_int(text, "num_hidden_layers", "n_layer", "num_layers"),
        vocab_size=_int(text, "vocab_size"),
    )
