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
HTTP/2 block cannot drift from what HTTP/1.1 sends. ``Blocks`` memoises them
per worker by the head bytes object (CPython caches a bytes object's hash, so
the lookup of a build-time head costs a dict probe); heads made per request (a
206, a redirect that keeps a query) pass through the same bounded memo.

Why on first use rather than in the build: a block is a pure function of its
head, so where it is computed changes no byte on the wire. Encoding one costs
~100 µs (measured, a 9-field head); the PostgreSQL docs have ~9,000 heads, so
emitting blocks would add ~1 s and a second constant per head to every build
(and change the generated module's format), while on first use a worker pays
100 µs once per head it actually serves.
"""

from __future__ import annotations

from hpack.hpack import encode_integer
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hpack.table import HeaderTable

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


def date_field(http_date: bytes) -> bytes:
    """The ``date`` field (static name 33) for one second's IMF-fixdate."""
    return field(b"date", http_date)


class Blocks:
    """Head bytes → header block, memoised; bounded so per-request heads cannot grow it."""

    __slots__ = ("memo",)

    def __init__(self) -> None:
        self.memo: dict[bytes, bytes] = {}

    def get(self, head: bytes) -> bytes:
        b = self.memo.get(head)
        if b is None:
            if len(self.memo) >= _MEMO_MAX:
                self.memo.clear()
            b = self.memo[head] = block(head)
        return b
