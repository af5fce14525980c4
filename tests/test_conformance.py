"""The conformance suite: every behaviour over a real loopback socket, per loop body.

Test ids carry the loop name. Servers run the demo site with --not-found
404.html (``port``) or in SPA mode with --fallback 200.html (``spa_port``).
"""

from __future__ import annotations

import gzip
import os
import re
import socket
import time

import brotli
import pytest
import zstandard
from conftest import DEMO, demo_file
from httpraw import Conn, exchange, split_responses

from orisha.core.dates import format_http_date, parse_http_date

DECODE = {"gzip": gzip.decompress, "br": brotli.decompress,
          "zstd": lambda b: zstandard.ZstdDecompressor().decompressobj().decompress(b)}
BIG = "/files/big.txt"


def get(port, path="/", **headers):
    c = Conn(port)
    try:
        return c.request(path, headers={k.replace("_", "-"): v for k, v in headers.items()})
    finally:
        c.close()


def raw(port, data: bytes):
    return split_responses(exchange(port, data))


# -- routing -----------------------------------------------------------------

@pytest.mark.parametrize("path,rel", [
    ("/", "index.html"), ("/index.html", "index.html"), ("/css/site.css", "css/site.css"),
    ("/docs/", "docs/index.html"), ("/docs/guide/getting-started", "docs/guide/getting-started.html"),
    ("/docs/guide/getting-started.html", "docs/guide/getting-started.html"),
    ("/css/site.css?v=3&x=%zz", "css/site.css"),
    ("/files/caf%C3%A9%20men%C3%BC.txt", "files/café menü.txt"),
    ("/docs/../css/./site.css", "css/site.css"), ("/%2e%2e/%2E%2e/css/site.css", "css/site.css"),
    ("//css//site.css", "css/site.css"), ("/files/empty.txt", "files/empty.txt"),
    ("/img/pixel.png", "img/pixel.png"), ("/files/big.txt", "files/big.txt"),
])
def test_routes(port, path, rel):
    r = get(port, path)
    assert r.status == 200
    assert r.body == demo_file(rel)
    assert r.h("content-encoding") is None


@pytest.mark.parametrize("path,location", [("/docs", "/docs/"), ("/docs?a=1&b", "/docs/?a=1&b"),
                                           ("/docs/guide", None)])
def test_directory_redirect_keeps_query(port, path, location):
    r = get(port, path)
    if location is None:  # a folder without index.html is not a page
        assert r.status == 404
    else:
        assert r.status == 301 and r.h("location") == location


@pytest.mark.parametrize("path", ["/nope", "/../../../../etc/passwd", "/docs/nope.html", "/css/site.css/"])
def test_unknown_path_gets_the_sites_404_page(port, path):
    r = get(port, path)
    assert r.status == 404
    assert r.body == demo_file("404.html")
    assert r.h("content-type") == "text/html; charset=utf-8"


def test_spa_fallback_is_a_full_document(spa_port):
    r = get(spa_port, "/app/some/client/route", accept_encoding="gzip")
    assert r.status == 200 and r.h("content-encoding") == "gzip"
    assert gzip.decompress(r.body) == demo_file("200.html")
    assert get(spa_port, "/app/x", accept_encoding="gzip", if_none_match=r.h("etag")).status == 304
    c = Conn(spa_port)
    h = c.request("/another/route", method="HEAD")
    assert h.status == 200 and h.body == b"" and int(h.h("content-length")) == len(demo_file("200.html"))
    assert c.request("/css/site.css").body == demo_file("css/site.css")  # real files still win


# -- headers -----------------------------------------------------------------

@pytest.mark.parametrize("path,ctype", [
    ("/", "text/html; charset=utf-8"), ("/css/site.css", "text/css; charset=utf-8"),
    ("/js/app.3f2a1b9c.js", "text/javascript; charset=utf-8"),
    ("/data/planets.json", "application/json; charset=utf-8"), ("/img/logo.svg", "image/svg+xml; charset=utf-8"),
    ("/img/pixel.png", "image/png"), ("/fonts/demo.woff2", "font/woff2"),
    ("/files/big.txt", "text/plain; charset=utf-8"),
])
def test_content_type(port, path, ctype):
    assert get(port, path).h("content-type") == ctype


