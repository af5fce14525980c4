"""HPACK header blocks for responses whose HTTP/1.1 heads are already built.

Strategy: a response head is a constant (the build formats it), so its HTTP/2
header block can be one too. The build's blocks use only HPACK representations
that do not depend on the connection (RFC 7541 §6.1 indexed fields from the
static table, §6.2.2 literals *without indexing*): the same bytes are valid on
every connection, in any order (the unikernel sends them as they are), and the
Date field (the one per-second part) is appended as its own literal. A hosted
connection also keeps the fields a site's heads share in the decoder's dynamic
table (``vocabulary``: the build's own representations, split, not encoded
again): a response names them in a byte each once they are in. The encoder
primitives (integers, Huffman codes, the static table) are the ``hpack``
library's; this module only chooses the representations.

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

from hpack.hpack import decode_integer, encode_integer
from hpack.huffman_table import decode_huffman
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.table import HeaderTable

from ..core.site import Entry, Guarded, Rules
from .fields import CONNECTION_FIELDS

_STATIC = HeaderTable.STATIC_TABLE
_INDEXED: dict[tuple[bytes, bytes], int] = {}
_NAMED: dict[bytes, int] = {}
for _i, (_name, _value) in enumerate(_STATIC, 1):
    _INDEXED.setdefault((_name, _value), _i)
    _NAMED.setdefault(_name, _i)
_HUFFMAN = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH)
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


def fields(head: bytes) -> list[tuple[bytes, bytes]]:
    """An HTTP/1.1 head's HTTP/2 fields: (name, value), ``:status`` first, no Date, none of
    the connection-specific ones."""
    lines = head.split(b"\r\n")
    out = [(b":status", lines[0][9:12])]
    for line in lines[1:]:
        if line:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name not in CONNECTION_FIELDS:
                out.append((name, value.strip()))
    return out


def block(head: bytes) -> bytes:
    """The header block for an HTTP/1.1 head (status line and field lines, no Date)."""
    return b"".join([field(name, value) for name, value in fields(head)])


# Each connection's dynamic table (RFC 7541 §2.3.2) holds the fields many of a site's heads
# share — a type, Cache-Control, Vary, a Content-Encoding, a Last-Modified — chosen when the
# site is taken (``Blocks.take``): the first response of a connection that carries one sends
# it with incremental indexing, every later one names it in a byte. What only one head has
# (its ETag, its Content-Length) and Date stay literals. Entries only ever go in: they fit the
# table a decoder starts with, so none is evicted and a block can be memoised per connection
# for as long as nothing new went in (h2.py, ``H2Connection._block``).
TABLE_SIZE = 4096  # a decoder's dynamic table until it says otherwise (RFC 9113 §6.5.2)
VOCABULARY_MAX = 64  # entries: the newest is index 62, the oldest 125 — one byte each (§6.1)
REF = [bytes([0x80 | i]) for i in range(128)]
_NOT_MODIFIED = field(b":status", b"304")  # an indexed field (§6.1), index < 128


def size_update(size: int) -> bytes:
    """A dynamic table size update to ``size`` (§6.3), at the start of a block."""
    n = encode_integer(size, 5)
    n[0] |= 0x20
    return bytes(n)


def _skip_string(data: bytes, pos: int) -> int:
    """Where the string (§5.2) at ``pos`` ends."""
    n, used = decode_integer(data[pos:pos + 6], 7)
    return pos + used + n


def representations(block: bytes) -> list[bytes]:
    """A block of ours split into its fields' representations: §6.1 indexed, §6.2.2 literal
    without indexing (what ``field`` makes)."""
    out, pos = [], 0
    while pos < len(block):
        start = pos
        if block[pos] & 0x80:
            pos += decode_integer(block[pos:pos + 6], 7)[1]
        else:
            index, used = decode_integer(block[pos:pos + 6], 4)
            pos = _skip_string(block, pos + used if index else _skip_string(block, pos + 1))
        out.append(block[start:pos])
    return out


def _entry_size(literal: bytes) -> int:
    """The size (§4.1) of the table entry a literal without indexing would make."""
    index, pos = decode_integer(literal[:6], 4)
    if index:
        name = len(_STATIC[index - 1][0])
    else:
        end = _skip_string(literal, pos)
        raw = literal[pos:end][decode_integer(literal[pos:pos + 6], 7)[1]:]
        name, pos = (len(decode_huffman(raw)) if literal[pos] & 0x80 else len(raw)), end
    raw = literal[pos:][decode_integer(literal[pos:pos + 6], 7)[1]:]
    return name + (len(decode_huffman(raw)) if literal[pos] & 0x80 else len(raw)) + 32


def _indexing(literal: bytes) -> bytes:
    """A literal without indexing (§6.2.2) as the same field with incremental indexing
    (§6.2.1): the name's index on a 6-bit prefix, the rest the same bytes."""
    index, used = decode_integer(literal, 4)
    n = encode_integer(index, 6)
    n[0] |= 0x40
    return bytes(n) + literal[used:]


def vocabulary(built: dict) -> tuple[list[bytes], list[int], dict]:
    """The fields the build's blocks (head → block) share: seen in two or more, ranked by
    the bytes they would save, at most ``VOCABULARY_MAX`` and ``TABLE_SIZE`` bytes as a
    table counts them. Returns (their representations with incremental indexing, their
    sizes, head → pieces), a head's pieces its block's representations as (vocabulary
    index or -1, the build's bytes), for the heads with a shared field. Made from the
    build's bytes (split, not encoded again): a take costs no Huffman coding."""
    split = {h: representations(b) for h, b in built.items()}
    counts: dict = {}
    for reps in split.values():
        if reps[0] != _NOT_MODIFIED:  # a 304 repeats its 200's fields: they are not shared
            for r in set(reps):
                counts[r] = counts.get(r, 0) + 1
    ranked = sorted((r for r, c in counts.items() if c >= 2 and not r[0] & 0x80),  # indexed:
                    key=lambda r: (-counts[r] * (len(r) - 1), r))           # a byte already
    chosen, sizes, room = {}, [], TABLE_SIZE
    for r in ranked:
        size = _entry_size(r)
        if size <= room and len(chosen) < VOCABULARY_MAX:
            chosen[r] = len(chosen)
            sizes.append(size)
            room -= size
    pieces = {h: tuple([(chosen.get(r, -1), r) for r in reps])
              for h, reps in split.items() if any(r in chosen for r in reps)}
    return [_indexing(r) for r in chosen], sizes, pieces


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

    __slots__ = ("built", "site", "memo", "early", "inc", "sizes", "pieces")

    def __init__(self) -> None:
        self.built: dict[bytes, bytes] = {}
        self.site = None
        self.memo: dict[bytes, bytes] = {}
        # 200 head → the header block of its 103 Early Hints (RFC 8297), for the heads
        # whose Link field preloads (the build's early hints, or _headers' own).
        self.early: dict[bytes, bytes] = {}
        # The connections' shared dynamic-table fields (``vocabulary``): their literals with
        # incremental indexing, their sizes, and head → pieces for the heads that use them.
        self.inc: list[bytes] = []
        self.sizes: list[int] = []
        self.pieces: dict[bytes, tuple] = {}

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
        self.inc, self.sizes, self.pieces = vocabulary(self.built)

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
            yield from e.deltas.values()  # dcz (RFC 9842): chosen by Available-Dictionary
