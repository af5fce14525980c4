"""The unikernel target: the assembled site as a binary image for the C core, linked into a kernel.

Strategy: the build decides everything, the kernel only interprets. The same
``orisha.core.site`` classes the Python loops use compute every head (200, 304,
416), the negotiation table and the redirects, so the two cores cannot drift
on what a response looks like; this module only lays them out as little-endian
records the C side (``unikernel/src/core.c``) reads in place. Byte strings and
bodies are stored once each. Then ``unikernel/build.sh`` links the blob into
``OUT/orisha.img`` and the manifest records the image.

Format: the record layouts are written once, in ``RECORDS`` below; ``encode``
packs them and ``policy_header`` declares the same layouts as C structs (with
their sizes and offsets asserted) in the kernel's generated ``policy.h``.
Offsets are from the start of the blob. The image is: the header, the byte
strings and bodies, padding to 4, then the error, variant, entry and route
tables. Routes are sorted by key bytes; a redirect's ``location`` is
"HTTP/1.1 301 …Location: /dir/" and the query goes between it and ``tail``.
An entry's ``choice[mask]`` is the variant for an Accept-Encoding mask
(``NO_VARIANT``: 406).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import subprocess

from ... import manifest
from ...core.connection import ERRORS
from ...core.site import CODING_BITS, Entry, Redirect, Variant
from ...embed.assemble import Document
from ...errors import BuildError

MAGIC = 0x4953524F  # "ORSI"
VERSION = 2
NONE = 0xFFFFFFFF   # no such entry (the header's fallback)
NO_VARIANT = 0xFF   # an entry's choice for a mask nothing acceptable answers: 406
ROUTE_ENTRY, ROUTE_REDIRECT = 0, 1  # a route's kind
ENTRY_CONDITIONAL = 1               # an entry's flags: takes preconditions and ranges
MASKS = 1 << len(CODING_BITS)       # Accept-Encoding masks: an entry's choice slots
IMAGE = "orisha.img"
BLOB = "site.img"
HERE = os.path.dirname(os.path.abspath(__file__))

# A field's kind: its struct format and the C members it becomes. ``span``: bytes
# elsewhere in the image (offset, length); ``table``: records elsewhere (offset,
# count); ``i64``: a signed 64-bit value as two u32 halves (tables are only 4-aligned).
KINDS = {"u32": ("I", ("",)), "span": ("II", ("_off", "_len")), "table": ("II", ("_off", "_n")),
         "i64": ("II", ("_lo", "_hi")), "choice": (f"{MASKS}s", ("",))}


class Record:
    """One record of the image: named fields packed little-endian, no padding."""

    def __init__(self, name: str, *fields: tuple[str, str]) -> None:
        self.name = name
        self.fields = fields
        self.struct = struct.Struct("<" + "".join(KINDS[kind][0] for _, kind in fields))
        self.size = self.struct.size

    def pack(self, **values) -> bytes:
        """The record's bytes; a span or table takes an (offset, length) pair."""
        args: list = []
        for name, kind in self.fields:
            v = values.pop(name)
            if kind == "i64":
                v &= 0xFFFFFFFFFFFFFFFF
                args += (v & 0xFFFFFFFF, v >> 32)
            elif kind in ("span", "table"):
                args += v
            else:
                args.append(v)
        assert not values, values
        return self.struct.pack(*args)


HEADER = Record("header", ("magic", "u32"), ("version", "u32"), ("size", "u32"),
                ("routes", "table"), ("entries", "table"), ("errors", "table"),
                ("not_found", "u32"), ("fallback", "u32"))
ERROR = Record("error", ("status", "u32"), ("head", "span"), ("body", "span"))
VARIANT = Record("variant", ("head", "span"), ("head_304", "span"), ("fields", "span"),
                 ("etag", "span"), ("body", "span"))
ENTRY = Record("entry", ("last_modified", "i64"), ("flags", "u32"), ("identity", "u32"),
               ("head_416", "span"), ("variants", "table"), ("choice", "choice"))
ROUTE = Record("route", ("key", "span"), ("kind", "u32"), ("entry", "u32"),
               ("location", "span"), ("tail", "span"))
RECORDS = (HEADER, ERROR, VARIANT, ENTRY, ROUTE)


def unikernel_dir() -> str:
    return os.environ.get("ORISHA_UNIKERNEL") or os.path.normpath(
        os.path.join(HERE, "..", "..", "..", "unikernel"))


def _entry(doc: Document) -> Entry:
    return Entry(tuple(Variant(v.coding.encode(), v.etag.encode(), v.fields, v.fields_304, v.body,
                               doc.status.encode()) for v in doc.variants),
                 doc.mtime, doc.conditional)