def test_headers_of_a_document(port):
    r = get(port, "/css/site.css")
    mtime = int(os.stat(os.path.join(DEMO, "css/site.css")).st_mtime)
    assert r.h("last-modified") == format_http_date(mtime).decode()
    assert r.h("accept-ranges") == "bytes"
    assert r.h("vary") == "Accept-Encoding"
    assert re.fullmatch(r'"[^"W/]+"', r.h("etag"))
    assert int(r.h("content-length")) == len(r.body)
    date = parse_http_date(r.h("date").encode())
    assert date is not None and abs(date - time.time()) <= 2
    assert r.h("date") == format_http_date(date).decode()  # IMF-fixdate exactly


def test_date_is_exact_to_the_second(port, loop):
    """RFC 9110 §6.6.1: Date is the time the response was generated — not a second late.

    The booted image reads the host's wall clock from kvmclock under KVM (exact);
    under TCG its only wall clock is QEMU's emulated RTC, which starts on the
    host's *whole* second, so there Date may lag by less than a second
    (unikernel/README.md) — that documented bound is what is asserted for TCG.
    """
    from orisha.targets.unikernel.boot import resolve_accel
    tcg = loop.startswith("unikernel") and resolve_accel("auto") == "tcg"
    c = Conn(port)
    if loop.startswith("unikernel"):
        time.sleep(1.2)  # a just-booted image re-anchors its clock at the RTC's first tick
    # Three points of about one second (not the middles of three seconds: 3 s per target): a
    # Date clock that ticks off the second's edge is a second late over part of every second,
    # which the early and the late point catch as the middle one alone would not.
    for point in (0.2, 0.5, 0.8):
        time.sleep((point - time.time() % 1) % 1)  # clear of the edges: no straddling
        before = time.time()
        date = parse_http_date(c.request("/css/site.css").h("date").encode())
        after = time.time()
        if int(before) == int(after):
            allowed = {int(before), int(before) - 1} if tcg else {int(before)}
            assert date in allowed, (date, before)


def test_date_advances_each_second(port):
    c = Conn(port)
    first = c.request("/css/site.css").h("date")
    time.sleep(1.1)
    assert c.request("/css/site.css").h("date") != first


@pytest.mark.parametrize("path,policy", [
    ("/", "no-cache"), ("/docs/", "no-cache"), ("/js/app.3f2a1b9c.js", "public, max-age=31536000, immutable"),
    ("/css/site.css", "public, max-age=3600"), ("/img/pixel.png", "public, max-age=3600"),
])
def test_cache_control_policy(port, path, policy):
    assert get(port, path).h("cache-control") == policy


def test_no_vary_for_a_single_variant(port):
    r = get(port, "/img/pixel.png", accept_encoding="gzip, br, zstd")
    assert r.h("vary") is None and r.h("content-encoding") is None


# -- content negotiation -------------------------------------------------------

@pytest.mark.parametrize("coding", ["gzip", "br", "zstd"])
def test_each_encoding(port, coding):
    r = get(port, BIG, accept_encoding=coding)
    assert r.h("content-encoding") == coding
    assert DECODE[coding](r.body) == demo_file("files/big.txt")
    assert r.h("etag") != get(port, BIG).h("etag")


def test_smallest_acceptable_variant_wins(port):
    sizes = {c: len(get(port, BIG, accept_encoding=c).body) for c in ("gzip", "br", "zstd")}
    r = get(port, BIG, accept_encoding="gzip, deflate, br, zstd")
    assert r.h("content-encoding") == min(sizes, key=sizes.get)
    assert len(r.body) == min(sizes.values())


@pytest.mark.parametrize("header,expect", [
    ("gzip;q=0, br", "br"), ("gzip;q=1.0, br;q=0, zstd;q=0", "gzip"), ("x-gzip", "gzip"),
    ("GZIP", "gzip"), ("identity", None), ("", None), ("deflate", None), ("compress;q=0.5", None),
    ("identity;q=0, gzip", "gzip"), ("*;q=0, zstd", "zstd"), ("gzip;q=bogus", None),
])
def test_accept_encoding_qvalues(port, header, expect):
    r = get(port, BIG, accept_encoding=header)
    assert r.status == 200 and r.h("content-encoding") == expect


def test_star_means_any_coding(port):
    r = get(port, BIG, accept_encoding="*")
    assert r.h("content-encoding") in ("gzip", "br", "zstd")


def test_no_accept_encoding_never_gets_a_coding(port):
    c = Conn(port)
    c.send(b"GET /files/big.txt HTTP/1.1\r\nHost: x\r\n\r\n")
    r = c.read()
    assert r.h("content-encoding") is None and r.body == demo_file("files/big.txt")


