"""A kevent-compatible TEST DOUBLE built on epoll, for running the kqueue loop body on Linux.

Linux has no kqueue. This double implements just the part of ``select.kqueue``
that ``orisha/loops/kqueue.py`` uses — read/write filters added, enabled,
disabled and deleted per descriptor, EV_EOF on hang-up — on top of epoll, so
the real kqueue loop body runs unchanged under the conformance suite. It is
installed into ``select`` only by the test runner, never by Orisha itself.
"""

from __future__ import annotations

import select

KQ_FILTER_READ, KQ_FILTER_WRITE = -1, -2
KQ_EV_ADD, KQ_EV_DELETE, KQ_EV_ENABLE, KQ_EV_DISABLE, KQ_EV_EOF = 0x1, 0x2, 0x4, 0x8, 0x8000


class kevent:
    def __init__(self, ident, filter=KQ_FILTER_READ, flags=KQ_EV_ADD, fflags=0, data=0, udata=0):
        self.ident = ident if isinstance(ident, int) else ident.fileno()
        self.filter, self.flags, self.fflags, self.data, self.udata = filter, flags, fflags, data, udata


class kqueue:
    def __init__(self) -> None:
        self._ep = select.epoll()
        self._filters: dict[int, dict[int, bool]] = {}  # fd → {filter: enabled}

    def _sync(self, fd: int, new: bool) -> None:
        f = self._filters.get(fd, {})
        mask = (select.EPOLLIN if f.get(KQ_FILTER_READ) else 0) | (select.EPOLLOUT if f.get(KQ_FILTER_WRITE) else 0)
        if not f:
            self._ep.unregister(fd)
            self._filters.pop(fd, None)
        elif new:
            self._ep.register(fd, mask)
        else:
            self._ep.modify(fd, mask)

    def control(self, changelist, max_events, timeout=None):
        for ch in changelist or ():
            fd = ch.ident
            new = fd not in self._filters
            f = self._filters.setdefault(fd, {})
            if ch.flags & KQ_EV_DELETE:
                if new:
                    self._filters.pop(fd)
                    raise FileNotFoundError(2, "No such file or directory")
                f.pop(ch.filter, None)
            elif ch.flags & KQ_EV_ADD or ch.filter in f:
                f[ch.filter] = not ch.flags & KQ_EV_DISABLE
            else:
                raise FileNotFoundError(2, "No such file or directory")
            self._sync(fd, new)
        if not max_events:
            return []
        out = []
        for fd, ev in self._ep.poll(-1 if timeout is None else timeout, max_events):
            eof = KQ_EV_EOF if ev & (select.EPOLLHUP | select.EPOLLERR) else 0
            f = self._filters.get(fd, {})
            if f.get(KQ_FILTER_READ) and ev & (select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR):
                out.append(kevent(fd, KQ_FILTER_READ, eof))
            if f.get(KQ_FILTER_WRITE) and ev & (select.EPOLLOUT | select.EPOLLERR):
                out.append(kevent(fd, KQ_FILTER_WRITE, eof))
        return out

    def close(self) -> None:
        self._ep.close()


def install() -> None:
    """Make ``select.kqueue`` and friends this double (only where kqueue is absent)."""
    if hasattr(select, "kqueue"):
        return
    for name, value in dict(globals()).items():
        if name in ("kqueue", "kevent") or name.startswith("KQ_"):
            setattr(select, name, value)
