"""The compiled site as the request core sees it.

Strategy: everything here is built once, by the generated module at import
time, from constants the build step wrote. A ``Variant`` is one encoding of one
document with its response heads already formatted (everything but the Date
and Connection lines, which depend on the clock and on the request).  An
``Entry`` is one routable document with its variants and a 16-slot table that
maps an Accept-Encoding mask to the smallest acceptable variant, so
negotiation at request time is one index.
"""

from __future__ import annotations

# Bit per content coding in an Accept-Encoding mask (see core/negotiate.py).
IDENTITY, GZIP, BR, ZSTD = 1, 2, 4, 8
CODING_BITS = {b"identity": IDENTITY, b"gzip": GZIP, b"br": BR, b"zstd": ZSTD}


class Variant:
    """One encoding of a document: heads for 200/HEAD and 304, and the body."""

    __slots__ = ("coding", "bit", "etag", "head", "head_304", "fields", "body", "length")

    def __init__(self, coding: bytes, etag: bytes, fields: bytes, fields_304: bytes,
                 body, status: bytes = b"200 OK") -> None:
        self.coding = coding
        self.bit = CODING_BITS[coding]
        self.etag = etag
        self.body = body
        self.length = len(body)
        self.head = b"HTTP/1.1 %s\r\nContent-Length: %d\r\n%s" % (status, self.length, fields)
        # ``fields``: every header line except the status line and Content-Length, kept
        # (for identity only: ranges are served from it) so a 206 is framed around it
        # without formatting anything else.
        self.fields = fields if coding == b"identity" else b""
        self.head_304 = b"HTTP/1.1 304 Not Modified\r\n" + fields_304


class Entry:
    """A routable document: its variants, validators and negotiation table."""

    __slots__ = ("variants", "choice", "identity", "last_modified", "conditional", "head_416",
                 "status")

    def __init__(self, variants: tuple[Variant, ...], last_modified: int,
                 conditional: bool = True) -> None:
        self.variants = tuple(sorted(variants, key=lambda v: (v.length, v.bit)))
        self.identity = next(v for v in self.variants if v.coding == b"identity")
        self.last_modified = last_modified
        self.status = int(self.identity.head[9:12])  # 200, or 404 for a not-found page
        # 404 pages are not subject to conditionals or ranges (RFC 9110 §13.2.1: preconditions
        # apply only where the response would otherwise be 2xx).
        self.conditional = conditional
        self.choice = tuple(next((v for v in self.variants if v.bit & mask), None)
                            for mask in range(16))
        self.head_416 = (b"HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */%d\r\n"
                         b"Content-Length: 0\r\n" % self.identity.length)


class Redirect:
    """``/dir`` → ``/dir/``: a 301 whose Location keeps the request's query."""

    __slots__ = ("location", "tail")

    def __init__(self, location: bytes) -> None:
        self.location = b"HTTP/1.1 301 Moved Permanently\r\nLocation: " + location
        self.tail = b"\r\nContent-Length: 0\r\nCache-Control: public, max-age=3600\r\n"


class Site:
    """The route table plus the documents for unknown paths."""

    __slots__ = ("routes", "not_found", "fallback", "summary", "loop")

    def __init__(self, routes: dict, not_found: Entry, fallback: Entry | None,
                 summary: str, loop: str) -> None:
        self.routes = routes
        self.not_found = not_found
        self.fallback = fallback
        self.summary = summary
        self.loop = loop
