"""The ``kind`` setting (pool/backends/_kinds.py) and its older spelling ``embedding``."""

from __future__ import annotations

import pytest

from pool.backends import get_backend
from pool.config import build_settings
from pool.errors import ConfigError


def _definition(**fields: object) -> object:
    settings = build_settings({"engine": {"models": {"m": fields}}})
    return settings.engine.models["m"]


@pytest.mark.parametrize(
    "backend", ["stub", "llama_cpp", "ct2", "llama_server", "openai_remote", "server"]
)
def test_embedding_true_and_kind_embedding_are_one_setting(backend: str) -> None:
    extra: dict[str, object] = {"model_path": "/x.gguf"} if backend != "stub" else {}
    if backend == "openai_remote":
        extra = {"remote_base_url": "http://127.0.0.1:1/v1", "remote_model": "x"}
    if backend == "server":
        extra = {"command": ["any-server", "--port", "${PORT}"]}
    old = _definition(backend=backend, embedding=True, **extra)
    new = _definition(backend=backend, kind="embedding", **extra)
    for definition in (old, new):
        assert definition.kind == "embedding" and definition.embedding is True  # type: ignore[attr-defined]
        assert get_backend(backend).capabilities(definition).kind == "embedding"  # type: ignore[arg-type]
    plain = _definition(backend=backend, **extra)
    assert plain.kind == "chat" and plain.embedding is False  # type: ignore[attr-defined]
    assert get_backend(backend).capabilities(plain).generation  # type: ignore[arg-type]


def test_a_kind_the_backend_cannot_serve_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="kind 'speech' is not served by this backend"):
        _definition(backend="llama_cpp", model_path="/x.gguf", kind="speech")
    with pytest.raises(ConfigError, match="embedding: true contradicts kind: rerank"):
        _definition(backend="stub", kind="rerank", embedding=True)
    # A chat-only backend has no kind field at all.
    with pytest.raises(ConfigError, match="kind"):
        _definition(backend="exllamav3", model_path="/x", kind="embedding")
    chat_only = _definition(backend="exllamav3", model_path="/x")
    assert get_backend("exllamav3").capabilities(chat_only).kind == "chat"  # type: ignore[arg-type]
