"""QPACK field sections for responses whose HTTP/1.1 heads are already built.

Strategy: the HTTP/3 twin of ``hpack_blocks.py``. An encoder may use no dynamic
table at all (RFC 9204 §3.2.3; H2O and nginx can be told to): every field is then
an indexed line of the static table (§4.5.2) or a literal with a static name
reference (§4.5.4) or a literal name (§4.5.6), behind a prefix of two zero bytes
(Required Insert Count 0, Delta Base 0: §4.5.1). Such a section depends on
nothing in the connection, so it is build output: orisha/embed/emit.py writes
the section of every variant's 200 and 304 head into ``site.py`` beside its HPACK
block (``Variant.h3``/``h3_304``), and at run time a response's section is a dict
probe by the head bytes. Heads made per request (a 206, a redirect keeping the
query, built-in errors) are encoded on first use into a bounded memo. The Date
field, the one per-second part, is appended as its own literal.

The string primitives (prefixed integers, the Huffman code — RFC 9204 §4.1.2
uses HPACK's) are the ``hpack`` library's, like the HTTP/2 blocks; the static
table below is RFC 9204 Appendix A, which no installed library exposes
(pylsqpack keeps its copy in C). A test decodes every built section with
pylsqpack and compares the fields with the head's.
"""

from __future__ import annotations

import functools

from hpack.hpack import encode_integer
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH

from .fields import CONNECTION_FIELDS
from .hpack_blocks import hint_links, variants

# RFC 9204 Appendix A: the static table, index 0 to 98 (a test decodes with pylsqpack).
STATIC = (
    (b":authority", b""), (b":path", b"/"), (b"age", b"0"), (b"content-disposition", b""),
    (b"content-length", b"0"), (b"cookie", b""), (b"date", b""), (b"etag", b""),
    (b"if-modified-since", b""), (b"if-none-match", b""), (b"last-modified", b""),
    (b"link", b""), (b"location", b""), (b"referer", b""), (b"set-cookie", b""),
    # 15-21: the seven ":method" entries (CONNECT … PUT). A response never carries
    # :method, and the method names are typed only in core/policy.py: placeholders keep
    # the indexes after them the RFC's.
    *[(b":method", None)] * 7, (b":scheme", b"http"), (b":scheme", b"https"),
    (b":status", b"103"), (b":status", b"200"), (b":status", b"304"), (b":status", b"404"),
    (b":status", b"503"), (b"accept", b"*/*"), (b"accept", b"application/dns-message"),
    (b"accept-encoding", b"gzip, deflate, br"), (b"accept-ranges", b"bytes"),
    (b"access-control-allow-headers", b"cache-control"),
    (b"access-control-allow-headers", b"content-type"),
    (b"access-control-allow-origin", b"*"), (b"cache-control", b"max-age=0"),
    (b"cache-control", b"max-age=2592000"), (b"cache-control", b"max-age=604800"),
    (b"cache-control", b"no-cache"), (b"cache-control", b"no-store"),
    (b"cache-control", b"public, max-age=31536000"), (b"content-encoding", b"br"),
    (b"content-encoding", b"gzip"), (b"content-type", b"application/dns-message"),
    (b"content-type", b"application/javascript"), (b"content-type", b"application/json"),
    (b"content-type", b"application/x-www-form-urlencoded"), (b"content-type", b"image/gif"),
    (b"content-type", b"image/jpeg"), (b"content-type", b"image/png"),
    (b"content-type", b"text/css"), (b"content-type", b"text/html; charset=utf-8"),
    (b"content-type", b"text/plain"), (b"content-type", b"text/plain;charset=utf-8"),
    (b"range", b"bytes=0-"), (b"strict-transport-security", b"max-age=31536000"),
    (b"strict-transport-security", b"max-age=31536000; includesubdomains"),
    (b"strict-transport-security", b"max-age=31536000; includesubdomains; preload"),
    (b"vary", b"accept-encoding"), (b"vary", b"origin"),
    (b"x-content-type-options", b"nosniff"), (b"x-xss-protection", b"1; mode=block"),
    (b":status", b"100"), (b":status", b"204"), (b":status", b"206"), (b":status", b"302"),
    (b":status", b"400"), (b":status", b"403"), (b":status", b"421"), (b":status", b"425"),
    (b":status", b"500"), (b"accept-language", b""),
    (b"access-control-allow-credentials", b"FALSE"),
    (b"access-control-allow-credentials", b"TRUE"), (b"access-control-allow-headers", b"*"),
    (b"access-control-allow-methods", b"get"),
    (b"access-control-allow-methods", b"get, post, options"),
    (b"access-control-allow-methods", b"options"),
    (b"access-control-expose-headers", b"content-length"),
    (b"access-control-request-headers", b"content-type"),
    (b"access-control-request-method", b"get"), (b"access-control-request-method", b"post"),
    (b"alt-svc", b"clear"), (b"authorization", b""),
    (b"content-security-policy", b"script-src 'none'; object-src 'none'; base-uri 'none'"),
    (b"early-data", b"1"), (b"expect-ct", b""), (b"forwarded", b""), (b"if-range", b""),
    (b"origin", b""), (b"purpose", b"prefetch"), (b"server", b""),
    (b"timing-allow-origin", b"*"), (b"upgrade-insecure-requests", b"1"),
    (b"user-agent", b""), (b"x-forwarded-for", b""), (b"x-frame-options", b"deny"),
    (b"x-frame-options", b"sameorigin"),
)
_INDEXED: dict[tuple[bytes, bytes], int] = {}
_NAMED: dict[bytes, int] = {}
for _i, (_name, _value) in enumerate(STATIC):
    _INDEXED.setdefault((_name, _value), _i)
    _NAMED.setdefault(_name, _i)
_HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
PREFIX = b"\x00\x00"  # Required Insert Count 0, Delta Base 0 (§4.5.1): no dynamic table
_MEMO_MAX = 8192  # sections memoised per worker beyond the site's own heads


def _string(s: bytes, prefix: int, pattern: int) -> bytes:
    """A string literal (§4.1.2) after ``pattern`` bits, its H bit just above a
    ``prefix``-bit length; Huffman-coded when that is shorter."""
    h = _HUFFMAN.encode(s)
    huffman = len(h) < len(s)
    n = encode_integer(len(h) if huffman else len(s), prefix)
    n[0] |= pattern | ((1 << prefix) if huffman else 0)
    return bytes(n) + (h if huffman else s)


@functools.lru_cache(maxsize=16384)  # a site's heads repeat most fields (types, caching, Vary)
def field(name: bytes, value: bytes) -> bytes:
    """One field line that leaves the dynamic table alone."""
    i = _INDEXED.get((name, value))
    if i is not None:  # §4.5.2 indexed field line, T=1 (static): 11xxxxxx
        n = encode_integer(i, 6)
        n[0] |= 0xC0
        return bytes(n)
    i = _NAMED.get(name)
    if i is not None:  # §4.5.4 literal with name reference, N=0, T=1: 0101xxxx
        n = encode_integer(i, 4)
        n[0] |= 0x50
        return bytes(n) + _string(value, 7, 0)
    # §4.5.6 literal with literal name, N=0: 001Hxxx, then the value
    return _string(name, 3, 0x20) + _string(value, 7, 0)


def section(head: bytes) -> bytes:
    """The field section for an HTTP/1.1 head (status line and field lines, no Date)."""
    lines = head.split(b"\r\n")
    out = [PREFIX, field(b":status", lines[0][9:12])]
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name not in CONNECTION_FIELDS:  # RFC 9114 §4.2: as in HTTP/2
                out.append(field(name, value.strip()))
    return b"".join(out)


def early_section(head: bytes) -> bytes:
    """The field section of the 103 Early Hints (RFC 8297; RFC 9114 §4.1 allows interim
    responses before the final one) for a 200 head: ``:status 103`` (static index 24) and
    the Link values ``hpack_blocks.hint_links`` selects, or b"" when there is none."""
    links = hint_links(head)
    return PREFIX + field(b":status", b"103") + field(b"link", links) if links else b""


def date_field(http_date: bytes) -> bytes:
    """The ``date`` field (static name 6) for one second's IMF-fixdate."""
    return field(b"date", http_date)


def headers_frame(section: bytes) -> bytes:
    """An HTTP/3 HEADERS frame (type 0x1, RFC 9114 §7.2.2) holding ``section``: its type and
    length as QUIC variable-length integers (RFC 9000 §16)."""
    n = len(section)
    length = (bytes((n,)) if n < 64 else (0x4000 | n).to_bytes(2, "big") if n < 16384
              else (0x80000000 | n).to_bytes(4, "big") if n < 1 << 30
              else (0xc000000000000000 | n).to_bytes(8, "big"))
    return b"\x01" + length + section


class Sections:
    """Head bytes → field section: the build's sections of a site, then a bounded memo;
    and 200 head → the HEADERS frame of its 103, for the heads whose Link preloads."""

    __slots__ = ("built", "site", "memo", "early")

    def __init__(self) -> None:
        self.built: dict[bytes, bytes] = {}
        self.site = None
        self.memo: dict[bytes, bytes] = {}
        self.early: dict[bytes, bytes] = {}

    def take(self, site, hosts=None) -> None:
        """Use the sections ``site``'s build encoded — every site's of ``hosts`` (several
        sites, orisha/core/hosts.py) — and make their 103 frames (once per site object, or
        per table of sites: the views of a worker share it, hpack_blocks.Blocks.take)."""
        key = site if hosts is None else hosts.sites
        if key is self.site:
            return
        self.site, self.built, self.early = key, {}, {}
        for v in (v for s in (hosts.sites if hosts is not None else (site,)) for v in variants(s)):
            if v.h3:
                self.built[v.head] = v.h3
                self.built[v.head_304] = v.h3_304
            hints = early_section(v.head)
            if hints:  # framed here too: the request path only looks it up
                self.early[v.head] = headers_frame(hints)

    def get(self, head: bytes) -> bytes:
        s = self.built.get(head)
        if s is None:
            s = self.memo.get(head)
            if s is None:
                if len(self.memo) >= _MEMO_MAX:
                    self.memo.clear()
                s = self.memo[head] = section(head)
        return s
