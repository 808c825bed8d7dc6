"""Who may call what: bearer tokens and the runner API's signed operation tokens.

Every comparison of a secret goes through :func:`hmac.compare_digest`, and every
token is compared against every configured token (no early exit on a match), so
response timing says nothing about how close a guess was.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pool.config import AuthSettings
from pool.errors import PoolError

Access = Literal["inference", "admin"]

ENV_API_TOKENS = "LLM_POOL_API_TOKENS"
ENV_ADMIN_TOKEN = "LLM_POOL_ADMIN_TOKEN"
ENV_OP_KEY_PATH = "LLM_POOL_OP_TOKEN_KEY_PATH"
_MAX_TOKEN_CHARS = 4096


def _unauthorized(message: str) -> PoolError:
    return PoolError("unauthorized", message)


def _matches_any(candidate: bytes, tokens: list[bytes]) -> bool:
    found = False
    for token in tokens:
        # Compare digests so tokens of different lengths take the same time too.
        same = hmac.compare_digest(
            hashlib.sha256(candidate).digest(), hashlib.sha256(token).digest()
        )
        found = found or same
    return found


@dataclass(frozen=True)
class _Keys:
    inference: list[bytes]
    admin: list[bytes]
    op_key: bytes | None


class Authenticator:
    """Checks bearer tokens per access level and verifies operation tokens."""

    def __init__(self, settings: AuthSettings, *, environ: dict[str, str] | None = None) -> None:
        env = dict(os.environ if environ is None else environ)
        self.settings = settings
        inference = [t for t in settings.inference_tokens if t]
        inference += [t.strip() for t in env.get(ENV_API_TOKENS, "").split(",") if t.strip()]
        admin = settings.admin_token or env.get(ENV_ADMIN_TOKEN) or None
        key_path = settings.op_token_key_path or env.get(ENV_OP_KEY_PATH) or None
        op_key = Path(key_path).expanduser().read_bytes().strip() if key_path else None
        if op_key is not None and not op_key:
            raise ValueError(f"op token key file {key_path} is empty")
        self._keys = _Keys(
            inference=[t.encode() for t in inference],
            admin=[admin.encode()] if admin else [],
            op_key=op_key,
        )
        self._seen_nonces: OrderedDict[str, float] = OrderedDict()

    @property
    def enabled(self) -> bool:
        """True when any token or key is configured (the service is not open)."""
        k = self._keys
        return bool(k.inference or k.admin or k.op_key)

    @property
    def has_admin_token(self) -> bool:
        return bool(self._keys.admin)

    @property
    def op_tokens_enabled(self) -> bool:
        return self._keys.op_key is not None

    def check_bearer(self, authorization: str | None, access: Access) -> None:
        """Raise ``unauthorized`` unless the header grants ``access``.

        Inference routes are open unless inference or admin tokens exist; admin routes
        are open only when no admin token is configured.
        """
        keys = self._keys
        allowed = keys.admin if access == "admin" else keys.inference + keys.admin
        if not allowed:
            return
        token = _bearer(authorization)
        if token is None or not _matches_any(token.encode(), allowed):
            raise _unauthorized(
                "a valid admin bearer token is required"
                if access == "admin"
                else "a valid bearer token is required"
            )

    def verify_op_token(
        self, raw: Any, *, operation: str, model: str | None, now: float | None = None
    ) -> dict[str, Any]:
        """Verify a ``verifiedOpToken`` for ``operation`` on ``model``; return its claims.

        The token is ``{"opToken": {...claims}, "signature": hex}`` as JSON, optionally
        base64url-encoded; the signature is HMAC-SHA256 over the claims serialised with
        sorted keys and no spaces. Claims: ``operation``, ``modelId``, ``issuedAt``
        (epoch seconds, within the window), ``signers`` (at least the minimum) and a
        ``nonce`` that may be used once.

        Raises:
            PoolError: ``unauthorized`` with the reason.
        """
        if self._keys.op_key is None:
            raise _unauthorized("operation tokens are not configured on this pool")
        envelope = _decode_envelope(raw)
        claims, signature = envelope.get("opToken"), envelope.get("signature")
        if not isinstance(claims, dict) or not isinstance(signature, str):
            raise _unauthorized("op token must carry `opToken` claims and a `signature`")
        expected = hmac.new(self._keys.op_key, canonical_claims(claims), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected.encode(), signature.strip().lower().encode()):
            raise _unauthorized("op token signature does not verify")
        if claims.get("operation") != operation:
            raise _unauthorized(f"op token is for {claims.get('operation')!r}, not {operation!r}")
        if model is not None and claims.get("modelId") not in (None, model):
            raise _unauthorized(f"op token is for model {claims.get('modelId')!r}")
        issued = claims.get("issuedAt")
        now = time.time() if now is None else now
        window = self.settings.op_token_window_s
        if not isinstance(issued, int | float) or isinstance(issued, bool):
            raise _unauthorized("op token has no numeric issuedAt")
        if abs(now - issued) > window:
            raise _unauthorized(f"op token issuedAt is outside the {window:g} s window")
        signers = claims.get("signers")
        if not isinstance(signers, list) or not all(isinstance(s, str) for s in signers):
            raise _unauthorized("op token signers must be a list of names")
        counted = set(signers)
        if self.settings.op_token_signers is not None:
            counted &= set(self.settings.op_token_signers)
        if len(counted) < self.settings.op_token_min_signers:
            raise _unauthorized(
                f"op token has {len(counted)} accepted signer(s);"
                f" {self.settings.op_token_min_signers} required"
            )
        nonce = claims.get("nonce")
        if not isinstance(nonce, str) or not 8 <= len(nonce) <= 256:
            raise _unauthorized("op token needs a nonce of 8 to 256 characters")
        self._forget_old_nonces(now)
        if nonce in self._seen_nonces:
            raise _unauthorized("op token nonce was already used (replay)")
        # A nonce only needs remembering while its token could still pass the window.
        self._seen_nonces[nonce] = float(issued) + window
        return claims

    def _forget_old_nonces(self, now: float) -> None:
        expired = [n for n, until in self._seen_nonces.items() if until < now]
        for nonce in expired:
            del self._seen_nonces[nonce]


def canonical_claims(claims: dict[str, Any]) -> bytes:
    return json.dumps(claims, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign_op_token(key: bytes, claims: dict[str, Any]) -> str:
    """A base64url ``verifiedOpToken`` for ``claims`` (for tools and tests)."""
    envelope = {
        "opToken": claims,
        "signature": hmac.new(key, canonical_claims(claims), hashlib.sha256).hexdigest(),
    }
    return base64.urlsafe_b64encode(json.dumps(envelope).encode()).decode().rstrip("=")


def _bearer(authorization: str | None) -> str | None:
    if not authorization or len(authorization) > _MAX_TOKEN_CHARS:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _decode_envelope(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str) or not raw or len(raw) > 16_384:
        raise _unauthorized("verifiedOpToken must be a token string or object")
    text = raw.strip()
    if not text.startswith("{"):
        try:
            text = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode()
        except (binascii.Error, ValueError, UnicodeDecodeError):
            raise _unauthorized("verifiedOpToken is not valid base64url JSON") from None
    try:
        envelope = json.loads(text)
    except json.JSONDecodeError:
        raise _unauthorized("verifiedOpToken is not valid JSON") from None
    if not isinstance(envelope, dict):
        raise _unauthorized("verifiedOpToken must decode to a JSON object")
    return envelope
