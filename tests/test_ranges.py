"""Several ranges in one request (RFC 9110 §14.6, §15.3.7.2) and the heads of error pages.

Multi-range requests get ``206 multipart/byteranges`` from the Python core on
every hosted loop, the container and the booted unikernel (its C core streams
the parts: tests/test_unikernel.py compares its bytes with the Python core's);
each part is parsed by its Content-Range (not by searching for the boundary)
and compared with the file. Error pages are checked field by field on every target.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from conftest import DEMO, Server, demo_file, orisha
from httpraw import Conn, exchange, split_responses

BIG = "/files/big.txt"
CTYPE = "text/plain; charset=utf-8"


@pytest.fixture(scope="module")
def big():
    return demo_file("files/big.txt")


@pytest.fixture
def multipart_target(loop):
    """Every target answers several ranges (the unikernel's C core too, since issue 13)."""
    return loop


def get(port, path=BIG, method="GET", **headers):
    c = Conn(port)
    try:
        return c.request(path, method, headers={k.replace("_", "-"): v for k, v in headers.items()})
    finally:
        c.close()


def parse_multipart(body: bytes, content_type: str, length: int) -> list[tuple[dict, int, int, bytes]]:
    """Parts of a multipart/byteranges payload as (fields, first, last, bytes), read strictly:
    each part's size comes from its Content-Range, and nothing may follow the close delimiter."""
    m = re.fullmatch(r'multipart/byteranges; boundary=([0-9A-Za-z\'()+_,./:=?-]{1,70})', content_type)
    assert m, content_type
    delim = b"--" + m.group(1).encode()
    parts, at = [], 0
    while True:
        lead = delim if at == 0 else b"\r\n" + delim
        assert body.startswith(lead, at), body[at:at + 80]
        at += len(lead)
        if body.startswith(b"--\r\n", at):
            assert at + 4 == len(body), "bytes after the close delimiter"
            return parts
        assert body.startswith(b"\r\n", at)
        end = body.index(b"\r\n\r\n", at + 2)
        fields = dict(line.split(": ", 1) for line in body[at + 2:end].decode().split("\r\n"))
        r = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+)", fields["Content-Range"])
        first, last, total = map(int, r.groups())
        assert total == length and first <= last < length
        at = end + 4
        parts.append((fields, first, last, body[at:at + last - first + 1]))
        at += last - first + 1


@pytest.mark.parametrize("spec,want", [
    ("bytes=0-99,1000-1099,-100", [(0, 99), (1000, 1099), (-100, None)]),
    ("bytes=500-599, 100-199", [(100, 199), (500, 599)]),               # sorted ascending
    ("bytes=0-0,1200000-,1000-1000", [(0, 0), (1000, 1000), (1200000, None)]),
    ("bytes=0-9 ,\t300-309,,", [(0, 9), (300, 309)]),                   # OWS and empty elements
    ("BYTES=0-9,300-309", [(0, 9), (300, 309)]),                        # the unit is case-insensitive
    ("bytes=0-9,99999999-,300-309", [(0, 9), (300, 309)]),              # unsatisfiable ones dropped
])
def test_several_ranges_are_multipart(port, big, multipart_target, spec, want):
    n = len(big)
    c = Conn(port)
    full = c.request(BIG)
    r = c.request(BIG, headers={"Range": spec, "Accept-Encoding": "gzip, br"})
    assert r.status == 206 and r.h("content-encoding") is None and r.h("content-range") is None
    assert int(r.h("content-length")) == len(r.body)
    for name in ("etag", "last-modified", "cache-control", "vary", "accept-ranges"):
        assert r.h(name) == full.h(name), name  # RFC 9110 §15.3.7: what a 200 would send
    parts = parse_multipart(r.body, r.h("content-type"), n)
    expect = [(lo if lo >= 0 else n + lo, n - 1 if hi is None else hi) for lo, hi in want]
    assert [(a, b) for _, a, b, _ in parts] == expect
    for fields, first, last, data in parts:
        assert list(fields) == ["Content-Type", "Content-Range"] and fields["Content-Type"] == CTYPE
        assert data == big[first:last + 1]
    assert c.request("/css/site.css").body == demo_file("css/site.css")  # framing intact


@pytest.mark.parametrize("spec,first,last", [
    ("bytes=0-10,5-20", 0, 20),            # overlapping
    ("bytes=10-19,0-9", 0, 19),            # adjacent, out of order
    ("bytes=0-9,50-59", 0, 59),            # a gap smaller than a part head: merged
    ("bytes=0-9,0-9", 0, 9),
    ("bytes=0-9,99999999-", 0, 9),         # the only satisfiable one
])
def test_ranges_that_merge_into_one_are_a_single_part(port, big, multipart_target, spec, first, last):
    r = get(port, range=spec)
    assert r.status == 206 and r.h("content-type") == CTYPE
    assert r.h("content-range") == f"bytes {first}-{last}/{len(big)}" and r.body == big[first:last + 1]


