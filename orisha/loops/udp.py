"""The datagram side of a loop body: reads in batches, GSO sends, the one timer.

Strategy: what ``base.py`` asks of a body for UDP is the same on every platform
once the socket is readable or writable, so it is written once here and every
body (epoll, kqueue, io_uring, asyncio and the compiled ones) drives a ``Pump``:
it watches ``pump.fd``, calls ``readable(now)`` when it is readable, ``flush(now)``
when it is writable (and watches for writing while that returns False), and waits
no longer than ``wait(now)``. The endpoint (orisha/protocols/compiled_h3.pyx) decides
everything else.

Batching where Python allows: Python has no recvmmsg/sendmmsg, so a turn here reads up
to ``BATCH`` datagrams with recvfrom until EAGAIN and hands them over as one batch;
sends use UDP GSO (Linux ≥ 4.18: one ``sendmsg`` with a ``UDP_SEGMENT`` control
message carries up to 64 datagrams of one size to one address, and the kernel
splits them), which is where the per-datagram syscall cost goes away. GSO is
probed at start-up (``getsockopt``) and dropped for good after a send it refuses
(EIO from a device without checksum offload, EINVAL): the slices then go one
``sendto`` each. The compiled bodies run ``compiled_udp.Pump``, this class with
``_read`` and ``_write`` replaced by one ``recvmmsg`` (with UDP GRO) and one
``sendmmsg`` per turn; this one turns GRO off on its socket, since it could not split
a coalesced message. ``reads``, ``writes`` (system calls) and ``received`` (datagrams)
count what each did.

Steering (``orisha/protocols/quic_steer.py``; Linux): when the datagram side carries a
``Steer``, the pump also binds the worker's unix datagram socket and hands over what the
endpoint puts in ``ep.forward`` — each turn's datagrams for one other worker as one
unix message (the kernel queues only ``net.unix.max_dgram_qlen`` messages, 10 by
default, so one per datagram would drop under load) — and reads what others hand it,
given to ``ep.receive(batch, now, True)``. So that no body has to watch one more
descriptor, ``pump.fd`` is then an epoll descriptor over both sockets: readable when
either is, and, while sends wait, when the UDP socket is writable (an epoll descriptor
never reports writable itself; every body reads and then flushes on readable).
"""

from __future__ import annotations

import errno
import os
import select
import socket
import struct
import sys

from .base import BATCH

_UDP_SEGMENT = 103  # <linux/udp.h>; Python's socket module has no name for it
_UDP_GRO = 104  # <linux/udp.h>: coalesced receives, which only compiled_udp splits
_SOL_UDP = getattr(socket, "SOL_UDP", 17)
_GSO_REFUSED = (errno.EIO, errno.EINVAL, errno.EOPNOTSUPP)
_RECORD = struct.Struct("!HH")  # a handed-over datagram: its address's length, its length
HANDOVER_BYTES = 1 << 18  # a hand-over message at most: a turn's datagrams for one worker


def handover_socket(steer) -> socket.socket:
    """Bind this worker's hand-over socket (a restarted worker takes its path again)."""
    path = steer.path(steer.tag)
    try:
        os.unlink(path)
    except FileNotFoundError:  # the first worker of this tag
        pass
    fwd = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    fwd.bind(path)
    fwd.setblocking(False)
    return fwd


def handed(msg, n: int) -> list:
    """The (datagram, address) pairs of one hand-over message of ``n`` bytes in ``msg``
    (``handovers``' records)."""
    batch, i = [], 0
    while i + 4 <= n:
        alen, dlen = _RECORD.unpack_from(msg, i)
        if i + 4 + alen + dlen > n:  # cut short (larger than ``HANDOVER_BYTES``): the rest lost
            break
        head = bytes(msg[i + 4:i + 4 + alen]).split()
        i += 4 + alen
        batch.append((bytes(msg[i:i + dlen]), (head[0].decode(), *map(int, head[1:]))))
        i += dlen
    return batch


def handovers(ep, paths: dict) -> list:
    """``ep.forward`` as (message, path) pairs, one per worker, and ``ep.forward`` emptied."""
    groups: dict[bytes, list] = {}
    for tag, data, addr in ep.forward:
        head = " ".join(map(str, addr)).encode()
        groups.setdefault(tag, []).extend((_RECORD.pack(len(head), len(data)), head, data))
    ep.forward.clear()
    out = []
    for tag, parts in groups.items():
        path = paths.get(tag)
        if path is None:
            path = paths[tag] = ep.steer.path(tag)
        out.append((b"".join(parts), path))
    return out


