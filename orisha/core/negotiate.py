"""Header interpretation: Accept-Encoding, validators, ranges and the path.

Strategy: each function reads one request header and answers a small value
the connection uses to pick a precomputed response. Nothing here formats a
response.
"""

from __future__ import annotations

import re

from .request import decimal
from .site import CODING_BITS, IDENTITY

# Accept-Encoding values repeat across requests (every browser sends one of a
# handful), so parsed masks are cached; the cache is bounded so hostile
# clients cannot grow it.
_mask_cache: dict[bytes, int] = {}
_MASK_CACHE_MAX = 512


# RFC 9110 §12.4.2: qvalue = ( "0" [ "." 0*3DIGIT ] ) / ( "1" [ "." 0*3("0") ] ).
_QVALUE = re.compile(rb"0(?:\.[0-9]{0,3})?|1(?:\.0{0,3})?")
# The tokens that name a coding: its own name, and x-gzip (RFC 9110 §8.4.1.3).
CODING_TOKENS = {**CODING_BITS, b"x-gzip": CODING_BITS[b"gzip"]}


def _weight(params: list[bytes]) -> int | None:
    """A member's weight in thousandths (1000 without one); None if a weight is malformed.

    weight = OWS ";" OWS "q=" qvalue: no space around "=" (OWS after the value
    belongs to the list). A member with an invalid weight is ignored.
    """
    q = 1000
    for p in params:
        name, _, value = p.partition(b"=")
        if name.strip().lower() == b"q":
            value = value.rstrip(b" \t")
            if name[-1:] not in (b"q", b"Q") or not _QVALUE.fullmatch(value):
                return None
            whole, _, frac = value.partition(b".")
            q = (whole == b"1") * 1000 + int(frac.ljust(3, b"0"))
    return q


def accept_encoding_mask(value: bytes | None) -> int:
    """Bit mask of acceptable codings (RFC 9110 §12.5.3).

    No header means the client did not ask for a coding: it gets identity
    (sending gzip to a client that never asked is the bug this project must not
    have). ``*`` stands for every coding not named; identity stays acceptable
    unless excluded by ``identity;q=0`` or ``*;q=0`` without an ``identity`` member.
    A result of 0 means nothing is acceptable (answered with 406).
    """
    if value is None:
        return IDENTITY
    mask = _mask_cache.get(value)
    if mask is not None:
        return mask
    named: dict[int, bool] = {}
    star: bool | None = None
    for member in value.split(b","):
        token, *params = member.split(b";")
        token = token.strip().lower()
        if not token:
            continue
        q = _weight(params)
        if q is None:
            continue
        if token == b"*":
            star = q > 0
        elif token in CODING_TOKENS:
            named[CODING_TOKENS[token]] = q > 0
    mask = 0
    for bit in (1, 2, 4, 8):
        ok = named.get(bit)
        if ok is None:
            ok = star if star is not None else bit == IDENTITY
        if ok:
            mask |= bit
    if len(_mask_cache) >= _MASK_CACHE_MAX:
        _mask_cache.clear()
    _mask_cache[value] = mask
    return mask


_dcz_cache: dict[bytes, bool] = {}


def accepts_dcz(value: bytes | None) -> bool:
    """Does Accept-Encoding name ``dcz`` with a weight above 0 (RFC 9842 §4)? A ``*`` does
    not count: a delta goes only to a client that says it decodes dictionary transport."""
    if not value:
        return False
    ok = _dcz_cache.get(value)
    if ok is None:
        ok = False
        for member in value.split(b","):
            token, *params = member.split(b";")
            if token.strip().lower() == b"dcz":
                q = _weight(params)
                if q is not None:  # a member with an invalid weight is ignored (as above)
                    ok = q > 0
        if len(_dcz_cache) >= _MASK_CACHE_MAX:
            _dcz_cache.clear()
        _dcz_cache[value] = ok
    return ok


def _opaque(tag: bytes) -> bytes:
    return tag[2:] if tag.startswith(b"W/") else tag


def none_match(value: bytes, etag: bytes) -> bool:
    """If-None-Match with weak comparison (RFC 9110 §13.1.2): True when the tag matches."""
    if value == etag:
        return True
    value = value.strip()
    if value == b"*":
        return True
    return any(_opaque(t.strip()) == etag for t in value.split(b","))


# RFC 9110 §14.1.1: ranges-specifier = range-unit "=" range-set, and one
# int-range (first-pos "-" [ last-pos ]) or suffix-range ("-" suffix-length) with
# positions 1*DIGIT: no whitespace inside. Several ranges are served whole (below).
_RANGE = re.compile(rb"bytes=([0-9]*)-([0-9]*)")
# Positions saturate here: far beyond any body an image or a build can hold, so a
# saturated position compares with a length as the exact number would.
RANGE_MAX = 1 << 60


def _magnitude(digits: bytes) -> tuple[int, bytes]:
    """A key that orders digit strings of any length as numbers."""
    digits = digits.lstrip(b"0")
    return len(digits), digits


def byte_range(value: bytes, length: int) -> tuple[int, int] | None | bool:
    """One satisfiable range as (first, last); False if unsatisfiable; None to ignore.

    None (serve the whole 200) for anything but a single well-formed byte range:
    other units, syntax errors and multiple ranges (RFC 9110 §14.2 lets a server
    ignore Range, and answering several ranges with the full body is allowed).
    """
    m = _RANGE.fullmatch(value)
    if m is None:
        return None
    first, last = m.group(1), m.group(2)
    if first:
        start = decimal(first, RANGE_MAX)
        if last:
            if _magnitude(last) < _magnitude(first):
                return None  # invalid range-spec: ignore the header
            end = min(decimal(last, RANGE_MAX), length - 1)
        else:
            end = length - 1
        if start >= length:
            return False
        return start, end
    if not last:
        return None
    suffix = decimal(last, RANGE_MAX)
    if suffix == 0 or length == 0:
        return False
    return max(0, length - suffix), length - 1


_BAD_PERCENT = re.compile(rb"%(?![0-9A-Fa-f]{2})")


def route_key(path: bytes) -> bytes | None:
    """The route-table key for a request path, or None if the path is malformed.

    Percent-decoding (UTF-8 bytes stay bytes), then RFC 3986 §5.2.4 dot-segment
    removal and merged slashes, so no spelling of a path can reach outside the
    root. The trailing slash is significant: ``/dir`` and ``/dir/`` route apart.
    """
    if b"%" in path:
        if _BAD_PERCENT.search(path):
            return None
        parts = path.split(b"%")
        path = parts[0] + b"".join(bytes.fromhex(p[:2].decode()) + p[2:] for p in parts[1:])
        if b"\x00" in path:
            return None
    if b"/." not in path and b"//" not in path:
        return path
    out: list[bytes] = []
    segments = path.split(b"/")
    for seg in segments[1:]:
        if seg == b"..":
            if out:
                out.pop()
        elif seg != b"." and seg != b"":
            out.append(seg)
    trailing = segments[-1] in (b"", b".", b"..") and len(segments) > 1
    key = b"/" + b"/".join(out)
    if trailing and out:
        key += b"/"
    return key
