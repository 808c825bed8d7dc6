"""A tiny BERT reranker GGUF with random weights and a rank head, written offline.

No GGUF with a rank head can be downloaded here, and the chat GGUF at hand (SmolLM2, a
``llama`` architecture) has no place for one: llama.cpp loads a rank head
(``cls.output``) only for the architectures whose rerankers it converts, BERT among
them. So this writes a BERT of two layers, 32 wide, over a vocabulary of a few hundred
words, with ``cls`` and ``cls.output``: llama.cpp's rank pooling reads the ``[CLS]``
vector of each ``[CLS] query [SEP] document [SEP]`` through them to one score.

The scores are noise from seeded weights, the same on every run: the tests check the
plumbing (the runtime read each pair and the pool returns its scores, in batches, in
order, the same as the runtime gives them directly), not which document is relevant.

The names and keys are those llama.cpp loads for ``bert`` (``token_embd``,
``position_embd``, ``token_types``, ``blk.N.*``, ``cls``, ``cls.output``; a WordPiece
vocabulary whose word-initial pieces start with ``▁``, BERT's special ids).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

WIDTH = 32
FEED_FORWARD = 64
LAYERS = 2
HEADS = 2
CONTEXT = 512
# BERT's special ids, which llama.cpp's WordPiece vocabulary assumes.
PAD, UNK, CLS, SEP, MASK = 0, 100, 101, 102, 103
_TEXT = (
    "the a an is are was of in on to and for with what where who how why which "
    "capital city country france paris germany berlin spain madrid italy rome river "
    "sea mountain cat dog bird fish tree house car train plane bike tyre tire flat "
    "fix repair bread bake cook music guitar play game chess food pasta water fire "
    "sun moon star sky red blue green big small old new fast slow good bad first last "
    "one two three large largest famous europe language speak people live lives many "
    "most best tall tower eiffel museum"
)
# The vocabulary's words (its pieces all whole words: no ``##`` continuations).
WORDS = tuple(_TEXT.split())


def vocabulary() -> list[str]:
    """The tokens in id order: BERT's special ids in place, then the words."""
    tokens = [f"[unused{i}]" for i in range(MASK + 1)]
    for index, special in ((PAD, "[PAD]"), (UNK, "[UNK]"), (CLS, "[CLS]"), (SEP, "[SEP]"),
                           (MASK, "[MASK]")):  # fmt: skip
        tokens[index] = special
    return tokens + ["\u2581" + word for word in WORDS]


def write(
    path: Path,
    width: int = WIDTH,
    layers: int = LAYERS,
    feed_forward: int = FEED_FORWARD,
    heads: int = HEADS,
) -> Path:
    """Write the reranker to ``path`` (float32; about 200 kB at the default size, which
    a benchmark raises to a real cross-encoder's: ms-marco-MiniLM-L-6-v2 is 384 wide, 6
    layers, 1536 feed-forward, 12 heads); returns ``path``."""
    import gguf

    rng = np.random.default_rng(7)

    def weights(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    tokens = vocabulary()
    writer = gguf.GGUFWriter(str(path), "bert")
    writer.add_name("tiny-reranker")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(width)
    writer.add_feed_forward_length(feed_forward)
    writer.add_block_count(layers)
    writer.add_head_count(heads)
    writer.add_layer_norm_eps(1e-12)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.RANK)
    writer.add_tokenizer_model("bert")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL if t.startswith("[") else gguf.TokenType.NORMAL for t in tokens]
    )
    writer.add_token_type_count(2)
    writer.add_bos_token_id(CLS)
    writer.add_eos_token_id(SEP)
    writer.add_sep_token_id(SEP)
    writer.add_unk_token_id(UNK)
    writer.add_pad_token_id(PAD)
    writer.add_mask_token_id(MASK)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(True)
    # numpy shapes are ggml's ne reversed: (out, in) for a matrix.
    tensors = {
        "token_embd.weight": weights(len(tokens), width),
        "token_types.weight": weights(2, width),
        "position_embd.weight": weights(CONTEXT, width),
        "token_embd_norm.weight": np.ones(width, np.float32),
        "token_embd_norm.bias": np.zeros(width, np.float32),
        "cls.weight": weights(width, width),
        "cls.bias": np.zeros(width, np.float32),
        "cls.output.weight": weights(1, width),
        "cls.output.bias": np.zeros(1, np.float32),
    }
    for layer in range(layers):
        block = f"blk.{layer}"
        for projection in ("attn_q", "attn_k", "attn_v", "attn_output"):
            tensors[f"{block}.{projection}.weight"] = weights(width, width)
            tensors[f"{block}.{projection}.bias"] = np.zeros(width, np.float32)
        for norm in ("attn_output_norm", "layer_output_norm"):
            tensors[f"{block}.{norm}.weight"] = np.ones(width, np.float32)
            tensors[f"{block}.{norm}.bias"] = np.zeros(width, np.float32)
        tensors[f"{block}.ffn_up.weight"] = weights(feed_forward, width)
        tensors[f"{block}.ffn_up.bias"] = np.zeros(feed_forward, np.float32)
        tensors[f"{block}.ffn_down.weight"] = weights(width, feed_forward)
        tensors[f"{block}.ffn_down.bias"] = np.zeros(width, np.float32)
    for name, tensor in tensors.items():
        writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
