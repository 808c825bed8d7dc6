"""The VRAM estimate chain: what a load of a model will take before it is measured.

In order, the first that answers wins (docs/vram.md):

1. ``vram_mb`` from the model's definition (the operator knows best);
2. a measured footprint: this load's delta, or one kept from an earlier load that was
   the same load: same files, same memory-relevant settings (``_footprints.py``);
3. a closed form from the artifact's own metadata: weights + KV cache for the context
   and cache types + a compute buffer, from the GGUF header or the HF ``config.json``;
4. the artifact's size x 1.1 (GGUF) or x 1.3 (safetensors and other folders);
5. the parameter count and quantization in the model's name.

Steps 3 to 5 count only what the load puts on the GPU: a llama.cpp model with some of
its layers on the CPU (``gguf_n_gpu_layers``, ``llama_server_n_gpu_layers``) is charged
their share (:func:`gpu_layer_shares`), and one with none there nothing.

Reading an artifact is blocking file I/O: :func:`read_artifact` runs in a worker
thread, once per model path; everything after it is arithmetic on what it read.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pool.backends import GgufHeader, MemoryProfile, file_identity, read_gguf_header
from pool.config import resolve_model_path

MIB = 1024 * 1024
GGUF_SIZE_FACTOR = 1.1
SAFETENSORS_SIZE_FACTOR = 1.3
# llama.cpp's default micro-batch: the compute buffer holds activations for this many tokens.
_UBATCH = 512
# Bytes per element of the KV cache types llama.cpp and vLLM accept (block formats
# averaged over their block: q8_0 is 34 bytes per 32 values).
_CACHE_TYPE_BYTES: dict[str, float] = {
    "f32": 4.0,
    "float32": 4.0,
    "f16": 2.0,
    "float16": 2.0,
    "bf16": 2.0,
    "bfloat16": 2.0,
    "auto": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
    "iq4_nl": 18 / 32,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
}

ArtifactKind = Literal["gguf", "safetensors", "folder", "file"]


@dataclass(frozen=True, slots=True)
class Artifact:
    """What the pool knows of a model's files: their size and their own metadata."""

    size_bytes: int
    kind: ArtifactKind
    gguf: GgufHeader | None = None
    hf_config: Mapping[str, Any] | None = None
    weights_bytes: int = 0  # safetensors (or GGUF tensor data) bytes
    error: str | None = field(default=None, compare=False)
    # Changes whenever the files are replaced (pool/backends/_file_identity.py): a
    # footprint measured with other files is not this one's.
    identity: str | None = field(default=None, compare=False)

    @property
    def size_mib(self) -> int:
        return max(1, math.ceil(self.size_bytes / MIB))


# -- reading ---------------------------------------------------------------------------


def read_artifact(model_path: str | None, base_dir: str | None) -> Artifact | None:
    """Size and metadata of a model file or folder (blocking); None when unset or unreadable."""
    if not model_path:
        return None
    try:
        path = resolve_model_path(model_path, base_dir)
        identity = file_identity(path)
        if path.is_dir():
            files = [p for p in path.rglob("*") if p.is_file()]
            size = sum(p.stat().st_size for p in files)
            weights = sum(p.stat().st_size for p in files if p.suffix == ".safetensors")
            config = _read_hf_config(path / "config.json")
            kind: ArtifactKind = "safetensors" if weights else "folder"
            return Artifact(size, kind, hf_config=config, weights_bytes=weights, identity=identity)
        size = path.stat().st_size
    except OSError:
        return None
    if path.suffix.lower() != ".gguf":
        return Artifact(size, "file", identity=identity)
    try:
        header = read_gguf_header(path)
    except (OSError, ValueError, struct.error) as exc:
        return Artifact(size, "gguf", error=f"unreadable GGUF header: {exc}", identity=identity)
    return Artifact(
        size, "gguf", gguf=header, weights_bytes=header.weights_bytes, identity=identity
    )


def _read_hf_config(path: Path) -> Mapping[str, Any] | None:
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


# -- closed forms -----------------------------------------------------------------------


def cache_type_bytes(name: str | None, default: float = 2.0) -> float:
    """Bytes per element of a KV cache type (``None``: the backend's default, f16)."""
    if name is None:
        return default
    return _CACHE_TYPE_BYTES.get(name.lower(), default)


