"""The sans-I/O core on its own: no sockets, no clock, bytes in and bytes out.

Parser cases are fed whole, one byte at a time, and followed by trailing
junk; a Hypothesis property checks that any bytes yield well-formed responses
(or a close) and never an exception or a stall.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest
from conftest import ROOT, demo_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from httpraw import split_responses

from orisha.core.connection import App, Limits
from orisha.core.dates import parse_http_date
from orisha.core.policy import LINGER
from orisha.core.negotiate import accept_encoding_mask, byte_range
from orisha.core.request import decimal
from orisha.serving.server import load_site

NOW = 1_764_470_000.0


@pytest.fixture(scope="module")
def app(builds):
    return App(load_site(builds["notfound"]), Limits())


def run(app, chunks, now=NOW, eof=True):
    """Feed chunks like a loop body would; return everything written and whether it closed."""
    conn = app.connect(now)
    out = b""

    def drain():
        nonlocal out
        while conn.outgoing:
            data = b"".join(bytes(b) for b in conn.outgoing)
            out += data
            conn.sent(len(data), now)

    for chunk in chunks:
        if conn.should_close:
            break
        assert chunk
        conn.receive(chunk, now)
        drain()
    if eof and not conn.should_close:
        conn.receive(b"", now)
        drain()
    closed = conn.should_close
    conn.close()
    return out, closed


def test_core_imports_no_io():
    """The core never imports socket, select, time, asyncio or a loop library."""
    banned = {"socket", "select", "selectors", "time", "asyncio", "uvloop", "liburing", "ssl",
              "threading", "mmap", "os"}
    core = os.path.join(ROOT, "orisha", "core")
    for name in os.listdir(core):
        if not name.endswith(".py"):
            continue
        tree = ast.parse(open(os.path.join(core, name)).read())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                mods = [node.module or ""] if node.level == 0 else []
            else:
                continue
            for m in mods:
                assert m.split(".")[0] not in banned, f"orisha/core/{name} imports {m}"
    # and at run time: importing the core loads none of them
    code = ("import sys; before = set(sys.modules); import orisha.core.connection; "
            "print(sorted(set(sys.modules) - before))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    new = eval(loaded.stdout)
    assert not [m for m in new if m.split(".")[0] in banned], new


CASES = [
    (b"GET /css/site.css HTTP/1.1\r\nHost: x\r\n\r\n", [200]),
    (b"GET /css/site.css HTTP/1.1\nHost: x\n\n", [200]),
    (b"HEAD / HTTP/1.1\r\nHost: x\r\n\r\n", [200]),
    (b"GET /docs HTTP/1.1\r\nHost: x\r\n\r\n", [301]),
    (b"GET /nope HTTP/1.1\r\nHost: x\r\n\r\n", [404]),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc", [405]),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n b\r\n\r\n", [400]),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n", [400]),
    (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", [505]),
    (b"BREW / HTTP/1.1\r\nHost: x\r\n\r\n", [501]),
    (b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n", [400]),
    (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: y\r\n" * 3000 + b"\r\n", [431]),
    (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", [414]),
    # bytes that cannot begin a request line: 400 before any line end (early 400)
    (b"\x16\x03\x01\x02\x00\x01", [400]),
    (b"\x00GET / HTTP/1.1\r\nHost: x\r\n\r\n", [400]),
    (b"\r\n GET / HTTP/1.1\r\nHost: x\r\n\r\n", [400]),
    (b"G(T / HTTP/2.0\r\nHost: x\r\n\r\n", [400]),  # the method is judged before the version
    (b"G(T " + b"a" * 9000, [400]),                 # ... and before the head's size
    # Content-Length = 1*DIGIT (RFC 9110 §8.6)
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 0003\r\n\r\nabc", [405]),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: +3\r\n\r\nabc", [400]),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1_0\r\n\r\nabc", [400]),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3 3\r\n\r\nabc", [400]),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: \xd9\xa3\r\n\r\nabc", [400]),
    (b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: " + b"9" * 5000 + b"\r\n\r\n", [400]),
    # Range positions: 1*DIGIT with no whitespace inside the range-spec (RFC 9110 §14.1.1)
    (b"GET /css/site.css HTTP/1.1\r\nHost: x\r\nRange: bytes=0-4\r\n\r\n", [206]),
    (b"GET /css/site.css HTTP/1.1\r\nHost: x\r\nRange: bytes = 0 - 4\r\n\r\n", [200]),
    (b"GET /css/site.css HTTP/1.1\r\nHost: x\r\nRange: bytes=" + b"9" * 5000 + b"-\r\n\r\n", [416]),
]


def statuses(out):
    return [s for s, _, _ in split_responses(out)]


@pytest.mark.parametrize("data,expect", CASES, ids=range(len(CASES)))
def test_whole_bytewise_and_with_junk(app, data, expect):
    whole, _ = run(app, [data])
    if data.startswith(b"HEAD"):
        assert whole.startswith(b"HTTP/1.1 200 OK\r\n") and whole.endswith(b"\r\n\r\n")
        return
    assert statuses(whole) == expect
    bytewise, _ = run(app, [bytes([b]) for b in data])
    assert bytewise == whole
    # trailing junk after a complete request: the request is still answered, the junk
    # becomes a 400 (or is dropped after a fatal error), and the connection closes
    junk, closed = run(app, [data + b"\x00\x01garbage\r\n\r\n"])
    got = statuses(junk)
    assert got[0] == expect[0] and closed
    assert got[1:] in ([], [400])


# RFC 9110 §12.4.2: qvalue = ( "0" [ "." 0*3DIGIT ] ) / ( "1" [ "." 0*3("0") ] ); a member
# whose weight breaks the grammar is ignored (here: gzip is then refused, as by default).
@pytest.mark.parametrize("value,gzip", [
    (b"gzip;q=0.001", True), (b"gzip;q=1.000", True), (b"gzip;q=1.", True), (b"gzip;Q=0.5", True),
    (b"gzip; q=0.5 ", True), (b"gzip;q=0", False), (b"gzip;q=0.000", False), (b"gzip;q=1.0001", False),
    (b"gzip;q=0.5000", False), (b"gzip;q=.5", False), (b"gzip;q= 0.5", False), (b"gzip;q =0.5", False),
    (b"gzip;q=1.5", False), (b"gzip;q=-0", False), (b"gzip;q=1e0", False), (b"gzip;q=nan", False),
    (b"gzip;q=inf", False), (b"gzip;q=0_5", False), (b"gzip;q", False), (b"*;q=0.001", True),
    (b"x-gzip;q=0.7", True), (b"gzip;q=1;q=0", False),
])
def test_weights_follow_the_rfc_grammar(value, gzip):
    assert bool(accept_encoding_mask(value) & 2) == gzip


@pytest.mark.parametrize("value,expect", [
    (b"bytes=0-4", (0, 4)), (b"bytes=5-", (5, 99)), (b"bytes=-5", (95, 99)), (b"bytes=0005-6", (5, 6)),
    (b"bytes = 0-4", None), (b"bytes=0 - 4", None), (b"bytes=+1-2", None), (b"bytes=1_0-20", None),
    (b"bytes=\xd9\xa1-2", None), (b"bytes=0-1,5-6", None), (b"bytes=5-4", None),
    (b"bytes=" + b"9" * 5000 + b"-", False), (b"bytes=0-" + b"9" * 5000, (0, 99)),
    (b"bytes=-" + b"9" * 5000, (0, 99)), (b"bytes=" + b"9" * 30 + b"-" + b"9" * 29 + b"8", None),
    (b"bytes=100-", False), (b"bytes=-0", False),
])
def test_ranges_follow_the_rfc_grammar(value, expect):
    assert byte_range(value, 100) == expect


def test_numbers_are_ascii_digits_and_saturate():
    assert decimal(b"0042", 1000) == 42 and decimal(b"9" * 5000, 1000) == 1000
    assert decimal(b"1001", 1000) == 1000 and decimal(b"000", 1000) == 0
    for bad in (b"", b"+1", b"-1", b"1_0", b" 1", b"1 ", b"\xd9\xa1", b"0x1"):
        assert decimal(bad, 1000) is None
    assert parse_http_date(b"Sun, 06 Nov 1994 08:49:37 GMT") == 784111777
    for bad in (b"Sun, 06 Nov +994 08:49:37 GMT", b"Sun, 06 Nov 1_94 08:49:37 GMT",
                b"Sun Nov  6 08:49:37 -1994", b"Sunday, +6-Nov-94 08:49:37 GMT"):
        assert parse_http_date(bad) is None
    assert parse_http_date(b"Sun Nov  6 08:49:37 " + b"9" * 5000) > 1 << 40  # no int() limit


def test_responses_are_not_formatted_per_request(app):
    """The 200 head is the build's constant, object for object: nothing formatted on the way."""
    conn = app.connect(NOW)
    conn.receive(b"GET /css/site.css HTTP/1.1\r\nHost: x\r\n\r\n", NOW)
    head, tail, body = conn.outgoing
    variant = app.routes[b"/css/site.css"].identity
    assert head is variant.head and isinstance(body, memoryview)
    assert tail.startswith(b"Date: ") and tail.endswith(b"\r\n\r\n")


