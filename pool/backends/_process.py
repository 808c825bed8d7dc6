"""Managed child processes for the pool-managed backends (llama-server, vllm serve).

The child runs in its own session (process group), so stopping it stops everything it
started; it gets a parent-death signal, so it dies with the pool even when the pool is
killed with SIGKILL. ``PR_SET_PDEATHSIG`` fires when the *thread* that forked the child
ends, and Trio's ``open_process`` forks from a short-lived worker thread; so the child is
forked here, from the Trio thread itself, which lives as long as the pool. Its exit is
awaited through a pidfd (no polling) and its output is read line by line into the
pool's log, with the last lines kept for error messages.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Mapping, Sequence

import trio

from pool.backends._placement import GpuPlacement
from pool.errors import BackendError

log = logging.getLogger("pool.process")

_PR_SET_PDEATHSIG = 1
_TAIL_LINES = 40
_KEPT_LINES = 64


def _die_with_parent() -> None:  # runs in the child between fork and exec
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _term_with_parent() -> None:  # the group guard's: it must live to act on the signal
    # Held blocked across exec (the mask is inherited) until the guard's handler is in:
    # a pool killed while the guard's interpreter still starts would otherwise kill the
    # guard by SIGTERM's default action, and the server's group would outlive both.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


# The parent-death signal reaches the server only, not the processes it starts (vLLM's
# engine core): a server's group outlived a SIGKILLed pool. This guard, one per server,
# gets SIGTERM when the pool dies and kills the server's whole group; when the pool stops
# the server itself, it writes "stop" to the guard's stdin and the guard just exits. A
# pool that dies closes that pipe before the kernel sends the parent-death signal, so EOF
# alone means the pool died (its parent id may not have changed yet when EOF is read:
# a guard that went by it exited and left the group behind).
_GROUP_GUARD = """
import os, signal, sys
def reap(*_):
    try:
        os.killpg(int(sys.argv[1]), signal.SIGKILL)
    finally:
        os._exit(0)
signal.signal(signal.SIGTERM, reap)
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a pending one runs reap now
if os.getppid() != int(sys.argv[2]):
    reap()  # the pool died before the parent-death signal was armed
if sys.stdin.buffer.read() != b"stop":
    reap()  # EOF without "stop": the pool died (it says "stop" once the group is gone)
"""


def group_alive(pgid: int) -> bool:
    """Whether any live process (zombies don't count) is in process group ``pgid``."""
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != b"Z":
            return True
    return False


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, SIGTSTP, a tracer)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            state = stat.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state in (b"T", b"t")


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (the child binds it right away)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def child_environment(
    env: Mapping[str, str] | None = None,
    library_path: Sequence[str] = (),
    placement: GpuPlacement | None = None,
) -> dict[str, str]:
    """The pool's environment plus ``env``, with ``library_path`` before LD_LIBRARY_PATH.

    With a ``placement`` the child sees exactly its GPUs (``CUDA_VISIBLE_DEVICES`` in
    the PCI bus order NVML counts in): the pool's gate decided where it runs, and its
    accounting holds only if the server goes there, so this wins over ``env``.
    """
    merged = dict(os.environ)
    merged.update(env or {})
    if placement is not None and placement.gpus:
        merged.update(placement.child_environment())
    if library_path:
        current = merged.get("LD_LIBRARY_PATH", "")
        merged["LD_LIBRARY_PATH"] = os.pathsep.join(
            [*library_path, current] if current else library_path
        )
    return merged