def kv_cache_bytes(
    *,
    layers: int,
    context: int,
    kv_heads: int,
    key_len: int,
    value_len: int,
    profile: MemoryProfile,
) -> float:
    per_token = kv_heads * (
        key_len * cache_type_bytes(profile.type_k) + value_len * cache_type_bytes(profile.type_v)
    )
    return layers * context * per_token


@dataclass(frozen=True, slots=True)
class GpuShares:
    """What part of a llama.cpp model its GPU layer count puts on the GPU."""

    weights: float  # of the weights: the repeating layers, and the output layer
    kv_cache: float  # of the KV cache: one per repeating layer, beside its layer
    compute: bool  # the compute buffer: there as soon as one layer is


_ON_GPU = GpuShares(1.0, 1.0, True)


def gpu_layer_shares(gpu_layers: int | str | None, blocks: int | None) -> GpuShares:
    """The GPU's share of a model of ``blocks`` repeating layers with ``gpu_layers``
    offloaded (llama.cpp's ``n_gpu_layers`` / ``-ngl``).

    llama.cpp offloads the last ``n`` repeating layers, with their KV cache, and the
    output layer once ``n`` exceeds the blocks; the token embeddings stay on the CPU.
    The weights count as ``blocks + 1`` equal parts (the output layer one of them).
    Every layer: a negative count, ``all``, or unset or ``auto`` (the backend's
    default, or a fit only the backend knows: counted in full). ``0``: nothing on the
    GPU. With ``blocks`` unknown a positive count is counted in full.
    """
    if isinstance(gpu_layers, str):
        text = gpu_layers.strip().lower()
        gpu_layers = int(text) if text.lstrip("-").isdigit() else None
    if gpu_layers is None or gpu_layers < 0:
        return _ON_GPU
    if gpu_layers == 0:
        return GpuShares(0.0, 0.0, False)
    if not blocks or gpu_layers > blocks:
        return _ON_GPU
    return GpuShares(gpu_layers / (blocks + 1), gpu_layers / blocks, True)


def gguf_blocks(header: GgufHeader | None) -> int | None:
    """The repeating layers of a GGUF model, from its header; None if it does not say."""
    if header is None:
        return None
    arch = header.metadata.get("general.architecture")
    try:
        return int(header.metadata[f"{arch}.block_count"])
    except (KeyError, TypeError, ValueError):
        return None