@pytest.mark.parametrize("header", ["identity;q=0", "*;q=0", "identity;q=0, deflate"])
def test_nothing_acceptable_is_406(port, header):
    r = get(port, "/img/pixel.png", accept_encoding=header)
    assert r.status == 406 and r.h("vary") == "Accept-Encoding"
    assert get(port, "/css/site.css", accept_encoding="*;q=0").status == 406


def test_compressed_types_are_not_recompressed(port):
    for path in ("/img/pixel.png", "/fonts/demo.woff2"):
        assert get(port, path, accept_encoding="gzip, br, zstd").h("content-encoding") is None


# -- HEAD --------------------------------------------------------------------

@pytest.mark.parametrize("path,enc", [("/", None), (BIG, "br"), ("/nope", None), ("/docs", None)])
def test_head_has_the_get_head_and_no_body(port, path, enc):
    c = Conn(port)
    hdrs = {"Accept-Encoding": enc} if enc else {}
    g = c.request(path, headers=hdrs)
    h = c.request(path, method="HEAD", headers=hdrs)
    assert h.status == g.status and h.body == b""
    strip = lambda r: [f for f in r.fields if f[0] != "date"]
    assert strip(h) == strip(g)
    # the connection is still in sync: no body bytes were sent after the HEAD
    assert c.request("/css/site.css").body == demo_file("css/site.css")


# -- conditional requests -------------------------------------------------------

def test_if_none_match_304(port):
    r = get(port, "/css/site.css")
    c = Conn(port)
    n = c.request("/css/site.css", headers={"If-None-Match": r.h("etag")})
    assert n.status == 304 and n.body == b""
    assert {k for k, _ in n.fields} == {"etag", "cache-control", "vary", "date"}
    assert n.h("etag") == r.h("etag") and n.h("cache-control") == r.h("cache-control")
    assert c.request("/css/site.css").status == 200  # framing intact after a 304


@pytest.mark.parametrize("make,status", [
    (lambda t: f'"nope", {t}', 304), (lambda t: f"W/{t}", 304), (lambda t: "*", 304),
    (lambda t: '"nope"', 200), (lambda t: t[:-2] + '"', 200),
])
def test_if_none_match_lists_and_weak_comparison(port, make, status):
    tag = get(port, "/data/planets.json").h("etag")
    assert get(port, "/data/planets.json", if_none_match=make(tag)).status == status


def test_etag_belongs_to_the_variant(port):
    gz = get(port, BIG, accept_encoding="gzip")
    assert get(port, BIG, accept_encoding="gzip", if_none_match=gz.h("etag")).status == 304
    assert get(port, BIG, if_none_match=gz.h("etag")).status == 200  # identity differs


def test_if_modified_since(port):
    lm = get(port, "/css/site.css").h("last-modified")
    t = parse_http_date(lm.encode())
    assert get(port, "/css/site.css", if_modified_since=lm).status == 304
    assert get(port, "/css/site.css", if_modified_since=format_http_date(t + 10).decode()).status == 304
    assert get(port, "/css/site.css", if_modified_since=format_http_date(t - 1).decode()).status == 200
    assert get(port, "/css/site.css", if_modified_since="yesterday").status == 200
    # RFC 850 and asctime forms are dates too
    rfc850 = time.strftime("%A, %d-%b-%y %H:%M:%S GMT", time.gmtime(t))
    assert get(port, "/css/site.css", if_modified_since=rfc850).status == 304
    # If-None-Match takes precedence: a non-matching tag means 200 whatever the date
    assert get(port, "/css/site.css", if_modified_since=lm, if_none_match='"x"').status == 200


def test_404_is_not_conditional(port):
    assert get(port, "/nope", if_none_match="*").status == 404


# -- ranges --------------------------------------------------------------------

@pytest.fixture(scope="module")
def big():
    return demo_file("files/big.txt")


@pytest.mark.parametrize("spec,first,last", [
    ("bytes=0-99", 0, 99), ("bytes=100-100", 100, 100), ("bytes=-500", -500, None),
    ("bytes=1000000-", 1000000, None), ("bytes=10-99999999", 10, None),
])
def test_single_ranges(port, big, spec, first, last):
    r = get(port, BIG, range=spec, accept_encoding="gzip, br")
    n = len(big)
    lo = first if first >= 0 else n + first
    hi = n - 1 if last is None else last
    assert r.status == 206 and r.h("content-encoding") is None
    assert r.h("content-range") == f"bytes {lo}-{hi}/{n}"
    assert r.body == big[lo:hi + 1]


