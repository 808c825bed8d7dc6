"""``ps``/``models``, ``load``, ``unload`` and ``events``: the admin API as commands."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import trio
from rich.table import Table

from pool.cli._client import EXIT_OK, EXIT_USAGE, CliError, Io, PoolClient


def parse_sets(pairs: list[str]) -> dict[str, Any]:
    """``field=value`` pairs as a load body; a value is JSON where it parses, else a string.

    Raises:
        CliError: a pair without ``=`` (exit 2).
    """
    body: dict[str, Any] = {}
    for pair in pairs:
        name, sep, raw = pair.partition("=")
        if not sep or not name.strip():
            raise CliError(f"--set wants field=value, got {pair!r}", EXIT_USAGE)
        try:
            value: Any = json.loads(raw)
        except ValueError:
            value = raw
        body[name.strip()] = value
    return body


def _memory(row: dict[str, Any]) -> str:
    # Held now only while loaded; an unloaded row's measurement is the estimate's basis.
    measured = row.get("observed_load_delta") if row.get("is_loaded") else None
    if measured is not None:
        return f"{measured:,.0f} MiB"
    estimate = row.get("vram_estimate_mib")
    return "-" if estimate is None else f"~{estimate:,.0f} MiB"


def _state(row: dict[str, Any]) -> str:
    """The runtime state, with ``degraded`` while its output canary finds it so."""
    state = str(row.get("runtime_state", ""))
    canary = row.get("canary") or {}
    return f"{state}, degraded" if canary.get("health") == "degraded" else state


def models_table(rows: list[dict[str, Any]]) -> Table:
    """The ``ps`` table: one line per configured model."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("MODEL", "KIND", "BACKEND", "STATE", "REPLICAS", "IN FLIGHT", "QUEUE"):
        table.add_column(column, justify="right" if column in ("IN FLIGHT", "QUEUE") else "left")
    table.add_column("GPU MEMORY", justify="right")
    table.add_column("ESTIMATE")
    table.add_column("GPUS")
    for row in rows:
        if row.get("parent"):
            table.add_row(*_adapter_line(row))
            continue
        gpus = row.get("gpus") or []
        table.add_row(
            row["name"],
            str(row.get("kind", "")),
            str(row.get("resolved_backend", "")),
            _state(row),
            # As the dashboard shows it: replicas serving / replicas configured now.
            f"{row.get('loaded_replicas', 0)}/{row.get('replicas', 0)}",
            str(row.get("inflight_requests", 0)),
            str(row.get("queue_depth", 0)),
            _memory(row),
            str(row.get("vram_estimate_basis") or row.get("vram_estimate_source") or "-"),
            # One entry per replica; a replica split over GPUs shows them joined by "+".
            ",".join(
                "+".join(str(g) for g in replica) if isinstance(replica, list) else str(replica)
                for replica in gpus
                if replica is not None
            )
            or "-",
        )
    return table


def _adapter_line(row: dict[str, Any]) -> tuple[str, ...]:
    """A LoRA adapter's line: served by its base, whose line has the state's numbers."""
    adapter = row.get("adapter") or {}
    return (
        row["name"],
        str(row.get("kind", "")),
        f"lora on {row['parent']}",
        _state(row),
        "-",
        "-",
        "-",
        f"+{adapter.get('size_mib', 0):,.1f} MiB",
        "adapter file size",
        "-",
    )


async def ps(client: PoolClient, io: Io) -> int:
    body = await client.call("GET", "/v1/admin/models")
    if io.json:
        io.emit(body)
        return EXIT_OK
    rows = body.get("models", [])
    io.out.print(models_table(rows))
    for row in rows:
        if row.get("last_error"):
            io.out.print(f"{row['name']}: {row['last_error']}", markup=False)
        canary = row.get("canary") or {}
        if canary.get("health") == "degraded":
            io.out.print(f"{row['name']}: degraded: {canary.get('reason')}", markup=False)
    return EXIT_OK


