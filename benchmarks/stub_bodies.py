"""The bodies a zero-work stub answers, for the bare baseline to answer identically."""

from __future__ import annotations

from typing import Any

WORD = "tok"


def stub_text(tokens: int) -> str:
    return " ".join([WORD] * tokens)


def _metrics(tokens: int) -> dict[str, Any]:
    return {
        "backend_inference_wall_ms": 0.1,
        "engine_total_wall_ms": 0.2,
        "engine_outside_backend_wall_ms": 0.1,
        "pool_total_wall_ms": 0.3,
        "engine_queue_wait_ms": 0.01,
        "engine_tokenize_ms": None,
        "gpu_time_to_first_token_ms": 0.02,
        "gpu_generate_total_ms": 0.1,
        "gpu_decode_after_first_token_ms": 0.08,
        "engine_prompt_tokens": tokens,
        "engine_output_tokens": tokens,
        "engine_tokens_per_second": 1000.0,
    }


def envelope(tokens: int) -> dict[str, Any]:
    text = stub_text(tokens)
    return {
        "id": "resp_0123456789abcdef0123456789abcdef",
        "object": "response",
        "model": "stub",
        "output": [{"type": "output_text", "text": text}],
        "output_text": text,
        "finish_reason": "stop",
        "metrics": _metrics(tokens),
    }


def events(tokens: int) -> list[dict[str, Any]]:
    words = stub_text(tokens).split(" ")
    pieces = [words[0]] + [" " + w for w in words[1:]]
    return (
        [
            {
                "type": "response.created",
                "id": "resp_0123456789abcdef0123456789abcdef",
                "model": "stub",
            }
        ]
        + [{"type": "response.output_text.delta", "delta": p} for p in pieces]
        + [
            {"type": "response.metrics", "metrics": _metrics(tokens)},
            {"type": "response.completed", "response": envelope(tokens)},
        ]
    )