@pytest.mark.parametrize("spec", ["bytes=99999999-", "bytes=-0"])
def test_unsatisfiable_range_416(port, big, spec):
    r = get(port, BIG, range=spec)
    assert r.status == 416 and r.h("content-range") == f"bytes */{len(big)}"


def test_empty_file_range_is_unsatisfiable(port):
    r = get(port, "/files/empty.txt", range="bytes=0-")
    assert r.status == 416 and r.h("content-range") == "bytes */0"


# (several ranges: tests/test_ranges.py; ranges adding up past the length are overlap abuse: 200)
@pytest.mark.parametrize("spec", ["bytes=0-,0-", "bytes=abc", "items=0-5", "bytes=5-1"])
def test_other_ranges_get_the_whole_document(port, big, spec):
    r = get(port, BIG, range=spec)
    assert r.status == 200 and r.body == big


def test_if_range(port, big):
    r = get(port, BIG)
    assert get(port, BIG, range="bytes=0-9", if_range=r.h("etag")).status == 206
    assert get(port, BIG, range="bytes=0-9", if_range=r.h("last-modified")).status == 206
    assert get(port, BIG, range="bytes=0-9", if_range='"stale"').status == 200
    assert get(port, BIG, range="bytes=0-9", if_range="W/" + r.h("etag")).status == 200
    assert get(port, BIG, range="bytes=0-9", if_range="Thu, 01 Jan 1970 00:00:00 GMT").status == 200


def test_head_ignores_range(port, big):
    c = Conn(port)
    r = c.request(BIG, method="HEAD", headers={"Range": "bytes=0-9"})
    assert r.status == 200 and int(r.h("content-length")) == len(big)


# -- connections -----------------------------------------------------------------

def test_keep_alive_by_default(port):
    c = Conn(port)
    for _ in range(3):
        assert c.request("/css/site.css").status == 200
    assert not c.closed(0.3)


def test_http10_closes_unless_keep_alive(port):
    c = Conn(port)
    r = c.request("/", version="HTTP/1.0")
    assert r.h("connection") == "close" and c.closed()
    c = Conn(port)
    r = c.request("/", version="HTTP/1.0", headers={"Connection": "keep-alive"})
    assert r.h("connection") == "keep-alive"
    assert c.request("/", version="HTTP/1.0", headers={"Connection": "keep-alive"}).status == 200


def test_http10_without_host_is_fine(port):
    out = raw(port, b"GET /css/site.css HTTP/1.0\r\n\r\n")
    assert out[0][0] == 200 and out[0][2] == demo_file("css/site.css")


def test_connection_close_is_honoured(port):
    c = Conn(port)
    r = c.request("/", headers={"Connection": "close"})
    assert r.status == 200 and r.h("connection") == "close" and c.closed()


def test_pipelining_answers_in_order(port):
    paths = ["/", "/css/site.css", "/nope", "/docs", "/data/planets.json"] * 20
    data = b"".join(f"GET {p} HTTP/1.1\r\nHost: x\r\n\r\n".encode() for p in paths)
    out = raw(port, data)
    assert [s for s, _, _ in out] == [{"/nope": 404, "/docs": 301}.get(p, 200) for p in paths]
    assert out[1][2] == demo_file("css/site.css")


def test_pipelined_flood_in_one_write(port):
    n = 2000
    out = raw(port, b"GET /data/planets.json HTTP/1.1\r\nHost: x\r\n\r\n" * n)
    assert len(out) == n and all(s == 200 for s, _, _ in out)


def test_request_split_byte_by_byte(port):
    c = Conn(port)
    c.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for b in b"GET /css/site.css HTTP/1.1\r\nHost: x\r\nAccept-Encoding: gzip\r\n\r\n":
        c.send(bytes([b]))
    r = c.read()
    assert r.status == 200 and gzip.decompress(r.body) == demo_file("css/site.css")


