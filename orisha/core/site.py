"""The compiled site as the request core sees it.

Strategy: everything here is built once, by the generated module at import
time, from constants the build step wrote. A ``Variant`` is one encoding of one
document with its response heads already formatted (everything but the Date
and Connection lines, which depend on the clock and on the request).  An
``Entry`` is one routable document with its variants and a 16-slot table that
maps an Accept-Encoding mask to the smallest acceptable variant, so
negotiation at request time is one index. A ``Redirect`` is a precomputed
redirect head; ``Rule`` and ``Rules`` are the few ``_redirects`` rules that
must be matched at run time (orisha/core/matcher.py does it, on a route-table
miss only), and ``Site`` ties the route table and those rules together.
"""

from __future__ import annotations

import binascii
import re

from .policy import AUTH_CHECKS, AUTH_REMEMBERED, unauthorized

# Bit per content coding in an Accept-Encoding mask (see core/negotiate.py).
IDENTITY, GZIP, BR, ZSTD = 1, 2, 4, 8
CODING_BITS = {b"identity": IDENTITY, b"gzip": GZIP, b"br": BR, b"zstd": ZSTD}
# A dcz delta (RFC 9842) is no slot of the mask: it is chosen by Available-Dictionary
# (``Entry.deltas``) after the table, and only when Accept-Encoding names dcz.


class Variant:
    """One encoding of a document: heads for 200/HEAD and 304, and the body.

    ``h2``/``h2_304``: the HTTP/2 header blocks of the two heads, encoded by the build
    (orisha/protocols/hpack_blocks.py; empty in builds made before it emitted them);
    ``h3``/``h3_304``: their HTTP/3 QPACK field sections (orisha/protocols/qpack_blocks.py)."""

    __slots__ = ("coding", "bit", "etag", "head", "head_304", "fields", "body", "length",
                 "h2", "h2_304", "h3", "h3_304")

    def __init__(self, coding: bytes, etag: bytes, fields: bytes, fields_304: bytes,
                 body, status: bytes = b"200 OK", h2: bytes = b"", h2_304: bytes = b"",
                 h3: bytes = b"", h3_304: bytes = b"") -> None:
        self.h2, self.h2_304 = h2, h2_304
        self.h3, self.h3_304 = h3, h3_304
        self.coding = coding
        self.bit = CODING_BITS.get(coding, 0)  # dcz: 0, never a table slot
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
    """A routable document: its variants, validators and negotiation table.

    ``deltas``: its dcz variants (RFC 9842 §4) by the exact Available-Dictionary value that
    selects each (``:base64 of the dictionary's SHA-256:``); empty for most documents."""

    __slots__ = ("variants", "choice", "identity", "last_modified", "conditional", "head_416",
                 "status", "multi_fields", "part_type", "deltas")

    def __init__(self, variants: tuple[Variant, ...], last_modified: int,
                 conditional: bool = True, deltas: dict | None = None) -> None:
        self.deltas = deltas or {}
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
        # A multipart/byteranges 206 (RFC 9110 §14.6): the identity fields with the
        # document's Content-Type moved into every part, whose head starts with it.
        fields = self.identity.fields
        at = fields.find(b"Content-Type: ")
        end = fields.find(b"\r\n", at) + 2
        if conditional and at >= 0:
            self.multi_fields = fields[:at] + fields[end:]
            self.part_type = fields[at:end] + b"Content-Range: bytes "
        else:
            self.multi_fields = self.part_type = b""


# Redirect statuses a rule may give (RFC 9110 §15.4). Their heads are formatted here, at
# build time or once per run-time rule match, so the core needs no reason table for them.
REDIRECTS = {301: b"Moved Permanently", 302: b"Found", 303: b"See Other",
             307: b"Temporary Redirect", 308: b"Permanent Redirect"}
_PERMANENT = (301, 308)


class Redirect:
    """A redirect: ``/dir`` → ``/dir/`` (301), or a ``_redirects`` rule's (301-308).

    Its head is ``location`` + (``?query`` when ``query`` is true and the
    request has one) + ``tail``: the layout the unikernel image carries.
    Permanent redirects may be cached for an hour; temporary ones are revalidated.
    """

    __slots__ = ("location", "tail", "status", "query")

    def __init__(self, location: bytes, status: int = 301, query: bool = True) -> None:
        self.location = b"HTTP/1.1 %d %s\r\nLocation: %s" % (status, REDIRECTS[status], location)
        cc = b"public, max-age=3600" if status in _PERMANENT else b"no-cache"
        self.tail = b"\r\nContent-Length: 0\r\nCache-Control: " + cc + b"\r\n"
        self.status = status
        self.query = query