def gso_supported(sock: socket.socket) -> bool:
    """Whether this kernel takes UDP_SEGMENT on ``sock`` (Linux ≥ 4.18)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        sock.getsockopt(_SOL_UDP, _UDP_SEGMENT)
    except OSError:  # ENOPROTOOPT: an older kernel
        return False
    return True


class Pump:
    """Moves datagrams between one UDP socket and its endpoint (``base.py``)."""

    __slots__ = ("sock", "fd", "ep", "gso", "fwd", "poll", "out_watched", "paths", "buf",
                 "reads", "writes", "received")

    def __init__(self, datagrams) -> None:
        self.sock, self.ep = datagrams.sock, datagrams.endpoint
        self.fd = self.sock.fileno()
        self.gso = gso_supported(self.sock)
        self.reads = self.writes = self.received = 0
        if self.gso:  # the same kernels (UDP_GRO: 5.0); a worker before may have set it
            try:
                self.sock.setsockopt(_SOL_UDP, _UDP_GRO, 0)
            except OSError:  # ENOPROTOOPT: no GRO, nothing to turn off
                pass
        self.fwd = self.poll = None
        self.out_watched = False
        steer = getattr(datagrams, "steer", None)
        if steer is not None and hasattr(select, "epoll"):
            self._steer(steer)

    def _steer(self, steer) -> None:
        fwd = handover_socket(steer)
        poll = select.epoll()
        poll.register(self.sock.fileno(), select.EPOLLIN)
        poll.register(fwd.fileno(), select.EPOLLIN)
        self.fwd, self.poll, self.fd, self.paths = fwd, poll, poll.fileno(), {}
        self.buf = bytearray(HANDOVER_BYTES)
        self.ep.steer_with(steer)

    def readable(self, now: float) -> bool:
        """Read one batch, hand it over, flush; False when the writes must wait."""
        batch = self._read()
        if batch:
            self.ep.receive(batch, now)
        if self.fwd is not None:
            self._handed(now)
        return self.flush(now)

    def _read(self) -> list:
        """Up to ``BATCH`` (data, address) pairs: what is queued on the UDP socket."""
        recv, batch, calls = self.sock.recvfrom, [], 0
        for _ in range(BATCH):
            calls += 1
            try:
                batch.append(recv(65535))
            except BlockingIOError:  # drained
                break
            except ConnectionRefusedError:  # an ICMP error for an earlier send: nothing to read
                continue
            except OSError:  # anything else ends the turn; the next readiness retries
                break
        self.reads += calls
        self.received += len(batch)
        return batch

    def _handed(self, now: float) -> None:
        """Read what other workers handed over (``_hand_over``'s records)."""
        for _ in range(BATCH):
            try:
                n = self.fwd.recv_into(self.buf)
            except BlockingIOError:  # drained
                return
            except OSError:  # nothing else is expected of a unix socket; the next turn retries
                return
            self.ep.receive(handed(self.buf, n), now, True)

    def _hand_over(self) -> None:
        """Send ``ep.forward`` to the workers it names, one message per worker."""
        for msg, path in handovers(self.ep, self.paths):
            try:
                self.fwd.sendto(msg, path)
            except OSError:  # ENOENT/ECONNREFUSED: no such worker (any more); EAGAIN: its
                pass         # queue is full. Lost datagrams, which QUIC recovers.

    def flush(self, now: float) -> bool:
        """Send what the endpoint has; False when the socket buffer filled first."""
        if self.fwd is not None and self.ep.forward:
            self._hand_over()
        if not self._write(now):
            if self.poll is not None and not self.out_watched:
                self.out_watched = True
                self.poll.modify(self.sock.fileno(), select.EPOLLIN | select.EPOLLOUT)
            return False
        if self.out_watched:
            self.out_watched = False
            self.poll.modify(self.sock.fileno(), select.EPOLLIN)
        return True

    def _write(self, now: float) -> bool:
        """Send ``ep.outgoing`` and report it (``ep.sent``); False when the buffer filled."""
        n = 0
        for payload, addr, segment in self.ep.outgoing:
            try:
                self._send(payload, addr, segment)
            except BlockingIOError:  # the socket buffer is full: wait until writable
                if n:
                    self.ep.sent(n, now)
                return False
            except OSError:  # EMSGSIZE, EHOSTUNREACH, ECONNREFUSED…: a lost datagram
                pass
            n += 1
        if n:
            self.ep.sent(n, now)
        return True

    def _send(self, payload, addr, segment: int) -> None:
        if not segment:
            self.writes += 1
            self.sock.sendto(payload, addr)
            return
        if self.gso:
            try:
                self.writes += 1
                self.sock.sendmsg([payload], [(_SOL_UDP, _UDP_SEGMENT, struct.pack("=H", segment))],
                                  0, addr)
                return
            except OSError as e:
                if e.errno not in _GSO_REFUSED:
                    raise
                self.gso = False  # this device or kernel refuses GSO: slices from now on
        view = memoryview(payload)
        for i in range(0, len(view), segment):
            # A full buffer part-way through loses the rest of this group: QUIC recovers it.
            self.writes += 1
            self.sock.sendto(view[i:i + segment], addr)

    def wait(self, now: float, longest: float = 1.0) -> float:
        """Seconds a body may wait before ``due`` must run (at most ``longest``)."""
        t = self.ep.timer
        if t is None:
            return longest
        return min(longest, max(0.0, t - now))

    def due(self, now: float) -> bool:
        """Run the endpoint's timer if it is due; False when the writes must wait."""
        t = self.ep.timer
        if t is not None and now >= t:
            self.ep.expire(now)
            return self.flush(now)
        return True
