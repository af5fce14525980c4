"""Turning files into complete responses and a route table.

Strategy: for every document, each kept variant gets its header block
formatted here, once: Content-Type, ETag (strong, one per coding), Last-Modified,
Cache-Control, Vary, Content-Encoding, Accept-Ranges (identity only: ranges are
served from it), then the author's headers (``_headers``, ``--header``); plus
the 304 block (RFC 9110 §15.4.5: ETag, Cache-Control, Vary, Expires,
Content-Location — Date is added at run time). Error pages (404) carry no
Accept-Ranges (no ranges are served on them), and the built-in one no
Last-Modified (it has no file). Routes are decided here too, so the server
only looks keys up.

Cache-Control policy (first match wins):
  1. ``--cache-control GLOB=VALUE`` overrides, matched against the path in the site;
  2. HTML: ``no-cache`` (always revalidate: pages change under stable names);
  3. names carrying a content hash (``app.3f2a1b9c.js``, ``index-B7xQ2aKp.css``):
     ``public, max-age=31536000, immutable``;
  4. everything else: ``public, max-age=3600`` (an hour fresh, then a cheap 304).
"""

from __future__ import annotations

import fnmatch
import hashlib
import re
from dataclasses import dataclass, field
from urllib.parse import quote

from ..core.dates import format_http_date
from ..core.policy import AUTH_CACHE_CONTROL
from .mime import compressible, content_type

HASHED = re.compile(
    r"[.\-_](?:(?=[0-9a-f]*[0-9])[0-9a-f]{8,}"
    r"|(?=[0-9A-Za-z]*[0-9])(?=[0-9A-Za-z]*[a-z])(?=[0-9A-Za-z]*[A-Z])[0-9A-Za-z]{8,})\.[A-Za-z0-9]+$")
IMMUTABLE = "public, max-age=31536000, immutable"
DEFAULT_CACHE = "public, max-age=3600"
_ETAG_SUFFIX = {"identity": "", "gzip": "-gz", "br": "-br", "zstd": "-zst"}


def cache_control(rel: str, ctype: str, overrides: list[tuple[str, str]]) -> str:
    for pattern, value in overrides:
        if fnmatch.fnmatchcase(rel, pattern):
            return value
    if ctype.startswith("text/html"):
        return "no-cache"
    if HASHED.search(rel.rpartition("/")[2]):
        return IMMUTABLE
    return DEFAULT_CACHE


@dataclass
class VariantOut:
    coding: str
    etag: str
    fields: bytes
    fields_304: bytes
    body: bytes


@dataclass
class Document:
    rel: str
    mtime: int
    variants: list[VariantOut] = field(default_factory=list)
    status: str = "200 OK"
    conditional: bool = True
    # dcz deltas (orisha/embed/dictionaries.py): (the Available-Dictionary value that
    # selects it, the variant), kept only where smaller than every plain variant
    deltas: list[tuple[bytes, VariantOut]] = field(default_factory=list)


# Author headers a 304 repeats (RFC 9110 §15.4.5); ETag, Cache-Control and Vary are built in.
_304_FIELDS = ("expires", "content-location")


