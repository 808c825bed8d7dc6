"""``pull``: follow a pull's NDJSON progress with a live bar; Ctrl-C only stops watching."""

from __future__ import annotations

import json
from typing import Any

import trio
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

from pool.cli._client import (
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_REFUSED,
    CliError,
    Io,
    PoolClient,
    on_interrupt,
)


async def cancel(client: PoolClient, io: Io, name: str) -> int:
    body = await client.call("DELETE", f"/api/pull/{name}")
    if io.json:
        io.emit(body)
    else:
        io.out.print(f"pull of {name} cancelled")
    return EXIT_OK


async def pull(client: PoolClient, io: Io, name: str) -> int:
    """Start (or join) the pull of ``name`` and follow it to its end."""
    final: dict[str, Any] = {}
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=io.err,
        transient=False,
    )
    with trio.CancelScope() as scope:
        async with (
            on_interrupt(scope) as pressed,
            client.stream("POST", "/api/pull", {"model": name}) as response,
        ):
            if io.json:
                async for line in response.aiter_lines():
                    if line.strip():
                        final = json.loads(line)
                        io.emit(final)
            else:
                with progress:
                    task = progress.add_task(name, total=None)
                    async for line in response.aiter_lines():
                        if not line.strip():
                            continue
                        final = json.loads(line)
                        status = final.get("status", "")
                        file = final.get("file")
                        progress.update(
                            task,
                            description=f"{name} {status}" + (f" {file}" if file else ""),
                            total=final.get("total"),
                            completed=final.get("completed", 0),
                        )
    if pressed:
        io.err.print(
            f"detached: the pull of {name} goes on in the pool "
            f"(`llm-pool pull {name}` follows it again, `--cancel` stops it)"
        )
        return EXIT_INTERRUPTED
    status = final.get("status")
    if status == "success":
        if not io.json:
            io.out.print(f"{name}: pulled to {final.get('path', '?')}")
        return EXIT_OK
    message = final.get("error") or f"pull ended with status {status!r}"
    if io.json:
        return EXIT_REFUSED
    raise CliError(f"pull of {name} failed: {message}", EXIT_REFUSED)
