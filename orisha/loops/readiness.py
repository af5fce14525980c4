"""What every readiness-based loop body shares (epoll, kqueue).

Strategy: a readiness loop waits until sockets are readable or writable, then
moves bytes. This class does the moving — accept, recv, one ``sendmsg`` per
flush (``sendfile`` for a FileRegion), close, the once-a-second tick and the
graceful stop — and leaves the
waiting to a subclass, which implements three methods in the manner of
CPython's ``selectors.BaseSelector``:

  _watch(fd, want)      start or change watching fd; want is READ, WRITE or 0
  _forget(fd)           stop watching fd (before it is closed)
  _wait(timeout)        → [(fd, readable, writable)] ready within timeout seconds

A connection is watched for reading while the core wants input and for
writing while output is pending, never both: that is the backpressure. The
graceful stop follows ``base.py``: the stop flag is read before a turn's events,
so a listener that is ready in that turn is not accepted from.

The datagram side (``base.py``), when given, is one more watched descriptor: a
``udp.Pump`` reads and sends, the wait is cut short by the endpoint's timer, and
the socket is watched for writing too while sends wait for buffer space.
"""

from __future__ import annotations

import errno
import os
import socket
import time

from ..blob import FileRegion, release as release_maps
from ..core.connection import App
from .base import ANSWERED, FRESH, LATE
from .udp import Pump

READ, WRITE = 1, 2
_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# The head before a file region goes out with MSG_MORE, so it shares a segment with the
# file's first bytes (nginx's tcp_nopush). Linux only; elsewhere the head goes alone.
_MORE = getattr(socket, "MSG_MORE", 0)


