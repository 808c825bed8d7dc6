"""The baseline: a bare ASGI app on Hypercorn's trio worker, returning what the pool returns.

``POST /v1/responses`` answers the same JSON envelope (or, with ``stream: true``, the
same SSE events) that the pool answers for a zero-work stub model, with no pool in
between: the difference between the two is what the pool costs.

    python -m benchmarks.bare_app --port 0
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from benchmarks.stub_bodies import envelope, events


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    request = json.loads(body)
    tokens = int(request.get("decoding", {}).get("max_tokens", 1))
    if not request.get("stream"):
        payload = json.dumps(envelope(tokens)).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": payload})
        return
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream")],
        }
    )
    for event in events(tokens):
        chunk = (
            b"event: " + event["type"].encode() + b"\ndata: " + json.dumps(event).encode() + b"\n\n"
        )
        await send({"type": "http.response.body", "body": chunk, "more_body": True})
    await send({"type": "http.response.body", "body": b""})


async def main(port: int) -> None:
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None

    async with trio.open_nursery() as nursery:
        binds = await nursery.start(serve, app, config)
        print(f"listening on {binds[0]}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, default=0)
    trio.run(main, parser.parse_args().port)
