"""``llm-pool`` (and ``python -m pool``): the parser and the dispatch of every command.

What the commands are for, as the user reads it in ``llm-pool --help``, is
:data:`DESCRIPTION`: plain text, since argparse prints it as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TextIO

import trio

from pool._version import __version__
from pool.cli import _keys, _lease
from pool.cli._args import Parser, positive
from pool.cli._client import (
    EXIT_INTERRUPTED,
    EXIT_REFUSED,
    EXIT_USAGE,
    CliError,
    Io,
    PoolClient,
    default_token,
    default_url,
    pool_url,
)
from pool.config import load_settings
from pool.errors import ConfigError, ListenError

SERVER_COMMANDS = frozenset({"serve", "convert"})

DESCRIPTION = """\
Serve the pool, run a tool, or steer a running pool.

serve and convert run here; every other command talks to a running pool over HTTP
(--url, default $LLM_POOL_URL or http://127.0.0.1:8011, http:// where no scheme is
given; the token comes from $LLM_POOL_ADMIN_TOKEN or $LLM_POOL_API_TOKEN).

Exit codes: 0 done, 1 the pool refused (its error code is printed), 2 usage,
3 no pool at the URL, 130 interrupted. Each error is one line on stderr.
"""


def _parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="llm-pool",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"llm-pool {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = commands.add_parser("serve", help="run the HTTP service")
    serve.add_argument(
        "--settings", type=Path, help="settings file (default: config/settings.json)"
    )
    serve.add_argument("--local", type=Path, help="local overrides (default: local.json beside it)")
    serve.add_argument("--host", help="address to bind (default: service.host)")
    serve.add_argument("--port", type=int, help="port (default: service.port; 0 picks one)")
    serve.add_argument(
        "--log-level",
        choices=["debug", "info", "warning", "error"],
        help="default: $LOG_LEVEL, else service.log_level",
    )
    serve.add_argument(
        "--log-format",
        choices=["text", "json"],
        help="text lines, or one JSON object per line (default: $LOG_FORMAT, else text)",
    )
    convert = commands.add_parser("convert", help="build a model for another backend")
    convert.add_argument("args", nargs=argparse.REMAINDER, help="see: llm-pool convert --help")

    common = Parser(add_help=False)
    common.add_argument(
        "--url",
        type=pool_url,
        default=default_url(),
        help="the pool; http:// where no scheme is given (default: $LLM_POOL_URL or %(default)s)",
    )
    common.add_argument("--json", action="store_true", help="JSON output for scripts")
    common.add_argument(
        "--timeout",
        type=positive(float),
        default=30,
        help="seconds for a plain request (default: 30)",
    )

    def client(name: str, help: str, aliases: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=help, parents=[common], aliases=list(aliases))

    client("ps", "models with state, replicas, in flight, queue, GPU memory", ("models",))
    load = client("load", "load a model (waits until it is loaded)")
    load.add_argument("name")
    load.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="a load override; VALUE is JSON where it parses, else a string (repeatable)",
    )
    load.add_argument(
        "--dry-run",
        action="store_true",
        help="say what the load would do now (placement, evictions, refusal), changing nothing",
    )
    why = client("why", "the pool's latest residency decisions (loads, evictions), in words")
    why.add_argument("name", nargs="?", help="only the decisions about this model")
    why.add_argument("-n", "--limit", type=int, default=20, help="default: 20")
    usage = client("usage", "recorded token usage by key, tenant or model")
    usage.add_argument(
        "--group-by", choices=("key", "tenant", "model"), default="tenant", help="default: tenant"
    )
    usage.add_argument("--since", help="from this time: RFC 3339 or seconds since the epoch")
    usage.add_argument("--until", help="before this time: RFC 3339 or seconds since the epoch")
    usage.add_argument("--bucket", choices=("hour", "day"), help="one line per UTC hour or day")
    unload = client("unload", "unload a model (waits until it is unloaded)")
    unload.add_argument("name")
    pull = client("pull", "pull a model from its source, with progress (Ctrl-C detaches)")
    pull.add_argument("name")
    pull.add_argument("--cancel", action="store_true", help="cancel the running pull instead")
    chat = client("chat", "chat with a model (streams over the WebSocket)")
    chat.add_argument("name")
    chat.add_argument("--system", help="system prompt (instructions)")
    chat.add_argument("--max-tokens", type=int, help="answer length limit")
    events = client("events", "follow model state changes")
    events.add_argument(
        "--interval",
        type=positive(float),
        default=1.0,
        help="seconds between polls, for a pool without an event stream (default: 1)",
    )
    events.add_argument("--count", type=int, help="stop after this many changes")
    bench = client("bench", "a quick latency and tokens/s check of one model")
    bench.add_argument("name")
    bench.add_argument("-n", "--requests", type=positive(int), default=5, help="default: 5")
    bench.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    bench.add_argument("--max-tokens", type=int, default=64, help="default: 64")
    _lease.add_parser(commands, common)
    _keys.add_parser(commands, common)
    return parser


async def _dispatch(args: argparse.Namespace, client: PoolClient, io: Io) -> int:
    from pool.cli import _bench, _chat, _models, _pull, _usage, _why

    command = "ps" if args.command == "models" else args.command
    if command == "ps":
        return await _models.ps(client, io)
    if command == "load":
        return await _models.load(client, io, args.name, args.sets, dry_run=args.dry_run)
    if command == "why":
        return await _why.why(client, io, args.name, args.limit)
    if command == "unload":
        return await _models.unload(client, io, args.name)
    if command == "usage":
        return await _usage.usage(client, io, args.group_by, args.since, args.until, args.bucket)
    if command == "pull":
        if args.cancel:
            return await _pull.cancel(client, io, args.name)
        return await _pull.pull(client, io, args.name)
    if command == "chat":
        return await _chat.chat(client, io, args.name, args.system, args.max_tokens)
    if command == "events":
        return await _models.events(client, io, args.interval, args.count)
    if command == "lease":
        return await _lease.run(args, io)
    if command == "keys":
        return await _keys.run(client, io, args)
    if command == "bench":
        return await _bench.bench(
            client, io, args.name, args.requests, args.prompt, args.max_tokens
        )
    raise AssertionError(command)


async def run_command(
    argv: list[str],
    *,
    stdout: TextIO | None = None,
    stderr: TextIO | None = None,
    read_line: Callable[[], Awaitable[str | None]] | None = None,
) -> int:
    """Run one client command (anything but ``serve``/``convert``) in the current Trio run.

    Args:
        argv: the arguments after ``llm-pool``.
        stdout, stderr: where output goes (default: the process's streams).
        read_line: the next input line, ``None`` at its end (default: stdin; ``chat``).

    Returns:
        The exit code.
    """
    out, err = stdout or sys.stdout, stderr or sys.stderr
    try:
        # argparse writes its help and its errors to the process's streams itself.
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command in SERVER_COMMANDS:
        print(f"llm-pool {args.command} does not run inside another program", file=err)
        return EXIT_USAGE
    io = Io(out, err, json=args.json)
    if read_line is not None:
        io.read_line = read_line
    client = PoolClient(args.url, default_token(), args.timeout)
    try:
        return await _dispatch(args, client, io)
    except (CliError, BaseExceptionGroup) as raised:
        # In a terminal, Ctrl-C's watcher (on_interrupt) is a nursery: the error comes wrapped.
        error = _lone(raised)
        if not isinstance(error, CliError):
            raise
        if io.json and error.body is not None:
            io.emit(error.body)
        # One line, whatever the server's message holds (a backend's output, say).
        io.err.print(f"llm-pool {args.command}: {' '.join(error.message.split())}", markup=False)
        return error.exit_code
    finally:
        with trio.CancelScope(shield=True):
            await client.aclose()


async def _serve(args: argparse.Namespace) -> None:
    from pool.cli._heap import settle_heap
    from pool.cli._logs import configure_logging
    from pool.http import ServerInfo, serve

    settings = load_settings(args.settings, args.local)
    configure_logging(
        args.log_level or os.environ.get("LOG_LEVEL") or settings.service.log_level,
        args.log_format or os.environ.get("LOG_FORMAT", "text").lower(),
    )
    log = logging.getLogger("pool")
    settle_heap()  # the modules imported, no model loaded yet (pool/cli/_heap.py)
    # Opened before the server starts, so a signal is never a KeyboardInterrupt.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def run_server(
                *, task_status: trio.TaskStatus[ServerInfo] = trio.TASK_STATUS_IGNORED
            ) -> None:
                await serve(settings, host=args.host, port=args.port, task_status=task_status)
                nursery.cancel_scope.cancel()  # stopped: no more signals to wait for

            info: ServerInfo = await nursery.start(run_server)
            print(f"llm-pool listening on {info.url}", flush=True)
            async for signum in signals:
                name = signal.Signals(signum).name
                if info.stopping.is_set():
                    log.warning("%s again: stopping without waiting for open streams", name)
                    nursery.cancel_scope.cancel()
                    return
                log.info("%s: graceful shutdown", name)
                info.shutdown()


def main(argv: list[str] | None = None) -> int:
    """The ``llm-pool`` entry point; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["convert"]:
        # pool.convert's own parser reads the rest, --help included (argparse's
        # REMAINDER would refuse a leading option).
        try:
            convert = importlib.import_module("pool.convert")
        except ImportError as exc:
            print(f"llm-pool convert is not available: {exc}", file=sys.stderr)
            return 2
        result: int = convert.main(argv[1:])
        return result
    try:
        args = _parser().parse_args(argv)
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command != "serve":
        try:
            return trio.run(run_command, argv)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED
    try:
        trio.run(_serve, args)
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:
        # Settings found unusable while starting (the cluster refused this pool's node
        # id, say) and an address it cannot listen on arrive through the server's
        # nurseries, wrapped in groups.
        problem = _lone(exc)
        if isinstance(problem, ListenError):
            print(f"llm-pool serve: {problem}", file=sys.stderr)
            return EXIT_REFUSED
        if not isinstance(problem, ConfigError):
            raise
        for line in problem.problems:
            print(f"llm-pool serve: invalid settings: {line}", file=sys.stderr)
        return EXIT_USAGE
    return 0


def _lone(exc: BaseException) -> BaseException:
    """The one exception inside nested groups of one (``exc`` itself otherwise)."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
