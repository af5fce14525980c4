"""A port belongs to one server: claim it before the workers' listeners share it.

Strategy: the workers' listeners are ``SO_REUSEPORT`` sockets, and Linux lets
*any* socket of the same effective UID join such a group (net/core/sock_reuseport.c:
same uid, both with the option): a second ``orisha serve`` on a held port would
bind, and the kernel would deal the connections out between the two servers.
So before making its group the supervisor binds a *probe* on the address
without ``SO_REUSEPORT`` (with ``SO_REUSEADDR``, so connections of a previous
run in TIME_WAIT do not count): that bind fails with EADDRINUSE while any
socket listens there, reuseport or not. The probe is closed and the group is
bound at once; the listeners are made once, in the supervisor, so a reload's
generation and every worker keep sharing them without another claim.

Two servers started at the same instant could both pass their probes before
either listens; a lock closes that window: an abstract Unix socket named for
the port, bound from the probe to the group's ``listen``. Abstract names live
in the network namespace — the very scope of the port — so it needs no file,
works in a FROM-scratch container and vanishes with its process.

HTTP/3's UDP sockets on the same port number are claimed the same way (a probe
bind without SO_REUSEPORT, under the same lock): a UDP reuseport group would
otherwise let a second server's sockets share the first's datagrams as silently.

Who holds the port is read from ``/proc/net/tcp{,6}`` (``udp{,6}`` for UDP) (the listener's inode)
and ``/proc/PID/fd`` (which process has that inode open): the supervisor, not
its workers, is named. Only processes of our own user are readable, which are
the only ones whose sockets could have joined the group anyway.
"""

from __future__ import annotations

import errno
import os
import socket
import sys
import time

from ..errors import ServeError

LOCK_WAIT = 5.0  # seconds another server's start-up may hold the port's lock
_LISTEN = "0A"  # /proc/net/tcp state of a listener (TCP_LISTEN)
_UNCONNECTED = "07"  # /proc/net/udp state of a bound, unconnected socket (TCP_CLOSE)


class Claim:
    """The port's lock, held from the probe until the group listens (a context manager)."""

    def __init__(self, port: int) -> None:
        self.port, self.lock = port, None

    def __enter__(self) -> "Claim":
        if self.port and sys.platform.startswith("linux"):
            self.lock = _lock(self.port)
        return self

    def __exit__(self, *exc) -> None:
        if self.lock is not None:
            self.lock.close()


def _lock(port: int) -> socket.socket | None:
    name = b"\0orisha-port-%d" % port
    deadline = time.monotonic() + LOCK_WAIT
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(name)
            return s
        except OSError as e:
            s.close()
            if e.errno != errno.EADDRINUSE:  # a sandbox without Unix sockets: the probe alone
                return None
        # EADDRINUSE: another server is between its probe and its listen (a few ms)
        if time.monotonic() > deadline:
            raise ServeError(f"port {port}: another server has been starting on it for "
                             f"{LOCK_WAIT:g} s")
        time.sleep(0.005)


def probe(family: int, addr, kind: int = socket.SOCK_STREAM,
          v6only: bool = False) -> OSError | None:
    """None when nothing listens on ``addr``; else the bind's error (EADDRINUSE).

    ``kind`` SOCK_DGRAM (HTTP/3's port): a bind with neither SO_REUSEPORT nor SO_REUSEADDR,
    which fails while any socket is bound there, so the workers' reuseport group cannot
    join another server's UDP sockets (there is no TIME_WAIT to allow for). ``v6only``: as
    the group will be bound (an IPv6-only wildcard beside 0.0.0.0 must not probe IPv4)."""
    s = socket.socket(family, kind)
    try:
        if v6only and family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        if kind == socket.SOCK_STREAM:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        return None
    except OSError as e:
        return e
    finally:
        s.close()


def holder(port: int, udp: bool = False, host: str | None = None) -> str | None:
    """"pid N: COMMAND" of the process that listens on ``port`` (``udp``: is bound to the
    UDP port), when /proc tells. With ``host`` (an address), a listener on it or on its
    family's wildcard address: the one a bind there collides with, not another server's
    on the same port number elsewhere (127.0.0.2, ::1); any listener on the port when
    none of those is seen."""
    inodes = _listening_inodes(port, udp, _clashing(host))
    if not inodes:
        return None
    pids = set()
    for pid in filter(str.isdigit, _listdir("/proc")):
        for fd in _listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:  # closed meanwhile, or not ours to read
                continue
            if link.startswith("socket:[") and link[8:-1] in inodes:
                pids.add(int(pid))
                break
    top = [p for p in pids if _ppid(p) not in pids]  # the supervisor, not its workers
    if not top:
        return None
    pid = min(top)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        cmd = ""
    return f"pid {pid}: {cmd[:200]}" if cmd else f"pid {pid}"


def _clashing(host: str | None) -> set[bytes] | None:
    """The local addresses (packed, 4 or 16 bytes) whose listeners a bind on ``host`` meets:
    itself and its family's wildcard (an IPv4 address also as IPv6's mapped one and ``::``,
    a dual-stack listener's); None (any) for a wildcard or a name."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            packed = socket.inet_pton(family, host or "")
        except OSError:
            continue
        if not packed.strip(b"\0"):
            return None  # a wildcard meets every listener on the port
        if family == socket.AF_INET:
            return {packed, bytes(4), bytes(10) + b"\xff\xff" + packed, bytes(16)}
        return {packed, bytes(16)}
    return None


def _local_address(hexed: str) -> bytes:
    """/proc/net/{tcp,udp}{,6}'s local address: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hexed)
    return b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))


def _listening_inodes(port: int, udp: bool = False, clashing: set | None = None) -> set[str]:
    inodes, others = set(), set()
    for name in (("/proc/net/udp", "/proc/net/udp6") if udp else
                 ("/proc/net/tcp", "/proc/net/tcp6")):
        try:
            with open(name) as f:
                rows = f.read().splitlines()[1:]
        except OSError:  # not Linux, or no IPv6
            continue
        for row in rows:
            fields = row.split()
            address, _, hexport = fields[1].rpartition(":")
            if fields[3] == (_UNCONNECTED if udp else _LISTEN) and int(hexport, 16) == port:
                if clashing is None or _local_address(address) in clashing:
                    inodes.add(fields[9])
                else:
                    others.add(fields[9])
    return inodes or others


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # a process that exited, or one of another user
        return []


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return 0
