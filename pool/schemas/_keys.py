"""Bodies of the key admin routes (``/v1/admin/keys``): a key's public row, the body
that adds one, and what adding and revoking answer. No body ever carries a stored key
or its digest; the clear key of a generated one is answered once, when it is added."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pool.config import SHA256_HEX_PATTERN, KeyFields, KeyRole, PriorityName


class KeyCreateRequest(KeyFields):
    """A key to add at runtime. Without ``key_sha256`` the pool generates the key."""

    key_sha256: str | None = Field(
        None,
        pattern=SHA256_HEX_PATTERN,
        description="SHA-256 (64 hex digits) of a key you generated yourself; the pool"
        " then never sees the key. Omitted: the pool generates one and answers it once.",
    )


class _Reply(BaseModel):
    model_config = ConfigDict(extra="allow")


class KeyRow(_Reply):
    name: str
    tenant: str | None = Field(description="The tenant of its requests; null: X-Tenant-ID.")
    role: KeyRole
    priority: PriorityName | None = Field(description="Default and highest priority.")
    rate_limit_rpm: float | None = Field(description="Its own requests-per-minute limit.")
    preemptible: bool = Field(
        description="Its generations may be paused for a swap whatever their priority."
    )
    created_at: float | None = Field(
        description="When it was added (seconds since the epoch); null for settings keys."
    )
    source: Literal["settings", "runtime"] = Field(
        description="`settings`: service.auth.keys; `runtime`: added through this API."
    )


class KeyList(_Reply):
    keys: list[KeyRow] = Field(description="The keys in force (revoked ones are gone).")


class KeyCreated(KeyRow):
    key: str | None = Field(
        description="The generated key, shown this once and never kept (only its SHA-256"
        " is); null when the request gave `key_sha256`."
    )


class KeyRevoked(KeyRow):
    revoked: Literal[True]
