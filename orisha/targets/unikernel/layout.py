"""The unikernel's site image: the assembled site laid out as little-endian records for the C core.

Strategy: the build decides everything, the kernel only interprets. The same
``orisha.core.site`` classes the Python loops use compute every head (200, 304,
416), the negotiation table and the redirects, so the two cores cannot drift
on what a response looks like; this module only lays them out as little-endian
records the C side (``unikernel/src/core.c``) reads in place. Byte strings and
bodies are stored once each. ``kernel.py`` links the blob into the kernel.

Format: the record layouts are written once, in ``RECORDS`` below; ``encode``
packs them and ``policy_header`` declares the same layouts as C structs (with
their sizes and offsets asserted) in the kernel's generated ``policy.h``.
Offsets are from the start of the blob. The image is: the header, the byte
strings and bodies, padding to 4, then the tables of ``_Image.TABLES``
(errors, variants, entries, routes, the routes of 404 rules, rules, pieces,
conditions, rule indices). Routes are sorted by key bytes; a redirect's
``location`` is "HTTP/1.1 301 …Location: /dir/" and the query goes between
it and ``tail`` when ``flags`` has ``ROUTE_QUERY``. An entry's
``choice[mask]`` is the variant for an Accept-Encoding mask (``NO_VARIANT``:
406); its ``multi_fields`` and ``part_type`` and the header's multipart
strings (from ``Site.boundary``) frame a multipart/byteranges 206. Beside
each stored head (a variant's 200 and 304, an entry's 416, an error page, a
route's redirect without its query) is its HTTP/2 header block,
``hpack_blocks.block(head)``: the bytes the hosted server sends, which h2.c
sends too (the core names it with its plan, ``core_resp.h2``).

Run-time ``_redirects`` rules (``matcher.match``) travel as records: a
pattern and a destination as pieces (text, ``:name``, ``*``; text and
captures numbered by slot), query conditions, and a 404 rule's destination
documents as routes. The header lists the rules tried on a route-table miss
(``site_rules``); a ``Rules`` route lists its own and its ``kind`` is its
default's (``ROUTE_NONE``: none). Rules beyond the C core's fixed buffers
(``PIECES_MAX``, ``SLOTS_MAX``, ``URL_MAX``) are a build error naming the rule.
"""

from __future__ import annotations

import hashlib
import struct

from ...core.connection import ERRORS
from ...core.policy import Limits
from ...core.site import CODING_BITS, REDIRECTS, Entry, Redirect, Variant
from ...embed.assemble import Document
from ...embed.emit import boundary
from ...errors import BuildError
from ...protocols.hpack_blocks import block, early_hints

MAGIC = 0x4953524F  # "ORSI"
VERSION = 6  # 6: a variant's 103 Early Hints block (h2_103)
NONE = 0xFFFFFFFF   # no such entry (the header's fallback), no such capture slot
NO_VARIANT = 0xFF   # an entry's choice for a mask nothing acceptable answers: 406
# A route's kind: an entry, a redirect, or (a ``Rules`` route whose rules all fail and
# that has no default) nothing: the fallback or not-found document.
ROUTE_ENTRY, ROUTE_REDIRECT, ROUTE_NONE = 0, 1, 2
ROUTE_QUERY = 1                     # a route's or rule's flags: a redirect passes the query on
ENTRY_CONDITIONAL = 1               # an entry's flags: takes preconditions and ranges
MASKS = 1 << len(CODING_BITS)       # Accept-Encoding masks: an entry's choice slots
# A rule piece's kind. In a path pattern: literal text, ``:name`` (one segment, at least
# one byte) or ``*`` (anything); in a destination: text, or a capture percent-encoded
# (a path placeholder, matcher._quote) or as it is (bound by a query condition).
PIECE_TEXT, PIECE_SEGMENT, PIECE_SPLAT, PIECE_QUOTED, PIECE_RAW = 0, 1, 2, 3, 4
# What the C core's fixed buffers hold (a rule beyond them is a build error): pieces of
# a pattern or destination, capture slots of a rule, and the bytes a 200 or 404 rule's
# destination may reach before it is looked up.
PIECES_MAX = 32
SLOTS_MAX = 16
URL_MAX = 1 << 16

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
                ("not_found", "u32"), ("fallback", "u32"), ("rules", "table"),
                ("site_rules", "table"), ("multi_head", "span"), ("delimiter", "span"),
                ("close_delimiter", "span"), ("navigations", "u32"), ("assets", "span"))
