"""The workers' counters, shared with the supervisor through one anonymous mapping.

Strategy: each worker owns a slot (its counters, then each site's) that it writes once a
second; the supervisor reads and sums the slots of the live workers for the admin port's
/metrics, and recycles a slot when its worker is reaped. Slots are sized for every
listener's workers over ``MAX_DRAINING`` + 1 generations (orisha/serving/supervisor.py).
"""

from __future__ import annotations

import mmap
import struct
from typing import Callable

from ..core.policy import STATS_SLOTS, Stat


class SharedStats:
    """Counters and a started flag per worker slot, in one map shared across fork.

    Each worker writes its counters once a second (``App.tick``) and sets its
    started flag when it enters its loop body; the supervisor reads them for the
    admin port and folds a slot into ``retired`` when its worker exits, so totals
    survive restarts and reloads. ``sites``: several sites (``--site``), whose request
    counters follow the worker's in each slot (``App.site_stats``).
    """

    def __init__(self, slots: int, sites: int = 0) -> None:
        self.width = STATS_SLOTS * (1 + sites)
        self.fmt = struct.Struct(f"<{self.width}q")
        self.started_at = slots * self.fmt.size  # then one byte per slot
        self.map = mmap.mmap(-1, self.started_at + slots)
        self.free = list(range(slots))
        self.retired: dict[int, list[int]] = {}

    def take(self) -> int:
        if not self.free:  # sized for MAX_DRAINING: reaching this is a bug, not a load
            raise RuntimeError("no free counter slot")
        slot = self.free.pop()
        self.fmt.pack_into(self.map, slot * self.fmt.size, *([0] * self.width))
        self.map[self.started_at + slot] = 0
        return slot

    def publisher(self, slot: int) -> Callable[[list[int]], None]:
        fmt, buf, off = self.fmt, self.map, slot * self.fmt.size
        return lambda stats: fmt.pack_into(buf, off, *stats)

    def mark_started(self, slot: int) -> None:
        self.map[self.started_at + slot] = 1

    def started(self, slot: int) -> bool:
        return self.map[self.started_at + slot] == 1

    def read(self, slot: int) -> tuple[int, ...]:
        return self.fmt.unpack_from(self.map, slot * self.fmt.size)

    def release(self, slot: int, index: int) -> None:
        acc = self.retired.setdefault(index, [0] * self.width)
        for k, v in enumerate(self.read(slot)):
            if k != Stat.OPEN_CONNECTIONS:  # a gauge: a dead worker has none
                acc[k] += v
        self.free.append(slot)
