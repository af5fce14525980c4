"""Mapping a build's body blob into memory.

Strategy: bodies live in one file beside the generated module and are mapped
read-only and shared, so every worker forked after loading uses the same page
cache pages (one copy of the site however many workers run), and a body is
sent as a memoryview slice of the map — never copied.
"""

from __future__ import annotations

import mmap
import os


def open_blob(module_file: str, name: str, size: int, offset: int | None = None) -> memoryview:
    """Map ``name`` beside ``module_file``; with ``offset``, map ``size`` bytes at that
    (page-aligned) offset of ``module_file`` itself instead — the container executable
    carries its build appended to it (see orisha/targets/container/runtime.py)."""
    if offset is None:
        path = os.path.join(os.path.dirname(os.path.abspath(module_file)), name)
    else:
        path = module_file
    with open(path, "rb") as f:
        actual = os.fstat(f.fileno()).st_size
        if offset is None and actual != size:
            raise ValueError(f"{path}: expected {size} bytes, found {actual}: rebuild the site")
        if offset is not None and (offset % mmap.ALLOCATIONGRANULARITY or actual < offset + size):
            raise ValueError(f"{path}: no {size}-byte blob at offset {offset}: rebuild the site")
        if size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ, offset=offset or 0))
