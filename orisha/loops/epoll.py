"""Loop body on Linux epoll (level-triggered).

Strategy: the shared readiness loop (``readiness.py``) does the moving; this
module only maps its wants onto one epoll set per worker.
"""

from __future__ import annotations

import select

from .readiness import READ, WRITE, ReadinessLoop

_HUP = select.EPOLLHUP | select.EPOLLERR


class Loop(ReadinessLoop):
    name = "epoll"

    def __init__(self, listener, app, datagrams=None) -> None:
        super().__init__(listener, app, datagrams)
        self.ep = select.epoll()
        self.watched: set[int] = set()

    def _watch(self, fd: int, want: int) -> None:
        mask = (select.EPOLLIN if want & READ else 0) | (select.EPOLLOUT if want & WRITE else 0)
        if fd in self.watched:
            self.ep.modify(fd, mask)
        else:
            self.ep.register(fd, mask)
            self.watched.add(fd)

    def _forget(self, fd: int) -> None:
        self.watched.discard(fd)
        self.ep.unregister(fd)

    def _wait(self, timeout: float):
        # A hang-up or error with nothing else reported is surfaced as readable:
        # the recv that follows returns b"" or raises, and the core decides.
        return [(fd, bool(ev & select.EPOLLIN or ev & _HUP), bool(ev & select.EPOLLOUT))
                for fd, ev in self.ep.poll(timeout)]

    def _done(self) -> None:
        self.ep.close()