def gguf_closed_form_mib(header: GgufHeader, profile: MemoryProfile) -> int | None:
    """Weights + KV cache + compute buffer of one llama.cpp context on the GPU, in MiB.

    The compute buffer holds one micro-batch's logits and attention scores (f32);
    only the layers ``profile.gpu_layers`` puts on the GPU count
    (:func:`gpu_layer_shares`). None when the header lacks the dimensions.
    """
    md = header.metadata
    arch = md.get("general.architecture")
    try:
        layers = int(md[f"{arch}.block_count"])
        embd = int(md[f"{arch}.embedding_length"])
        heads = int(md[f"{arch}.attention.head_count"])
    except (KeyError, TypeError, ValueError):
        return None
    kv_heads = int(md.get(f"{arch}.attention.head_count_kv", heads))
    key_len = int(md.get(f"{arch}.attention.key_length", embd // max(1, heads)))
    value_len = int(md.get(f"{arch}.attention.value_length", embd // max(1, heads)))
    vocab = int(md.get(f"{arch}.vocab_size") or md.get("tokenizer.ggml.tokens") or 0)
    context = profile.context or int(md.get(f"{arch}.context_length", 4096))
    kv = kv_cache_bytes(
        layers=layers,
        context=context,
        kv_heads=kv_heads,
        key_len=key_len,
        value_len=value_len,
        profile=profile,
    )
    ubatch = min(profile.batch or _UBATCH, _UBATCH)
    compute = ubatch * (vocab + 4 * embd) * 4 + ubatch * context * heads * 4
    share = gpu_layer_shares(profile.gpu_layers, layers)
    on_gpu = (
        header.weights_bytes * share.weights
        + kv * share.kv_cache
        + (compute if share.compute else 0)
    )
    return math.ceil(on_gpu / MIB)


def hf_closed_form_mib(
    config: Mapping[str, Any], weights_bytes: int, profile: MemoryProfile
) -> int | None:
    """Weights (the safetensors) + KV cache + activations from an HF ``config.json``."""
    text = config.get("text_config")
    dims = text if isinstance(text, Mapping) else config
    try:
        layers = int(dims["num_hidden_layers"])
        hidden = int(dims["hidden_size"])
        heads = int(dims["num_attention_heads"])
    except (KeyError, TypeError, ValueError):
        return None
    if not weights_bytes:
        return None
    kv_heads = int(dims.get("num_key_value_heads") or heads)
    head_dim = int(dims.get("head_dim") or hidden // max(1, heads))
    vocab = int(dims.get("vocab_size") or config.get("vocab_size") or 0)
    context = profile.context or int(dims.get("max_position_embeddings") or 4096)
    dtype = str(dims.get("torch_dtype") or config.get("torch_dtype") or "float16")
    element = cache_type_bytes(dtype)
    default = MemoryProfile(type_k=profile.type_k or dtype, type_v=profile.type_v or dtype)
    kv = kv_cache_bytes(
        layers=layers,
        context=context,
        kv_heads=kv_heads,
        key_len=head_dim,
        value_len=head_dim,
        profile=default,
    )
    compute = _UBATCH * (vocab + 4 * hidden) * max(element, 2.0)
    return math.ceil((weights_bytes + kv + compute) / MIB)


def closed_form_mib(artifact: Artifact, profile: MemoryProfile) -> int | None:
    """The artifact's own metadata as one replica's footprint; None if it has none."""
    if artifact.gguf is not None:
        return gguf_closed_form_mib(artifact.gguf, profile)
    if artifact.hf_config is not None:
        return hf_closed_form_mib(artifact.hf_config, artifact.weights_bytes, profile)
    return None


def size_estimate_mib(artifact: Artifact, gpu_layers: int | str | None = None) -> int:
    """The artifact's size with the spec's margin: x 1.1 for GGUF, x 1.3 otherwise;
    of a llama.cpp model, the weights' share that ``gpu_layers`` puts on the GPU."""
    factor = GGUF_SIZE_FACTOR if artifact.kind == "gguf" else SAFETENSORS_SIZE_FACTOR
    share = gpu_layer_shares(gpu_layers, gguf_blocks(artifact.gguf)).weights
    if share == 0:
        return 0
    return max(1, math.ceil(artifact.size_bytes * factor * share / MIB))


_PARAMS = re.compile(r"(\d+(?:\.\d+)?)([bm])(?![a-z])", re.IGNORECASE)
_BITS = (
    (re.compile(r"(?<![a-z])(q2|iq2)", re.I), 2.6),
    (re.compile(r"(?<![a-z])(q3|iq3)", re.I), 3.5),
    (re.compile(r"(?<![a-z])(q4|iq4|int4|4bit|awq|gptq|nf4)", re.I), 4.5),
    (re.compile(r"(?<![a-z])(q5)", re.I), 5.5),
    (re.compile(r"(?<![a-z])(q6)", re.I), 6.6),
    (re.compile(r"(?<![a-z])(q8|int8|8bit|fp8)", re.I), 8.5),
)


def name_estimate_mib(*names: str | None, gpu_layers: int | str | None = None) -> int | None:
    """A guess from a name such as ``mistral-24b-instruct-q4_k_m``: parameters x bits of
    the quantization named (16 when none) x 1.2 for the cache and buffers; nothing for
    a model ``gpu_layers`` keeps off the GPU (``0``)."""
    for name in names:
        if not name:
            continue
        stem = Path(name).name
        match = _PARAMS.search(stem)
        if match is None:
            continue
        params = float(match.group(1)) * (1e9 if match.group(2).lower() == "b" else 1e6)
        bits = next((b for pattern, b in _BITS if pattern.search(stem)), 16.0)
        if gpu_layer_shares(gpu_layers, None).weights == 0:
            return 0
        return max(1, math.ceil(params * bits / 8 * 1.2 / MIB))
    return None
