"""Rank pooling in-process: one relevance score per (query, document) pair from a GGUF
with a rank head, through llama-cpp-python's low-level calls.

llama-cpp-python's ``Llama.embed`` reads ``n_embd`` floats per sequence, where rank
pooling leaves ``n_cls_out`` (one score), and it tokenizes plain text only, where a pair
needs the vocabulary's special tokens between its parts. So the pairs are tokenized and
decoded here, as llama-server lays them out (its ``format_prompt_rerank``): the GGUF's
``rerank`` template with ``{query}`` and ``{document}`` filled in where it has one, else
``[BOS] query [EOS] [SEP] document [EOS]``, each special token where the vocabulary asks
for it (SEP in place of a missing EOS). As many pairs as fit ``n_batch`` tokens and
``n_seq_max`` sequences go in one decode.

Call only from the runtime's worker thread (the ``llama`` object is not thread-safe).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pool.backends._rerank import RankResult
from pool.errors import BackendError, PoolError

_TOKEN_NULL = -1


def pair_tokens(llama: Any, query: str, document: str) -> list[int]:
    """The tokens of one (query, document) pair, as llama-server forms them."""
    import llama_cpp

    model = llama._model
    vocab = model.vocab
    template = llama_cpp.llama_model_chat_template(model.model, b"rerank")
    if template:
        prompt = template.decode().replace("{query}", query).replace("{document}", document)
        return list(llama.tokenize(prompt.encode(), add_bos=False, special=True))
    query_tokens = list(llama.tokenize(query.encode(), add_bos=False, special=False))
    document_tokens = list(llama.tokenize(document.encode(), add_bos=False, special=False))
    eos = llama_cpp.llama_vocab_eos(vocab)
    sep = llama_cpp.llama_vocab_sep(vocab)
    if eos == _TOKEN_NULL:
        eos = sep
    add_eos = bool(llama_cpp.llama_vocab_get_add_eos(vocab))
    tokens: list[int] = []
    if llama_cpp.llama_vocab_get_add_bos(vocab):
        tokens.append(llama_cpp.llama_vocab_bos(vocab))
    tokens += query_tokens
    if add_eos:
        tokens.append(eos)
    if llama_cpp.llama_vocab_get_add_sep(vocab):
        tokens.append(sep)
    tokens += document_tokens
    if add_eos:
        tokens.append(eos)
    return tokens


def rank_pairs(llama: Any, model_name: str, query: str, documents: Sequence[str]) -> RankResult:
    """One score per document of ``documents`` against ``query`` (the first output of
    the rank head), and the tokens read.

    Raises:
        PoolError: ``invalid_request`` for a pair longer than the context's batch.
        BackendError: llama.cpp failed to decode.
    """
    import llama_cpp

    n_batch = llama.n_batch
    n_seq_max = llama.context_params.n_seq_max
    scores: list[float] = []
    tokens_read = 0
    pending: list[list[int]] = []

    def decode(pairs: list[list[int]]) -> None:
        llama._batch.reset()
        for seq_id, tokens in enumerate(pairs):
            llama._batch.add_sequence(tokens, seq_id, True)
        llama._ctx.kv_cache_clear()
        try:
            llama._ctx.decode(llama._batch)
        except RuntimeError as exc:
            raise BackendError(f"llama.cpp rank pooling failed: {exc}") from exc
        for seq_id in range(len(pairs)):
            scores.append(float(llama_cpp.llama_get_embeddings_seq(llama._ctx.ctx, seq_id)[0]))
        llama._batch.reset()

    try:
        held = 0
        for index, document in enumerate(documents):
            tokens = pair_tokens(llama, query, document)
            if len(tokens) > n_batch:
                raise PoolError(
                    "invalid_request",
                    f"model {model_name!r}: document {index} with the query is {len(tokens)}"
                    f" tokens, more than the {n_batch} the model reads at once",
                )
            tokens_read += len(tokens)
            if pending and (held + len(tokens) > n_batch or len(pending) >= n_seq_max):
                decode(pending)
                pending, held = [], 0
            pending.append(tokens)
            held += len(tokens)
        if pending:
            decode(pending)
    finally:
        llama._ctx.kv_cache_clear()
        llama.reset()
    return RankResult(tuple(scores), tokens_read)
