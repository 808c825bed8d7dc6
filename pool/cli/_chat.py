"""``chat``: a REPL over the ``/v1/responses`` WebSocket, keeping the conversation.

Each answer streams as it is generated. Ctrl-C while an answer runs sends
``response.cancel`` and keeps the session; Ctrl-C or end of input at the prompt ends it.
"""

from __future__ import annotations

import json
from typing import Any

import trio
from trio_websocket import ConnectionClosed, HandshakeError, open_websocket_url

from pool.cli._client import (
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    CliError,
    Io,
    PoolClient,
    on_interrupt,
)

HELP = "commands: /thinking on|off|default, /clear (forget the conversation), /bye"


class _Session:
    def __init__(self, model: str, io: Io, system: str | None, max_tokens: int | None) -> None:
        self.model = model
        self.io = io
        self.system = system
        self.max_tokens = max_tokens
        self.history: list[dict[str, str]] = []
        self.thinking = "default"

    def body(self, text: str) -> dict[str, Any]:
        turns = [*self.history, {"role": "user", "content": text}]
        # A first turn goes as `input`, which single-turn models accept too.
        body: dict[str, Any] = (
            {"model": self.model, "messages": turns}
            if len(turns) > 1
            else {"model": self.model, "input": text}
        )
        if self.thinking != "default":
            body["thinking"] = self.thinking
        if self.system:
            body["instructions"] = self.system
        if self.max_tokens is not None:
            body["decoding"] = {"max_tokens": self.max_tokens}
        return body

    def command(self, line: str) -> bool:
        """Handle a ``/command``; False ends the session."""
        word, _, arg = line[1:].partition(" ")
        arg = arg.strip().lower()
        if word in ("bye", "exit", "quit"):
            return False
        if word == "thinking" and arg in ("on", "off", "default"):
            self.thinking = {"on": "enabled", "off": "disabled"}.get(arg, "default")
            self.io.err.print(f"thinking: {self.thinking}")
        elif word == "clear":
            self.history.clear()
            self.io.err.print("conversation cleared")
        else:
            self.io.err.print(HELP)
        return True


async def _answer(ws: Any, session: _Session, text: str) -> None:
    """Send one turn and print its answer; Ctrl-C cancels it on the server."""
    io = session.io
    await ws.send_message(json.dumps(session.body(text)))
    parts: list[str] = []
    with trio.CancelScope() as interrupted:
        async with on_interrupt(interrupted):
            while True:
                event = json.loads(await ws.get_message())
                if io.json:
                    io.emit(event)
                kind = event.get("type")
                if kind == "response.output_text.delta":
                    parts.append(event["delta"])
                    if not io.json:
                        io.raw.write(event["delta"])
                        io.raw.flush()
                elif kind == "response.completed":
                    if not io.json:
                        io.raw.write("\n")
                    session.history += [
                        {"role": "user", "content": text},
                        {"role": "assistant", "content": "".join(parts)},
                    ]
                    return
                elif kind == "error":
                    error = event.get("error", {})
                    if not io.json:
                        io.raw.write("\n" if parts else "")
                        io.err.print(f"error {error.get('code')}: {error.get('message')}")
                    return
                elif kind == "response.cancelled":
                    return
    # Ctrl-C: ask the server to stop, then wait for its answer (bounded).
    await ws.send_message(json.dumps({"type": "response.cancel"}))
    with trio.move_on_after(10):
        while True:
            event = json.loads(await ws.get_message())
            if event.get("type") in ("response.cancelled", "response.completed", "error"):
                break
    if io.json:
        io.emit({"type": "response.cancelled"})
    else:
        io.raw.write("\n")
        io.err.print("[cancelled]")


async def chat(
    client: PoolClient, io: Io, model: str, system: str | None, max_tokens: int | None
) -> int:
    # Say so before a prompt opens: a typo would otherwise surface only at the first answer.
    served = await client.call("GET", "/v1/models")
    if model not in {m["id"] for m in served.get("data", ())}:
        raise CliError(
            f"model {model!r} is not served by the pool at {client.url}"
            " (llm-pool ps lists the models; one not loaded needs llm-pool load)",
            EXIT_REFUSED,
        )
    session = _Session(model, io, system, max_tokens)
    headers = [(b"authorization", f"Bearer {client.token}".encode())] if client.token else []
    try:
        async with open_websocket_url(
            client.ws_url("/v1/responses"), extra_headers=headers, connect_timeout=10
        ) as ws:
            if not io.json:
                io.err.print(f"chatting with {model}; {HELP}; Ctrl-C stops an answer")
            while True:
                if not io.json:
                    io.err.print(">>> ", end="")
                line = await io.read_line()
                if line is None:
                    break
                line = line.strip()
                if not line:
                    continue
                if line.startswith("/"):
                    if not session.command(line):
                        break
                    continue
                await _answer(ws, session, line)
    except HandshakeError as exc:
        raise CliError(f"the pool refused the WebSocket: {exc}", EXIT_REFUSED) from exc
    except ConnectionClosed as exc:
        raise CliError(f"the pool closed the connection: {exc.reason}", EXIT_REFUSED) from exc
    except OSError as exc:
        raise CliError(f"cannot reach the pool at {client.url}: {exc}", EXIT_UNREACHABLE) from exc
    return EXIT_OK
