"""``usage``: recorded token usage by key, tenant or model (``GET /v1/admin/usage``)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

from rich.table import Table

from pool.cli._client import EXIT_OK, Io, PoolClient

_COUNTS = ("requests", "prompt_tokens", "cached_tokens", "output_tokens", "characters")


def usage_table(group_by: str, rows: list[dict[str, Any]]) -> Table:
    """One line per group (and per hour or day when bucketed), with the totals."""
    table = Table(box=None, pad_edge=False, header_style="bold")
    bucketed = any("bucket" in row for row in rows)
    if bucketed:
        table.add_column("BUCKET (UTC)")
    table.add_column(group_by.upper())
    for column in ("REQUESTS", "PROMPT", "CACHED", "OUTPUT", "CHARS"):
        table.add_column(column, justify="right")
    for row in rows:
        name = row.get(group_by)
        cells = [str(row.get("bucket", ""))] if bucketed else []
        # Requests without a named key (or before keys existed) have a null key.
        cells.append("-" if name is None else str(name))
        cells.extend(f"{row.get(count, 0):,}" for count in _COUNTS)
        table.add_row(*cells)
    return table


async def usage(
    client: PoolClient,
    io: Io,
    group_by: str,
    since: str | None,
    until: str | None,
    bucket: str | None,
) -> int:
    """Print the usage table; the server checks the parameters (400 names what is wrong)."""
    query = {"group_by": group_by}
    for name, value in (("since", since), ("until", until), ("bucket", bucket)):
        if value is not None:
            query[name] = value
    body = await client.call("GET", f"/v1/admin/usage?{urlencode(query)}")
    rows = body.get("usage", [])
    if io.json:
        io.emit(body)
        return EXIT_OK
    if not rows:
        io.out.print("no usage recorded in this range", markup=False)
        return EXIT_OK
    io.out.print(usage_table(group_by, rows))
    return EXIT_OK
