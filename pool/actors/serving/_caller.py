"""Who sent the request being served: the identity of the key it was authenticated by.

The HTTP layer authenticates each request (and each WebSocket at its handshake) and
sets :data:`CALLER` for it, in one place (``pool/http/_common.py``, ``require``);
admission reads it from there (``Serving.admit``), so every surface gets the key's
name on its :class:`~pool.actors.InferenceRequest` and the key's rate limit without
passing either through each route. A request authenticated by a plain token, or by
none, has no caller (``None``): only the tenant's limits apply to it.

A context variable rather than an argument for the same reason as
:data:`~pool.actors.RELAYED`: it belongs to the request's task, and the tasks a
WebSocket session starts for its requests inherit it.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from pool.config import KeyRole, PriorityName


@dataclass(frozen=True, slots=True)
class Caller:
    """The identity a key gives its requests (``service.auth.keys``, ``/v1/admin/keys``).

    Attributes:
        key_name: the key's name; usage and logs name the caller by it.
        tenant: the tenant of every request of the key; None lets ``X-Tenant-ID`` decide.
        role: ``admin`` keys reach every route, ``inference`` keys the inference routes.
        priority: the default and highest priority of its requests; None: ``X-Priority``.
        rate_limit_rpm: requests per minute the key may send; None: no limit of its own.
        preemptible: its generations may be paused for a swap whatever their priority.
    """

    key_name: str
    tenant: str | None = None
    role: KeyRole = "inference"
    priority: PriorityName | None = None
    rate_limit_rpm: float | None = None
    preemptible: bool = False


CALLER: ContextVar[Caller | None] = ContextVar("llm_pool_caller", default=None)
