"""Loop body on Linux epoll (level-triggered).

Strategy: one epoll set per worker holding the listener and every connection.
A connection is watched for EPOLLIN while the core wants input and for
EPOLLOUT while output is pending, never both: that is the backpressure. Each
write hands the core's buffer list to one ``sendmsg`` (writev), so heads and
constant bodies go out without being joined or copied.
"""

from __future__ import annotations

import errno
import select
import socket
import time

from ..core.connection import App

_IN, _OUT = select.EPOLLIN, select.EPOLLOUT
_EXHAUSTED = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)


class Loop:
    name = "epoll"

    def __init__(self, listener: socket.socket, app: App) -> None:
        self.listener = listener
        self.app = app
        self.ep = select.epoll()
        self.conns: dict[int, list] = {}  # fd → [socket, connection, registered mask]

    def run(self, stopping) -> None:
        ep, conns, lfd = self.ep, self.conns, self.listener.fileno()
        ep.register(lfd, _IN)
        accepting, paused, deadline = True, False, None
        next_tick = time.time() + 1
        while conns or accepting:
            events = ep.poll(1.0)
            now = time.time()
            for fd, ev in events:
                if fd == lfd:
                    paused = not self._accept(now)
                    if paused:  # out of descriptors: stop polling the listener until the next tick
                        ep.unregister(lfd)
                    continue
                c = conns.get(fd)
                if c is None:
                    continue
                conn = c[1]
                if ev & _IN or (ev & (select.EPOLLHUP | select.EPOLLERR) and not ev & _OUT):
                    try:
                        data = c[0].recv(65536)
                    except BlockingIOError:  # spurious wakeup: nothing to read after all
                        continue
                    except OSError:  # ECONNRESET and friends end this connection only
                        self._close(fd)
                        continue
                    conn.receive(data, now)
                self._flush(fd, c, now)
            if now >= next_tick:
                next_tick = now + 1
                if paused and accepting:
                    ep.register(lfd, _IN)
                    paused = False
                for fd, c in list(conns.items()):
                    c[1].tick(now)
                    self._flush(fd, c, now)
            if accepting and stopping():
                accepting = False
                if not paused:
                    ep.unregister(lfd)
                self.listener.close()
                deadline = now + self.app.limits.grace
                for fd, c in list(conns.items()):
                    c[1].shutdown(now)
                    self._flush(fd, c, now)
            if deadline is not None and now > deadline:
                for fd in list(conns):
                    self._close(fd)
        ep.close()

    def _accept(self, now: float) -> bool:
        """Accept all pending connections; False when out of descriptors or memory."""
        while True:
            try:
                sock, _ = self.listener.accept()
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
            c = self.conns[fd] = [sock, self.app.connect(now), _IN]
            self.ep.register(fd, _IN)
            self._flush(fd, c, now)

    def _flush(self, fd: int, c: list, now: float) -> None:
        sock, conn = c[0], c[1]
        while conn.outgoing:
            try:
                n = sock.sendmsg(conn.outgoing)
            except BlockingIOError:  # socket buffer full: wait for EPOLLOUT
                break
            except OSError:  # EPIPE/ECONNRESET: the peer is gone
                self._close(fd)
                return
            conn.sent(n, now)
        if conn.should_close:
            self._close(fd)
            return
        want = _OUT if conn.outgoing else (_IN if conn.wants_read else 0)
        if want != c[2]:
            self.ep.modify(fd, want)
            c[2] = want

    def _close(self, fd: int) -> None:
        sock, conn, _ = self.conns.pop(fd)
        self.ep.unregister(fd)
        sock.close()
        conn.close()
