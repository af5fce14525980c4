"""Parsing one HTTP/1.x request head (RFC 9112) into the few facts we need.

Strategy: the connection finds where a head ends; ``parse_head`` checks the
request line and every field line strictly and returns a ``Request`` with the
handful of fields a static server acts on. Anything malformed raises
``HttpError`` with the status the core answers before closing. Policy
(RFC 9112 §2.2, §5): a bare LF ends a line (recipients MAY accept it); a bare
CR, obs-fold, whitespace before the colon, NUL and other control bytes are 400.
"""

from __future__ import annotations

import re

from .policy import SAFE_METHODS


def decimal(text: bytes, cap: int) -> int | None:
    """``1*DIGIT`` (ASCII digits only, RFC 5234) as a number, saturated at ``cap``; else None.

    Never ``int()`` on header bytes: it would accept a sign, "1_0" and spaces, and
    raise beyond 4300 digits. The C core has the same function (``decimal``).
    """
    if not text.isdigit():  # bytes.isdigit(): ASCII 0-9 only, and not empty
        return None
    digits = text.lstrip(b"0")
    if len(digits) > len(str(cap)):
        return cap
    return min(int(digits or b"0"), cap)


class HttpError(Exception):
    """A request the core refuses; ``status`` is the response it deserves."""

    def __init__(self, status: int, reason: str = "") -> None:
        super().__init__(status, reason)
        self.status = status
        self.reason = reason


# RFC 9110 §5.6.2 tchar, the bytes of a method and a field name (the C core's
# table is generated from this).
TCHARS = b"!#$%&'*+-.^_`|~0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"
_T = b"[" + re.escape(TCHARS) + b"]"
_TOKEN = re.compile(_T + b"+")
_METHOD_START = re.compile(_T + b"*")
_FIELD = re.compile(b"(" + _T + rb"+):[ \t]*((?:[^\x00-\x08\x0a-\x1f\x7f]*[^\x00-\x20\x7f])?)[ \t]*")
_VERSION = re.compile(rb"HTTP/(\d)\.(\d)")
_TARGET_BAD = re.compile(rb"[\x00-\x20\x7f]")
_ABSOLUTE = re.compile(rb"[Hh][Tt][Tt][Pp][Ss]?://[^/?#]*")

# Fields the core reads; the rest are validated and dropped. A single field keeps
# one value (a repeat makes it invalid, or 400 for Host and differing lengths); a
# list field's lines are joined with ", " (RFC 9110 §5.3). The C core gets both
# tuples, in this order, from its generated header.
SINGLE_FIELDS = (b"host", b"content-length", b"if-modified-since", b"range", b"if-range",
                 b"sec-fetch-dest", b"authorization",
                 # RFC 9842 §2.2, §2.3 (compression dictionaries: connection._delta)
                 b"available-dictionary", b"dictionary-id")
LIST_FIELDS = (b"connection", b"transfer-encoding", b"accept-encoding", b"if-none-match")
_SINGLE = frozenset(SINGLE_FIELDS)
_LIST = frozenset(LIST_FIELDS)


class Request:
    __slots__ = ("method", "path", "query", "minor", "fields")

    def __init__(self, method: bytes, path: bytes, query: bytes | None, minor: int,
                 fields: dict[bytes, bytes]) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.minor = minor
        self.fields = fields


def cannot_begin(buf: bytes, end: int) -> bool:
    """Whether ``buf[:end]``, a head without its end yet, can only be answered 400.

    So it is when its method (the bytes before the first SP) is empty or holds a
    byte that is not a tchar: a TLS ClientHello, NUL, binary junk. ``parse_head``
    checks the method first, so the complete head would get the same 400; waiting
    for a line end (or the head timeout) would only keep the connection open.
    """
    n = _METHOD_START.match(buf, 0, end).end()
    return n < len(buf) and n < end and (n == 0 or buf[n] != 32)


def _lines(head: bytes) -> list[bytes]:
    if head.count(b"\r\n") == head.count(b"\n") == head.count(b"\r"):
        return head.split(b"\r\n")
    lines = []
    for line in head.split(b"\n"):
        if line.endswith(b"\r"):
            line = line[:-1]
        if b"\r" in line:
            raise HttpError(400, "bare CR")
        lines.append(line)
    return lines


def _origin(target: bytes, end: int, fields: dict) -> bytes:
    """An absolute-form target's path; its authority replaces Host (RFC 9112 §3.2.2: it is
    what names the site when a server has several)."""
    fields[b"host"] = target[:end].partition(b"//")[2].rpartition(b"@")[2]
    target = target[end:] or b"/"
    return target if target[0] == 47 else b"/" + target


def parse_head(head: bytes, max_target: int) -> Request:
    """Parse a complete head (without its final empty line)."""
    lines = _lines(head)
    parts = lines[0].split(b" ")
    if len(parts) != 3:
        if len(parts) == 2 and _TOKEN.fullmatch(parts[0]):
            raise HttpError(400, "HTTP/0.9 request or missing version")
        raise HttpError(400, "malformed request line")
    method, target, version = parts
    if not _TOKEN.fullmatch(method):  # first, so that cannot_begin can judge it early
        raise HttpError(400, "malformed method")
    v = _VERSION.fullmatch(version)
    if v is None:
        raise HttpError(400, "malformed HTTP version")
    if v.group(1) != b"1":
        raise HttpError(505)
    if len(target) > max_target:
        raise HttpError(414)
    if not target or _TARGET_BAD.search(target):
        raise HttpError(400, "malformed target")

    fields: dict[bytes, bytes] = {}
    for line in lines[1:]:
        m = _FIELD.fullmatch(line)
        if m is None:
            # obs-fold (a line starting with SP/HT), space before the colon, control bytes.
            raise HttpError(400, "malformed field line")
        name = m.group(1).lower()
        if name in _SINGLE:
            old = fields.get(name)
            if old is None:
                fields[name] = m.group(2)
            elif name == b"content-length" and old == m.group(2):
                pass  # identical repeats are one value (RFC 9110 §8.6)
            elif name in (b"host", b"content-length"):
                raise HttpError(400, "duplicate " + name.decode())
            else:
                fields[name] = b""  # a repeated singleton field is invalid: treated as absent below
        elif name in _LIST:
            old = fields.get(name)
            fields[name] = m.group(2) if old is None else old + b", " + m.group(2)

    minor = int(v.group(2))
    if minor >= 1 and b"host" not in fields:
        raise HttpError(400, "missing Host")  # RFC 9112 §3.2

    if target[0] != 47:  # not origin-form
        a = _ABSOLUTE.match(target)
        if a is not None:
            target = _origin(target, a.end(), fields)
        elif method in SAFE_METHODS:
            # authority-form is for CONNECT and asterisk-form for OPTIONS, both 405 below.
            raise HttpError(400, "malformed target")
        else:
            target = b"/"
    path, sep, query = target.partition(b"?")
    path = path.partition(b"#")[0]
    return Request(method, path, query if sep else None, minor, fields)