def document(rel: str, data: bytes, mtime: int, encoded: dict[str, bytes] | None,
             overrides: list[tuple[str, str]], status: str = "200 OK",
             headers: tuple[tuple[str, str], ...] = (), dated: bool = True,
             private: bool = False,
             deltas: tuple[tuple[bytes, bytes, bytes], ...] = ()) -> Document:
    """Every kept variant of one document with its heads formatted.

    ``headers``: the author's fields, merged already (orisha/embed/rules.py); a
    Content-Type or Cache-Control among them replaces the build's, a Vary adds to
    Accept-Encoding. ``dated``: whether the document has a file (Last-Modified).
    ``private``: served behind --basic-auth: the build's Cache-Control becomes private
    (policy.AUTH_CACHE_CONTROL) unless --cache-control or an author header sets it.
    ``deltas``: (dictionary SHA-256, Available-Dictionary value, dcz body) per earlier
    version a browser may hold, each kept only when smaller than every plain variant (the
    document then varies on Available-Dictionary too).
    """
    ctype = content_type(rel)
    kept = {"identity": data}
    if encoded and compressible(ctype):
        for coding, body in encoded.items():
            if len(body) < len(data):  # kept only when it saves bytes
                kept[coding] = body
    tag = hashlib.blake2b(data, digest_size=10).hexdigest()
    if status == "200 OK":
        cc = cache_control(rel, ctype, overrides)
    else:
        cc = "no-cache"
    if private and not any(fnmatch.fnmatchcase(rel, p) for p, _ in overrides):
        cc = f"{AUTH_CACHE_CONTROL}, {cc.removeprefix('public, ')}"
    ctype, cc, author_vary, extra, extra_304 = _author_fields(headers, ctype, cc)
    smallest = min(len(b) for b in kept.values())
    deltas = [d for d in deltas if len(d[2]) < smallest]
    varies = ((["Accept-Encoding"] if len(kept) > 1 or deltas else [])
              + (["Available-Dictionary"] if deltas else []) + author_vary)
    vary = f"Vary: {', '.join(varies)}\r\n" if varies else ""
    lm = f"Last-Modified: {format_http_date(mtime).decode()}\r\n" if dated else ""
    ranges = "Accept-Ranges: bytes\r\n" if status == "200 OK" else ""
    doc = Document(rel, mtime, status=status, conditional=status == "200 OK")

    def variant(coding: str, etag: str, body: bytes) -> VariantOut:
        ce = "" if coding == "identity" else f"Content-Encoding: {coding}\r\n"
        fields = (f"Content-Type: {ctype}\r\nETag: {etag}\r\n{lm}"
                  f"Cache-Control: {cc}\r\n{vary}{ce}{ranges if coding == 'identity' else ''}"
                  f"{extra}")
        fields_304 = f"ETag: {etag}\r\nCache-Control: {cc}\r\n{vary}{extra_304}"
        return VariantOut(coding, etag, fields.encode("utf-8", "surrogateescape"),
                          fields_304.encode("utf-8", "surrogateescape"), body)

    for coding in ("identity", "gzip", "br", "zstd"):
        if coding in kept:
            doc.variants.append(variant(coding, f'"{tag}{_ETAG_SUFFIX[coding]}"', kept[coding]))
    for sha, key, body in deltas:  # each its own strong ETag: another body on the wire
        doc.deltas.append((key, variant("dcz", f'"{tag}-dcz{sha.hex()[:12]}"', body)))
    return doc


def _author_fields(headers: tuple[tuple[str, str], ...], ctype: str, cc: str):
    """(Content-Type, Cache-Control, Vary values, other field lines, the lines a 304
    repeats) once the author's fields are applied to the build's type and Cache-Control."""
    author_vary = []
    extra = extra_304 = ""
    for name, value in headers:
        lname = name.lower()
        if lname == "content-type":
            ctype = value
        elif lname == "cache-control":
            cc = value
        elif lname == "vary":
            author_vary.append(value)
        else:
            extra += f"{name}: {value}\r\n"
            if lname in _304_FIELDS:
                extra_304 += f"{name}: {value}\r\n"
    return ctype, cc, author_vary, extra, extra_304


BUILTIN_404 = (b"<!doctype html>\n<meta charset=utf-8>\n<title>404 Not Found</title>\n"
               b"<h1>404 Not Found</h1>\n<p>The requested page does not exist.</p>\n")


def url_key(rel: str) -> bytes:
    return b"/" + rel.encode("utf-8", "surrogateescape")


def routes(rels: list[str]) -> dict[bytes, tuple]:
    """Map each request path to ('doc', rel) or ('redirect', (location, status, keep query)).

    ``/a/b.css`` → the file; ``/dir/`` → ``dir/index.html``; ``/dir`` → 301 to
    ``/dir/``; ``/page`` → ``page.html`` when no file or directory claims it.
    Keys are decoded bytes (the core percent-decodes before looking up).
    """
    table: dict[bytes, tuple] = {}
    for rel in rels:
        table[url_key(rel)] = ("doc", rel)
    for rel in rels:
        head, _, name = rel.rpartition("/")
        if name == "index.html":
            d = url_key(head + "/") if head else b"/"
            table.setdefault(d, ("doc", rel))
            if head:
                loc = quote("/" + head + "/", safe="/!$&'()*+,;=:@-._~", errors="surrogateescape")
                table.setdefault(url_key(head), ("redirect", (loc.encode(), 301, True)))
    for rel in rels:
        if rel.endswith(".html") and len(rel) > 5:
            table.setdefault(url_key(rel[:-5]), ("doc", rel))
    return table


def asset_extensions(rels: list[str]) -> frozenset[bytes]:
    """The extensions (lower case, no dot) of the non-HTML files among ``rels``: an unknown
    path ending in one asks for a missing asset, not a page (``Site.assets``)."""
    out = set()
    for rel in rels:
        name = rel.rpartition("/")[2]
        ext = name.rpartition(".")[2] if "." in name else ""
        if ext and not content_type(name).startswith("text/html"):
            out.add(ext.encode("utf-8", "surrogateescape").lower())  # ASCII only, as the cores
    return frozenset(out)
