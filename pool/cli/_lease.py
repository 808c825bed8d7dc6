"""``llm-pool lease``: take, hold, list and release GPU leases in the shared ledger.

These commands talk to Redis, not to a pool. ``--redis-url``, ``--prefix`` and
``--host`` default to ``$LLM_POOL_REDIS_URL``, ``$LLM_POOL_KEY_PREFIX`` and
``$LLM_POOL_GPU_HOST``, else to ``engine.cluster`` in the pool's settings files (the
ones ``llm-pool serve`` reads), so a job on the pool's machine finds the same ledger
with no option. A training job takes a lease before it allocates, and every pool of the
cluster counts it (docs/cluster.md)::

    llm-pool lease acquire --gpu 0:20000 --purpose training --hold -- (Ctrl-C releases)
    id=$(llm-pool lease acquire --gpu 0:20000 --ttl 3600) ... llm-pool lease release $id
"""

from __future__ import annotations

import argparse
import getpass
import os
import signal
import socket
import threading
from typing import Any

import trio
from rich.table import Table

from pool.cli._client import EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE, CliError, Io

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_PREFIX = "llm-pool"

# ``llm-pool lease --help``: plain text, argparse prints it as it is.
DESCRIPTION = """\
Take, hold, list and release GPU leases in the shared ledger.

These commands talk to Redis, not to a pool: a training job takes a lease before it
allocates, and every pool of the cluster counts it (docs/cluster.md). --redis-url,
--prefix and --host default to $LLM_POOL_REDIS_URL, $LLM_POOL_KEY_PREFIX and
$LLM_POOL_GPU_HOST, else to engine.cluster in the pool's settings files
($LLM_POOL_SETTINGS_PATH, else config/settings.json, with its local.json):

    llm-pool lease acquire --gpu 0:20000 --purpose training --hold   (Ctrl-C releases)
    id=$(llm-pool lease acquire --gpu 0:20000 --ttl 3600) ... llm-pool lease release $id
"""


