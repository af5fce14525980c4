"""Mapping a build's body blob into memory.

Strategy: bodies live in one file beside the generated module and are mapped
read-only and shared, so every worker forked after loading uses the same page
cache pages (one copy of the site however many workers run), and a body is
sent as a memoryview slice of the map — never copied.
"""

from __future__ import annotations

import mmap
import os


def open_blob(module_file: str, name: str, size: int) -> memoryview:
    path = os.path.join(os.path.dirname(os.path.abspath(module_file)), name)
    with open(path, "rb") as f:
        actual = os.fstat(f.fileno()).st_size
        if actual != size:
            raise ValueError(f"{path}: expected {size} bytes, found {actual}: rebuild the site")
        if size == 0:
            return memoryview(b"")
        return memoryview(mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ))
