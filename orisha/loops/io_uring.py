"""Loop body on Linux io_uring, through the ``liburing`` package (its 2024.x Cython API).

Strategy: io_uring reports completions, not readiness, so the seam is used
inverted: a recv is *submitted* whenever the core wants input, and the core
learns of the bytes when the completion arrives; all of ``outgoing`` is
submitted as one writev and ``sent`` is called with its result. One multishot
accept serves every new connection (single-shot on kernels before 5.19). Each
loop iteration queues what the core asked for and makes one ``submit_and_wait``
call (with a 1 s timeout for the tick), then drains every completion.

Package facts (liburing 2024.5.3; newer wheels on PyPI are built for AVX-512
and die with SIGILL on other CPUs, hence the pin and the probe in a forked
child in ``orisha/loops/__init__.py``): sendmsg cannot be given iovecs from
Python, so sends use writev, capped at 60 buffers; provided-buffer rings are
not reachable, so each connection owns a 16 KiB slot of a preallocated slab;
user_data 0 is refused, so op tags start at 1.

The datagram side (``base.py``) is readiness through the ring: a one-shot poll
(IORING_OP_POLL_ADD) on the UDP socket, re-armed after each completion, tells
when to run the shared ``udp.Pump`` (recvfrom batches, GSO sendmsg) — the
package cannot hand the kernel a msghdr with a control message, so GSO sends
are syscalls of their own; the wait is cut short by the endpoint's timer.
"""

from __future__ import annotations

import errno
import select
import socket
import time

import liburing as L

from ..blob import FileRegion, release as release_maps
from .base import ANSWERED, FRESH, LATE, last_accepts
from .udp import Pump

RECV = 16384
IOV_MAX = 60
SLAB = 64
ACCEPT, RECV_OP, SEND, IGNORE, SHUT, UDP = 1, 2, 3, 4, 5, 6  # UDP: only as user_data 6 itself
SHUTTING, SHUT_DONE = 1, 2  # _Conn.shut: a SHUT_WR in flight, then done
F_MORE, CANCEL_ALL = 2, 1  # IORING_CQE_F_MORE, IORING_ASYNC_CANCEL_ALL (kernel ABI values)
_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class _Conn:
    __slots__ = ("id", "fd", "conn", "buf", "recv", "iov", "closing", "shut", "region", "done",
                 "first")

    def __init__(self, cid: int, fd: int, conn, buf: memoryview) -> None:
        self.id, self.fd, self.conn, self.buf = cid, fd, conn, buf
        self.recv, self.iov, self.closing, self.shut = False, None, False, False
        self.region, self.done = None, 0  # a FileRegion being written and its bytes written
        self.first = FRESH  # its first answer: FRESH, LATE, ANSWERED (base.py: graceful stop)