class ReadinessLoop:
    name = "readiness"

    def __init__(self, listener: socket.socket, app: App, datagrams=None) -> None:
        self.pump = Pump(datagrams) if datagrams is not None else None
        self.listener = listener
        self.lfd = listener.fileno()
        self.app = app
        self.conns: dict[int, list] = {}  # fd → [socket, connection, watched, may shut,
        #                   bytes of the first FileRegion already sent, first answer (base.py)]

    # -- implemented by each platform -------------------------------------------
    def _watch(self, fd: int, want: int) -> None:
        raise NotImplementedError

    def _forget(self, fd: int) -> None:
        raise NotImplementedError

    def _wait(self, timeout: float) -> list[tuple[int, bool, bool]]:
        raise NotImplementedError

    def _done(self) -> None:
        """Release the platform's resources."""

    # -- shared ----------------------------------------------------------------
    def run(self, stopping) -> None:
        conns, lfd, pump = self.conns, self.lfd, self.pump
        self._watch(lfd, READ)
        ufd = pump.fd if pump else -1
        if pump:
            self._watch(ufd, READ)
            self.udp_want = READ
        accepting, paused, deadline = True, False, None
        next_tick = time.time() + 1
        while conns or accepting or (pump and pump.ep.busy):
            ready = self._wait(pump.wait(time.time()) if pump else 1.0)
            now = time.time()
            if accepting and stopping():  # before this turn's events (base.py: graceful stop)
                accepting = False
                deadline = now + self.app.limits.grace
                self._stop(paused, now)
            for fd, readable, _ in ready:  # writable or not, a flush is attempted below
                if fd == ufd:
                    self._datagrams(pump.readable(now) if readable else pump.flush(now))
                    continue
                if fd == lfd:
                    if accepting and not paused and not self._accept(now):
                        paused = True  # out of descriptors: leave the backlog until the next tick
                        self._forget(lfd)
                    continue
                c = conns.get(fd)
                if c is not None:
                    self._read(fd, c, readable, now)
            if pump:
                self._datagrams(pump.due(now))
            if now >= next_tick:
                next_tick = now + 1
                if pump:
                    pump.ep.tick(now)
                    self._datagrams(pump.flush(now))
                self.app.tick(now)
                release_maps()
                if paused and accepting:
                    self._watch(lfd, READ)
                    paused = False
                for fd, c in list(conns.items()):
                    c[1].tick(now)
                    self._flush(fd, c, now)
            if deadline is not None and now > deadline:
                for fd in list(conns):
                    self._close(fd)
                if pump:
                    pump.ep.close()  # connections past the grace: no longer busy
        if pump:
            self._forget(ufd)
            pump.sock.close()
            pump.ep.close()
        self.app.tick(time.time())  # last counters and log lines
        self._done()

    def _read(self, fd: int, c: list, readable: bool, now: float) -> None:
        """A connection's turn: read if it is readable and the core wants input, then flush."""
        if readable and c[1].wants_read:
            try:
                data = c[0].recv(65536)
            except BlockingIOError:  # spurious readiness
                return
            except OSError:  # ECONNRESET and friends end this connection only
                self._close(fd)
                return
            c[1].receive(data, now)
            if c[5] and c[1].outgoing:  # its first response (see _stop)
                if c[5] == LATE:
                    c[1].shutdown(now)
                c[5] = ANSWERED
        self._flush(fd, c, now)

    def _datagrams(self, flushed: bool) -> None:
        """Watch the UDP socket for writing too while its sends wait for buffer space."""
        want = READ if flushed else READ | WRITE
        if want != self.udp_want:
            self._watch(self.pump.fd, want)
            self.udp_want = want

    def _stop(self, paused: bool, now: float) -> None:
        """Stop accepting (what is queued stays for the next generation, or is refused), then
        shut down every connection but the late ones: those still awaiting their first answer."""
        if not paused:
            self._forget(self.lfd)
        self.listener.close()
        if self.pump:
            self.pump.ep.shutdown(now)
            self._datagrams(self.pump.flush(now))
        for fd, c in list(self.conns.items()):
            if c[5]:
                c[5] = LATE
            else:
                c[1].shutdown(now)
                self._flush(fd, c, now)

    def _accept(self, now: float) -> bool:
        """Accept all pending connections; False when out of descriptors or memory."""
        while True:
            try:
                sock, addr = self.listener.accept()
            except BlockingIOError:  # backlog drained
                return True
            except OSError as e:
                if e.errno in _EXHAUSTED:
                    return False
                if e.errno == errno.ECONNABORTED:  # the client gave up while queued
                    continue
                raise
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            fd = sock.fileno()
            c = self.conns[fd] = [sock, self.app.connect(now, addr[0]), READ, True, 0, FRESH]
            self._watch(fd, READ)
            self._flush(fd, c, now)

    def _flush(self, fd: int, c: list, now: float) -> None:
        sock, conn = c[0], c[1]
        out = conn.outgoing
        while out:
            try:
                try:
                    n = sock.sendmsg(out)
                except TypeError:  # a FileRegion is not bytes-like: sendmsg refused before sending
                    n = self._send_region(fd, c, out)
            except BlockingIOError:  # socket buffer full: wait until writable
                break
            except OSError:  # EPIPE/ECONNRESET: the peer is gone
                self._close(fd)
                return
            conn.sent(n, now)
        if conn.should_close:
            self._close(fd)
            return
        if conn.shut_write and c[3]:
            c[3] = False
            try:
                sock.shutdown(socket.SHUT_WR)
            except OSError:  # ENOTCONN: the peer is already gone; the next read says so
                pass
        want = WRITE if conn.outgoing else (READ if conn.wants_read else 0)
        if want != c[2]:
            self._watch(fd, want)
            c[2] = want

    @staticmethod
    def _send_region(fd: int, c: list, out: list) -> int:
        """Send what precedes the first FileRegion, or from the region with sendfile;
        the count to report to ``sent`` (a region only whole: 0 while part of it is out)."""
        i = 0
        while out[i].__class__ is not FileRegion:
            i += 1
        if i:
            return c[0].sendmsg(out[:i], (), _MORE)
        region, done = out[0], c[4]
        done += os.sendfile(fd, region.fd, region.offset + done, region.length - done)
        if done < region.length:
            c[4] = done
            return 0
        c[4] = 0
        return region.length

    def _close(self, fd: int) -> None:
        sock, conn = self.conns.pop(fd)[:2]
        self._forget(fd)
        sock.close()
        conn.close()