def test_half_closed_client_gets_its_answers(port):
    out = raw(port, b"GET / HTTP/1.1\r\nHost: x\r\n\r\nGET /css/site.css HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [s for s, _, _ in out] == [200, 200]


def test_idle_keep_alive_times_out(port):
    c = Conn(port)
    assert c.request("/").status == 200
    assert not c.closed(1.0)
    assert c.closed(6.0)  # the server runs with --idle-timeout 3


def test_slowloris_head_times_out(port):
    c = Conn(port)
    c.send(b"GET / HTTP/1.1\r\nHost: x\r\n")
    for _ in range(5):
        time.sleep(0.5)
        c.send(b"X-Slow: 1\r\n")  # trickling bytes does not reset the head timeout
    assert c.read().status == 408  # (without the head timeout the read would time out instead)
    assert c.closed(3.0)


# -- malformed requests ------------------------------------------------------------

@pytest.mark.parametrize("data,status", [
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\rb\r\n\r\n", 400),                 # bare CR
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\r\n folded\r\n\r\n", 400),         # obs-fold
    (b"GET / HTTP/1.1\r\nHost: x\r\nX : a\r\n\r\n", 400),                   # space before colon
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\x00b\r\n\r\n", 400),               # NUL
    (b"GET / HTTP/1.1\r\nHost: x\r\nX: a\x01b\r\n\r\n", 400),               # control byte
    (b"GET / HTTP/1.1\r\nHost: x\r\nNoColon\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\n\r\n", 400),                                       # no Host in 1.1
    (b"GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400),
    (b"GET  / HTTP/1.1\r\nHost: x\r\n\r\n", 400),                           # two spaces
    (b"GET /\r\n\r\n", 400),                                               # HTTP/0.9
    (b"GET / http/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET / HTTP/1\r\nHost: x\r\n\r\n", 400),
    (b"GET /a\x7fb HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET /%zz HTTP/1.1\r\nHost: x\r\n\r\n", 400),                        # bad percent-encoding
    (b"GET /a%00b HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET x.org:80 HTTP/1.1\r\nHost: x\r\n\r\n", 400),                    # authority-form
    (b"GET * HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET / HTTP/2.0\r\nHost: x\r\n\r\n", 505),
    (b"GET / HTTP/3.0\r\nHost: x\r\n\r\n", 505),
    (b"GET / HTTP/0.9\r\nHost: x\r\n\r\n", 505),
    (b"BREW / HTTP/1.1\r\nHost: x\r\n\r\n", 501),
    (b"get / HTTP/1.1\r\nHost: x\r\n\r\n", 501),                           # methods are case-sensitive
    (b"G(T / HTTP/1.1\r\nHost: x\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 1e3\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 411),
    (b"GET / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 400),
    (b"GET / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n", 400),
    (b"GET / HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999\r\n\r\n", 413),
])
def test_malformed_requests(port, data, status):
    out = raw(port, data + b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert out[0][0] == status
    if status not in (501,):
        # after a framing error the server closes: the trailing request is not answered
        assert len(out) == 1 and out[0][1].get("connection") == "close"


def test_long_target_414(port):
    assert raw(port, b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n")[0][0] == 414
    assert raw(port, b"GET /" + b"a" * 20000)[0][0] == 414  # no line end in sight


def test_big_head_431(port):
    head = b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: %s\r\n" % (i, b"v" * 50) for i in range(200))
    assert raw(port, head + b"\r\n")[0][0] == 431
    assert raw(port, b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X: a\r\n" * 5000 + b"\r\n")[0][0] == 431


def test_lenient_but_safe_framing(port):
    # RFC 9112 §2.2: a bare LF may end a line; empty lines before a request are ignored.
    out = raw(port, b"\r\n\r\nGET /css/site.css HTTP/1.1\nHost: x\n\nGET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [s for s, _, _ in out] == [200, 200] and out[0][2] == demo_file("css/site.css")
    # a minor version above 1 is answered as HTTP/1.1; repeated equal Content-Length is one value
    assert raw(port, b"GET / HTTP/1.7\r\nHost: x\r\n\r\n")[0][0] == 200
    out = raw(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Length: 3\r\n\r\nabc"
                    b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert [s for s, _, _ in out] == [405, 200]


def test_absolute_form_target(port):
    out = raw(port, b"GET http://example.com/css/site.css?x HTTP/1.1\r\nHost: example.com\r\n\r\n")
    assert out[0][0] == 200 and out[0][2] == demo_file("css/site.css")


@pytest.mark.parametrize("method", ["POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"])
def test_known_methods_405_keep_the_connection(port, method):
    out = raw(port, f"{method} / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nbody".encode()
              + b"GET /css/site.css HTTP/1.1\r\nHost: x\r\n\r\n")
    assert out[0][0] == 405 and out[0][1]["allow"] == "GET, HEAD"
    assert out[1][0] == 200 and out[1][2] == demo_file("css/site.css")


def test_body_sent_in_pieces_is_discarded(port):
    c = Conn(port)
    c.send(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 10\r\n\r\n01234")
    assert c.read().status == 405
    c.send(b"56789GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert c.read().status == 200
