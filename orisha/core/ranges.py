"""Several byte ranges in one request: parsing the set and framing the multipart 206.

Strategy: ``range_set`` reads a Range header that lists more than one
range-spec (a single range stays with ``negotiate.byte_range``) with the RFC
9110 §14.1.1 grammar, strictly — ``bytes`` (any case) directly followed by
``=``, ASCII digits only, no whitespace inside a range-spec, optional
whitespace and empty elements only around the commas of the list (§5.6.1).
It answers the ranges to send, sorted and coalesced, or says to send the whole
200 (RFC 9110 §14.2 lets a server ignore Range) or a 416. ``multipart``
frames the chosen ranges as ``multipart/byteranges`` (§14.6, §15.3.7.2) around
strings the build prepared: the boundary of the build (``Site.boundary``) and
the entry's fields and part prefix (``Entry.multi_fields``, ``Entry.part_type``).

Abuse bounds, as nginx and Apache have them: ranges that overlap, touch or lie
closer than ``GAP`` bytes are merged (§14.6 allows it: a smaller gap costs
less than another part's head); when the ranges asked for add up to more than
the document (overlap abuse), or more than ``MAX_PARTS`` parts remain, or the
parts would exceed ``MAX_BYTES`` (the core copies them into one body), the
whole 200 is sent instead.
"""

from __future__ import annotations

import re

# The rule's numbers, named once: the C core gets them from its generated header
# (orisha/targets/unikernel/policy_header.py).
GAP = 80                 # bytes: about the head of one more part
MAX_PARTS = 16
MAX_BYTES = 1 << 20      # a multipart body is assembled by copying: bound it per response
DIGITS = 18              # a position of more digits (leading zeros aside) counts as BIG
BIG = 1 << 62            # stands for any number longer than DIGITS digits

_UNIT = re.compile(rb"[Bb][Yy][Tt][Ee][Ss]=")
_SPEC = re.compile(rb"([0-9]*)-([0-9]*)")


def _num(digits: bytes) -> int:
    digits = digits.lstrip(b"0") or b"0"
    return BIG if len(digits) > DIGITS else int(digits)


def range_set(value: bytes, length: int) -> list[tuple[int, int]] | None | bool:
    """The ranges of a multi-range header as sorted, merged ``(first, last)`` pairs;
    False when none is satisfiable (416); None to ignore the header (send the 200)."""
    if not _UNIT.match(value) or value[6:7] in (b" ", b"\t"):
        return None  # OWS may stand around the commas only
    wanted: list[tuple[int, int]] = []
    asked = 0
    for element in value[6:].split(b","):
        element = element.strip(b" \t")
        if not element:  # RFC 9110 §5.6.1: empty list elements are allowed and ignored
            continue
        m = _SPEC.fullmatch(element)
        if m is None:
            return None
        first, last = m.group(1), m.group(2)
        if first:
            start = _num(first)
            end = _num(last) if last else BIG
            if end < start:
                return None  # an invalid range-spec makes the header invalid (§14.1.1)
            if start >= length:
                continue     # unsatisfiable: dropped, the others may still be served
            end = min(end, length - 1)
        elif last:
            suffix = _num(last)
            if suffix == 0 or length == 0:
                continue
            start, end = max(0, length - suffix), length - 1
        else:
            return None      # "-" alone
        wanted.append((start, end))
        asked += end - start + 1
    if not wanted:
        return False
    if asked > length:
        return None          # overlapping abuse (nginx's rule): the whole document instead
    wanted.sort()
    merged = [wanted[0]]
    for start, end in wanted[1:]:
        top = merged[-1]
        if start <= top[1] + 1 + GAP:
            if end > top[1]:
                merged[-1] = (top[0], end)
        else:
            merged.append((start, end))
    if len(merged) > MAX_PARTS or sum(e - s + 1 for s, e in merged) > MAX_BYTES:
        return None
    return merged


def multipart(body, ranges: list[tuple[int, int]], length: int, boundary: bytes,
              part_type: bytes) -> bytes:
    """The multipart/byteranges payload (RFC 9110 §14.6) for two or more ranges.

    Each part: ``--BOUNDARY CRLF`` (after a CRLF from the second part on),
    ``part_type`` (``Content-Type: …CRLF Content-Range: bytes ``), ``FIRST-LAST/LENGTH``,
    an empty line, the bytes; the payload ends ``CRLF --BOUNDARY-- CRLF``.
    """
    out = []
    sep = b"--" + boundary + b"\r\n"
    for first, last in ranges:
        out.append(sep)
        out.append(part_type + b"%d-%d/%d\r\n\r\n" % (first, last, length))
        out.append(bytes(body[first:last + 1]))
        sep = b"\r\n--" + boundary + b"\r\n"
    out.append(b"\r\n--" + boundary + b"--\r\n")
    return b"".join(out)
