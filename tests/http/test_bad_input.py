"""Hundreds of generated bad bodies: always a 4xx with a code, and the pool keeps serving."""

from __future__ import annotations

import json

import httpx
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import start_server

_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=30),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=12,
)
_field_names = st.sampled_from(
    ["model", "input", "messages", "instructions", "stream", "thinking", "decoding", "allow_remote",
     "source_lang_code", "target_lang_code", "keep_alive", "replicas", "gguf_n_ctx",
     "exllama_cache_size", "llama_server_spec_draft_p_min", "surprise"]
)  # fmt: skip
_bodies = st.one_of(
    st.dictionaries(_field_names, _json_values, max_size=6).map(lambda d: json.dumps(d).encode()),
    st.dictionaries(_field_names, _json_values, max_size=4).map(
        lambda d: json.dumps({"model": "echo", "input": "x", **d}).encode()
    ),
    _json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=64),
    st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),
)


async def test_generated_bad_bodies_never_5xx(nursery: trio.Nursery) -> None:
    info = await start_server(
        nursery, {"echo": {"backend": "stub", "enabled": True}, "x": {"backend": "stub"}}
    )
    seen: list[tuple[str, int, bytes]] = []

    async with httpx.AsyncClient(base_url=info.url, timeout=10) as client:

        async def send(path: str, body: bytes) -> None:
            reply = await client.post(path, content=body)
            seen.append((path, reply.status_code, body))
            assert reply.status_code < 500, (path, body, reply.text)
            if reply.status_code >= 400:
                assert reply.json()["error"]["code"]

        collected: list[bytes] = []

        @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
        @given(_bodies)
        def collect(body: bytes) -> None:
            collected.append(body)

        collect()
        for body in collected:
            for path in ("/v1/responses", "/v1/admin/models/x/load", "/v1/models/load"):
                await send(path, body)
        ok = await client.post("/v1/responses", json={"model": "echo", "input": "still fine"})
        assert ok.json()["output_text"] == "still fine"
        row = (await client.get("/v1/admin/models/x")).json()
        assert row["load_override"] == {}
    assert len(seen) >= 600