def test_backpressure_bounds_pipelined_answers(app):
    conn = app.connect(NOW)
    conn.receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 100, NOW)
    assert not conn.wants_read
    assert len(conn.outgoing) == 3 * app.limits.pipeline  # the rest waits for the writes
    answered = 0
    while conn.outgoing:
        answered += len(conn.outgoing) // 3
        conn.sent(sum(len(b) for b in conn.outgoing), NOW)
    assert answered == 100 and conn.wants_read


def test_timeouts(app):
    lim = app.limits
    conn = app.connect(NOW)
    conn.tick(NOW + lim.idle_timeout - 1)
    assert not conn.should_close
    conn.tick(NOW + lim.idle_timeout + 1)
    assert conn.should_close
    conn = app.connect(NOW)
    conn.receive(b"GET / HTTP/1.1\r\n", NOW)
    conn.tick(NOW + lim.head_timeout + 1)
    assert bytes(conn.outgoing[0]).startswith(b"HTTP/1.1 408 ")
    conn = app.connect(NOW)
    conn.receive(b"GET /files/big.txt HTTP/1.1\r\nHost: x\r\n\r\n", NOW)
    conn.sent(100, NOW + 5)
    conn.tick(NOW + 5 + lim.send_timeout - 1)
    assert not conn.should_close
    conn.tick(NOW + 5 + lim.send_timeout + 1)
    assert conn.should_close


