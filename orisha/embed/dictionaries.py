"""Compression dictionaries (RFC 9842): which responses become dictionaries, and their deltas.

Strategy: a browser that was told ``Use-As-Dictionary: match="…"`` keeps that
response's body and, on a later request its pattern matches, names it by SHA-256
in ``Available-Dictionary``; a server that knows the body answers a delta
(``Content-Encoding: dcz``: zstd with the body as a raw-content dictionary). The
bodies a returning visitor can hold are the earlier builds' own, so the build
keeps them: each build folder carries the dictionary-worthy bodies of its last K
builds (itself included) in ``dictionaries/<sha-256 hex>`` and their table in the
manifest (``dictionaries.builds``: newest first, path → [pattern, hash]); the next
build into the same folder reads them (``History``), precomputes one ``dcz`` per
(file, earlier body under the same pattern) and keeps it only when smaller than
the file's best plain variant. At run time a delta is one dict lookup by the
header's exact bytes (orisha/core/connection.py): nothing is compressed per request.

Patterns: a file's own path (an HTML page also under the names the route table
gives it: ``/dir/{index.html}?``, ``/page{.html}?``); a fingerprinted name
(``app.3f2a9c1b.js``, assemble.HASHED) ``/assets/app.*.js``, so the next build's
name matches — unless two files of one build would share that pattern (split
chunks): then each keeps its own path, so a delta is never against an unrelated
file. No ``match-dest``: a path already narrows the pattern, and a destination
would drop the dictionary for the same script fetched by a worker or ``fetch()``.

Brotli's ``dcb`` is not built: the ``brotli`` binding on PyPI (1.2.1) takes no
custom dictionary.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Callable
from urllib.parse import quote

import zstandard

from .. import manifest
from ..core.policy import DICTIONARIES_KEPT, RANGES
from .assemble import HASHED
from .compress import through_cache

# Worth keeping as a dictionary: code, styles and pages (types that change a little per
# release), from 1 KiB (a smaller delta saves little more than its 40-byte header) to 8 MiB
# (the window a dcz decoder must support for any dictionary, RFC 9842 §4).
TYPES = frozenset({"text/javascript", "text/css", "application/wasm", "application/json",
                   "text/html"})
MIN_SIZE = 1024
MAX_SIZE = 8 << 20
DEFAULT_KEEP = DICTIONARIES_KEPT  # --dictionaries K: the builds a delta may start from
MAX_KEEP = RANGES["dictionaries"].high  # bounds the history a build folder carries
FOLDER = "dictionaries"
# RFC 9842 §4: a zstd skippable frame (magic 0x184D2A5E, 32 bytes) that holds the SHA-256
# of the dictionary, before the zstd frame itself.
DCZ_MAGIC = b"\x5e\x2a\x4d\x18\x20\x00\x00\x00"
_VERSION = f"dcz-zstd{zstandard.__version__}-19"
_URLPATTERN_SPECIAL = re.compile(r"([:*(){}+?\\])")


def worth(ctype: str, size: int) -> bool:
    """Is a response of this type and size kept as a dictionary?"""
    return ctype.partition(";")[0] in TYPES and MIN_SIZE <= size <= MAX_SIZE


def _escape(path: str) -> str:
    """A path as a URLPattern pathname that matches only itself (percent-encoded as a
    browser sends it; the pattern syntax's special characters escaped)."""
    return _URLPATTERN_SPECIAL.sub(r"\\\1", quote(path, safe="/!$&'()*+,;=:@-._~",
                                                  errors="surrogateescape"))


def pattern(rel: str) -> str:
    """The match pattern a file's responses announce (before the ambiguity check)."""
    head, _, name = rel.rpartition("/")
    folder = "/" + head + "/" if head else "/"
    m = HASHED.search(name)
    if m:
        return _escape(folder + name[:m.start() + 1]) + "*" + _escape(name[name.rindex("."):])
    if name == "index.html":
        return _escape(folder) + "{index.html}?"
    if name.endswith(".html") and len(name) > 5:
        return _escape(folder + name[:-5]) + "{.html}?"
    return _escape("/" + rel)


def patterns(rels: list[str]) -> dict[str, str]:
    """rel → pattern for a build's dictionary-worthy files: a pattern two files would
    share is replaced by each one's own path."""
    wanted = {rel: pattern(rel) for rel in rels}
    count: dict[str, int] = {}
    for p in wanted.values():
        count[p] = count.get(p, 0) + 1
    return {rel: p if count[p] == 1 else _escape("/" + rel) for rel, p in wanted.items()}


def field(match: str) -> str:
    """The Use-As-Dictionary value (a structured-field dictionary, RFC 9842 §2.1)."""
    return 'match="' + match.replace("\\", "\\\\").replace('"', '\\"') + '"'


def available(sha: bytes) -> bytes:
    """The Available-Dictionary value a browser sends for a body of this SHA-256 (an sf-binary,
    RFC 9842 §2.2): the exact bytes the run-time table is keyed by."""
    return b":" + base64.b64encode(sha) + b":"


def encode(data: bytes, dictionary: bytes) -> bytes:
    """``data`` as dcz against ``dictionary`` (RFC 9842 §4): the header with the dictionary's
    SHA-256, then zstd -19 with it as raw content. The window covers dictionary and data
    (every match may reach back into the dictionary) up to the max(8 MiB, 1.25 × the
    dictionary) a client must decode."""
    window = (len(data) + len(dictionary) - 1).bit_length()
    limit = max(8 << 20, len(dictionary) * 5 // 4).bit_length() - 1
    params = zstandard.ZstdCompressionParameters.from_level(
        19, source_size=len(data), dict_size=len(dictionary),
        window_log=max(10, min(window, limit)), write_content_size=True, write_checksum=False,
        write_dict_id=False)
    d = zstandard.ZstdCompressionDict(dictionary, dict_type=zstandard.DICT_TYPE_RAWCONTENT)
    z = zstandard.ZstdCompressor(dict_data=d, compression_params=params).compress(data)
    return DCZ_MAGIC + hashlib.sha256(dictionary).digest() + z


def _job(args: tuple[bytes, bytes, str | None]) -> bytes:
    """``encode`` through the compression cache (in a worker process): a rebuild
    recomputes no delta."""
    data, dictionary, cache = args
    key = hashlib.blake2b(hashlib.sha256(data).digest() + hashlib.sha256(dictionary).digest()
                          + _VERSION.encode(), digest_size=20).hexdigest()
    return through_cache(cache, f"{key}.dcz", lambda: encode(data, dictionary))


def encode_all(jobs: list[tuple[bytes, bytes]], cache: str | None,
               progress: Callable[[int], None]) -> list[bytes]:
    """Each (data, dictionary) as dcz, in order, one process per core (zstd -19 with a
    dictionary costs about what the plain one does); ``progress(len(data))`` per delta."""
    args = [(data, dictionary, cache) for data, dictionary in jobs]
    workers = min(len(args), os.cpu_count() or 1)
    results: list[bytes] = []

    def collect(it) -> None:
        for (data, _), body in zip(jobs, it):
            results.append(body)
            progress(len(data))

    if workers <= 1:
        collect(map(_job, args))
    else:
        with ProcessPoolExecutor(workers) as pool:
            collect(pool.map(_job, args, chunksize=1))
    return results


@dataclass(frozen=True)
class Earlier:
    """A body an earlier build announced as a dictionary."""
    sha: bytes
    data: bytes


class History:
    """The dictionaries of the last builds kept in a build folder, by pattern (newest first)."""

    def __init__(self, out: str, keep: int) -> None:
        self.builds: list[dict] = []
        self.bodies: dict[str, bytes] = {}  # sha hex → body
        self.by_pattern: dict[str, list[Earlier]] = {}
        m = manifest.read(out) if keep else None
        kept = (m or {}).get("dictionaries")
        builds = kept.get("builds") if isinstance(kept, dict) else None
        if not isinstance(builds, list):  # none, or not this format: no deltas, no error
            return
        for b in builds[:keep]:
            if not isinstance(b, dict):
                continue
            kept = {}
            for path, value in b.items():
                body = self._body(out, value)
                if body is not None:
                    kept[path] = value
                    seen = self.by_pattern.setdefault(value[0], [])
                    if all(e.sha.hex() != value[1] for e in seen):
                        seen.append(Earlier(bytes.fromhex(value[1]), body))
            self.builds.append(kept)

    def _body(self, out: str, value) -> bytes | None:
        """An earlier body, checked against its hash (a damaged or edited history gives no
        delta: a delta against the wrong bytes would decode to garbage)."""
        if not (isinstance(value, list) and len(value) == 2 and isinstance(value[0], str)
                and isinstance(value[1], str) and re.fullmatch(r"[0-9a-f]{64}", value[1])):
            return None
        if value[1] in self.bodies:
            return self.bodies[value[1]]
        try:
            with open(os.path.join(out, FOLDER, value[1]), "rb") as f:
                body = f.read()
        except OSError:  # not there (or unreadable): that version gets no delta
            return None
        if hashlib.sha256(body).hexdigest() != value[1]:
            return None
        self.bodies[value[1]] = body
        return body

    def earlier(self, match: str, sha: bytes) -> list[Earlier]:
        """The earlier bodies a browser may hold for a response announced with ``match``,
        other than the response's own (``sha``)."""
        return [e for e in self.by_pattern.get(match, ()) if e.sha != sha]


def write(tmp: str, current: dict[str, tuple[str, bytes]], history: History,
          keep: int) -> dict:
    """Write the bodies of this build's and the kept earlier builds' dictionaries into the
    build being written (``tmp``); returns the manifest's ``dictionaries`` section.
    ``current``: path → (pattern, body) of this build."""
    folder = os.path.join(tmp, FOLDER)
    os.makedirs(folder, exist_ok=True)
    this = {}
    bodies = dict(history.bodies)
    for path, (match, body) in sorted(current.items()):
        sha = hashlib.sha256(body).hexdigest()
        this[path] = [match, sha]
        bodies[sha] = body
    builds = [this, *history.builds][:keep]
    size = 0
    for sha in sorted({v[1] for b in builds for v in b.values()}):
        with open(os.path.join(folder, sha), "wb") as f:
            f.write(bodies[sha])
        size += len(bodies[sha])
    return {"builds": builds, "history_bytes": size}

