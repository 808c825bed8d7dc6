"""What every client command shares: the HTTP client, error mapping, output, Ctrl-C."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TextIO

import httpx
import trio
from rich.console import Console

DEFAULT_URL = "http://127.0.0.1:8011"

# Exit codes: scripts branch on these.
EXIT_OK = 0
EXIT_REFUSED = 1  # the server answered with an error (its code is printed)
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3  # no pool at --url
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """Ends a command with ``exit_code``; ``body`` is the server's error body, if any."""

    def __init__(self, message: str, exit_code: int, *, body: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.body = body


def default_url() -> str:
    return os.environ.get("LLM_POOL_URL") or DEFAULT_URL


def pool_url(text: str) -> str:
    """``--url`` (and ``$LLM_POOL_URL``) as the client uses it: ``http://`` where no scheme
    is written (``localhost:8011``, as ``curl`` takes it).

    Raises:
        argparse.ArgumentTypeError: not an http:// or https:// URL with a host.
    """
    url = text.strip()
    if "://" not in url:
        url = f"http://{url}"
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a URL: {exc}") from None
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not the URL of a pool (http://HOST:PORT or https://...)"
        )
    return url


def default_token() -> str | None:
    """The admin token if set (it is accepted everywhere), else the first API token."""
    admin = os.environ.get("LLM_POOL_ADMIN_TOKEN")
    if admin:
        return admin
    api = os.environ.get("LLM_POOL_API_TOKEN") or os.environ.get("LLM_POOL_API_TOKENS")
    return api.split(",")[0].strip() if api else None


async def _read_stdin_line() -> str | None:
    line = await trio.to_thread.run_sync(sys.stdin.readline, abandon_on_cancel=True)
    return line if line else None


def _console(stream: TextIO) -> Console:
    # A pipe or a file gets whole table lines (`llm-pool ps | grep loaded`), not 80 columns.
    wide = None if stream.isatty() or os.environ.get("COLUMNS") else 200
    return Console(file=stream, highlight=False, markup=False, soft_wrap=True, width=wide)


@dataclass
class Io:
    """Where a command writes and reads: the process's streams, or a test's.

    ``out`` takes human output (tables, progress); ``raw`` takes ``--json`` lines.
    """

    raw: TextIO
    err_stream: TextIO
    json: bool = False
    read_line: Callable[[], Awaitable[str | None]] = _read_stdin_line
    out: Console = field(init=False)
    err: Console = field(init=False)

    def __post_init__(self) -> None:
        self.out = _console(self.raw)
        self.err = _console(self.err_stream)

    def emit(self, obj: Any) -> None:
        """One JSON document per line (``--json``)."""
        self.raw.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self.raw.flush()


def _error_text(status: int, body: dict[str, Any]) -> str:
    """The server's error in one line: its code and status, then what it says."""
    error = body.get("error")
    if isinstance(error, str):  # Ollama's format on /api/*
        return f"{status}: {error}"
    if not isinstance(error, dict):
        return f"{status}: {json.dumps(body)}"
    # A schema refusal lists every field it refused; its message names only the first.
    fields = [
        f"field {'.'.join(str(p) for p in item.get('loc', ())) or 'body'}: {item.get('msg')}"
        for item in error.get("errors") or []
    ]
    said = "; ".join(fields) or str(error.get("message", ""))
    last_error = error.get("last_error")
    if last_error and str(last_error) not in said:
        said += f"; last error: {last_error}"
    return f"{error.get('code', 'error')} ({status}): {said}"


def refused(response: httpx.Response) -> CliError:
    """The error a command ends with when the server answered ``response`` (4xx/5xx)."""
    try:
        body = response.json()
    except ValueError:
        body = {"error": {"code": "http_error", "message": response.text.strip()[:500]}}
    if not isinstance(body, dict):
        body = {"error": {"code": "http_error", "message": str(body)}}
    return CliError(_error_text(response.status_code, body), EXIT_REFUSED, body=body)


class PoolClient:
    """HTTP to a running pool; connection failures become exit 3, error answers exit 1."""

    def __init__(self, url: str, token: str | None, timeout: float) -> None:
        self.url = url.rstrip("/")
        self.token = token
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.http = httpx.AsyncClient(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout)
        )

    async def aclose(self) -> None:
        await self.http.aclose()

    def _unreachable(self, exc: Exception) -> CliError:
        # Some failures (TLS spoken to a plain HTTP port) say nothing but through a cause.
        reason: BaseException | None = exc
        while reason is not None and not str(reason):
            reason = reason.__cause__ or reason.__context__
        said = str(reason) if reason is not None else type(exc).__name__
        return CliError(f"cannot reach the pool at {self.url}: {said}", EXIT_UNREACHABLE)

    async def call(
        self, method: str, path: str, body: Any = None, *, unbounded: bool = False
    ) -> Any:
        """One request; the decoded JSON answer. ``unbounded`` waits as long as it takes."""
        extra: dict[str, Any] = {"timeout": None} if unbounded else {}
        try:
            response = await self.http.request(method, path, json=body, **extra)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise self._unreachable(exc) from exc
        except httpx.TimeoutException as exc:
            raise CliError(f"{method} {path}: no answer in time", EXIT_REFUSED) from exc
        if response.status_code >= 400:
            raise refused(response)
        return response.json()

    @asynccontextmanager
    async def stream(
        self, method: str, path: str, body: Any = None
    ) -> AsyncIterator[httpx.Response]:
        """A streamed answer (no read timeout: pulls and generations take their time)."""
        try:
            async with self.http.stream(
                method, path, json=body, timeout=httpx.Timeout(10, read=None)
            ) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise refused(response)
                yield response
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise self._unreachable(exc) from exc

    def ws_url(self, path: str) -> str:
        scheme, rest = self.url.split("://", 1)
        return f"{'wss' if scheme == 'https' else 'ws'}://{rest}{path}"


@asynccontextmanager
async def on_interrupt(scope: trio.CancelScope) -> AsyncIterator[list[bool]]:
    """Ctrl-C cancels ``scope`` instead of raising ``KeyboardInterrupt``.

    Yields a list that holds ``True`` once Ctrl-C was pressed. Signals can only be
    caught on the main thread; elsewhere (a test driving a command) this does nothing.
    """
    pressed: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return
    with trio.open_signal_receiver(signal.SIGINT) as signals:
        async with trio.open_nursery() as nursery:

            async def watch() -> None:
                async for _ in signals:
                    pressed.append(True)
                    scope.cancel()

            nursery.start_soon(watch)
            try:
                yield pressed
            finally:
                nursery.cancel_scope.cancel()