# ``navigations``: 1 when the fallback answers navigations only (``Site.assets`` is not
# None); ``assets`` then lists its extensions as "/js/css/png/" (connection.unknown).
# ``h2``, ``h2_304``, ``h2_416``: the HTTP/2 header block of the head beside it
# (``hpack_blocks.block``, the bytes the hosted server's site.py carries), which h2.c
# sends in place of converting the head; a route's is its redirect's without a query.
# ``h2_103``: the HTTP/2 block of the 103 Early Hints sent before a variant's 200 (RFC
# 8297; ``hpack_blocks.early_hints`` of its head, the hosted server's bytes; empty: none).
ERROR = Record("error", ("status", "u32"), ("head", "span"), ("body", "span"), ("h2", "span"))
VARIANT = Record("variant", ("head", "span"), ("head_304", "span"), ("fields", "span"),
                 ("etag", "span"), ("body", "span"), ("h2", "span"), ("h2_304", "span"),
                 ("h2_103", "span"))
ENTRY = Record("entry", ("last_modified", "i64"), ("flags", "u32"), ("identity", "u32"),
               ("head_416", "span"), ("variants", "table"), ("choice", "choice"),
               ("multi_fields", "span"), ("part_type", "span"), ("h2_416", "span"))
ROUTE = Record("route", ("key", "span"), ("kind", "u32"), ("entry", "u32"),
               ("location", "span"), ("tail", "span"), ("flags", "u32"), ("rules", "table"),
               ("h2", "span"))
RULE = Record("rule", ("status", "u32"), ("flags", "u32"), ("slots", "u32"), ("path", "table"),
              ("query", "table"), ("to", "table"), ("location", "span"), ("tail", "span"),
              ("entries", "table"))
PIECE = Record("piece", ("kind", "u32"), ("slot", "u32"), ("text", "span"))
CONDITION = Record("condition", ("key", "span"), ("slot", "u32"), ("literal", "span"))
INDEX = Record("index", ("rule", "u32"))
RECORDS = (HEADER, ERROR, VARIANT, ENTRY, ROUTE, RULE, PIECE, CONDITION, INDEX)


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


class _Ref:
    """``n`` records of table ``table`` from its record ``start``: a table field's value,
    resolved to (offset, count) once the tables' places are known."""

    def __init__(self, table: str, start: int, n: int) -> None:
        self.table, self.start, self.n = table, start, n


class _Image:
    """The data area, then record tables in ``TABLES`` order, each 4-aligned (every
    record's size is a multiple of 4). Records are added as field values and packed at
    the end, when every table's offset is known."""

    TABLES = (("errors", ERROR), ("variants", VARIANT), ("entries", ENTRY), ("routes", ROUTE),
              ("rule_routes", ROUTE), ("rules", RULE), ("pieces", PIECE),
              ("conditions", CONDITION), ("indices", INDEX))

    def __init__(self) -> None:
        self.data = _Data(HEADER.size)
        self.rows: dict[str, list[dict]] = {name: [] for name, _ in self.TABLES}

    def add(self, table: str, rows: list[dict]) -> _Ref:
        start = len(self.rows[table])
        self.rows[table] += rows
        return _Ref(table, start, len(rows))

    def pack(self, **header) -> bytes:
        pad = -(HEADER.size + self.data.size) % 4
        offsets, at = {}, HEADER.size + self.data.size + pad
        for name, rec in self.TABLES:
            offsets[name] = at
            at += rec.size * len(self.rows[name])
        if at >= 1 << 32:
            raise BuildError(f"site too large for the unikernel image ({at:,} bytes; the limit is 4 GiB)")
        sizes = dict(self.TABLES)

        def resolve(values: dict) -> dict:
            return {k: (offsets[v.table] + sizes[v.table].size * v.start, v.n)
                    if v.__class__ is _Ref else v for k, v in values.items()}

        tables = [rec.pack(**resolve(row)) for name, rec in self.TABLES for row in self.rows[name]]
        out = b"".join([HEADER.pack(**resolve(dict(header, magic=MAGIC, version=VERSION, size=at))),
                        *self.data.parts, b"\0" * pad, *tables])
        assert len(out) == at
        return out