def test_a_stop_answers_every_request_read_with_a_last_response_that_says_close(builds):
    """A graceful stop (``shutdown``): a keep-alive connection idle for LINGER closes at
    once; one writing a response finishes it, then answers the request it read meanwhile
    with ``Connection: close`` and closes; a head half read is answered the same way once
    it is whole; one that wrote its last response just now waits LINGER for a request on
    its way (its response may still be in the kernel's buffers: closing now, that
    request's reset would cut it). (Before, the request read after the stop was drained
    unanswered while the connection lingered, though no response had said it would close.)"""
    app = App(load_site(builds["notfound"]), Limits())  # its own: a stop marks the App
    idle = app.connect(NOW - LINGER - 1)
    busy, half = app.connect(NOW), app.connect(NOW)
    busy.receive(b"GET /files/big.txt HTTP/1.1\r\nHost: x\r\n\r\n", NOW)
    first = b"".join(bytes(b) for b in busy.outgoing)
    assert b"\r\nConnection: close\r\n" not in first.split(b"\r\n\r\n", 1)[0] + b"\r\n"
    busy.sent(100, NOW)  # the response is being written
    half.receive(b"GET /css/site.css HTTP/1.1\r\nHo", NOW)
    for conn in (idle, busy, half):
        conn.shutdown(NOW)
    assert idle.should_close and not busy.should_close and not half.should_close
    busy.receive(b"GET /css/site.css HTTP/1.1\r\nHost: x\r\n\r\n", NOW)  # the next request
    busy.sent(len(first) - 100, NOW)  # the first response written: the next one is answered
    out = b"".join(bytes(b) for b in busy.outgoing)
    assert out.startswith(b"HTTP/1.1 200 OK\r\n") and b"\r\nConnection: close\r\n" in out
    assert out.endswith(demo_file("css/site.css"))
    busy.sent(len(out), NOW)
    assert busy.shut_write or busy.should_close
    half.receive(b"st: x\r\n\r\n", NOW)
    out = b"".join(bytes(b) for b in half.outgoing)
    assert b"\r\nConnection: close\r\n" in out and out.endswith(demo_file("css/site.css"))
    half.sent(len(out), NOW)
    assert half.shut_write or half.should_close
    quiet = app.connect(NOW)  # its response just written, and no request after it
    quiet.receive(b"GET /css/site.css HTTP/1.1\r\nHost: x\r\n\r\n", NOW)
    quiet.sent(sum(len(b) for b in quiet.outgoing), NOW)
    quiet.shutdown(NOW)
    assert not quiet.should_close and quiet.wants_read  # a request on its way is answered
    quiet.tick(NOW + LINGER - 0.5)
    assert not quiet.should_close
    quiet.tick(NOW + LINGER + 0.5)  # none came: closed, nothing unread (no reset)
    assert quiet.should_close


