"""The unikernel target: the assembled site as a binary image for the C core, linked into a kernel.

Strategy: the build decides everything, the kernel only interprets. The same
``orisha.core.site`` classes the Python loops use compute every head (200, 304,
416), the negotiation table and the redirects, so the two cores cannot drift
on what a response looks like; this module only lays them out as little-endian
u32 records the C side (``unikernel/src/core.c``) reads in place. Byte strings
and bodies are stored once each. Then ``unikernel/build.sh`` links the blob into
``OUT/orisha.img`` and the manifest records the image.

Format (version 1; offsets are from the start of the blob, all u32 LE):

  header   16 u32: magic "ORSI", version, total size, n_routes, routes_off,
           n_entries, entries_off, not_found entry, fallback entry (0xffffffff:
           none), errors_off, n_errors, 5 reserved
  route    8 u32, sorted by key bytes: key_off, key_len, kind (0 entry,
           1 redirect), entry, location_off, location_len, tail_off, tail_len
           (location = "HTTP/1.1 301 …Location: /dir/", the query goes between
           location and tail)
  entry    8 u32 + 16 u8: last_modified lo, hi (signed 64), flags (1 = conditional),
           n_variants, identity variant, head_416 off, len, variants_off;
           choice[mask] = variant index for an Accept-Encoding mask, 0xff = 406
  variant  10 u32: head, head_304, fields, etag, body as (off, len) pairs
  error    5 u32: status, head off, len, body off, len (406's head carries Vary)
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import struct
import subprocess

from ... import manifest
from ...core.connection import ERRORS
from ...core.site import Entry, Redirect, Variant
from ...embed.assemble import Document
from ...errors import BuildError

MAGIC = 0x4953524F  # "ORSI"
VERSION = 1
NONE = 0xFFFFFFFF
IMAGE = "orisha.img"
BLOB = "site.img"
HERE = os.path.dirname(os.path.abspath(__file__))


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


def encode(docs: list[Document], table: dict[bytes, tuple[str, str]], not_found: Document,
           fallback: str | None) -> bytes:
    """The site image the C core interprets (see the module docstring)."""
    entries = [_entry(d) for d in docs] + [_entry(not_found)]
    index = {d.rel: i for i, d in enumerate(docs)}
    nf = len(docs)
    data = _Data(64)

    erecs = []
    for status in sorted(ERRORS):
        head, body = ERRORS[status]
        erecs.append((status, *data.put(head), *data.put(body)))

    vrecs: list[tuple] = []
    ent_recs = []
    for e in entries:
        first = len(vrecs)
        for v in e.variants:
            vrecs.append((*data.put(v.head), *data.put(v.head_304), *data.put(v.fields),
                          *data.put(v.etag), *data.put(v.body)))
        choice = bytes(0xFF if c is None else e.variants.index(c) for c in e.choice)
        lm = e.last_modified & 0xFFFFFFFFFFFFFFFF
        ent_recs.append((lm & 0xFFFFFFFF, lm >> 32, 1 if e.conditional else 0, len(e.variants),
                         e.variants.index(e.identity), *data.put(e.head_416), first, choice))

    rrecs = []
    for key in sorted(table):
        kind, value = table[key]
        if len(key) > 0xFFFF:
            raise BuildError(f"{key.decode('utf-8', 'replace')}: path too long for the unikernel image")
        if kind == "doc":
            rrecs.append((*data.put(key), 0, index[value], 0, 0, 0, 0))
        else:
            r = Redirect(value.encode())
            rrecs.append((*data.put(key), 1, 0, *data.put(r.location), *data.put(r.tail)))

    pad = -(64 + data.size) % 4
    base = 64 + data.size + pad
    errors_off = base
    variants_off = errors_off + 20 * len(erecs)
    entries_off = variants_off + 40 * len(vrecs)
    routes_off = entries_off + 48 * len(ent_recs)
    total = routes_off + 32 * len(rrecs)
    if total >= 1 << 32:
        raise BuildError(f"site too large for the unikernel image ({total:,} bytes; the limit is 4 GiB)")

    out = bytearray()
    out += struct.pack("<16I", MAGIC, VERSION, total, len(rrecs), routes_off, len(ent_recs),
                       entries_off, nf, index[fallback] if fallback else NONE, errors_off,
                       len(erecs), 0, 0, 0, 0, 0)
    for p in data.parts:
        out += p
    out += b"\0" * pad
    for r in erecs:
        out += struct.pack("<5I", *r)
    for r in vrecs:
        out += struct.pack("<10I", *r)
    for r in ent_recs:
        *nums, first, choice = r
        out += struct.pack("<8I", *nums, variants_off + 40 * first) + choice
    for r in rrecs:
        out += struct.pack("<8I", *r)
    assert len(out) == total
    return bytes(out)


def link(blob_path: str, image_path: str) -> None:
    """Run unikernel/build.sh: the kernel with the blob embedded, as one ELF for QEMU -kernel."""
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
