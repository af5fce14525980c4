"""Mapping a build's body blob into memory, and large bodies as file regions.

Strategy: bodies live in one file beside the generated module and are mapped
read-only and shared, so every worker forked after loading uses the same page
cache pages (one copy of the site however many workers run). A small body is
sent as a memoryview slice of the map — never copied. A body of at least
``REGION_MIN`` bytes is a ``FileRegion`` instead: the loop body hands it to the
kernel by file descriptor and offset (sendfile), so the bytes go from the page
cache to the socket without passing through the worker's address space, and
the pages are never mapped into a worker (they do not count in its PSS).

The choice is made once, where the generated module slices the blob
(``B[start:end]``), so the request core carries regions like any other body
and needs no branch of its own; ``orisha/loops/base.py`` says how a loop sends
one.

Smaller bodies are sent from the map, which maps their pages into the worker.
``release()``, called by every loop body once a second, drops those mappings
again (MADV_DONTNEED on a shared file map: the pages stay in the page cache,
the next send maps them back with a minor fault), so the blob is held once, by
the page cache, the way nginx's sendfile holds it — not also as pages counted
in each worker's PSS and pinned against reclaim by being mapped.
"""

from __future__ import annotations

import mmap
import os
import weakref

# Bodies at least this large are sent with sendfile. Below it one sendmsg of head and
# body costs less than a sendmsg for the head plus a sendfile (measured in bench/bench.py).
# ORISHA_REGION_MIN overrides it (bytes), e.g. to trade CPU for memory (bench/memory.py).
REGION_MIN = int(os.environ.get("ORISHA_REGION_MIN") or 64 * 1024)


class FileRegion:
    """``length`` bytes at ``offset`` of the open file ``fd``: a body the kernel copies.

    Behaves as a read-only body for everything above the loops: ``len``, truth,
    slicing (a 206's range: a region again, or a memoryview when small) and
    ``bytes``. ``view`` is the same bytes as a memoryview of the map, for loop
    bodies that cannot send from a file (asyncio transports).
    """

    __slots__ = ("fd", "offset", "length", "view", "_file")

    def __init__(self, file, offset: int, view: memoryview) -> None:
        self._file = file  # keeps the descriptor open as long as a body refers to it
        self.fd = file.fileno()
        self.offset = offset
        self.length = len(view)
        self.view = view

    def __len__(self) -> int:
        return self.length

    def __bytes__(self) -> bytes:
        return bytes(self.view)

    def __getitem__(self, index: slice):
        start, stop, step = index.indices(self.length)
        if step != 1:
            raise ValueError("a FileRegion slices with step 1 only")
        view = self.view[start:stop]
        return FileRegion(self._file, self.offset + start, view) if len(view) >= REGION_MIN else view

    def __repr__(self) -> str:
        return f"FileRegion(fd={self.fd}, offset={self.offset}, length={self.length})"


class Blob:
    """The mapped blob; slicing it gives each body (see the module docstring)."""

    __slots__ = ("view", "file", "base")

    def __init__(self, view: memoryview, file, base: int) -> None:
        self.view, self.file, self.base = view, file, base
        if file is not None:
            # The map itself, weakly: the generated module (and this Blob) may be gone
            # while the bodies, slices of the map, keep it alive.
            _OPEN.add(view.obj)

    def __len__(self) -> int:
        return len(self.view)

    def __getitem__(self, index: slice):
        view = self.view[index]
        if len(view) < REGION_MIN or self.file is None:
            return view
        return FileRegion(self.file, self.base + index.indices(len(self.view))[0], view)


_OPEN: "weakref.WeakSet[mmap.mmap]" = weakref.WeakSet()


def release() -> None:
    """Unmap the pages of every open blob from this process (see the module docstring)."""
    for m in list(_OPEN):
        m.madvise(mmap.MADV_DONTNEED)


def open_blob(module_file: str, name: str, size: int, offset: int | None = None) -> Blob:
    """Map ``name`` beside ``module_file``; with ``offset``, map ``size`` bytes at that
    (page-aligned) offset of ``module_file`` itself instead — the container executable
    carries its build appended to it (see orisha/targets/container/runtime.py)."""
    if offset is None:
        path = os.path.join(os.path.dirname(os.path.abspath(module_file)), name)
    else:
        path = module_file
    # Kept open for sendfile (unbuffered: only its descriptor is used, always with an
    # explicit offset, so workers forked from this process share it safely).
    f = open(path, "rb", buffering=0)
    try:
        actual = os.fstat(f.fileno()).st_size
        if offset is None and actual != size:
            raise ValueError(f"{path}: expected {size} bytes, found {actual}: rebuild the site")
        if offset is not None and (offset % mmap.ALLOCATIONGRANULARITY or actual < offset + size):
            raise ValueError(f"{path}: no {size}-byte blob at offset {offset}: rebuild the site")
    except BaseException:
        f.close()
        raise
    if size == 0:
        f.close()
        return Blob(memoryview(b""), None, 0)
    view = memoryview(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ, offset=offset or 0))
    return Blob(view, f, offset or 0)
