"""A request's fields, once for HTTP/2 and HTTP/3: what makes them malformed, the HTTP/1.1
head the core answers, its Content-Length, and the two per-answer pieces both send.

Strategy: HTTP/2 (RFC 9113 §8.2, §8.3) and HTTP/3 (RFC 9114 §4.2, §4.3) read a request's
fields by the same rules, so each rule is written here once and both frame layers call it:
``synthetic_head`` turns the decoded fields into the head ``answer()`` takes (or None for a
malformed request), ``declared_length`` reads that head's Content-Length by RFC 9110's
grammar (digits only: ``int`` would also take ``1_0``, ``+7`` and `` 7 ``), ``invalid`` checks
names and values with byte operations over all of them at once (a third of a per-field
regular expression's cost). ``CONNECTION_FIELDS`` is also what the build leaves out of the
HPACK and QPACK sections it precomputes. Nothing here knows about frames or streams.
"""

from __future__ import annotations

import re

from ..core.connection import ERRORS, Close, Plan, Tail
from ..core.dates import format_http_date
from ..core.policy import CONNECT, SAFE_METHODS

# RFC 9113 §8.2.2, RFC 9114 §4.2: fields that are connection-specific in HTTP/1.1 are never
# sent, and make a request that carries them malformed.
CONNECTION_FIELDS = frozenset((b"connection", b"keep-alive", b"proxy-connection",
                               b"transfer-encoding", b"upgrade"))

# RFC 9113 §8.2.1, RFC 9114 §4.2, over every name (or value) of a request joined by NULs: a
# NUL is never valid in either, so the joins keep the fields apart (their count is checked).
# Names: none of \x01-\x20, A-Z, \x7f-\xff (what deleting every other byte leaves), and a
# colon only where a name starts. Values: no CR or LF, no space or tab at either end.
_NAME_OK = bytes(b for b in range(256) if not (0x01 <= b <= 0x20 or 0x41 <= b <= 0x5A or b >= 0x7F))
_EDGE = (b" ", b"\t")
_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length: ([^\r]*)")


def bad_names(names: bytes) -> bool:
    """Whether NUL-joined ``names`` hold a byte no name may have, or a colon past a start."""
    return bool(names.translate(None, _NAME_OK)) \
        or names.count(b":") != names.count(b"\0:") + (names[:1] == b":")


def bad_values(v: bytes) -> bool:
    """Whether NUL-joined values hold a CR or LF, or one starts or ends with a space or tab."""
    return (b"\r" in v or b"\n" in v or b"\0 " in v or b"\0\t" in v or b" \0" in v
            or b"\t\0" in v or v[:1] in _EDGE or v[-1:] in _EDGE)


def invalid(names: list, values: list) -> bool:
    """Whether any of these names or values is not allowed (a NUL in one is caught by the
    count of the joins' NULs)."""
    if not names:
        return False
    joined, vals = b"\0".join(names), b"\0".join(values)
    n = len(names) - 1
    return bad_names(joined) or bad_values(vals) or joined.count(0) != n or vals.count(0) != n


def synthetic_head(fields) -> tuple[bytes | None, bytes]:
    """(the HTTP/1.1 head ``answer()`` takes, the access-log request line), or (None, b"")
    for a malformed request (RFC 9113 §8.2, §8.3; RFC 9114 §4.2, §4.3)."""
    method = path = scheme = authority = host = None
    lines = [b""]
    cookies, names, values = [], [], []
    for name, value in fields:
        if name[:1] == b":":
            if names:
                return None, b""  # a pseudo-header after a regular field
            if name == b":method" and method is None:
                method = value
            elif name == b":path" and path is None:
                path = value
            elif name == b":scheme" and scheme is None:
                scheme = value
            elif name == b":authority" and authority is None:
                authority = value
            else:
                return None, b""  # unknown, repeated or a response pseudo-header
            continue
        if not name or name in CONNECTION_FIELDS or (name == b"te" and value != b"trailers"):
            return None, b""  # RFC 9113 §8.2.2
        names.append(name)
        values.append(value)
        if name == b"cookie":
            cookies.append(value)  # §8.2.3: crumbs are joined again for HTTP/1.1
        elif name == b"host":
            host = value
        else:
            lines.append(name + b": " + value)
    if method is None or invalid(names, values):
        return None, b""
    if method == CONNECT:
        if path is not None or scheme is not None or authority is None:
            return None, b""  # §8.5
        path = authority
    elif not path or scheme is None:
        return None, b""
    if cookies:
        lines.append(b"cookie: " + b"; ".join(cookies))
    lines[0] = b"%s %s HTTP/1.1\r\nhost: %s" % (method, path, authority if authority is not None
                                                  else host or b"")
    return b"\r\n".join(lines), b"%s %s HTTP/2.0" % (method, path)