class Rule:
    """A ``_redirects`` rule matched at run time (it has a splat, a placeholder or a
    query condition), consulted only when the route table has no answer.

    ``pattern``: a regular expression over the decoded path whose named groups are
    the placeholders (``splat`` for ``*``); ``query``: ``(key, name, literal)`` per
    condition — the raw query parameter ``key`` must be present, equal ``literal``
    when that is not None, and binds ``name`` when that is not None; ``to``: the
    destination as pieces, bytes literals and placeholder names (str); ``status``:
    a redirect status, 200 (rewrite: the destination's route) or 404 (the
    destination document with status 404, from ``entries`` by destination key).
    """

    __slots__ = ("pattern", "query", "to", "status", "query_append", "entries")

    def __init__(self, pattern: bytes, query: tuple, to: tuple, status: int,
                 query_append: bool = True, entries: dict | None = None) -> None:
        self.pattern = re.compile(pattern, re.S)
        self.query = query
        self.to = to
        self.status = status
        self.query_append = query_append
        self.entries = entries or {}


class Rules:
    """A route whose answer depends on the query (rules with query conditions match its
    path): ``rules`` are tried in order, else ``default`` (None: the not-found answer)."""

    __slots__ = ("rules", "default")

    def __init__(self, rules: tuple, default) -> None:
        self.rules = rules
        self.default = default


class Auth:
    """One ``--basic-auth`` area (RFC 7617): its realm, users and bcrypt hashes, the 401
    answered without valid credentials (formatted once, here), and the Authorization
    values this worker has judged, most recent last (policy.AUTH_REMEMBERED of them)."""

    __slots__ = ("realm", "users", "head_401", "body_401", "judged")

    def __init__(self, realm: str, users: dict[bytes, bytes]) -> None:
        self.realm = realm
        self.users = users
        self.head_401, self.body_401 = unauthorized(realm)
        self.judged: dict[bytes, bool] = {}

    def allows(self, value: bytes | None) -> bool | None:
        """Whether an Authorization field value names a user with its password. bcrypt
        runs once per value (a hit is moved to the end: least recently used goes first),
        at most ``AUTH_CHECKS`` times per second in this worker: None when the value would
        need one more this second (not remembered: judged when asked again later)."""
        if not value:
            return False
        judged = self.judged
        ok = judged.pop(value, None)
        if ok is None:
            ok = self._verify(value)
            if ok is None:
                return None
            if len(judged) >= AUTH_REMEMBERED:
                del judged[next(iter(judged))]
        judged[value] = ok
        return ok

    def _verify(self, value: bytes) -> bool | None:
        scheme, _, token = value.partition(b" ")
        if scheme.lower() != b"basic":  # RFC 7235 §2.1: the scheme is case-insensitive
            return False
        try:
            user, sep, password = binascii.a2b_base64(token.strip(), strict_mode=True).partition(b":")
        except binascii.Error:  # not base64: no credentials
            return False
        hashed = self.users.get(user) if sep else None
        if hashed is None:
            return False
        if CHECKS[0] <= 0:  # this second's bcrypt budget is spent
            return None
        CHECKS[0] -= 1
        import bcrypt  # only a worker that serves a protected path loads it
        # bcrypt reads 72 bytes of a password (htpasswd -B hashed no more); bcrypt>=5
        # refuses longer ones instead of cutting them.
        return bcrypt.checkpw(password[:72], hashed)


# The bcrypt checks this worker may still run this second (policy.AUTH_CHECKS), for every
# area and site of the worker; ``refill_checks`` runs from ``App.tick``, once a second.
CHECKS = [AUTH_CHECKS]


def refill_checks() -> None:
    CHECKS[0] = AUTH_CHECKS


class Guarded:
    """A route behind Basic auth: ``auth`` decides, then ``target`` answers."""

    __slots__ = ("auth", "target")

    def __init__(self, auth: Auth, target) -> None:
        self.auth = auth
        self.target = target


class Site:
    """The route table, the run-time rules and the documents for unknown paths.

    ``boundary``: the multipart/byteranges boundary of this build (RFC 9110 §14.6).
    ``assets``: with a fallback, the file extensions (lower case, no dot) of the non-HTML
    types the site serves: an unknown path ending in one is a missing asset, answered
    not-found rather than with the fallback (connection.unknown); None (``--fallback-all``,
    or a build made before) gives the fallback to every unknown path.
    ``auth``: (path pattern, ``Auth``) of each ``--basic-auth`` area, first match wins,
    for paths the route table does not have (its own routes are ``Guarded``).
    """

    __slots__ = ("routes", "not_found", "fallback", "summary", "loop", "rules", "boundary",
                 "assets", "auth")

    def __init__(self, routes: dict, not_found: Entry, fallback: Entry | None,
                 summary: str, loop: str, rules: tuple = (),
                 boundary: bytes = b"orisha-byteranges",
                 assets: frozenset[bytes] | None = None, auth: tuple = ()) -> None:
        self.auth = tuple((re.compile(pattern, re.S), a) for pattern, a in auth)
        self.routes = routes
        self.not_found = not_found
        self.fallback = fallback
        self.summary = summary
        self.loop = loop
        self.rules = rules
        self.boundary = boundary
        self.assets = assets
