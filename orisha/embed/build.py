"""The build step: site directory in, build output directory out.

Strategy: walk → compress (parallel, cached) → assemble responses and routes →
emit, all into a temporary directory beside OUT that replaces OUT only when
complete, so a failed build leaves OUT as it was. An existing OUT is replaced
only if it is itself an Orisha build: a build never deletes a user's files.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable

from . import assemble, compress, emit
from .. import manifest
from ..errors import BuildError
from ..loops import BUILD_CHOICES as LOOPS
from .walk import SourceFile, walk


@dataclass
class Result:
    out: str
    files: int
    bytes: dict[str, int]
    seconds: float
    summary: str


def _check_doc(site: str, rel: str | None, option: str) -> str | None:
    if rel is None:
        return None
    rel = rel.strip("/")
    if not os.path.isfile(os.path.join(site, rel)):
        raise BuildError(f"{os.path.join(site, rel)}: {option} file does not exist in the site")
    return rel


def check_out(site: str, out: str) -> None:
    """OUT must not be inside SITE and may replace only an earlier build (or nothing)."""
    real_site, real_out = os.path.realpath(site), os.path.realpath(out)
    if real_out == real_site or real_out.startswith(real_site + os.sep):
        raise BuildError(f"{out}: the output directory is inside the site directory {site}")
    if not manifest.replaceable(out):
        raise BuildError(f"{out}: exists and is not an Orisha build; refusing to replace it")


def build(site: str, out: str, *, fallback: str | None = None, not_found: str | None = None,
          cache_control: list[tuple[str, str]] | None = None, loop: str = "auto",
          cache: str | None = "", progress: bool = False,
          warn: Callable[[str], None] = lambda m: print(f"orisha: warning: {m}", file=sys.stderr),
          ) -> Result:
    started = time.monotonic()
    if loop not in LOOPS:
        raise BuildError(f"--loop {loop}: unknown loop (choose from {', '.join(LOOPS)})")
    if not os.path.isdir(site):
        raise BuildError(f"{site}: no such directory" if not os.path.exists(site)
                         else f"{site}: not a directory")
    check_out(site, out)
    fallback = _check_doc(site, fallback, "--fallback")
    not_found = _check_doc(site, not_found, "--not-found")
    overrides = cache_control or []

    files = walk(site, warn)
    datas = [_read(f) for f in files]
    encoded = _compress(files, datas, compress.default_cache_dir() if cache == "" else cache,
                        progress)
    docs = [assemble.document(f.rel, datas[i], f.mtime, encoded[i], overrides)
            for i, f in enumerate(files)]
    if not_found:
        i = [f.rel for f in files].index(not_found)
        nf = assemble.document(not_found, datas[i], files[i].mtime, encoded[i], overrides,
                               status="404 Not Found")
    else:
        nf = assemble.document("404.html", assemble.BUILTIN_404, 0, None, overrides,
                               status="404 Not Found")
    table = assemble.routes([f.rel for f in files])

    totals = {c: 0 for c in ("identity", *compress.CODINGS)}
    for d in docs:
        for v in d.variants:
            totals[v.coding] += len(v.body)
    summary = (f"{len(files)} files, {totals['identity']} bytes"
               + "".join(f", {c} {totals[c]}" for c in compress.CODINGS if totals[c]))

    def write(tmp: str) -> None:
        emit.write(tmp, docs, table, nf, fallback, loop, summary,
                   {"files": len(files), "bytes": totals})
        if loop == "unikernel":  # the image is linked from the same documents
            from ..targets.unikernel import image
            image.write(tmp, docs, table, nf, fallback)
    replace_dir(out, write)
    return Result(out, len(files), totals, time.monotonic() - started, summary)


def _read(f: SourceFile) -> bytes:
    try:
        with open(f.path, "rb") as fh:
            return fh.read()
    except OSError as e:
        raise BuildError(f"{f.path}: cannot read ({e.strerror})") from None


def _compress(files: list[SourceFile], datas: list[bytes], cache: str | None,
              progress: bool) -> list[dict[str, bytes] | None]:
    """Every coding of every compressible file (None for the rest), in file order."""
    from .mime import compressible, content_type
    todo = [i for i, f in enumerate(files) if datas[i] and compressible(content_type(f.rel))]
    jobs = [(files[i].path, compress.cache_key(datas[i]), len(datas[i])) for i in todo]
    if progress:
        import click
        with click.progressbar(length=len(jobs), label="compressing", file=sys.stdout) as bar:
            results = compress.compress_all(jobs, cache, bar.update)
    else:
        results = compress.compress_all(jobs, cache, lambda n: None)
    encoded: list[dict[str, bytes] | None] = [None] * len(files)
    for i, r in zip(todo, results):
        encoded[i] = r
    return encoded


def replace_dir(out: str, fill: Callable[[str], None]) -> None:
    """Run ``fill(tmp)`` on a fresh folder beside OUT, then put it in OUT's place.

    A failure anywhere leaves OUT as it was (the caller checked that OUT may be
    replaced: ``check_out``)."""
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".orisha-build-", dir=parent)
    try:
        fill(tmp)
        os.chmod(tmp, 0o755)
        if os.path.exists(out):
            old = tempfile.mkdtemp(prefix=".orisha-old-", dir=parent)
            os.rename(out, os.path.join(old, "out"))
            os.rename(tmp, out)
            shutil.rmtree(old)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