# HTTP/3's bounds (compiled_h3). Request streams a client may have open at once
# (MAX_STREAMS, RFC 9000 §4.6): a page's requests in one flight; credit returns as streams end.
H3_MAX_STREAMS = 100
# A stream's receive window past what was read: requests are a field section (the head
# limit, 8 KiB by default, bounds a useful one) and, for the methods that carry one, a body
# that is answered without being read. 16 KiB is room for either, and with at most
# H3_MAX_STREAMS request streams open it bounds what a connection makes a worker hold.
H3_WINDOW = 16 * 1024
# Seconds a handshake may take at most (ngtcp2's handshake timeout; until then the idle
# timeout, counted from the last datagram heard, also ends it). A client's probes back off
# from a 1 s timeout (RFC 9002 §6.2.1): at 1, 3, 7, 15, 31 and 63 s, and while its address is
# not validated the server is held to 3x what the client sent (RFC 9000 §8.1), which its
# first flight may use up: then only those probes bring the handshake on. 64 s outlasts
# every probe but the one at 63 s.
H3_HANDSHAKE_HOLD = 64.0
H3_RETRY_LIFETIME = 30.0  # s a Retry's token is taken back (RFC 9000 §8.1.4: clients return it
                          # at once; a captured one is worth a 3x amplification from its address)
RETRY_ABOVE = 64          # handshakes in progress beyond which new clients get a Retry
FRAME_HEADS = 4           # a frame held whole (HEADERS, SETTINGS) over this many head limits:
                          # H3_EXCESSIVE_LOAD (RFC 9114 §7.1)
_PSEUDO = frozenset((b":method", b":scheme", b":authority", b":path", b":protocol"))
_NEEDED = frozenset((b":method", b":authority"))


def request_fields_error(headers) -> str | None:
    """Why an HTTP/3 request's fields make it malformed (RFC 9114 §4.1.2, §4.2, §4.3), or
    None: aioquic's verdicts (a test compares them), with its per-byte loops over every
    name and value replaced by byte operations over all of them at once."""
    after = False
    seen = set()
    if invalid([k for k, _ in headers], [v for _, v in headers]):
        return "A field name or value has invalid characters"
    for key, value in headers:
        if key[:1] == b":":
            if after or key not in _PSEUDO or key in seen:
                return f"Pseudo-header {key!r} is out of place, unknown or twice"
            seen.add(key)
            continue
        after = True
        if key == b"te":
            if value.lower() != b"trailers":
                return f"Header {key!r} value is not trailers"
        elif key in CONNECTION_FIELDS:
            return f"Header {key!r} is connection-specific"
    if not _NEEDED <= seen:
        return f"Pseudo-headers {sorted(_NEEDED - seen)} are missing"
    return None


def refused_early(head: bytes) -> bool:
    """Whether a request that came as 0-RTT early data gets 425 Too Early: any method but
    GET and HEAD (RFC 8470 §5.2; a replay of those changes nothing on a static site)."""
    return head[:head.find(b" ")] not in SAFE_METHODS


def declared_length(head: bytes | None) -> int:
    """The content-length of a synthetic head, or -1 when it has none the DATA can be held
    to (absent, repeated with different values, not digits: the core answers those 400)."""
    # find(), not ``in``: bytes.__contains__ first tries its argument as an int, and the
    # TypeError it makes and drops (message formatted) cost ~6% of an h2 request (perf).
    if head is None or head.find(b"\r\ncontent-length: ") < 0:
        return -1
    found = set(_CONTENT_LENGTH.findall(head))
    value = found.pop() if len(found) == 1 else b""
    return int(value) if value.isdigit() and len(value) <= 18 else -1


def error_plan(status: int) -> Plan:
    """The core's error answer for ``status``, the connection kept."""
    head, body = ERRORS[status]
    return Plan(head, Tail.KEEP_ALIVE, body, Close.NO, 0, status)


class PerSecond:
    """The one per-second part of an answer's fields: the Date field, encoded by ``encode``
    (HPACK's or QPACK's literal) once a second. ``second`` and ``field`` are read directly
    on the hot path; calling it brings them up to ``now``."""
    __slots__ = ("encode", "second", "field")

    def __init__(self, encode) -> None:
        self.encode, self.second, self.field = encode, -1, b""

    def __call__(self, now: float) -> bytes:
        second = int(now)
        if second != self.second:
            self.second, self.field = second, self.encode(format_http_date(second))
        return self.field
