"""Precompressing documents: gzip, brotli and zstd, once, at the strongest level.

Strategy: compression is paid once per build, so levels are the strongest that
still finish: gzip 9, brotli 11 and zstd 19 (brotli drops to 9 above 4 MiB,
where quality 11 costs minutes for a fraction of a percent). Results are
content-addressed in a cache (key: the bytes' hash, the coding, its level and
library version), so a rebuild after one edit recompresses one file. Files
are compressed in parallel, one process per core. Every coder is run
deterministically (gzip carries no name and mtime 0) so builds are reproducible.
"""

from __future__ import annotations

import gzip
import hashlib
import os
import tempfile
from concurrent.futures import ProcessPoolExecutor
from typing import Callable, Iterable

import brotli
import zstandard

from ..manifest import cache_root

BIG = 4 << 20
CODINGS = ("gzip", "br", "zstd")
_VERSIONS = f"gz9-br{brotli.__version__}-zstd{zstandard.__version__}-19"


def _encode(coding: str, data: bytes) -> bytes:
    if coding == "gzip":
        return gzip.compress(data, compresslevel=9, mtime=0)
    if coding == "br":
        return brotli.compress(data, quality=11 if len(data) <= BIG else 9)
    return zstandard.ZstdCompressor(level=19).compress(data)


def default_cache_dir() -> str:
    return cache_root("compressed")


def through_cache(cache: str | None, name: str, make: Callable[[], bytes]) -> bytes:
    """``make()``'s bytes, kept as ``name`` in the cache folder and read back from it next
    time (no cache: made every time)."""
    cached = os.path.join(cache, name) if cache else None
    if cached and os.path.exists(cached):
        with open(cached, "rb") as f:
            return f.read()
    enc = make()
    if cached:
        os.makedirs(cache, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache)
        with os.fdopen(fd, "wb") as f:
            f.write(enc)
        os.replace(tmp, cached)  # atomic: concurrent builds never see half a file
    return enc


def _job(args: tuple[str, str, str, str | None]) -> bytes:
    """Compress one file in one coding (in a worker process), through the cache."""
    path, digest, coding, cache = args

    def make() -> bytes:
        with open(path, "rb") as f:
            return _encode(coding, f.read())
    return through_cache(cache, f"{digest}.{coding}", make)


def cache_key(data: bytes) -> str:
    return hashlib.blake2b(data + _VERSIONS.encode(), digest_size=20).hexdigest()


def compress_all(jobs: Iterable[tuple[str, str, int]], cache: str | None,
                 progress: Callable[[int], None]) -> list[dict[str, bytes]]:
    """Compress each (path, digest, size) in every coding; results in input order.
    ``progress(size)`` is called as each file's last coding is done.

    One task per file and coding, largest first, so two cores finish together
    instead of one waiting on a big file's brotli at the end.
    """
    jobs = list(jobs)
    tasks = sorted(((i, c) for i in range(len(jobs)) for c in CODINGS),
                   key=lambda t: (-jobs[t[0]][2], t[0], t[1]))
    args = [(jobs[i][0], jobs[i][1], c, cache) for i, c in tasks]
    results: list[dict[str, bytes]] = [{} for _ in jobs]
    if not tasks:
        return results
    workers = min(len(tasks), os.cpu_count() or 1)
    done_per_file = [0] * len(jobs)

    def collect(it) -> None:
        for (i, c), enc in zip(tasks, it):
            results[i][c] = enc
            done_per_file[i] += 1
            if done_per_file[i] == len(CODINGS):
                progress(jobs[i][2])

    if workers == 1:
        collect(map(_job, args))
    else:
        with ProcessPoolExecutor(workers) as pool:
            collect(pool.map(_job, args, chunksize=1))
    return results
