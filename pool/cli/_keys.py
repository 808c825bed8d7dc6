"""``keys list|add|revoke``: the pool's keys with identities (``/v1/admin/keys``)."""

from __future__ import annotations

import argparse
import time
from typing import Any
from urllib.parse import quote

from rich.table import Table

from pool.cli._client import EXIT_OK, Io, PoolClient


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    """``keys`` and its three actions, each taking the client options of ``common``."""
    keys = commands.add_parser("keys", help="list, add or revoke keys (admin)")
    actions = keys.add_subparsers(dest="keys_action", required=True, metavar="ACTION")
    actions.add_parser("list", parents=[common], help="the keys in force, without secrets")
    add = actions.add_parser(
        "add", parents=[common], help="add a key; a generated key is printed this once"
    )
    add.add_argument("name")
    add.add_argument("--tenant", help="the tenant of its requests (default: X-Tenant-ID)")
    add.add_argument("--role", choices=["inference", "admin"], default="inference")
    add.add_argument(
        "--priority",
        choices=["high", "normal", "low"],
        help="default and highest priority of its requests (default: X-Priority)",
    )
    add.add_argument("--rpm", type=float, help="requests per minute it may send")
    add.add_argument(
        "--preemptible",
        action="store_true",
        default=None,
        help="its generations may be paused for a swap whatever their priority",
    )
    add.add_argument(
        "--key-sha256",
        help="SHA-256 (hex) of a key you generated; the pool then never sees the key",
    )
    revoke = actions.add_parser("revoke", parents=[common], help="revoke a key, at once")
    revoke.add_argument("name")


def keys_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("NAME", "TENANT", "ROLE", "PRIORITY", "RPM", "PREEMPTIBLE", "SOURCE", "CREATED"):
        table.add_column(column)
    for row in rows:
        created = row.get("created_at")
        rpm = row.get("rate_limit_rpm")
        table.add_row(
            row["name"],
            row.get("tenant") or "-",
            row["role"],
            row.get("priority") or "-",
            "-" if rpm is None else f"{rpm:g}",
            "yes" if row.get("preemptible") else "no",
            row["source"],
            "-" if created is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(created)),
        )
    return table


async def run(client: PoolClient, io: Io, args: argparse.Namespace) -> int:
    if args.keys_action == "list":
        body = await client.call("GET", "/v1/admin/keys")
        if io.json:
            io.emit(body)
        elif not body["keys"]:
            io.out.print("no keys", markup=False)
        else:
            io.out.print(keys_table(body["keys"]))
        return EXIT_OK
    if args.keys_action == "add":
        wanted = {
            "name": args.name,
            "tenant": args.tenant,
            "role": args.role,
            "priority": args.priority,
            "rate_limit_rpm": args.rpm,
            "preemptible": args.preemptible,
            "key_sha256": args.key_sha256,
        }
        added = await client.call(
            "POST", "/v1/admin/keys", {k: v for k, v in wanted.items() if v is not None}
        )
        if io.json:
            io.emit(added)
        elif added.get("key"):
            io.out.print(added["key"], markup=False)
            io.err.print(f"key {added['name']} added: store it now, it is not shown again")
        else:
            io.out.print(f"key {added['name']} added (from its SHA-256)", markup=False)
        return EXIT_OK
    revoked = await client.call("DELETE", f"/v1/admin/keys/{quote(args.name, safe='')}")
    if io.json:
        io.emit(revoked)
    else:
        io.out.print(f"key {revoked['name']} revoked", markup=False)
    return EXIT_OK
