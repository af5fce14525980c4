"""HPACK header blocks for responses whose HTTP/1.1 heads are already built.

Strategy: a response head is a constant (the build formats it), so its HTTP/2
header block can be one too. Only HPACK representations that do not depend on
the connection are used (RFC 7541 §6.1 indexed fields from the static table,
§6.2.2 literals *without indexing*): the block never touches the decoder's
dynamic table, so the same bytes are valid on every connection, in any order,
and the Date field (the one per-second part) is appended as its own literal.
The encoder primitives (integers, Huffman codes, the static table) are the
``hpack`` library's; this module only chooses the representations.

Blocks are made from the HTTP/1.1 head bytes, not from the site's sources: a
head is the one description of a response (the core's plans carry it), so the
HTTP/2 block cannot drift from what HTTP/1.1 sends. The build encodes the block
of every variant's 200 and 304 head (orisha/embed/emit.py writes them into
``site.py`` beside the heads, the unikernel image carries the same bytes), so at
run time a response's block is a dict probe by the head bytes object (CPython
caches a bytes object's hash). Heads made per request — a 206, a redirect that
keeps the query, the built-in error pages — are encoded on first use and kept
in a bounded memo. Encoding costs ~100 µs a head (the hpack library's Huffman
coder in Python): ~1 s more for a build of the PostgreSQL docs' ~9,000 heads.
"""

from __future__ import annotations

import functools
import re

from hpack.hpack import encode_integer
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.table import HeaderTable

from ..core.site import Entry, Guarded, Rules

_STATIC = HeaderTable.STATIC_TABLE
_INDEXED: dict[tuple[bytes, bytes], int] = {}
_NAMED: dict[bytes, int] = {}
for _i, (_name, _value) in enumerate(_STATIC, 1):
    _INDEXED.setdefault((_name, _value), _i)
    _NAMED.setdefault(_name, _i)
_HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
# RFC 9113 §8.2.2: connection-specific fields are never sent over HTTP/2.
CONNECTION_FIELDS = frozenset((b"connection", b"keep-alive", b"proxy-connection",
                               b"transfer-encoding", b"upgrade"))
_MEMO_MAX = 8192  # blocks memoised per worker beyond the site's own heads (see Blocks)


def _string(s: bytes) -> bytes:
    """RFC 7541 §5.2: Huffman-coded when that is shorter."""
    h = _HUFFMAN.encode(s)
    if len(h) < len(s):
        n = encode_integer(len(h), 7)
        n[0] |= 0x80
        return bytes(n) + h
    return bytes(encode_integer(len(s), 7)) + s


@functools.lru_cache(maxsize=16384)  # a site's heads repeat most fields (types, caching, Vary)
def field(name: bytes, value: bytes) -> bytes:
    """One field: a static-table index, else a literal without indexing (§6.2.2)."""
    i = _INDEXED.get((name, value))
    if i is not None:
        n = encode_integer(i, 7)
        n[0] |= 0x80
        return bytes(n)
    i = _NAMED.get(name)
    if i is not None:
        return bytes(encode_integer(i, 4)) + _string(value)
    return b"\x00" + _string(name) + _string(value)


def block(head: bytes) -> bytes:
    """The header block for an HTTP/1.1 head (status line and field lines, no Date)."""
    lines = head.split(b"\r\n")
    out = [field(b":status", lines[0][9:12])]
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name not in CONNECTION_FIELDS:
                out.append(field(name, value.strip()))
    return b"".join(out)


_EXTRA = [b""]  # fields every response carries after Date: set once at start-up (advertise)


def date_field(http_date: bytes) -> bytes:
    """The ``date`` field (static name 33) for one second's IMF-fixdate — the per-second
    part of a block h2.py appends — and the fields ``advertise`` set (Alt-Svc)."""
    return field(b"date", http_date) + _EXTRA[0]


def advertise(name: bytes, value: bytes) -> None:
    """Add ``name: value`` to every HTTP/2 response of this process, after Date (the server
    does it before forking its workers: the Alt-Svc of HTTP/3, whose port is known only then)."""
    _EXTRA[0] = field(name, value)


_LINK = re.compile(rb"\r\nLink: ([^\r\n]*)", re.I)
_LINK_VALUE = re.compile(rb"\s*(<[^>]*>[^,]*)")
_HINT_RELS = re.compile(rb";\s*rel=\"?(?:preload|modulepreload|preconnect)\b", re.I)


def hint_links(head: bytes) -> bytes:
    """The ``link`` value of the 103 Early Hints (RFC 8297) for a 200 head: its Link values
    that ask to preload or preconnect (what a browser acts on in a 103, as Cloudflare
    sends), joined, or b"" when there is none. The one rule for HTTP/2 (``early_hints``),
    HTTP/3 (``qpack_blocks.early_section``) and the image (which stores the HTTP/2 block)."""
    if head[9:12] != b"200":
        return b""
    return b", ".join(v.strip() for m in _LINK.finditer(head)
                      for v in _LINK_VALUE.findall(m.group(1)) if _HINT_RELS.search(v))


def early_hints(head: bytes) -> bytes:
    """The header block of the 103 Early Hints for a 200 head (``hint_links``), or b"" when
    there is none. Made once per variant when a site is taken."""
    links = hint_links(head)
    return field(b":status", b"103") + field(b"link", links) if links else b""


class Blocks:
    """Head bytes → header block: the build's blocks of a site, then a memo of the rest,
    bounded so per-request heads cannot grow it."""

    __slots__ = ("built", "site", "memo", "early")

    def __init__(self) -> None:
        self.built: dict[bytes, bytes] = {}
        self.site = None
        self.memo: dict[bytes, bytes] = {}
        # 200 head → the header block of its 103 Early Hints (RFC 8297), for the heads
        # whose Link field preloads (the build's early hints, or _headers' own).
        self.early: dict[bytes, bytes] = {}

    def take(self, site, hosts=None) -> None:
        """Use the blocks ``site``'s build encoded — every site's of ``hosts`` (several
        sites, orisha/core/hosts.py: one table, whichever site a connection's requests
        name) — and make their 103 blocks; once per site, or per table of sites."""
        key = site if hosts is None else hosts.sites  # one list for a worker's every view
        if key is self.site:
            return
        self.site, self.built, self.early = key, {}, {}
        for v in (v for s in (hosts.sites if hosts is not None else (site,)) for v in variants(s)):
            if v.h2:  # a head is the same bytes in two sites only with the same fields
                self.built[v.head] = v.h2
                self.built[v.head_304] = v.h2_304
            hints = early_hints(v.head)
            if hints:
                self.early[v.head] = hints

    def get(self, head: bytes) -> bytes:
        b = self.built.get(head)
        if b is None:
            b = self.memo.get(head)
            if b is None:
                if len(self.memo) >= _MEMO_MAX:
                    self.memo.clear()
                b = self.memo[head] = block(head)
        return b


def variants(site):
    """Every variant of every document a site can answer with (routes, rules, error pages)."""
    entries = [site.not_found, site.fallback]
    rules = list(site.rules)
    for target in site.routes.values():
        if target.__class__ is Guarded:  # behind --basic-auth
            target = target.target
        if target.__class__ is Entry:
            entries.append(target)
        elif target.__class__ is Rules:  # a route whose rules have query conditions
            entries.append(target.default)
            rules.extend(target.rules)
    for rule in rules:
        entries.extend(rule.entries.values())  # the documents of its 404 rules
    seen = set()
    for e in entries:
        if e.__class__ is Entry and id(e) not in seen:
            seen.add(id(e))
            yield from e.variants
