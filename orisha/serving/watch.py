"""Files polled for change: the certificate files a renewal reads again.

Strategy: no inotify (a Kubernetes Secret is a symlink swapped under a folder, certbot
renames): compare what ``stat`` says of each path, through symlinks, about once a second,
from the supervisor's loop, which never sleeps longer than its next deadline.
"""

from __future__ import annotations

import os
import time


class FileWatch:
    """Files polled for change (certbot renew, a Kubernetes Secret's symlink swap): their
    device, inode, size and mtime, through symlinks, compared about once a second."""

    def __init__(self, paths: list[str], every: float = 1.0) -> None:
        self.paths, self.every = paths, every
        self.seen = self._look()
        self.next = time.monotonic() + every

    def _look(self) -> tuple:
        out = []
        for p in self.paths:
            try:
                st = os.stat(p)
            except OSError as e:  # mid-rename, or gone: a change the reload will report
                out.append(e.errno)
                continue
            out.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)

    def changed(self) -> bool:
        now = time.monotonic()
        if now < self.next:
            return False
        self.next = now + self.every
        seen = self._look()
        if seen == self.seen:
            return False
        self.seen = seen
        return True