class ManagedProcess:
    def __init__(
        self,
        label: str,
        command: Sequence[str],
        env: Mapping[str, str],
        keep: re.Pattern[str] | None = None,
    ) -> None:
        self.label = label
        # Output lines matching ``keep``, beyond the tail's reach (a server's startup
        # figures scroll out of it); bounded.
        self._keep_pattern = keep
        self.kept: list[str] = []
        self.command = list(command)
        self._env = dict(env)
        self._popen: subprocess.Popen[bytes] | None = None
        self._guard: subprocess.Popen[bytes] | None = None
        self._pidfd: int | None = None
        self._output: trio.lowlevel.FdStream | None = None
        self._tail: deque[str] = deque(maxlen=_TAIL_LINES)
        self._partial = b""
        self._exited = trio.Event()
        self._output_closed = trio.Event()
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        assert self._popen is not None
        return self._popen.pid

    @property
    def alive(self) -> bool:
        return self._popen is not None and not self._exited.is_set()

    def tail(self) -> str:
        return "\n".join(self._tail)

    async def exits_within(self, timeout_s: float) -> bool:
        """Whether the process is seen to exit within ``timeout_s`` (its watcher, the
        task in :meth:`wait`, reaps it; this only looks)."""
        with trio.move_on_after(timeout_s):
            await self._exited.wait()
        return self._exited.is_set()

    def spawn(self) -> None:
        """Start the child (from the calling, long-lived Trio thread; see the module doc)."""
        try:
            self._popen = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=self._env,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # only prctl runs there: fork-safe
            )
        except OSError as exc:
            raise BackendError(f"cannot start {self.command[0]}: {exc.strerror or exc}") from exc
        try:
            self._guard = subprocess.Popen(
                [sys.executable, "-c", _GROUP_GUARD, str(self._popen.pid), str(os.getpid())],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_term_with_parent,
            )
        except OSError as exc:
            self._signal_group(signal.SIGKILL)
            raise BackendError(f"cannot start the process guard: {exc}") from exc
        assert self._popen.stdout is not None
        self._output = trio.lowlevel.FdStream(os.dup(self._popen.stdout.fileno()))
        self._popen.stdout.close()
        self._pidfd = os.pidfd_open(self._popen.pid)
        log.info("%s: started pid %d: %s", self.label, self._popen.pid, " ".join(self.command))

    async def pump_output(self) -> None:
        """Copy the child's output into the log until it closes (run as a task)."""
        if self._output is None:
            return
        with contextlib.suppress(trio.ClosedResourceError, OSError):
            while chunk := await self._output.receive_some(65536):
                self._partial += chunk
                *lines, self._partial = self._partial.split(b"\n")
                for raw in lines:
                    self._keep(raw)
            # The end of the output: its last line may have no newline.
            self._keep(self._partial)
            self._partial = b""
            self._output_closed.set()

    def _keep(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip()
        if line:
            self._tail.append(line)
            keep = self._keep_pattern
            if keep is not None and len(self.kept) < _KEPT_LINES and keep.search(line):
                self.kept.append(line)
            log.info("%s: %s", self.label, line)

    async def output_read(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the child's output has been read to its end,
        so an error about its exit quotes what it said last (the reader may lag behind
        the exit on a busy machine)."""
        with trio.move_on_after(timeout_s):
            await self._output_closed.wait()

    async def wait(self) -> int:
        """Wait for the child to exit; returns its exit status (negative: a signal)."""
        if self._exited.is_set():
            assert self.returncode is not None
            return self.returncode
        assert self._popen is not None and self._pidfd is not None
        await trio.lowlevel.wait_readable(self._pidfd)
        self.returncode = self._popen.wait()  # already exited: reaps at once
        self._exited.set()
        return self.returncode

    async def stop(self, grace_s: float) -> None:
        """SIGTERM to the whole group, SIGKILL after ``grace_s``, reap. Shielded, bounded."""
        if self._popen is None:
            return
        with trio.CancelScope(shield=True):
            if not self._exited.is_set():
                # A stopped server cannot act on SIGTERM until it is continued, and one
                # continued mid-request may not stop in time either: it goes at once
                # (the watchdog recycling a hung replica, docs/faults.md).
                if await trio.to_thread.run_sync(stopped, self._popen.pid):
                    log.warning("%s: stopped (not running); killing it", self.label)
                    grace_s = 0.0
                self._signal_group(signal.SIGTERM)
                with trio.move_on_after(grace_s):
                    await self.wait()
                if not self._exited.is_set():
                    log.warning("%s: did not stop within %.1fs; killing", self.label, grace_s)
                    self._signal_group(signal.SIGKILL)
                    with trio.move_on_after(5):
                        await self.wait()
            # Children the server left behind in its group go too; unload returns once
            # they are gone (bounded: a process stuck in the kernel cannot hold it). They
            # are not our children, so their deaths send no event: look, briefly.
            self._signal_group(signal.SIGKILL)
            with trio.move_on_after(5):
                while await trio.to_thread.run_sync(group_alive, self._popen.pid):  # noqa: ASYNC110
                    await trio.sleep(0.02)
            await self._dismiss_guard()
            if self._output is not None:
                await self._output.aclose()
                self._output = None
            if self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None

    async def _dismiss_guard(self) -> None:
        """The group is gone: tell the guard to exit without acting; reap it (bounded)."""
        guard, self._guard = self._guard, None
        if guard is None:
            return
        assert guard.stdin is not None
        # A guard that is gone already: a broken pipe (or one closed: ValueError).
        with contextlib.suppress(OSError, ValueError):
            guard.stdin.write(b"stop")
        with contextlib.suppress(OSError):
            guard.stdin.close()
        pidfd = os.pidfd_open(guard.pid)
        try:
            with trio.move_on_after(5):
                await trio.lowlevel.wait_readable(pidfd)
        finally:
            os.close(pidfd)
        if guard.poll() is None:
            guard.kill()
        guard.wait()  # exited (or killed just now): reaps at once

    def _signal_group(self, signum: int) -> None:
        assert self._popen is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._popen.pid, signum)
