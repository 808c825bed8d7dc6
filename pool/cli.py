"""``llm-pool`` (and ``python -m pool``): serve the pool, or run a tool."""

from __future__ import annotations

import argparse
import importlib
import logging
import signal
import sys
from pathlib import Path

import trio

from pool.config import load_settings
from pool.errors import ConfigError


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llm-pool", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
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
        help="default: service.log_level",
    )
    convert = commands.add_parser("convert", help="build a model for another backend")
    convert.add_argument("args", nargs=argparse.REMAINDER, help="see `llm-pool convert --help`")
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s %(message)s",
        stream=sys.stderr,
    )


async def _serve(args: argparse.Namespace) -> None:
    from pool.http import ServerInfo, serve

    settings = load_settings(args.settings, args.local)
    _configure_logging(args.log_level or settings.service.log_level)
    log = logging.getLogger("pool")
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
    args = _parser().parse_args(argv)
    if args.command == "convert":
        try:
            convert = importlib.import_module("pool.convert")
        except ImportError as exc:
            print(f"llm-pool convert is not available: {exc}", file=sys.stderr)
            return 2
        result: int = convert.main(args.args)
        return result
    try:
        trio.run(_serve, args)
    except ConfigError as exc:
        print(f"llm-pool: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
