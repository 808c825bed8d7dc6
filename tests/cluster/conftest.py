"""A real ``redis-server`` per test, on a free loopback port with its own folder.

scripts/test installs Debian's redis-server; without it (or without the coredis
client) these tests fail under CI=true and skip elsewhere, naming what is missing.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from pool.cluster import LeaseLedger, missing_client_reason
from tests.components import missing


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class RedisServer:
    """One redis-server process that a test may stop and start again on the same port."""

    def __init__(self, binary: str, folder: Path) -> None:
        self.binary = binary
        self.folder = folder
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            [
                self.binary,
                "--port", str(self.port),
                "--bind", "127.0.0.1",
                "--dir", str(self.folder),
                "--save", "",
                "--appendonly", "no",
                "--protected-mode", "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def pause(self) -> None:
        """Stop the process where it stands (``SIGSTOP``): connections stay open and
        commands sent meanwhile wait in its socket, unanswered, until :meth:`resume`."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let the paused process go on (``SIGCONT``) with its data, port and folder."""
        assert self.process is not None
        self.process.send_signal(signal.SIGCONT)

    def shut_down_saving(self) -> None:
        """Shut the server down as an operator would (``SHUTDOWN SAVE``): its data goes
        to ``dump.rdb`` in its folder, which :meth:`start` loads again."""
        assert self.process is not None
        with socket.create_connection(("127.0.0.1", self.port), timeout=5) as sock:
            sock.sendall(b"*2\r\n$8\r\nSHUTDOWN\r\n$4\r\nSAVE\r\n")
            with contextlib.suppress(OSError):
                sock.recv(64)  # the server closes the connection as it exits
        self.process.wait(10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGCONT)  # a paused one could not end
            self.process.terminate()
            self.process.wait(10)
        self.process = None


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    binary = shutil.which("redis-server")
    if binary is None:
        missing("redis-server", "scripts/test installs Debian's package")
    reason = missing_client_reason()
    if reason is not None:
        missing("the coredis client", reason)
    folder = tmp_path / "redis"
    folder.mkdir()
    server = RedisServer(binary, folder)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def wait_renewals(ledger: LeaseLedger, lease_id: str, count: int) -> None:
    """Until the holder of ``lease_id`` has renewed it ``count`` times; it must be there
    at every look. A renewal publishes nothing: it shows as the lease's time left going
    back up, so that is what is polled (under a generous deadline, as a hang guard)."""
    seen = 0
    last: int | None = None
    with trio.fail_after(60):
        while seen < count:
            lease = await ledger.get(lease_id)
            assert lease is not None and lease.expires_in_ms is not None, "it expired"
            if last is not None and lease.expires_in_ms > last:
                seen += 1
            last = lease.expires_in_ms
            await trio.sleep(0.02)
