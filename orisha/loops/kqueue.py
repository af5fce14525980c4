"""Loop body on kqueue (macOS and the BSDs).

Strategy: the shared readiness loop (``readiness.py``) does the moving; this
module maps its wants onto one kqueue per worker: a read filter and a write
filter per socket, each enabled or disabled as the core wants input or has
output pending. On Linux the suite runs this module against a kevent-compatible
test double (tests/kqueue_double.py).
"""

from __future__ import annotations

import select

from .readiness import READ, WRITE, ReadinessLoop


class Loop(ReadinessLoop):
    name = "kqueue"

    def __init__(self, listener, app, datagrams=None) -> None:
        super().__init__(listener, app, datagrams)
        self.kq = select.kqueue()
        self.wants: dict[int, int] = {}

    def _watch(self, fd: int, want: int) -> None:
        old = self.wants.get(fd)
        changes = []
        for bit, filt in ((READ, select.KQ_FILTER_READ), (WRITE, select.KQ_FILTER_WRITE)):
            if old is None:
                flags = select.KQ_EV_ADD | (select.KQ_EV_ENABLE if want & bit else select.KQ_EV_DISABLE)
            elif (old ^ want) & bit:
                flags = select.KQ_EV_ENABLE if want & bit else select.KQ_EV_DISABLE
            else:
                continue
            changes.append(select.kevent(fd, filt, flags))
        self.wants[fd] = want
        if changes:
            self.kq.control(changes, 0)

    def _forget(self, fd: int) -> None:
        # Filters vanish with the descriptor's last close; the listener, though, may
        # only be paused (EMFILE), so delete its filters explicitly.
        if self.wants.pop(fd, None) is not None:
            self.kq.control([select.kevent(fd, f, select.KQ_EV_DELETE)
                             for f in (select.KQ_FILTER_READ, select.KQ_FILTER_WRITE)], 0)

    def _wait(self, timeout: float):
        ready: dict[int, list[bool]] = {}
        for ev in self.kq.control(None, 1024, timeout):
            r = ready.setdefault(ev.ident, [False, False])
            if ev.filter == select.KQ_FILTER_READ or ev.flags & select.KQ_EV_EOF:
                r[0] = True
            if ev.filter == select.KQ_FILTER_WRITE:
                r[1] = True
        return [(fd, r[0], r[1]) for fd, r in ready.items()]

    def _done(self) -> None:
        self.kq.close()
