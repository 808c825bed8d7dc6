"""Who may call what: bearer tokens, keys with identities (``pool/http/_keys.py``) and
the runner API's signed operation tokens.

Every comparison of a secret goes through :func:`hmac.compare_digest`, and every
token is compared against every configured token (no early exit on a match), so
response timing says nothing about how close a guess was.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hashlib
import hmac
import json
import logging
import os
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pool.actors import Caller
from pool.config import ENV_OP_TOKEN_KEY_PATH, AuthSettings, state_dir
from pool.errors import ConfigError, PoolError
from pool.http._keys import FILE_NAME, KeyFile, KeyRing

Access = Literal["inference", "admin"]

ENV_API_TOKENS = "LLM_POOL_API_TOKENS"
ENV_ADMIN_TOKEN = "LLM_POOL_ADMIN_TOKEN"
ENV_OP_KEY_PATH = "LLM_POOL_OP_TOKEN_KEY_PATH"
_MAX_TOKEN_CHARS = 4096
# Nonce files untouched this long hold only expired entries (issuedAt may lie at most one
# window, at most 3600 s, ahead of the write, plus the window itself): safe to delete.
_STALE_NONCE_FILE_S = 2 * 3600.0

log = logging.getLogger("pool.auth")


def nonce_file_path(key_path: str, key: bytes, environ: dict[str, str]) -> Path:
    """Where the nonces seen under one op-token key are kept across restarts.

    ``op-token-nonces/<digest>.json`` in the state dir (``$LLM_POOL_STATE_DIR``, else
    the cache dir), named by a digest of the key file's path and the key: a restart with
    the same key finds the nonces it must still refuse, and two pools (or two test runs)
    with different keys never share a file.
    """
    absolute = str(Path(key_path).expanduser().resolve())
    digest = hashlib.sha256(absolute.encode() + b"\0" + key).hexdigest()[:24]
    return state_dir(environ) / "op-token-nonces" / f"{digest}.json"


class NonceStore:
    """The op-token nonces still inside their window, persisted in one small JSON file.

    Read once at start; rewritten atomically (a temporary file in the same folder, then
    ``os.replace``) each time a nonce is accepted, pruned by expiry. The write is
    synchronous on purpose: the nonce must be on disk before the operation it allows
    runs, the file holds only the nonces of the last window, and only a token with a
    valid signature reaches it.
    """

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._seen: OrderedDict[str, float] = OrderedDict()
        if path is not None:
            self._read(path)

    def _read(self, path: Path) -> None:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            # Refusing to start would lock operators out; say so loudly instead.
            log.warning("op-token nonce file %s unreadable, starting empty: %s", path, exc)
            return
        if isinstance(data, dict):
            for nonce, until in data.items():
                if isinstance(nonce, str) and isinstance(until, int | float):
                    self._seen[nonce] = float(until)

    def __contains__(self, nonce: str) -> bool:
        return nonce in self._seen

    def forget_expired(self, now: float) -> None:
        for nonce in [n for n, until in self._seen.items() if until < now]:
            del self._seen[nonce]

    def add(self, nonce: str, until: float) -> None:
        self._seen[nonce] = until
        if self.path is None:
            return
        try:
            self._write(self.path)
        except OSError as exc:
            # The nonce is still refused until this process ends; only a restart forgets it.
            log.error("op-token nonce file %s not written: %s", self.path, exc)

    def _write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, temporary = tempfile.mkstemp(prefix=".nonces-", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as out:
                json.dump(dict(self._seen), out)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        self._remove_stale_siblings(path)

    @staticmethod
    def _remove_stale_siblings(path: Path) -> None:
        cutoff = time.time() - _STALE_NONCE_FILE_S
        for sibling in path.parent.glob("*.json"):
            with contextlib.suppress(OSError):
                if sibling != path and sibling.stat().st_mtime < cutoff:
                    sibling.unlink()


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


def _read_op_key(path: str | None, named_by: str) -> bytes | None:
    """The operation-token key, or a settings error naming where the path came from."""
    if path is None:
        return None
    try:
        key = Path(path).expanduser().read_bytes().strip()
    except OSError as exc:
        raise ConfigError([f"{named_by}: cannot read {path}: {exc.strerror}"]) from exc
    if not key:
        raise ConfigError([f"{named_by}: the op token key file {path} is empty"])
    return key


class Authenticator:
    """Checks bearer tokens and keys per access level and verifies operation tokens.

    Args:
        environ: where the token variables and the state directory (the key file,
            op-token nonces) come from; default the process environment.
    """

    def __init__(self, settings: AuthSettings, *, environ: dict[str, str] | None = None) -> None:
        env = dict(os.environ if environ is None else environ)
        self.settings = settings
        self.keys = KeyRing(settings.keys, KeyFile(state_dir(env) / FILE_NAME))
        inference = [t for t in settings.inference_tokens if t]
        inference += [t.strip() for t in env.get(ENV_API_TOKENS, "").split(",") if t.strip()]
        admin = settings.admin_token or env.get(ENV_ADMIN_TOKEN) or None
        key_path = settings.op_token_key_path or env.get(ENV_OP_KEY_PATH) or None
        # The runner spec's variable is merged into the settings: name what the user set.
        named_by = next(
            (
                f"${name}"
                for name in (ENV_OP_TOKEN_KEY_PATH, ENV_OP_KEY_PATH)
                if key_path is not None and env.get(name, "").strip() == key_path
            ),
            "service.auth.op_token_key_path",
        )
        op_key = _read_op_key(key_path, named_by)
        self._keys = _Keys(
            inference=[t.encode() for t in inference],
            admin=[admin.encode()] if admin else [],
            op_key=op_key,
        )
        # Seen nonces outlive the process, so a token replayed after a restart is refused.
        self._seen_nonces = NonceStore(
            nonce_file_path(key_path, op_key, env) if key_path and op_key else None
        )

    @property
    def enabled(self) -> bool:
        """True when any token or key is configured (the service is not open)."""
        k = self._keys
        return bool(k.inference or k.admin or k.op_key or self.keys)

    @property
    def has_admin_token(self) -> bool:
        return bool(self._keys.admin) or self.keys.grants(admin=True)

    @property
    def op_tokens_enabled(self) -> bool:
        return self._keys.op_key is not None

    def guards(self, access: Access) -> bool:
        """Whether ``access`` needs a token or key (else :meth:`authenticate` lets all in).

        Keys count as tokens do: any key guards the inference routes, an admin key the
        admin routes; keys added or revoked at runtime change this at once.
        """
        keys = self._keys
        if access == "admin":
            return bool(keys.admin) or self.keys.grants(admin=True)
        return bool(keys.inference or keys.admin) or self.keys.grants(admin=False)

    def authenticate(
        self, authorization: str | None, access: Access, *, api_key: str | None = None
    ) -> Caller | None:
        """The caller that the credentials make, for ``access``; ``unauthorized`` if none.

        Inference routes are open unless a token or key exists; admin routes are open
        only when no admin token or admin key exists. A key grants its role (an admin
        key every route, an inference key the inference routes) and names its caller;
        a plain token names none.

        Args:
            api_key: an ``x-api-key`` header, where the route takes one (Anthropic's
                Messages API): a token or key as the bearer token is; either one that
                matches grants access (a key before a plain token).

        Returns:
            The key's caller; None for a plain token or an open route.
        """
        if not self.guards(access):
            return None
        tokens = self._keys.admin if access == "admin" else self._keys.inference + self._keys.admin
        presented = [t for t in (_bearer(authorization), _api_key(api_key)) if t is not None]
        # Both checks run in full whatever they find, so the time says nothing.
        matched = [_matches_any(t.encode(), tokens) for t in presented]
        record = self.keys.match(presented)
        if record is not None and (access != "admin" or record.caller.role == "admin"):
            return record.caller
        if any(matched):
            return None
        if record is not None:
            raise _unauthorized(
                f"key {record.name!r} has the inference role; this route needs an admin"
                " key or the admin token"
            )
        raise _unauthorized(
            "a valid admin bearer token is required"
            if access == "admin"
            else "a valid bearer token is required"
        )

    def check_bearer(
        self, authorization: str | None, access: Access, *, api_key: str | None = None
    ) -> None:
        """Raise ``unauthorized`` unless the credentials grant ``access``
        (:meth:`authenticate`, for a caller that needs no identity)."""
        self.authenticate(authorization, access, api_key=api_key)

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
        self._seen_nonces.forget_expired(now)
        if nonce in self._seen_nonces:
            raise _unauthorized("op token nonce was already used (replay)")
        # A nonce only needs remembering while its token could still pass the window.
        self._seen_nonces.add(nonce, float(issued) + window)
        return claims


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


def _api_key(value: str | None) -> str | None:
    if not value or len(value) > _MAX_TOKEN_CHARS or not value.strip():
        return None
    return value.strip()


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