def _row_line(row: dict[str, Any]) -> str:
    return (
        f"{row['name']}: {row.get('runtime_state')}, {row.get('replicas', 0)} replica(s), "
        f"GPU memory {_memory(row)} ({row.get('vram_estimate_basis') or 'no estimate'})"
    )


async def load(
    client: PoolClient, io: Io, name: str, sets: list[str], *, dry_run: bool = False
) -> int:
    body = parse_sets(sets)
    if dry_run:
        from pool.cli._why import preview_lines

        preview = await client.call("POST", f"/v1/admin/models/{name}/load?dry_run=true", body)
        if io.json:
            io.emit(preview)
        else:
            for line in preview_lines(preview):
                io.out.print(line, markup=False)
        return EXIT_OK
    # A load answers once it has finished, which may take minutes for a big model: a
    # terminal shows a spinner meanwhile, gone when it ends (a refusal is one line alone).
    with contextlib.nullcontext() if io.json else io.err.status(f"loading {name}…"):
        row = await client.call("POST", f"/v1/admin/models/{name}/load", body, unbounded=True)
    if io.json:
        io.emit(row)
    else:
        io.out.print(_row_line(row))
    return EXIT_OK


async def unload(client: PoolClient, io: Io, name: str) -> int:
    row = await client.call("POST", f"/v1/admin/models/{name}/unload", unbounded=True)
    if io.json:
        io.emit(row)
    else:
        io.out.print(_row_line(row))
    return EXIT_OK


_WATCHED = ("runtime_state", "replicas", "last_error")


class _Changes:
    """Prints each model's state the first time, then what changed; counts the changes."""

    def __init__(self, io: Io, count: int | None) -> None:
        self.io = io
        self.count = count
        self.seen: dict[str, dict[str, Any]] = {}
        self.printed = 0

    def see(self, rows: list[dict[str, Any]]) -> bool:
        """Print what ``rows`` changed; True once ``count`` changes were printed."""
        io = self.io
        for row in rows:
            now = {key: row.get(key) for key in _WATCHED}
            before = self.seen.get(row["name"])
            self.seen[row["name"]] = now
            if before == now:
                continue
            event = {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "model": row["name"],
                "from": None if before is None else before["runtime_state"],
                "to": now["runtime_state"],
                "replicas": now["replicas"],
                "last_error": now["last_error"],
            }
            if before is not None:
                self.printed += 1
            if io.json:
                io.emit(event)
            else:
                change = (
                    event["to"]
                    if before is None or before["runtime_state"] == now["runtime_state"]
                    else f"{event['from']} -> {event['to']}"
                )
                tail = f" ({now['last_error']})" if now["last_error"] else ""
                io.out.print(
                    f"{event['time']} {row['name']}: {change}, {now['replicas']} replica(s){tail}"
                )
            if self.count is not None and self.printed >= self.count:
                return True
        return False


async def events(client: PoolClient, io: Io, interval: float, count: int | None) -> int:
    """Follow state changes through the pool's event stream (``GET /v1/admin/events``).

    The first event prints every model's state; later ones print what changed.
    ``count`` stops after that many changes (for scripts and tests). A pool without the
    stream (an older one) is polled every ``interval`` seconds instead.
    """
    changes = _Changes(io, count)
    try:
        async with client.stream("GET", "/v1/admin/events") as response:
            kind = ""
            async for line in response.aiter_lines():
                if line.startswith("event: "):
                    kind = line.removeprefix("event: ")
                elif (
                    line.startswith("data: ")
                    and kind == "state"
                    and changes.see(json.loads(line.removeprefix("data: "))["models"])
                ):
                    return EXIT_OK
        io.err.print("the pool closed the event stream (it is shutting down)")
        return EXIT_OK
    except CliError as exc:
        if exc.body is None or exc.body.get("error", {}).get("code") != "not_found":
            raise
    while True:
        rows = (await client.call("GET", "/v1/admin/models")).get("models", [])
        if changes.see(rows):
            return EXIT_OK
        await trio.sleep(interval)