def add_parser(commands: Any, common: argparse.ArgumentParser) -> None:
    """Add ``lease`` and its subcommands to the ``llm-pool`` parser."""
    lease = commands.add_parser(
        "lease",
        help="GPU leases shared with the pools (Redis)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = lease.add_subparsers(dest="lease_command", required=True, metavar="ACTION")
    shared = argparse.ArgumentParser(add_help=False, parents=[common])
    shared.add_argument(
        "--redis-url",
        help="the cluster's Redis (default: $LLM_POOL_REDIS_URL, engine.cluster.redis_url,"
        f" or {DEFAULT_REDIS_URL})",
    )
    shared.add_argument(
        "--prefix",
        help="the pools' engine.cluster.key_prefix (default: $LLM_POOL_KEY_PREFIX, the"
        f" settings, or {DEFAULT_PREFIX})",
    )
    acquire = actions.add_parser("acquire", parents=[shared], help="take a lease")
    acquire.add_argument(
        "--gpu",
        dest="gpus",
        action="append",
        required=True,
        metavar="INDEX:MIB",
        help="a GPU and the MiB to lease on it (repeat for a multi-GPU lease)",
    )
    acquire.add_argument(
        "--host",
        help="the machine of the GPUs, as the pools' engine.cluster.gpu_host"
        f" (default: $LLM_POOL_GPU_HOST, the settings, or {socket.gethostname()})",
    )
    acquire.add_argument(
        "--holder", default=f"{getpass.getuser()}@{socket.gethostname()}", help="who holds it"
    )
    acquire.add_argument("--purpose", default="", help="what it is for (shown in lists)")
    acquire.add_argument(
        "--ttl",
        type=float,
        default=None,
        help="seconds until it expires unless renewed (default: 600, or 15 with --hold)",
    )
    acquire.add_argument(
        "--wait", type=float, default=0.0, help="seconds to wait for room (default: 0)"
    )
    acquire.add_argument(
        "--hold",
        action="store_true",
        help="keep it, renewed, until interrupted (Ctrl-C or SIGTERM), then release it",
    )
    release = actions.add_parser("release", parents=[shared], help="release a lease")
    release.add_argument("id")
    listing = actions.add_parser("list", parents=[shared], help="every live lease")
    listing.add_argument("--host", help="only this machine's GPUs")


def _parse_gpus(pairs: list[str]) -> dict[int, int]:
    gpus: dict[int, int] = {}
    for pair in pairs:
        index, sep, mib = pair.partition(":")
        try:
            if not sep:
                raise ValueError
            gpus[int(index)] = int(mib)
        except ValueError:
            raise CliError(f"--gpu wants INDEX:MIB, got {pair!r}", EXIT_USAGE) from None
        if int(index) < 0 or int(mib) <= 0:
            raise CliError(f"--gpu wants a GPU index >= 0 and MiB > 0, got {pair!r}", EXIT_USAGE)
    return gpus


def leases_table(leases: list[dict[str, Any]]) -> Table:
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("ID", "HOLDER", "HOST", "GPUS", "MIB", "PURPOSE", "EXPIRES IN"):
        table.add_column(column, justify="right" if column in ("MIB", "EXPIRES IN") else "left")
    for lease in leases:
        left = lease.get("expires_in_ms")
        table.add_row(
            lease["id"],
            lease["holder"],
            lease["host"],
            ",".join(str(g["index"]) for g in lease["gpus"]),
            f"{sum(g['mib'] for g in lease['gpus']):,}",
            lease.get("purpose") or "-",
            "-" if left is None else f"{left / 1000:.1f}s",
        )
    return table


def _settings_cluster() -> dict[str, Any]:
    """``engine.cluster`` as the pool's settings files give it, unvalidated ({} if none:
    a job's machine need not hold the pool's settings)."""
    from pool.config import default_local_path, default_settings_path, merge, read_json
    from pool.errors import ConfigError

    path = default_settings_path()
    data: dict[str, Any] = {}
    for file in (path, default_local_path(path)):
        if file.is_file():
            try:
                data = merge(data, read_json(file))
            except ConfigError:
                return {}
    cluster = data.get("engine", {}).get("cluster")
    return cluster if isinstance(cluster, dict) else {}


def _fill_defaults(args: argparse.Namespace) -> None:
    """Option, else environment variable, else the settings, else the built-in default."""
    cluster = _settings_cluster()

    def pick(option: str | None, env: str, key: str, fallback: str) -> str:
        value = option or os.environ.get(env) or cluster.get(key)
        return value if isinstance(value, str) and value else fallback

    args.redis_url = pick(args.redis_url, "LLM_POOL_REDIS_URL", "redis_url", DEFAULT_REDIS_URL)
    args.prefix = pick(args.prefix, "LLM_POOL_KEY_PREFIX", "key_prefix", DEFAULT_PREFIX)
    if args.lease_command == "acquire":
        args.host = pick(args.host, "LLM_POOL_GPU_HOST", "gpu_host", socket.gethostname())


async def run(args: argparse.Namespace, io: Io) -> int:
    """Run one ``lease`` action; returns the exit code."""
    from pool.cluster import LeaseRefused, RedisUnavailable, missing_client_reason, open_ledger

    reason = missing_client_reason()
    if reason is not None:
        raise CliError(reason, EXIT_USAGE)
    _fill_defaults(args)
    try:
        async with open_ledger(args.redis_url, prefix=args.prefix, timeout_s=args.timeout) as led:
            if args.lease_command == "list":
                leases = [lease.as_json() for lease in await led.list_leases(args.host)]
                if io.json:
                    io.emit({"leases": leases})
                else:
                    io.out.print(leases_table(leases))
                return EXIT_OK
            if args.lease_command == "release":
                if not await led.release(args.id):
                    raise CliError(f"no lease {args.id!r} (expired or released)", EXIT_REFUSED)
                if io.json:
                    io.emit({"released": args.id})
                return EXIT_OK
            ttl = args.ttl if args.ttl is not None else (15.0 if args.hold else 600.0)
            request = {
                "holder": args.holder,
                "host": args.host,
                "gpus": _parse_gpus(args.gpus),
                "purpose": args.purpose,
                "ttl_s": ttl,
            }
            if not args.hold:
                lease = await led.acquire_waiting(args.wait, **request)
                if io.json:
                    io.emit(lease.as_json())
                else:
                    io.out.print(lease.id)
                return EXIT_OK
            return await _hold(led, request, args.wait, io)
    except LeaseRefused as exc:
        raise CliError(f"no room: {exc}", EXIT_REFUSED) from None
    except RedisUnavailable as exc:
        raise CliError(f"no Redis at {args.redis_url}: {exc}", EXIT_UNREACHABLE) from None


async def _hold(ledger: Any, request: dict[str, Any], wait_s: float, io: Io) -> int:
    from pool.cluster import hold_lease

    async with hold_lease(ledger, wait_s=wait_s, **request) as lease:
        if io.json:
            io.emit(lease.as_json())
        else:
            io.out.print(lease.id)
        io.raw.flush()
        if threading.current_thread() is threading.main_thread():
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    break
        else:
            await trio.sleep_forever()
    return EXIT_OK
