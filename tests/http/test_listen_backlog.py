"""The pool's listening socket queues as many connections as ``service.listen_backlog``
says, so a burst of new clients waits for an accept instead of losing its handshake."""

from __future__ import annotations

import os
import socket
import struct
import sys

import pytest
import trio

from .conftest import start_server

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads the kernel's sock_diag")

_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLMSG_DONE = 3
_TCP_LISTEN = 10


def kernel_listen_backlog(port: int) -> int:
    """The accept-queue limit the kernel holds for the IPv4 TCP socket listening on
    ``port``: what ``ss -lnt`` shows as Send-Q, read over netlink (no iproute2 needed)."""
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 4) as diag:  # NETLINK_SOCK_DIAG
        # inet_diag_req_v2 for every listening TCP socket of the family (a dump ignores
        # the id, so the port is picked out below).
        request = struct.pack(
            "=BBBBI48x", socket.AF_INET, socket.IPPROTO_TCP, 0, 0, 1 << _TCP_LISTEN
        )
        header = struct.pack("=IHHII", 16 + len(request), _SOCK_DIAG_BY_FAMILY, 0x301, 1, 0)
        diag.send(header + request)  # flags: NLM_F_REQUEST | NLM_F_DUMP
        while True:
            data = diag.recv(65536)
            offset = 0
            while offset < len(data):
                length, kind = struct.unpack_from("=IH", data, offset)
                if kind == _NLMSG_DONE:
                    raise LookupError(f"nothing listens on port {port}")
                if kind == _NLMSG_ERROR:  # e.g. a kernel without inet_diag: fail, not wait
                    errno = -struct.unpack_from("=i", data, offset + 16)[0]
                    raise OSError(errno, f"sock_diag refused the dump: {os.strerror(errno)}")
                # inet_diag_msg after the 16-byte header: the source port at 4
                # (big-endian) and idiag_wqueue at 60, a listening socket's backlog.
                sport = struct.unpack_from("!H", data, offset + 16 + 4)[0]
                if sport == port:
                    return int(struct.unpack_from("=I", data, offset + 16 + 60)[0])
                offset += (length + 3) & ~3


def somaxconn() -> int:
    with open("/proc/sys/net/core/somaxconn") as limit:
        return int(limit.read())


async def test_the_listening_socket_queues_what_the_setting_says(nursery: trio.Nursery) -> None:
    info = await start_server(nursery, listen_backlog=77)
    assert kernel_listen_backlog(info.port) == 77


async def test_the_default_backlog_is_past_hypercorns_hundred(nursery: trio.Nursery) -> None:
    info = await start_server(nursery)
    assert kernel_listen_backlog(info.port) == min(2048, somaxconn())
