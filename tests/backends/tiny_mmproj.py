"""A tiny multimodal projector GGUF for SmolLM2, with random weights, written offline.

llama-server serves images only with a projector (``--mmproj``) whose output width is the
text model's embedding width, and no vision GGUF can be downloaded here. This writes a
LLaVA-style one (llama.cpp's ``mlp`` projector type): a 2-layer ViT over 32x32-pixel
images in 8-pixel patches, then ``mm.0``/``mm.2`` to SmolLM2-135M's 576 wide embeddings.
Each image becomes :data:`TOKENS_PER_IMAGE` embeddings in the prompt. The answers it
gives are noise; the test checks the plumbing (the server decoded the image and put its
tokens in the prompt), not what the model says of it.

The names and keys are those llama.cpp's ``tools/mtmd/clip.cpp`` loads for ``mlp``
(``clip.vision.*`` hyperparameters, ``v.blk.N.*`` layers, ``mm.0``/``mm.2``).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

IMAGE_SIZE = 32
PATCH_SIZE = 8
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2
WIDTH = 64
FEED_FORWARD = 128
LAYERS = 2
HEADS = 2
TEXT_WIDTH = 576  # SmolLM2-135M's n_embd


def write(path: Path) -> Path:
    """Write the projector to ``path`` (float32, about 1 MB); returns ``path``."""
    import gguf

    rng = np.random.default_rng(0)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer = gguf.GGUFWriter(str(path), "clip")
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", WIDTH)
    writer.add_uint32("clip.vision.feed_forward_length", FEED_FORWARD)
    writer.add_uint32("clip.vision.block_count", LAYERS)
    writer.add_uint32("clip.vision.projection_dim", TEXT_WIDTH)
    writer.add_uint32("clip.vision.attention.head_count", HEADS)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    # numpy shapes are ggml's ne reversed: (out, in) for a matrix, (OC, IC, KH, KW) for
    # the patch convolution.
    tensors = {
        "v.patch_embd.weight": weights(WIDTH, 3, PATCH_SIZE, PATCH_SIZE),
        "v.position_embd.weight": weights(TOKENS_PER_IMAGE, WIDTH),
        "mm.0.weight": weights(TEXT_WIDTH, WIDTH),
        "mm.0.bias": np.zeros(TEXT_WIDTH, np.float32),
        "mm.2.weight": weights(TEXT_WIDTH, TEXT_WIDTH),
        "mm.2.bias": np.zeros(TEXT_WIDTH, np.float32),
    }
    for layer in range(LAYERS):
        block = f"v.blk.{layer}"
        for norm in ("ln1", "ln2"):
            tensors[f"{block}.{norm}.weight"] = np.ones(WIDTH, np.float32)
            tensors[f"{block}.{norm}.bias"] = np.zeros(WIDTH, np.float32)
        for projection in ("attn_q", "attn_k", "attn_v", "attn_out"):
            tensors[f"{block}.{projection}.weight"] = weights(WIDTH, WIDTH)
            tensors[f"{block}.{projection}.bias"] = np.zeros(WIDTH, np.float32)
        tensors[f"{block}.ffn_up.weight"] = weights(FEED_FORWARD, WIDTH)
        tensors[f"{block}.ffn_up.bias"] = np.zeros(FEED_FORWARD, np.float32)
        tensors[f"{block}.ffn_down.weight"] = weights(WIDTH, FEED_FORWARD)
        tensors[f"{block}.ffn_down.bias"] = np.zeros(WIDTH, np.float32)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