def test_a_stop_answers_the_pipelined_requests_it_read_the_last_saying_close(builds):
    """Requests pipelined on one read after a graceful stop began (a connection a retiring
    worker took late, or one whose client sent several at once) are all answered, in
    order, and only the last response says ``Connection: close``: the stop's close comes
    after the last request read, never between two of them (closing after the first left
    the others read and unanswered; a reload storm's held download met that EOF)."""
    app = App(load_site(builds["notfound"]), Limits())
    conn = app.connect(NOW)
    conn.shutdown(NOW)  # the stop, before this connection's first request
    conn.receive(b"GET /css/site.css HTTP/1.1\r\nHost: x\r\n\r\n" * 3, NOW)
    out = b"".join(bytes(b) for b in conn.outgoing)
    responses = out.split(b"HTTP/1.1 200 OK\r\n")[1:]
    assert len(responses) == 3, out[:300]
    closes = [b"\r\nConnection: close\r\n" in b"\r\n" + r.split(b"\r\n\r\n", 1)[0] + b"\r\n"
              for r in responses]
    assert closes == [False, False, True]
    assert all(r.endswith(demo_file("css/site.css")) for r in responses)
    conn.sent(len(out), NOW)
    assert conn.shut_write or conn.should_close


def test_connection_limit_answers_503(builds):
    app = App(load_site(builds["notfound"]), Limits(connections=2))
    conns = [app.connect(NOW) for _ in range(3)]
    assert not conns[0].outgoing and not conns[1].outgoing
    assert bytes(conns[2].outgoing[0]).startswith(b"HTTP/1.1 503 ")
    conns[2].close()  # the loop closes it after the 503
    conns[0].close()
    assert not app.connect(NOW).outgoing


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.binary(min_size=1, max_size=300),
                          st.sampled_from([b"GET / HTTP/1.1\r\n", b"Host: x\r\n", b"\r\n", b"\n",
                                           b"Content-Length: 3\r\n", b"HEAD /css/site.css HTTP/1.0\r\n",
                                           b"Range: bytes=0-5\r\n", b"Transfer-Encoding: chunked\r\n"])),
                min_size=1, max_size=20))
def test_any_bytes_give_responses_or_a_close(app, chunks):
    out, closed = run(app, chunks)
    assert closed  # after EOF the core always ends the connection: never a hang
    # whatever came out is a sequence of well-formed responses (HEAD answers carry no body)
    while out:
        head, sep, out = out.partition(b"\r\n\r\n")
        assert sep and head.startswith(b"HTTP/1.1 ")
        status = int(head[9:12])
        assert status in (200, 206, 301, 304, 400, 404, 405, 406, 408, 411, 413, 414, 416, 431, 501, 505)
        n = 0 if status == 304 else int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
        if out.startswith(b"HTTP/1.1 "):
            n = 0  # a HEAD response (no demo body starts like a status line): the next follows
        out = out[n:]