class _Data:
    """Byte strings and bodies, each stored once."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.parts: list[bytes] = []
        self.size = 0
        self.seen: dict[bytes, int] = {}

    def put(self, b: bytes) -> tuple[int, int]:
        b = bytes(b)
        if not b:
            return 0, 0
        key = hashlib.blake2b(b, digest_size=16).digest() if len(b) > 256 else b
        off = self.seen.get(key)
        if off is None:
            off = self.seen[key] = self.start + self.size
            self.parts.append(b)
            self.size += len(b)
        return off, len(b)


def _errors(data: _Data) -> list[bytes]:
    return [ERROR.pack(status=status, head=data.put(ERRORS[status][0]),
                       body=data.put(ERRORS[status][1])) for status in sorted(ERRORS)]


def _variants(entries: list[Entry], data: _Data) -> tuple[list[bytes], list[int]]:
    """Every entry's variants, in entry order, and the index of each entry's first."""
    records, first = [], []
    for e in entries:
        first.append(len(records))
        records += [VARIANT.pack(head=data.put(v.head), head_304=data.put(v.head_304),
                                 fields=data.put(v.fields), etag=data.put(v.etag),
                                 body=data.put(v.body)) for v in e.variants]
    return records, first


def _entries(entries: list[Entry], first: list[int], head_416: list[tuple[int, int]],
             variants_off: int) -> list[bytes]:
    return [ENTRY.pack(last_modified=e.last_modified,
                       flags=ENTRY_CONDITIONAL if e.conditional else 0,
                       identity=e.variants.index(e.identity), head_416=h416,
                       variants=(variants_off + VARIANT.size * i, len(e.variants)),
                       choice=bytes(NO_VARIANT if c is None else e.variants.index(c)
                                    for c in e.choice))
            for e, i, h416 in zip(entries, first, head_416)]


def _routes(table: dict[bytes, tuple[str, str]], index: dict[str, int], data: _Data) -> list[bytes]:
    records = []
    for key in sorted(table):
        kind, value = table[key]
        if len(key) > 0xFFFF:
            raise BuildError(f"{key.decode('utf-8', 'replace')}: path too long for the unikernel image")
        if kind == "doc":
            records.append(ROUTE.pack(key=data.put(key), kind=ROUTE_ENTRY, entry=index[value],
                                      location=(0, 0), tail=(0, 0)))
        else:
            r = Redirect(*value)  # (location, status, query kept): orisha/embed/assemble.py
            records.append(ROUTE.pack(key=data.put(key), kind=ROUTE_REDIRECT, entry=0,
                                      location=data.put(r.location), tail=data.put(r.tail)))
    return records


def encode(docs: list[Document], table: dict[bytes, tuple[str, str]], not_found: Document,
           fallback: str | None) -> bytes:
    """The site image the C core interprets (see the module docstring)."""
    entries = [_entry(d) for d in docs] + [_entry(not_found)]
    index = {d.rel: i for i, d in enumerate(docs)}
    data = _Data(HEADER.size)
    errors = _errors(data)
    variants, first = _variants(entries, data)
    head_416 = [data.put(e.head_416) for e in entries]
    routes = _routes(table, index, data)
    # Entries point at their variants: they are packed once the tables' places are known.
    n_entries = len(entries)
    pad = -(HEADER.size + data.size) % 4
    errors_off = HEADER.size + data.size + pad
    variants_off = errors_off + ERROR.size * len(errors)
    entries_off = variants_off + VARIANT.size * len(variants)
    routes_off = entries_off + ENTRY.size * n_entries
    total = routes_off + ROUTE.size * len(routes)
    if total >= 1 << 32:
        raise BuildError(f"site too large for the unikernel image ({total:,} bytes; the limit is 4 GiB)")
    records = _entries(entries, first, head_416, variants_off)
    head = HEADER.pack(magic=MAGIC, version=VERSION, size=total, routes=(routes_off, len(routes)),
                       entries=(entries_off, n_entries), errors=(errors_off, len(errors)),
                       not_found=len(docs), fallback=index[fallback] if fallback else NONE)
    out = b"".join([head, *data.parts, b"\0" * pad, *errors, *variants, *records, *routes])
    assert len(out) == total
    return out


def link(blob_path: str, image_path: str) -> None:
    """Run unikernel/build.sh: the kernel with the blob embedded, as one ELF for QEMU -kernel."""
    from . import policy_header  # here: it reads this module's layouts
    src = unikernel_dir()
    script = os.path.join(src, "build.sh")
    if not os.path.isfile(script):
        raise BuildError(f"{src}: unikernel sources not found (set ORISHA_UNIKERNEL)")
    # One shared object directory (the kernel objects do not depend on the site), so
    # concurrent builds take turns; the lock also keeps them off each other's site.bin.
    objdir = os.path.join(src, "build", "image")
    os.makedirs(objdir, exist_ok=True)
    env = dict(os.environ, BUILD="build/image", JOBS=os.environ.get("JOBS", "2"))
    with open(os.path.join(objdir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        policy_header.write(os.path.join(objdir, "gen"))  # the Makefile's $(GEN)
        try:
            r = subprocess.run([script, blob_path, image_path], capture_output=True, text=True,
                               env=env)
        except OSError as e:
            raise BuildError(f"{script}: cannot run ({e.strerror})") from None
    if r.returncode != 0 or not os.path.isfile(image_path):
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        why = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "")
        raise BuildError(f"unikernel build failed (exit {r.returncode}): {why.strip()}")


def write(out: str, docs: list[Document], table: dict[bytes, tuple[str, str]],
          not_found: Document, fallback: str | None) -> None:
    """Write OUT/site.img and OUT/orisha.img, and record them in OUT's manifest."""
    blob = encode(docs, table, not_found, fallback)
    blob_path = os.path.join(out, BLOB)
    with open(blob_path, "wb") as f:
        f.write(blob)
    image_path = os.path.join(out, IMAGE)
    link(blob_path, image_path)
    os.chmod(image_path, 0o644)
    size = os.path.getsize(image_path)
    manifest.update(out, image=IMAGE, image_bytes=size, site_image_bytes=len(blob),
                    kernel_bytes=size - len(blob))