def _h2(put, head: bytes) -> tuple[int, int]:
    """The stored HTTP/2 header block of a stored head (none for no head)."""
    return put(block(bytes(head))) if head else (0, 0)


def _documents(img: _Image, entries: list[Entry]) -> None:
    """The error pages, and every entry with its variants."""
    put = img.data.put
    img.add("errors", [dict(status=status, head=put(ERRORS[status][0]), body=put(ERRORS[status][1]),
                            h2=_h2(put, ERRORS[status][0]))
                       for status in sorted(ERRORS)])
    for e in entries:
        variants = img.add("variants", [
            dict(head=put(v.head), head_304=put(v.head_304), fields=put(v.fields),
                 etag=put(v.etag), body=put(v.body), h2=_h2(put, v.head),
                 h2_304=_h2(put, v.head_304), h2_103=put(early_hints(bytes(v.head))))
            for v in e.variants])
        img.add("entries", [dict(
            last_modified=e.last_modified, flags=ENTRY_CONDITIONAL if e.conditional else 0,
            identity=e.variants.index(e.identity), head_416=put(e.head_416), variants=variants,
            choice=bytes(NO_VARIANT if c is None else e.variants.index(c) for c in e.choice),
            multi_fields=put(e.multi_fields), part_type=put(e.part_type),
            h2_416=_h2(put, e.head_416))])


def _multipart(put, boundary: bytes) -> dict:
    """The header's multipart/byteranges strings (RFC 9110 §14.6), framed as
    connection._ranges and ranges.multipart frame them: the 206 head up to its
    Content-Length value, and the delimiters before a part (the first part's starts
    at its third byte: no CRLF) and after the last."""
    return dict(multi_head=put(b"HTTP/1.1 206 Partial Content\r\nContent-Type: multipart/byteranges; "
                               b"boundary=" + boundary + b"\r\nContent-Length: "),
                delimiter=put(b"\r\n--" + boundary + b"\r\n"),
                close_delimiter=put(b"\r\n--" + boundary + b"--\r\n"))


def _route(img: _Image, key: bytes, value, index: dict[str, int], rules) -> dict:
    """One route record: an entry, a redirect, or rules tried first (``Rules``)."""
    row = dict(key=img.data.put(key), kind=ROUTE_NONE, entry=0, location=(0, 0), tail=(0, 0),
               flags=0, rules=(0, 0), h2=(0, 0))
    if value is not None and value[0] == "rules":
        pending, value = value[1]
        row["rules"] = img.add("indices", [dict(rule=rules.index(r)) for r in pending])
    if value is None:
        return row
    kind, v = value
    if kind == "doc":
        row.update(kind=ROUTE_ENTRY, entry=index[v])
    else:
        r = Redirect(*v)  # (location, status, query kept): orisha/embed/assemble.py
        row.update(kind=ROUTE_REDIRECT, location=img.data.put(r.location),
                   tail=img.data.put(r.tail), flags=ROUTE_QUERY if r.query else 0,
                   h2=_h2(img.data.put, r.location + r.tail))  # sent when no query is kept
    return row


def _routes(img: _Image, table: dict, index: dict[str, int], rules: list) -> None:
    rows = []
    for key in sorted(table):
        if len(key) > 0xFFFF:
            raise BuildError(f"{key.decode('utf-8', 'replace')}: path too long for the unikernel image")
        rows.append(_route(img, key, table[key], index, rules))
    img.add("routes", rows)


def _pieces(img: _Image, r, slots: dict[str, int], raw: set) -> tuple[_Ref, _Ref]:
    """A rule's path pattern and destination as pieces (the captures numbered by ``slots``)."""
    put = img.data.put
    path = [dict(kind=PIECE_TEXT, slot=NONE, text=put(p.encode("utf-8", "surrogateescape")))
            if p.__class__ is str else
            dict(kind=PIECE_SPLAT if p[0] == "*" else PIECE_SEGMENT, slot=slots[p[1]], text=(0, 0))
            for p in r.pieces]
    to = [dict(kind=PIECE_TEXT, slot=NONE, text=put(p)) if p.__class__ is bytes else
          dict(kind=PIECE_RAW if p in raw else PIECE_QUOTED, slot=slots[p], text=(0, 0))
          for p in r.to if p.__class__ is bytes or p in slots]  # an unbound name is b""
    if len(path) > PIECES_MAX or len(to) > PIECES_MAX:
        raise BuildError(f"{r.where}: more than {PIECES_MAX} pieces in a pattern or destination "
                         "(the unikernel's limit)")
    return img.add("pieces", path), img.add("pieces", to)


