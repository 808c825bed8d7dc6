"""LoRA adapters for SmolLM2 written offline with the ``gguf`` package.

No adapter can be downloaded here, so the tests make their own: low-rank pairs on
every layer's query projection (``blk.N.attn_q.weight``), in the file form llama.cpp's
``convert_lora_to_gguf.py`` writes and ``llama-adapter.cpp`` loads:

- ``general.type = adapter``, ``general.architecture`` the base's (llama.cpp refuses an
  adapter of another architecture), ``adapter.type = lora``, ``adapter.lora.alpha``
  (float32; the applied scale is ``alpha / rank`` times the runtime scale);
- ``<base tensor>.lora_a`` with ggml shape ``[in, rank]`` and ``.lora_b`` with
  ``[rank, out]``. The writer reverses numpy's axes, so the arrays are ``(rank, in)``
  and ``(out, rank)``: PEFT's own ``nn.Linear`` layout.

A zero adapter (``lora_b`` all zeros, as PEFT initialises one) changes nothing; a
non-zero one moves the query projections far enough that greedy output changes.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pool.backends._gguf import read_gguf_header

RANK = 8
ALPHA = 8.0
# Scale of the random factors: the product's entries are about 0.25, several times
# SmolLM2-135M's own query weights, so each seed makes the model say something else.
SPREAD = 0.3


def write(path: Path, base: Path, *, seed: int = 1, zero: bool = False) -> Path:
    """Write a LoRA adapter for the GGUF ``base`` to ``path``; returns ``path``.

    Args:
        path: where the adapter goes.
        base: the base model's GGUF (its architecture and shapes are read from it).
        seed: picks the random factors (each seed makes another adapter).
        zero: ``lora_b`` all zeros: loads and applies, and changes nothing.
    """
    import gguf

    metadata = read_gguf_header(base).metadata
    arch = str(metadata["general.architecture"])
    width = int(metadata[f"{arch}.embedding_length"])
    layers = int(metadata[f"{arch}.block_count"])
    heads = int(metadata[f"{arch}.attention.head_count"])
    head_dim = int(metadata.get(f"{arch}.attention.key_length", width // heads))
    q_out = heads * head_dim
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, ALPHA)
    for layer in range(layers):
        name = f"blk.{layer}.attn_q.weight"
        lora_a = (rng.standard_normal((RANK, width)) * SPREAD).astype(np.float32)
        lora_b = (rng.standard_normal((q_out, RANK)) * SPREAD).astype(np.float32)
        if zero:
            lora_b[:] = 0.0
        writer.add_tensor(f"{name}.lora_a", lora_a)
        writer.add_tensor(f"{name}.lora_b", lora_b)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