class Loop:
    name = "io-uring"

    def __init__(self, listener: socket.socket, app, datagrams=None) -> None:
        self.pump = Pump(datagrams) if datagrams is not None else None
        self.udp_armed, self.udp_blocked = False, False
        self.listener = listener
        self.app = app
        self.ring, self.cqe = L.io_uring(), L.io_uring_cqe()
        L.io_uring_queue_init(4096, self.ring)
        self.conns: dict[int, _Conn] = {}
        self.free: list[memoryview] = []
        self.next_id = 1
        self.addr = L.sockaddr()  # the kernel writes peers' addresses here while accept is armed
        self.accepting = False
        self.multishot = True

    def _sqe(self, user_data: int):
        sqe = L.io_uring_get_sqe(self.ring)
        if not sqe:  # submission queue full: flush early (the only extra submit)
            L.io_uring_submit(self.ring)
            sqe = L.io_uring_get_sqe(self.ring)
        sqe.user_data = user_data
        return sqe

    def _arm_accept(self) -> None:
        # Multishot accept needs Linux 5.19; older kernels answer EINVAL and get one
        # accept per submission instead (see the ACCEPT completion below).
        prep = L.io_uring_prep_multishot_accept if self.multishot else L.io_uring_prep_accept
        prep(self._sqe(ACCEPT), self.listener.fileno(), self.addr, socket.SOCK_CLOEXEC)
        self.accepting = True

    def _service(self, c: _Conn) -> None:
        """Queue what the core wants for this connection: a close, a writev, a recv."""
        if not c.closing and c.conn.should_close:
            c.closing = True
        if c.closing:
            if c.recv or c.iov is not None:  # wait for in-flight ops to be cancelled
                L.io_uring_prep_cancel_fd(self._sqe(IGNORE), c.fd, CANCEL_ALL)
            elif c.shut != SHUTTING:  # a shutdown runs in io-wq: a close before it completes
                # frees the number for the next accept, and the late SHUT_WR then hits that new
                # connection (seen as EPIPE on its first write under fast churn)
                L.io_uring_prep_close(self._sqe(IGNORE), c.fd)
                self.free.append(c.buf)
                del self.conns[c.id]
                c.conn.close()
            return
        out = c.conn.outgoing
        if c.conn.shut_write and not out and not c.shut and c.iov is None:
            c.shut = SHUTTING
            L.io_uring_prep_shutdown(self._sqe(c.id << 3 | SHUT), c.fd, socket.SHUT_WR)
        if c.iov is None and out:
            bufs = [b for b in out[:IOV_MAX] if len(b)]
            if FileRegion in map(type, bufs):
                bufs = self._upto_region(c, bufs)
            c.iov = L.iovec(bufs)  # holds the buffers until the completion arrives
            L.io_uring_prep_writev(self._sqe(c.id << 3 | SEND), c.fd, c.iov, len(bufs), 0)
        if not c.recv and c.conn.wants_read:
            L.io_uring_prep_recv(self._sqe(c.id << 3 | RECV_OP), c.fd, c.buf, RECV, 0)
            c.recv = True

    @staticmethod
    def _upto_region(c: _Conn, bufs: list) -> list:
        """The buffers before the first FileRegion or, when it is first, the rest of its map:
        this fallback writes regions from memory (the compiled loop splices them)."""
        if bufs[0].__class__ is FileRegion:
            c.region = bufs[0]
            return [c.region.view[c.done:]]
        return bufs[:list(map(type, bufs)).index(FileRegion)]

    def _accepted(self, fd: int, now: float, late: bool) -> None:
        if not self.free:
            slab = memoryview(bytearray(SLAB * RECV))
            self.free += [slab[i * RECV:(i + 1) * RECV] for i in range(SLAB)]
        s = socket.socket(fileno=fd)  # only to set an option: the ring keeps the descriptor
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            peer = s.getpeername()[0]
        except OSError:  # already reset by the peer: the first recv will say so
            peer = "-"
        s.detach()
        c = self.conns[self.next_id] = _Conn(self.next_id, fd, self.app.connect(now, peer), self.free.pop())
        if late:
            c.first = LATE
        self.next_id += 1
        self._service(c)

    def run(self, stopping) -> None:
        ring, cqe, pump = self.ring, self.cqe, self.pump
        ts = L.timespec(1.0)
        self._arm_accept()
        self._arm_udp()
        self.stopped, self.paused, self.deadline = False, False, None
        next_tick = time.time() + 1
        while True:
            if pump:
                ts = L.timespec(pump.wait(time.time()))
            try:
                L.io_uring_submit_and_wait_timeout(ring, cqe, 1, ts)
            except OSError:  # the 1 s timeout or EINTR (the package's errno is unreliable here)
                pass
            now = time.time()
            if not self.stopped and stopping():  # before this turn's completions (base.py)
                self._stop(now)
            while L.io_uring_peek_cqe(ring, cqe) == 0:
                ud, res, flags = cqe.user_data, cqe.res, cqe.flags
                L.io_uring_cqe_seen(ring, cqe)
                if ud & 7 == ACCEPT:
                    self._accept_done(res, flags, now)
                elif ud == UDP:
                    self._udp_ready(res, now)
                else:
                    self._done(ud, res, now)
            if pump and pump.sock.fileno() >= 0:
                self.udp_blocked = not pump.due(now)
                self._arm_udp()
            if now >= next_tick:
                next_tick = now + 1
                self._tick(now)
            if self.stopped and not self.conns and not self.accepting and not (
                    pump and pump.ep.busy):
                L.io_uring_submit(ring)  # the queued closes run at submit
                break
        if pump:
            pump.sock.close()  # an armed poll on it ends with the ring
            pump.ep.close()
        self.app.tick(time.time())  # last counters and log lines
        L.io_uring_queue_exit(ring)

    def _arm_udp(self) -> None:
        """Poll the UDP socket through the ring: readable, and writable while sends wait."""
        if self.pump and not self.udp_armed:
            mask = select.POLLIN | (select.POLLOUT if self.udp_blocked else 0)
            L.io_uring_prep_poll_add(self._sqe(UDP), self.pump.fd, mask)
            self.udp_armed = True

    def _udp_ready(self, res: int, now: float) -> None:
        self.udp_armed = False
        if res < 0:  # ECANCELED at the end; anything else: poll again next turn
            return
        pump = self.pump
        if res & select.POLLIN:
            self.udp_blocked = not pump.readable(now)
        elif res & select.POLLOUT:
            self.udp_blocked = not pump.flush(now)

    def _stop(self, now: float) -> None:
        """Stop accepting; every connection finishes what it is sending within the grace,
        except the late ones, which first answer the request on its way (base.py)."""
        self.stopped, self.deadline = True, now + self.app.limits.grace
        if self.pump:
            self.pump.ep.shutdown(now)
            self.udp_blocked = not self.pump.flush(now)
        if self.accepting:
            L.io_uring_prep_cancel64(self._sqe(IGNORE), ACCEPT, 0)
        else:
            self._last_accepts(now)  # our descriptor closes there: then, with the supervisor's
        #                              closed too, the port refuses instead of queueing for nobody
        for c in list(self.conns.values()):
            if c.first:
                c.first = LATE
            else:
                c.conn.shutdown(now)
                self._service(c)

    def _tick(self, now: float) -> None:
        self.app.tick(now)
        release_maps()
        if self.pump:
            if self.deadline is not None and now > self.deadline:
                self.pump.ep.close()  # connections past the grace: no longer busy
            self.pump.ep.tick(now)
            self.udp_blocked = not self.pump.flush(now)
        if self.paused and not self.stopped:  # out of descriptors last time: try again now
            self.paused = False
            self._arm_accept()
        for c in list(self.conns.values()):
            if self.deadline is not None and now > self.deadline:
                c.closing = True
            c.conn.tick(now)
            self._service(c)

    def _accept_done(self, res: int, flags: int, now: float) -> None:
        if not flags & F_MORE:
            self.accepting = False
        if res >= 0:
            # Multishot accept takes connections from the backlog eagerly, so some arrive
            # after the stop: they are late (base.py), answered once (closing them would
            # reset a client whose request the next generation would otherwise have served).
            self._accepted(res, now, self.stopped)
        elif -res in _EXHAUSTED:
            self.paused = True  # re-armed at the next tick: no spinning on EMFILE
        elif res == -errno.EINVAL and self.multishot:
            self.multishot = False  # a kernel before 5.19: single-shot accepts
        if not self.accepting and self.stopped:
            self._last_accepts(now)
        elif not self.accepting and not self.paused and res != -errno.ECANCELED:
            self._arm_accept()

    def _last_accepts(self, now: float) -> None:
        """After the stop, once our accept has ended: what is still queued is served late
        (base.last_accepts says why), then our descriptor is closed."""
        for fd in last_accepts(self.listener):
            self._accepted(fd, now, True)

    def _done(self, ud: int, res: int, now: float) -> None:
        """A recv or writev completed for connection ``ud >> 3``."""
        op = ud & 7
        c = self.conns.get(ud >> 3)
        if c is None or op == IGNORE:
            return
        if op == SHUT:
            c.shut = SHUT_DONE
        elif op == RECV_OP:
            c.recv = False
            if res >= 0:
                c.conn.receive(bytes(c.buf[:res]), now)
                if c.first and c.conn.outgoing:  # its first response (see _stop)
                    if c.first == LATE:
                        c.conn.shutdown(now)
                    c.first = ANSWERED
            elif res != -errno.ECANCELED:
                c.closing = True  # ECONNRESET and friends end this connection only
        else:
            c.iov = None
            if res >= 0 and c.region is not None:  # a region is reported whole (base.py)
                region, c.region = c.region, None
                c.done += res
                if c.done < region.length:
                    c.conn.sent(0, now)
                else:
                    c.done = 0
                    c.conn.sent(region.length, now)
            elif res >= 0:
                c.conn.sent(res, now)
            elif res != -errno.ECANCELED:
                c.closing = True  # EPIPE/ECONNRESET: the client left mid-response
        self._service(c)
