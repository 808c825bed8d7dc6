"""Reload while serving (drain, then swap): unload lets the running stream finish, the
load with a new override serves next, and no request is cut or left without an answer."""

from __future__ import annotations

import json

import httpx
import trio

from .conftest import start_server, words


async def test_drain_then_swap_loses_nothing(nursery: trio.Nursery) -> None:
    model = {
        "backend": "stub",
        "enabled": True,
        "replica_max": 2,
        "stub_reply": words(40),
        # A five-second stream: the unload and the refused request fall inside it with
        # ten times the room they need on a loaded machine.
        "stub_tokens_per_second": 8,
    }
    info = await start_server(nursery, {"m": model})
    first_delta = trio.Event()
    marks: dict[str, float] = {}
    finals: list[dict[str, object]] = []

    async def stream(client: httpx.AsyncClient) -> None:
        body = {"model": "m", "input": "x", "stream": True}
        async with client.stream("POST", "/v1/responses", json=body) as response:
            async for line in response.aiter_lines():
                if line == "event: response.output_text.delta":
                    first_delta.set()
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if event["type"] in ("response.completed", "error"):
                        finals.append(event)
        marks["stream_done"] = trio.current_time()

    async with httpx.AsyncClient(base_url=info.url, timeout=60) as client:
        with trio.fail_after(60):
            async with trio.open_nursery() as inner:
                inner.start_soon(stream, client)
                await first_delta.wait()
                unloading = trio.Event()

                async def unload() -> None:
                    unloading.set()
                    reply = await client.post("/v1/admin/models/m/unload", json={})
                    assert reply.json()["runtime_state"] == "unloaded"
                    marks["unloaded"] = trio.current_time()

                inner.start_soon(unload)
                await unloading.wait()
                actor = info.pool.model("m")
                while actor.state != "unloading":  # the unload call reached the model
                    await actor.wait_state_change()
                # While it drains, a new request is refused with a reason (not queued to die).
                refused = await client.post("/v1/responses", json={"model": "m", "input": "y"})
                assert refused.status_code == 409
                assert refused.json()["error"]["code"] == "model_unloading"
            assert [e["type"] for e in finals] == ["response.completed"]
            assert finals[0]["response"]["output_text"] == words(40)  # type: ignore[index]
            assert marks["stream_done"] <= marks["unloaded"]  # drained before the swap
            # Swap: load with a new override, and both replicas serve.
            loaded = await client.post("/v1/admin/models/m/load", json={"replicas": 2})
            row = loaded.json()
            assert loaded.status_code == 200 and row["loaded_replicas"] == 2
            replies: list[httpx.Response] = []

            async def ask() -> None:
                body = {"model": "m", "input": "z", "decoding": {"max_tokens": 3}}
                replies.append(await client.post("/v1/responses", json=body))

            async with trio.open_nursery() as inner:
                inner.start_soon(ask)
                inner.start_soon(ask)
            assert [r.json()["output_text"] for r in replies] == ["w0 w1 w2"] * 2
