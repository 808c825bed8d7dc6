"""The key admin routes: list the keys in force, add one, revoke one (settings keys too).

Changes are in force once the call answers, on every route: a revoked key's next
request is refused and a WebSocket it opened is closed (``pool/http/responses/_routes.py``).
"""

from __future__ import annotations

import logging

from quart import Quart, Response

from pool.config import KeyFields
from pool.http._common import AppContext, json_response, read_body, request_id, require
from pool.schemas import KeyCreateRequest

log = logging.getLogger("pool.http")


def register(app: Quart, ctx: AppContext) -> None:
    keys = ctx.auth.keys

    @app.get("/v1/admin/keys")
    async def list_keys() -> Response:
        """The keys in force, without their secrets."""
        require(ctx, "admin")
        return json_response({"keys": keys.rows()})

    @app.post("/v1/admin/keys")
    async def add_key() -> Response:
        """Add a key; a generated key is answered this once."""
        require(ctx, "admin")
        body = await read_body(KeyCreateRequest)
        fields = KeyFields.model_validate(body.model_dump(exclude={"key_sha256"}))
        record, clear = await keys.add(fields, body.key_sha256)
        log.info(
            "request_id=%s key added: name=%s tenant=%s role=%s source=runtime",
            request_id(),
            record.name,
            record.caller.tenant,
            record.caller.role,
        )
        return json_response({**record.row(), "key": clear or None}, 201)

    @app.delete("/v1/admin/keys/<name>")
    async def revoke_key(name: str) -> Response:
        """Revoke a key: refused from now on, across restarts."""
        require(ctx, "admin")
        record = await keys.revoke(name)
        log.warning(
            "request_id=%s key revoked: name=%s source=%s", request_id(), name, record.source
        )
        return json_response({**record.row(), "revoked": True})