def _check_url(r, raw: set) -> None:
    """A 200 or 404 rule's destination is built whole before it is looked up: its longest
    (every capture the longest a request target allows, percent-encoded) must fit."""
    target = Limits().target + 1  # a path may gain its "/" (absolute-form)
    most = sum(len(p) if p.__class__ is bytes else target * (1 if p in raw else 3) for p in r.to)
    if r.status in (200, 404) and most > URL_MAX:
        raise BuildError(f"{r.where}: the destination may reach {most:,} bytes, more than the "
                         f"unikernel's {URL_MAX:,} (use fewer placeholders)")


def _rule(img: _Image, r, index: dict[str, int]) -> dict:
    """One rule for the C matcher (``matcher.match``): its captures numbered in the order
    Python binds them (path placeholders, then query names, which win)."""
    put = img.data.put
    slots: dict[str, int] = {}
    for p in r.pieces:
        if p.__class__ is not str:
            slots.setdefault(p[1], len(slots))
    raw = {name for _, name, _ in r.query if name is not None}
    for name in sorted(raw - set(slots), key=[n for _, n, _ in r.query].index):
        slots[name] = len(slots)
    if len(slots) > SLOTS_MAX:
        raise BuildError(f"{r.where}: more than {SLOTS_MAX} placeholders (the unikernel's limit)")
    _check_url(r, raw)
    path, to = _pieces(img, r, slots, raw)
    query = img.add("conditions", [dict(key=put(key), slot=NONE if name is None else slots[name],
                                        literal=put(literal or b""))
                                   for key, name, literal in r.query])
    row = dict(status=r.status, flags=ROUTE_QUERY if r.query_append else 0, slots=len(slots),
               path=path, query=query, to=to, location=(0, 0), tail=(0, 0), entries=(0, 0))
    if r.status in REDIRECTS:
        red = Redirect(b"", r.status, r.query_append)
        row.update(location=put(red.location), tail=put(red.tail))
    if r.entries:
        row["entries"] = img.add("rule_routes", [_route(img, key, ("doc", r.entries[key]), index, [])
                                                 for key in sorted(r.entries)])
    return row


def _all_rules(table: dict, runtime: list) -> list:
    """Every compiled rule once: the run-time ones in order, then those only ``Rules`` routes name."""
    out = list(runtime)
    for value in table.values():
        if value[0] == "rules":
            out += [r for r in value[1][0] if r not in out]
    return out


def encode(docs: list[Document], table: dict[bytes, tuple], not_found: Document,
           fallback: str | None, runtime: list = (), assets: frozenset | None = None) -> bytes:
    """The site image the C core interprets (see the module docstring). ``runtime``: the
    rules matched on a route-table miss (``emit.CompiledRule``), in order; ``assets``:
    ``Site.assets``."""
    entries = [_entry(d) for d in docs] + [_entry(not_found)]
    index = {d.rel: i for i, d in enumerate(docs)}
    img = _Image()
    _documents(img, entries)
    rules = _all_rules(table, list(runtime))
    _routes(img, table, index, rules)
    site_rules = img.add("indices", [dict(rule=i) for i in range(len(runtime))])
    all_rules = img.add("rules", [_rule(img, r, index) for r in rules])
    return img.pack(routes=_Ref("routes", 0, len(table)), entries=_Ref("entries", 0, len(entries)),
                    errors=_Ref("errors", 0, len(ERRORS)), not_found=len(docs),
                    fallback=index[fallback] if fallback else NONE, rules=all_rules,
                    site_rules=site_rules, **_multipart(img.data.put, boundary(docs)),
                    navigations=int(assets is not None),
                    assets=img.data.put(b"/" + b"".join(e + b"/" for e in sorted(assets or ()))
                                        if assets else b""))