@pytest.mark.parametrize("spec", ["bytes=99999999-,99999998-", "bytes=-0,-0", "bytes=99999999-,-0"])
def test_no_satisfiable_range_is_416(port, big, multipart_target, spec):
    r = get(port, range=spec)
    assert r.status == 416 and r.h("content-range") == f"bytes */{len(big)}" and r.body == b""


@pytest.mark.parametrize("spec", [
    "bytes=0-,0-",                                         # overlapping abuse: more than the file
    "bytes=0-0,2000-",                                     # parts over 1 MiB (copied): the 200
    ",".join(f"bytes={i * 1000}-{i * 1000 + 9}" if i == 0 else f"{i * 1000}-{i * 1000 + 9}"
             for i in range(17)),                          # 17 parts: more than 16
    "bytes=0-1,x", "bytes=0-1,5-3", "bytes=0-1,-", "bytes= 0-1,5-6", "bytes=0-1,5 -6",
    "bytes=0-1,٣-٤",                                      # digits are ASCII digits
])
def test_abusive_or_malformed_sets_get_the_whole_200(port, big, spec):
    c = Conn(port)
    c.send(f"GET {BIG} HTTP/1.1\r\nHost: x\r\nRange: {spec}\r\n\r\n".encode())
    r = c.read()
    assert r.status == 200 and r.body == big


def test_sixteen_parts_are_served(port, big, multipart_target):
    spec = "bytes=" + ",".join(f"{i * 1000}-{i * 1000 + 9}" for i in range(16))
    r = get(port, range=spec)
    assert r.status == 206
    assert len(parse_multipart(r.body, r.h("content-type"), len(big))) == 16


def test_if_range_and_head(port, big, multipart_target):
    full = get(port)
    spec = "bytes=0-9,500-509"
    assert get(port, range=spec, if_range=full.h("etag")).status == 206
    assert get(port, range=spec, if_range=full.h("last-modified")).status == 206
    stale = get(port, range=spec, if_range='"stale"')
    assert stale.status == 200 and stale.body == big
    h = get(port, method="HEAD", range=spec)
    assert h.status == 200 and int(h.h("content-length")) == len(big)


def test_pipelined_multipart_responses(port, big, multipart_target):
    req = f"GET {BIG} HTTP/1.1\r\nHost: x\r\nRange: bytes=1-2,3000-3001\r\n\r\n".encode()
    out = split_responses(exchange(port, req * 3 + b"GET /css/site.css HTTP/1.1\r\nHost: x\r\n\r\n"))
    assert [s for s, _, _ in out] == [206, 206, 206, 200]
    for _, hs, body in out[:3]:
        assert [d for *_, d in parse_multipart(body, hs["content-type"], len(big))] == [
            big[1:3], big[3000:3002]]


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is installed by .ci/run")
def test_curl_several_ranges(port, big, multipart_target):
    r = subprocess.run(["curl", "-sS", "-D", "-", "-r", "0-99,5000-5099,-50",
                        f"http://127.0.0.1:{port}{BIG}"], capture_output=True, timeout=30)
    assert r.returncode == 0, r.stderr
    head, _, body = r.stdout.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 206 Partial Content\r\n")
    ctype = re.search(rb"\r\nContent-Type: ([^\r]+)", head).group(1).decode()
    parts = parse_multipart(body, ctype, len(big))
    n = len(big)
    assert [(a, b, d) for _, a, b, d in parts] == [
        (0, 99, big[:100]), (5000, 5099, big[5000:5100]), (n - 50, n - 1, big[-50:])]


# -- error pages, field by field --------------------------------------------------------------

def _names(r) -> list[str]:
    return [k for k, _ in r.fields]


def test_sites_404_page_fields(port):
    r = get(port, "/nope")
    assert r.status == 404 and r.body == demo_file("404.html")
    assert _names(r) == ["content-length", "content-type", "etag", "last-modified", "cache-control",
                         "vary", "date"]
    assert r.h("cache-control") == "no-cache"
    gz = get(port, "/nope", accept_encoding="gzip")
    assert _names(gz) == ["content-length", "content-type", "etag", "last-modified",
                          "cache-control", "vary", "content-encoding", "date"]
    assert get(port, "/nope", range="bytes=0-9").status == 404  # no ranges on error pages


