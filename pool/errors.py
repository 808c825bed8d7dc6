"""The pool's own error types: one class, a machine-readable code, an HTTP status.

Every layer translates what it catches into a :class:`PoolError` at its boundary, so
the HTTP surface can render any failure as ``{"error": {"code", "message", ...}}``
without knowing where it came from.
"""

from __future__ import annotations

from typing import Any

# The status for every code the pool emits (DESIGN section 5). Keeping the table in
# one place means a code can never be sent with two different statuses.
STATUS_BY_CODE: dict[str, int] = {
    "invalid_request": 400,
    "invalid_load_request": 400,
    "thinking_unsupported": 400,
    "modality_unsupported": 400,
    "multi_turn_unsupported": 400,
    "remote_not_allowed": 400,
    "image_refused": 400,
    "wrong_model_kind": 400,
    "sampling_unsupported": 400,
    "logprobs_unsupported": 400,
    "tools_unsupported": 400,
    "structured_output_unsupported": 400,
    "copy_unsupported": 400,
    "no_pull_source": 400,
    "dimensions_unsupported": 400,
    "tool_choice_unmatched": 400,
    "duplicate_tool": 400,
    "invalid_json_schema": 400,
    "stream_multiple_prompts": 400,
    "invalid_conversation": 400,
    "too_many_documents": 400,
    "document_too_long": 400,
    "rerank_too_long": 400,
    "invalid_audio": 400,
    "audio_too_long": 400,
    "input_too_long": 400,
    "unknown_voice": 400,
    "response_format_unsupported": 400,
    "unauthorized": 401,
    "host_not_allowed": 403,
    "tenant_forbidden": 403,
    "origin_not_allowed": 403,
    "not_found": 404,
    "unknown_model": 404,
    "unknown_key": 404,
    "method_not_allowed": 405,
    "model_not_loaded": 409,
    "model_unloading": 409,
    "model_failed": 409,
    "model_in_use": 409,
    "key_exists": 409,
    "usage_disabled": 409,
    "request_timeout": 408,
    "request_too_large": 413,
    "audio_too_large": 413,
    "unsupported_media_type": 415,
    "upgrade_required": 426,
    "validation_error": 422,
    "rate_limit_exceeded": 429,
    "budget_exceeded": 429,
    "load_failed": 500,
    "internal_error": 500,
    "backend_error": 502,
    "model_loading": 503,
    "queue_full": 503,
    # A paused stream (priority low, paused for a swap) that was not resumed within
    # engine.preempt_max_pause_s: it ends with this error event, charged what it made.
    "preempted": 503,
    "shutting_down": 503,
    "starting": 503,
    "queue_timeout": 504,
    "backend_timeout": 504,
    # The state directory's filesystem is full (or refuses writes): a stored response
    # could not be saved.
    "insufficient_storage": 507,
}


class PoolError(Exception):
    """An error with a stable code that clients can act on.

    Args:
        code: one of :data:`STATUS_BY_CODE`.
        message: a sentence for a person.
        retry_after_s: seconds a client should wait before retrying, where that helps.
        details: extra machine-readable fields merged into the error body.
    """

    def __init__(
        self,
        code: str,
        message: str,
        *,
        retry_after_s: float | None = None,
        details: dict[str, Any] | None = None,
    ) -> None:
        if code not in STATUS_BY_CODE:
            raise ValueError(f"unknown error code {code!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.details = dict(details or {})

    @property
    def status(self) -> int:
        return STATUS_BY_CODE[self.code]

    def __repr__(self) -> str:
        return f"PoolError({self.code!r}, {self.message!r})"


class ConfigError(Exception):
    """The settings files are unusable; one line per problem in ``problems``."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("invalid settings:\n" + "\n".join(f"  - {p}" for p in problems))
        self.problems = problems


class ListenError(OSError):
    """The server cannot listen where it is told to: the port is in use or out of range,
    or the host is no address of this machine. Raised before anything loads."""


class BackendError(Exception):
    """A backend failed in a way the pool reports as ``backend_error`` (or ``load_failed``)."""
