"""Bearer tokens and signed operation tokens (unit level; routes are tested with HTTP)."""

from __future__ import annotations

import base64
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pool.config import AuthSettings
from pool.errors import PoolError
from pool.http._auth import Authenticator, sign_op_token

KEY = b"0123456789abcdef0123456789abcdef"


def _env(**variables: str) -> dict[str, str]:
    """An environment with only ``variables`` and this test's own state dir."""
    return {"LLM_POOL_STATE_DIR": os.environ["LLM_POOL_STATE_DIR"], **variables}


def _auth(tmp_path: Path, **settings: Any) -> Authenticator:
    key_file = tmp_path / "op.key"
    key_file.write_bytes(KEY + b"\n")
    return Authenticator(AuthSettings(op_token_key_path=str(key_file), **settings), environ=_env())


def _claims(**over: Any) -> dict[str, Any]:
    return {
        "operation": "model-load",
        "modelId": "m",
        "issuedAt": time.time(),
        "signers": ["admin1"],
        "nonce": "nonce-0001",
        **over,
    }


def test_open_pool_without_tokens() -> None:
    auth = Authenticator(AuthSettings(), environ=_env())
    assert not auth.enabled
    auth.check_bearer(None, "inference")
    auth.check_bearer(None, "admin")


def test_inference_and_admin_tokens() -> None:
    auth = Authenticator(
        AuthSettings(inference_tokens=["user-token"], admin_token="admin-token"), environ=_env()
    )
    auth.check_bearer("Bearer user-token", "inference")
    auth.check_bearer("bearer admin-token", "inference")
    auth.check_bearer("Bearer admin-token", "admin")
    for header, access in [
        (None, "inference"),
        ("Bearer wrong", "inference"),
        ("Basic user-token", "inference"),
        ("Bearer user-token", "admin"),
        ("Bearer " + "x" * 10_000, "admin"),
    ]:
        with pytest.raises(PoolError) as info:
            auth.check_bearer(header, access)  # type: ignore[arg-type]
        assert info.value.code == "unauthorized" and info.value.status == 401


def test_x_api_key_is_a_token_where_a_route_takes_it() -> None:
    """The Messages API's ``x-api-key``: a token as the bearer is; either may match."""
    auth = Authenticator(
        AuthSettings(inference_tokens=["user-token"], admin_token="admin-token"), environ=_env()
    )
    auth.check_bearer(None, "inference", api_key="user-token")
    auth.check_bearer(None, "inference", api_key=" admin-token ")
    auth.check_bearer("Bearer wrong", "inference", api_key="user-token")
    auth.check_bearer("Bearer user-token", "inference", api_key="wrong")
    auth.check_bearer(None, "admin", api_key="admin-token")
    for header, key, access in [
        (None, "wrong", "inference"),
        (None, "", "inference"),
        (None, "Bearer user-token", "inference"),
        ("Bearer wrong", "wrong", "inference"),
        (None, "user-token", "admin"),
        (None, "x" * 10_000, "inference"),
    ]:
        with pytest.raises(PoolError) as info:
            auth.check_bearer(header, access, api_key=key)  # type: ignore[arg-type]
        assert info.value.code == "unauthorized"


def test_tokens_from_environment() -> None:
    auth = Authenticator(
        AuthSettings(), environ=_env(LLM_POOL_API_TOKENS="a, b", LLM_POOL_ADMIN_TOKEN="root")
    )
    auth.check_bearer("Bearer b", "inference")
    auth.check_bearer("Bearer root", "admin")
    with pytest.raises(PoolError):
        auth.check_bearer("Bearer a", "admin")


def test_admin_token_only_leaves_inference_open_to_admin_only() -> None:
    auth = Authenticator(AuthSettings(admin_token="root"), environ=_env())
    with pytest.raises(PoolError):
        auth.check_bearer(None, "inference")


def test_valid_op_token(tmp_path: Path) -> None:
    auth = _auth(tmp_path)
    claims = auth.verify_op_token(sign_op_token(KEY, _claims()), operation="model-load", model="m")
    assert claims["signers"] == ["admin1"]
    # The plain JSON form is accepted too.
    token = json.loads(
        base64.urlsafe_b64decode(sign_op_token(KEY, _claims(nonce="n-000002")) + "==")
    )
    auth.verify_op_token(json.dumps(token), operation="model-load", model="m")


def _signed(key: bytes = KEY, **over: Any) -> Callable[[], Any]:
    """A token signed when the test runs: one signed at collection time could fall out of
    the issuedAt window before a slow run reaches it."""
    return lambda: sign_op_token(key, _claims(**over))


def _issued(offset_s: float) -> Callable[[], Any]:
    return lambda: sign_op_token(KEY, _claims(issuedAt=time.time() + offset_s))


@pytest.mark.parametrize(
    ("make_token", "reason"),
    [
        (_signed(b"another key entirely 000000000000"), "signature"),
        (_issued(-301), "window"),
        (_issued(3600), "window"),
        (_signed(operation="model-unload"), "model-unload"),
        (_signed(modelId="other"), "other"),
        (_signed(signers=[]), "signer"),
        (_signed(nonce="short"), "nonce"),
        (_signed(issuedAt="yesterday"), "issuedAt"),
        (lambda: "not base64 at all!", "base64"),
        (lambda: "e30", "opToken"),
        (lambda: {"opToken": _claims(), "signature": "00" * 32}, "signature"),
    ],
)
def test_forged_expired_or_malformed_op_tokens(
    tmp_path: Path, make_token: Callable[[], Any], reason: str
) -> None:
    with pytest.raises(PoolError) as info:
        _auth(tmp_path).verify_op_token(make_token(), operation="model-load", model="m")
    assert info.value.code == "unauthorized" and reason in info.value.message


def test_replayed_nonce_is_refused(tmp_path: Path) -> None:
    auth = _auth(tmp_path)
    token = sign_op_token(KEY, _claims())
    auth.verify_op_token(token, operation="model-load", model="m")
    with pytest.raises(PoolError) as info:
        auth.verify_op_token(token, operation="model-load", model="m")
    assert "replay" in info.value.message


def test_m_of_n_signers(tmp_path: Path) -> None:
    auth = _auth(tmp_path, op_token_min_signers=2, op_token_signers=["alice", "bob", "carol"])
    with pytest.raises(PoolError):
        auth.verify_op_token(
            sign_op_token(KEY, _claims(signers=["alice", "mallory"])),
            operation="model-load",
            model="m",
        )
    auth.verify_op_token(
        sign_op_token(KEY, _claims(signers=["alice", "carol"], nonce="n-000003")),
        operation="model-load",
        model="m",
    )


def test_op_tokens_refused_when_not_configured() -> None:
    with pytest.raises(PoolError):
        Authenticator(AuthSettings(), environ=_env()).verify_op_token(
            sign_op_token(KEY, _claims()), operation="model-load", model="m"
        )