@pytest.mark.parametrize("data,status,names", [
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n", 405,
     ["content-type", "content-length", "allow", "date"]),
    (b"BREW / HTTP/1.1\r\nHost: x\r\n\r\n", 501, ["content-type", "content-length", "allow", "date"]),
    (b"GET /img/pixel.png HTTP/1.1\r\nHost: x\r\nAccept-Encoding: identity;q=0\r\n\r\n", 406,
     ["content-type", "content-length", "vary", "date"]),
    (b"GET / HTTP/1.1\r\n\r\n", 400, ["content-type", "content-length", "date", "connection"]),
])
def test_plain_error_fields(port, data, status, names):
    c = Conn(port)
    c.send(data)
    r = c.read()
    assert r.status == status and _names(r) == names
    assert r.h("content-type") == "text/plain; charset=utf-8"
    assert r.body == f"{status} ".encode() + r.body.split(b" ", 1)[1] and r.body.endswith(b"\n")


def test_builtin_404_has_no_1970_date_and_no_accept_ranges(tmp_path):
    out = str(tmp_path / "o")
    assert orisha("build", DEMO, "-o", out).returncode == 0
    s = Server(out, "--loop", "epoll", "--workers", "1")
    try:
        r = get(s.port, "/nope")
        assert r.status == 404 and b"404 Not Found" in r.body
        assert _names(r) == ["content-length", "content-type", "etag", "cache-control", "date"]
        assert r.h("cache-control") == "no-cache"
        h = get(s.port, "/nope", method="HEAD")
        assert h.status == 404 and _names(h) == _names(r)
    finally:
        s.stop()


def test_accept_ranges_only_on_identity_variants(port):
    for enc, ranges in (("identity", "bytes"), ("gzip", None), ("br", None), ("zstd", None)):
        r = get(port, BIG, accept_encoding=enc)
        assert r.status == 200 and r.h("accept-ranges") == ranges, enc


# -- the core, without sockets: the exact plan, and any header -----------------------------------

def _site(body: bytes):
    from orisha.core.site import Entry, Site, Variant
    fields = b'Content-Type: text/plain\r\nETag: "t"\r\nAccept-Ranges: bytes\r\n'
    entry = Entry((Variant(b"identity", b'"t"', fields, b'ETag: "t"\r\n', body),), 0)
    return Site({b"/f": entry}, entry, None, "", "epoll", (), b"BOUNDARY")


def test_multipart_plan_bytes():
    """The exact plan the C core is to produce (see the report to the lead)."""
    from orisha.core.connection import answer
    from orisha.core.policy import Limits
    site = _site(bytes(range(256)) * 4)
    plan = answer(site, site.routes, Limits(), b"GET /f HTTP/1.1\r\nHost: x\r\nRange: bytes=1000-1001,0-1")
    body = (b"--BOUNDARY\r\nContent-Type: text/plain\r\nContent-Range: bytes 0-1/1024\r\n\r\n\x00\x01"
            b"\r\n--BOUNDARY\r\nContent-Type: text/plain\r\nContent-Range: bytes 1000-1001/1024\r\n\r\n"
            b"\xe8\xe9\r\n--BOUNDARY--\r\n")
    assert plan.head == (b"HTTP/1.1 206 Partial Content\r\n"
                         b"Content-Type: multipart/byteranges; boundary=BOUNDARY\r\n"
                         b"Content-Length: %d\r\n" % len(body) + b'ETag: "t"\r\nAccept-Ranges: bytes\r\n')
    assert plan.body == body and plan.status == 206


_spec = st.one_of(
    st.tuples(st.integers(0, 3000), st.one_of(st.none(), st.integers(0, 3000))).map(
        lambda t: f"{t[0]}-{'' if t[1] is None else t[1]}"),
    st.integers(0, 3000).map(lambda n: f"-{n}"),
    st.sampled_from(["", " ", "x", "-", "1-2-3", "0x10-", "+1-2"]))
_header = st.one_of(
    st.lists(_spec, min_size=2, max_size=24).map(lambda xs: "bytes=" + ",".join(xs)),
    st.text(max_size=60).map(lambda t: "bytes=" + t))

@settings(max_examples=300, deadline=None)
@given(_header, st.integers(0, 2500))
def test_range_set_any_header(header, length):
    """Any header: None, False, or sorted, disjoint, non-adjacent ranges inside the document."""
    from orisha.core.ranges import MAX_PARTS, range_set
    r = range_set(header.encode("utf-8"), length)
    assert r is None or r is False or isinstance(r, list)
    if isinstance(r, list):
        assert 1 <= len(r) <= MAX_PARTS
        for first, last in r:
            assert 0 <= first <= last < length
        for (_, a), (b, _) in zip(r, r[1:]):
            assert b > a + 1
