"""orisha/protocols/fields.py: the request-field rules HTTP/2 and HTTP/3 share, against the
RFC's own wording as regular expressions (RFC 9113 §8.2.1, RFC 9114 §4.2), field by field."""

from __future__ import annotations

import re

from hypothesis import example, given, strategies as st

from orisha.protocols.fields import declared_length, invalid, synthetic_head

# A regular field's name: no byte of \x00-\x20, A-Z, \x7f-\xff, and no colon (a name that
# starts with one is a pseudo-header); its value: no NUL, CR or LF, no space or tab at either
# end. Empty names are refused by synthetic_head before this check.
_BAD_NAME = re.compile(rb"[\x00-\x20A-Z:\x7f-\xff]")
_BAD_VALUE = re.compile(rb"[\x00\r\n]|\A[ \t]|[ \t]\Z")
_BYTES = st.binary(min_size=1, max_size=6) | st.sampled_from(
    [b"accept", b"x-a", b"Accept", b"a:b", b"a b", b"\xff", b"a\0", b" v", b"v\t", b"v v", b""])


@given(st.lists(st.tuples(_BYTES, _BYTES), min_size=1, max_size=4))
@example([(b"a", b"x\0y")])
@example([(b"a\0b", b"x")])
@example([(b"a", b"ok"), (b"b", b" lead")])
def test_invalid_is_the_rfcs_rule_for_every_field(pairs):
    names = [n for n, _ in pairs if n and n[:1] != b":"]
    values = [v for n, v in pairs if n and n[:1] != b":"]
    want = any(_BAD_NAME.search(n) or _BAD_VALUE.search(v) for n, v in zip(names, values))
    assert invalid(names, values) == bool(want)


def test_the_synthetic_head_of_a_request_and_of_malformed_ones():
    base = [(b":method", b"GET"), (b":scheme", b"https"), (b":authority", b"example.org"),
            (b":path", b"/a?b")]
    head, line = synthetic_head(base + [(b"accept", b"*/*"), (b"cookie", b"a=1"),
                                        (b"cookie", b"b=2")])
    assert head == (b"GET /a?b HTTP/1.1\r\nhost: example.org\r\naccept: */*\r\n"
                    b"cookie: a=1; b=2")
    assert line == b"GET /a?b HTTP/2.0"
    for bad in ([(b"accept", b"x"), (b":path", b"/")],  # a pseudo-header after a field
                [(b"connection", b"close")], [(b"te", b"gzip")], [(b"Accept", b"x")],
                [(b"accept", b" x")], [(b"", b"x")], [(b":status", b"200")]):
        assert synthetic_head(base + bad) == (None, b""), bad
    assert synthetic_head(base + [(b"te", b"trailers")])[0] is not None


def test_declared_length_takes_digits_only():
    head = b"POST / HTTP/1.1\r\nhost: a\r\ncontent-length: "
    assert declared_length(head + b"7") == 7
    for value in (b"1_0", b" 7 ", b"+7", b"0x7", b"", b"9" * 19):
        assert declared_length(head + value) == -1, value
    assert declared_length(head + b"7\r\ncontent-length: 7") == 7
    assert declared_length(head + b"7\r\ncontent-length: 8") == -1
    assert declared_length(b"GET / HTTP/1.1\r\nhost: a") == -1 and declared_length(None) == -1
