"""HTTP/2: the same answers as HTTP/1.1, framed per RFC 9113.

The first part drives the sans-I/O layer in memory (an ``h2`` library client
over a fake socket): every conformance behaviour must give the same status,
fields and bytes as HTTP/1.1 for the same request, since both go through the
one ``answer()``. The second part runs real servers per loop body, over TLS
(ALPN h2) and as h2c with prior knowledge, with real clients (curl, nghttp).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import struct
import subprocess
import time

import h2.settings
import pytest
from conftest import DEMO, Server, demo_file
from h2util import (DATA, GOAWAY, HEADERS, PREFACE, H2Client, frame, goaway_code, read_frames,
                    settings)
from httpraw import Conn, split_responses
from tlsutil import (_stop_servers, client_context, h2c_port, hosted, pki, tls_connect,  # noqa: F401
                     tls_port, tls_server)

from orisha.core.connection import App
from orisha.core.policy import Limits
from orisha.protocols.front import Plain
from orisha.serving.server import load_site

NOW = 1_700_000_000.0


@pytest.fixture(scope="module")
def site(builds):
    return load_site(builds["notfound"])


class MemSock:
    """A socket-shaped pipe into a sans-I/O connection (what a loop body would do)."""

    def __init__(self, conn, now: float = NOW) -> None:
        self.conn, self.now, self.pending, self.closed = conn, now, b"", False

    def _drain(self) -> bytes:
        out = b""
        while self.conn.outgoing:
            data = b"".join(bytes(b) for b in self.conn.outgoing)
            self.conn.sent(len(data), self.now)
            out += data
        if self.conn.should_close or self.conn.shut_write:
            self.closed = True
        return out

    def sendall(self, data: bytes) -> None:
        self.conn.receive(data, self.now)
        self.pending += self._drain()

    def recv(self, n: int) -> bytes:
        self.pending += self._drain()
        data, self.pending = self.pending[:n], self.pending[n:]
        if not data and not self.closed:
            raise AssertionError("the server waits for input the test did not send")
        return data

    def close(self) -> None:
        self.conn.close()


def h1(app, method: str, path: str, headers: dict) -> tuple[int, dict, bytes]:
    conn = app.connect(NOW, "-")
    head = f"{method} {path} HTTP/1.1\r\nHost: localhost\r\n" + "".join(
        f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    conn.receive(head.encode(), NOW)
    out = b"".join(bytes(b) for b in conn.outgoing)
    conn.close()
    if method == "HEAD":
        h, _, _ = out.partition(b"\r\n\r\n")
        out = h + b"\r\n\r\n"
        status, hs, _ = split_responses(out.replace(b"Content-Length", b"X-Length"))[0]
        hs["content-length"] = hs.pop("x-length")
        return status, hs, b""
    return split_responses(out)[0]


CASES = [
    ("GET", "/", {}), ("GET", "/", {"accept-encoding": "gzip, br"}),
    ("GET", "/", {"accept-encoding": "zstd"}), ("HEAD", "/css/site.css", {"accept-encoding": "br"}),
    ("GET", "/docs", {}), ("GET", "/docs?a=1&b", {}), ("GET", "/nope", {}),
    ("GET", "/", {"accept-encoding": "identity;q=0"}),
    ("GET", "/files/big.txt", {"range": "bytes=10-99"}),
    ("GET", "/files/big.txt", {"range": "bytes=999999999-"}),
    ("GET", "/files/big.txt", {"range": "bytes=0-9,5000-5009"}),  # multipart/byteranges
    ("GET", "/files/big.txt", {}), ("POST", "/", {}), ("GET", "/%zz", {}),
    ("GET", "/files/empty.txt", {}), ("GET", "/img/pixel.png", {}),
]


def test_every_answer_is_the_http1_answer(site):
    app = App(site, protocols=Plain())
    client = H2Client(MemSock(app.connect(NOW, "-")))
    etag = client.get("/").h("etag")
    cases = CASES + [("GET", "/", {"if-none-match": etag}),
                     ("GET", "/", {"if-modified-since": "Fri, 01 Jan 2100 00:00:00 GMT"})]
    got = client.fetch(cases, scheme="http")
    for (method, path, headers), r in zip(cases, got):
        status, hs, body = h1(app, method, path, headers)
        assert r.status == status, (method, path, headers)
        hs.pop("connection", None)
        assert r.headers == hs, (method, path)
        assert r.body == body, (method, path)
    assert [r.status for r in got[-2:]] == [304, 304]


def test_many_streams_and_flow_control_with_a_tiny_window(site):
    app = App(site, protocols=Plain())
    client = H2Client(MemSock(app.connect(NOW, "-")), settings={"initial_window_size": 100,
                                                                 "max_frame_size": 16384})
    paths = ["/", "/css/site.css", "/nope", "/img/pixel.png"] * 25  # 100 streams at once
    got = client.fetch([("GET", p, {}) for p in paths], scheme="http")
    assert all(r.reset is None for r in got)
    assert [r.body for r in got[::4]] == [demo_file("index.html")] * 25
    assert {r.status for r in got[2::4]} == {404}
    # the window opened wide: a large body in 16 KiB frames, byte-identical
    client.c.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 1 << 20})
    assert client.get("/files/big.txt").body == demo_file("files/big.txt")


def raw(site, data: bytes | list[bytes], now: float = NOW, limits: Limits | None = None):
    """Feed raw bytes (after the preface); return (server bytes, connection)."""
    app = App(site, limits, protocols=Plain())
    conn = app.connect(now, "-")
    sock = MemSock(conn, now)
    for chunk in [PREFACE + settings()] + ([data] if isinstance(data, bytes) else data):
        if sock.closed:
            break
        sock.sendall(chunk)
    return sock.pending + sock._drain(), conn


def request_block(path: str = "/", extra: list | None = None) -> bytes:
    from hpack import Encoder
    return Encoder().encode([(":method", "GET"), (":path", path), (":scheme", "http"),
                             (":authority", "x")] + (extra or []))


def test_padding_continuation_and_bytewise_input(site):
    block = request_block("/css/site.css")
    padded = bytes([7]) + block[:5] + b"\0" * 7
    data = (frame(HEADERS, 0x8 | 0x1, 1, padded) + frame(9, 0, 1, block[5:9])
            + frame(9, 0x4, 1, block[9:]))
    whole, _ = raw(site, data)
    bytewise, _ = raw(site, [data[i:i + 1] for i in range(len(data))])
    for out in (whole, bytewise):
        frames = read_frames(out)
        hdr = [f for f in frames if f[0] == HEADERS]
        body = b"".join(f[3] for f in frames if f[0] == DATA and f[2] == 1)
        assert len(hdr) == 1 and body == demo_file("css/site.css")


def _goaways(out: bytes) -> list[tuple[int, int]]:
    """Each GOAWAY frame's (last stream id, error code)."""
    return [struct.unpack(">LL", p[:8]) for t, _, _, p in read_frames(out) if t == GOAWAY]


def _pings(out: bytes) -> list[bytes]:
    """The payloads of the PINGs (not the ACKs) in ``out``."""
    return [p for t, f, _, p in read_frames(out) if t == 6 and not f & 1]


def test_graceful_stop_sends_goaway_and_finishes_streams(site):
    app = App(site, protocols=Plain())
    conn = app.connect(NOW, "-")
    sock = MemSock(conn)
    sock.sendall(PREFACE + settings(initial_window_size=10) + frame(HEADERS, 0x5, 1, request_block("/files/big.txt")))
    conn.shutdown(NOW)
    out, sock.pending = sock.pending + sock._drain(), b""
    assert goaway_code(out) == 0
    assert not conn.should_close  # stream 1 still owes its body (window 10)
    (ping,) = _pings(out)  # the stop's PING, answered as every client does (§6.7)
    sock.sendall(frame(6, 1, 0, ping) + frame(8, 0, 1, (1 << 30).to_bytes(4, "big"))
                 + frame(8, 0, 0, (1 << 30).to_bytes(4, "big")))
    out += sock.pending
    body = b"".join(p for t, _, s, p in read_frames(out) if t == DATA and s == 1)
    assert body == demo_file("files/big.txt")
    assert conn.shut_write or conn.should_close


def test_a_stop_takes_the_streams_sent_before_the_client_read_its_goaway(site):
    """RFC 9113 §6.8's graceful stop: a GOAWAY naming 2^31-1 with a PING; a stream the
    client sent meanwhile (before it read that GOAWAY) is answered; once the PING comes
    back, the GOAWAY naming the last stream taken; a stream after it is not answered;
    then the connection closes. A client that never answers the PING gets the second
    GOAWAY at the first tick after _DRAIN_WAIT. (One GOAWAY naming stream 1 at once
    refused stream 3 before: a request in flight at every reload failed.)"""
    app = App(site, protocols=Plain())
    conn = app.connect(NOW, "-")
    sock = MemSock(conn)
    sock.sendall(PREFACE + settings() + frame(HEADERS, 0x5, 1, request_block("/")))
    sock.pending = b""
    conn.shutdown(NOW)
    out = sock._drain()
    assert _goaways(out) == [((1 << 31) - 1, 0)] and not conn.should_close
    (ping,) = _pings(out)
    sock.sendall(frame(HEADERS, 0x5, 3, request_block("/css/site.css")))  # in flight
    sock.sendall(frame(6, 1, 0, ping))  # the ACK: now every earlier stream has arrived
    sock.sendall(frame(HEADERS, 0x5, 5, request_block("/")))  # after the last GOAWAY
    out = sock.pending
    frames = read_frames(out)
    assert {s for t, _, s, _ in frames if t == HEADERS} == {3}
    body = b"".join(p for t, _, s, p in frames if t == DATA and s == 3)
    assert body == demo_file("css/site.css")
    assert _goaways(out) == [(3, 0)]
    assert conn.shut_write or conn.should_close

    silent = app.connect(NOW, "-")  # one that never answers the PING
    sock = MemSock(silent)
    sock.sendall(PREFACE + settings())
    silent.shutdown(NOW)
    sock._drain()
    silent.tick(NOW + 0.5)
    assert not _goaways(sock._drain())  # still waiting for the ACK
    silent.tick(NOW + 1.5)
    assert _goaways(sock._drain()) == [(0, 0)] and (silent.shut_write or silent.should_close)


def test_idle_connection_goes_away(site):
    limits = Limits(idle_timeout=3)
    out, conn = raw(site, b"", limits=limits)
    conn.tick(NOW + 10)
    assert goaway_code(b"".join(bytes(b) for b in conn.outgoing)) == 0


def test_h2_ignores_the_plain_path_and_http1_is_untouched(site):
    app = App(site, protocols=Plain())
    conn = app.connect(NOW, "-")
    conn.receive(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", NOW)
    assert type(conn).__name__ == "Http1"
    assert bytes(conn.outgoing[0]).startswith(b"HTTP/1.1 200 OK")
    conn = app.connect(NOW, "-")
    conn.receive(b"PRI * HTTP/2.0\r\n\r\nXX\r\n\r\n", NOW)  # the preface's first line: HTTP/2
    assert type(conn).__name__ == "H2Front"  # and the broken rest a connection error (§3.4)
    assert goaway_code(b"".join(bytes(b) for b in conn.outgoing)) == 1  # PROTOCOL_ERROR
    conn = app.connect(NOW, "-")
    conn.receive(b"PRI / HTTP/1.1\r\nHost: x\r\n\r\n", NOW)  # not that line: HTTP/1.1 decides
    assert type(conn).__name__ == "Http1"


# -- real servers, per loop body, over TLS (ALPN h2) and h2c ----------------------------------

def h2_client(proto: str, port: int, pki) -> H2Client:
    if proto == "tls":
        s = tls_connect(port, client_context(pki, ("h2",)))
        assert s.selected_alpn_protocol() == "h2"
        return H2Client(s)
    return H2Client(socket.create_connection(("127.0.0.1", port), timeout=10))


@pytest.fixture(params=["tls", "h2c"])
def proto(request):
    return request.param


def http11(port: int, method: str, path: str, headers: dict) -> tuple[int, dict, bytes]:
    c = Conn(port)
    try:
        r = c.request(path, method=method, headers={"Host": "localhost", **headers})
        hs = dict(r.headers)
        return r.status, hs, r.body
    finally:
        c.close()


def test_h2_answers_equal_http11_on_every_loop(proto, tls_port, h2c_port, pki):
    client = h2_client(proto, tls_port if proto == "tls" else h2c_port, pki)
    try:
        etag = client.get("/").h("etag")
        cases = CASES + [("GET", "/", {"if-none-match": etag}),
                         ("HEAD", "/files/big.txt", {"range": "bytes=0-0"})]
        got = client.fetch(cases, scheme="https" if proto == "tls" else "http")
    finally:
        client.close()
    for (method, path, headers), r in zip(cases, got):
        status, hs, body = http11(h2c_port, method, path, headers)
        for h in ("date", "connection", "alt-svc"):  # Alt-Svc: TLS only (HTTP/3)
            hs.pop(h, None)
            r.headers.pop(h, None)
        assert (r.status, r.headers, r.body) == (status, hs, body), (method, path, headers)


def test_many_concurrent_streams_on_one_connection(proto, tls_port, h2c_port, pki):
    client = h2_client(proto, tls_port if proto == "tls" else h2c_port, pki)
    try:
        paths = ["/", "/css/site.css", "/nope", "/docs/", "/img/pixel.png"] * 20
        paths[3] = "/files/big.txt"
        for _ in range(3):  # 300 streams, 100 at a time (the advertised limit)
            got = client.fetch([("GET", p, {}) for p in paths])
            assert all(r.reset is None for r in got)
            assert [r.status for r in got] == [200, 200, 404, 200, 200] * 20
            assert got[3].body == demo_file("files/big.txt")
            assert got[8].body == demo_file("docs/index.html")
    finally:
        client.close()


def test_curl_and_nghttp_speak_h2c_with_prior_knowledge(h2c_port, tmp_path):
    out = tmp_path / "big"
    r = subprocess.run(["curl", "-sS", "--http2-prior-knowledge", "-o", str(out), "-w",
                        "%{http_version} %{http_code}", f"http://127.0.0.1:{h2c_port}/files/big.txt"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout == "2 200", r.stderr
    assert out.read_bytes() == demo_file("files/big.txt")
    r = subprocess.run(["nghttp", "-n", "-s", "-a", f"http://127.0.0.1:{h2c_port}/"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and " 200 " in r.stdout, r.stdout + r.stderr


def test_graceful_stop_sends_goaway_over_a_real_socket(builds, pki):
    s = tls_server(builds, "epoll", pki, "--grace", "5")
    sock = tls_connect(s.port, client_context(pki, ("h2",)))
    client = H2Client(sock)
    assert client.get("/").status == 200
    s.stop()
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    assert goaway_code(data) == 0


# -- the container: h2c on its plain port, and TLS with a certificate mounted at run time ------

@pytest.fixture(scope="module")
def container_tls(pki):
    from conftest import MODES, TEST_LIMITS
    from container_target import Container, build
    _, tag = build(DEMO, MODES["notfound"])
    os.chmod(pki.dir, 0o755)  # the container runs as uid 65534
    os.chmod(pki.key, 0o644)
    c = Container(tag, TEST_LIMITS, run_args=["-v", f"{pki.dir}:/certs:ro",
                                              "-e", "TLS_CERT=/certs/chain.pem",
                                              "-e", "TLS_KEY=/certs/key.pem"])
    yield c
    c.stop()


@pytest.fixture(scope="module")
def container_plain():
    from conftest import MODES, TEST_LIMITS
    from container_target import start
    c = start(DEMO, MODES["notfound"], TEST_LIMITS)
    yield c
    c.stop()


@pytest.mark.slow
def test_the_container_speaks_https_h2_and_h2c(container_tls, container_plain, pki, tmp_path):
    assert "https://" in container_tls.line
    for proto, port in (("tls", container_tls.port), ("h2c", container_plain.port)):
        client = h2_client(proto, port, pki)
        try:
            got = client.fetch(CASES, scheme="https" if proto == "tls" else "http")
        finally:
            client.close()
        for (method, path, headers), r in zip(CASES, got):
            status, hs, body = http11(container_plain.port, method, path, headers)
            for h in ("date", "connection"):
                hs.pop(h, None)
                r.headers.pop(h, None)
            if proto == "tls":  # HTTP/3 is advertised on the TLS port only (its port inside)
                assert r.headers.pop("alt-svc").startswith('h3=":'), (method, path)
            assert (r.status, r.headers, r.body) == (status, hs, body), (proto, method, path)
    out = tmp_path / "page"
    r = subprocess.run(["curl", "-sS", "--http2", "--cacert", pki.ca, "-o", str(out), "-w",
                        "%{http_version} %{http_code}",
                        f"https://localhost:{container_tls.port}/docs/"],
                       capture_output=True, text=True, timeout=60)
    assert r.stdout == "2 200", r.stderr
    assert out.read_bytes() == demo_file("docs/index.html")


@pytest.mark.parametrize("path", [b"\x84", b"\x04\x01/"])  # indexed; a literal never indexed
def test_memoised_header_blocks_follow_the_dynamic_table(site, path):
    """The same bytes mean another field once the dynamic table has changed."""
    gzip_in = b"\x82\x84\x86\x81" + b"\x50\x04gzip"  # accept-encoding: gzip → dynamic 62
    indexed = b"\x82" + path + b"\x86\x81\xbe"        # GET / with dynamic entry 62
    br_in = b"\x82\x84\x86\x81" + b"\x50\x02br"      # accept-encoding: br → 62 (gzip → 63)
    data = b"".join(frame(HEADERS, 0x5, sid, b) for sid, b in
                    ((1, gzip_in), (3, indexed), (5, br_in), (7, indexed)))
    out, _ = raw(site, data)
    from hpack import Decoder
    d = Decoder()
    blocks = [dict(d.decode(p)) for t, _, s, p in read_frames(out) if t == HEADERS]
    codings = [b.get("content-encoding") for b in blocks
               if b.get(":status") != "103"]  # "/" has early hints (issue 23): a 103 first
    assert codings == ["gzip", "gzip", "br", "br"]


def test_a_first_block_decoded_once_per_worker_adds_its_entries_on_every_connection(site):
    """A connection's first header block, decoded against the pristine table, is memoised
    per worker (h2._first_block); a second connection's copy of it must still add its entries
    to that connection's table: its next block refers to them (dynamic index 62)."""
    from orisha.protocols import h2 as layer
    first = b"\x82\x84\x86\x41\x07example" + b"\x50\x02br"  # :authority, accept-encoding
    again = b"\x82\x84\x86\xbf\xbe"                            # both by dynamic index
    data = b"".join(frame(HEADERS, 0x5, sid, b) for sid, b in ((1, first), (3, again)))
    from hpack import Decoder
    decoded = Decoder()
    decoded.decode(first)
    layer._FIRST.clear()
    for _ in range(2):  # the second connection's first block is the memo's
        out, conn = raw(site, data)
        table = conn.proto.decoder.header_table
        assert [bytes(n) for n, _ in table.dynamic_entries] == [b"accept-encoding", b":authority"]
        # the whole table as decoding leaves it (what decides its evictions: its size count)
        assert vars(table) == vars(decoded.header_table)
        d = Decoder()
        blocks = [dict(d.decode(p)) for t, _, s, p in read_frames(out) if t == HEADERS]
        assert [b.get("content-encoding") for b in blocks if b.get(":status") != "103"] \
            == ["br", "br"] and goaway_code(out) is None
        assert (first, 4 * Limits().head) in layer._FIRST


def test_new_connections_with_the_same_first_block_over_real_sockets(proto, tls_port, h2c_port,
                                                                     pki):
    """Three connections of one client, each sending its first block (every field indexed
    incrementally by the h2 library) then blocks that refer to those entries: every
    answer is right, the second and third connections' first blocks coming from the memo."""
    port = tls_port if proto == "tls" else h2c_port
    for _ in range(3):
        client = h2_client(proto, port, pki)
        try:
            for _ in range(2):
                r = client.get("/css/site.css", accept_encoding="gzip", user_agent="orisha-test/1")
                assert r.status == 200 and r.reset is None and client.goaway is None
                assert r.h("content-encoding") == "gzip"
        finally:
            client.close()


def _variant(site, path: bytes, coding: bytes):
    return next(v for v in site.routes[path].variants if v.coding == coding)


def test_the_build_encodes_every_heads_header_block(builds):
    """site.py carries each variant's 200 and 304 header blocks (issue 12: encoded by the
    build), equal to what hpack_blocks makes of the head; and h2 sends the build's bytes:
    a block changed in the loaded site is what goes out (nothing encodes it again)."""
    from hpack import Decoder
    from orisha.protocols.hpack_blocks import block, field
    site = load_site(builds["notfound"])
    v = _variant(site, b"/css/site.css", b"br")
    assert v.h2 and v.h2 == block(v.head) and v.h2_304 == block(v.head_304)
    entries = [e for e in site.routes.values() if hasattr(e, "variants")]
    assert all(x.h2 == block(x.head) and x.h2_304 == block(x.head_304)
               for e in entries for x in e.variants)
    marked = _variant(site, b"/css/site.css", b"br")  # a site object no server has used yet
    marked.h2 += field(b"x-block", b"from-the-build")
    etag = marked.etag.decode()
    get = [("accept-encoding", "br")]
    out, _ = raw(site, [frame(HEADERS, 0x5, 1, request_block("/css/site.css", get)),
                        frame(HEADERS, 0x5, 3, request_block("/css/site.css",
                                                             get + [("if-none-match", etag)]))])
    blocks = [p for t, _, _, p in read_frames(out) if t == HEADERS]
    d = Decoder()
    fields = [dict(d.decode(b)) for b in blocks]
    assert fields[0].get("x-block") == "from-the-build"
    assert fields[1][":status"] == "304" and "x-block" not in fields[1]
    # the build's bytes, field by field (the fields its heads share with incremental indexing,
    # hpack_blocks.vocabulary): the marked field's bytes among them, as the build made them
    assert field(b"x-block", b"from-the-build") in blocks[0]
    for sent, built in ((fields[0], marked.h2), (fields[1], marked.h2_304)):
        assert {k: v for k, v in sent.items() if k != "date"} == dict(Decoder().decode(built))


# -- a real site over https/h2: curl, nghttp and Chromium --------------------------------------

REAL = "/usr/share/doc/postgresql-doc-15/html"


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir(REAL), reason="apt-get install postgresql-doc-15 (./dev test does)")
def test_real_site_over_https_h2_with_curl_nghttp_and_chromium(pki, tmp_path):
    from conftest import orisha
    from tlsutil import serve
    build = str(tmp_path / "pg")
    r = orisha("build", REAL, "-o", build)
    assert r.returncode == 0, r.stderr
    log = tmp_path / "access.log"
    s = serve(build, "--workers", "2", "--tls-cert", pki.chain, "--tls-key", pki.key,
              "--access-log", str(log))
    try:
        base = f"https://localhost:{s.port}/"
        files = sorted(os.path.relpath(os.path.join(d, n), REAL)
                       for d, _, names in os.walk(REAL) for n in names)
        assert len(files) > 1000
        # curl: every file over h2 (multiplexed), identical to the file HTTP/1.1 serves
        config = tmp_path / "curl.cfg"
        config.write_text("".join(f'url = "{base}{f}"\noutput = "{tmp_path}/c{i}"\n'
                                  for i, f in enumerate(files)))
        r = subprocess.run(["curl", "-sS", "--http2", "-Z", "--parallel-max", "20", "--cacert",
                            pki.ca, "-w", "%{http_version} %{http_code}\\n", "-K", str(config)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        assert set(r.stdout.split("\n")[:-1]) == {"2 200"}
        for i, f in enumerate(files):
            with open(os.path.join(REAL, f), "rb") as src:
                assert (tmp_path / f"c{i}").read_bytes() == src.read(), f
        # nghttp: the whole site on one connection (sizes), and a sample byte for byte
        har = tmp_path / "nghttp.har"
        identity = "accept-encoding: identity"  # nghttp asks for gzip otherwise and keeps it
        r = subprocess.run(["nghttp", "-n", "-H", identity, f"--har={har}", *[base + f for f in files]],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        import json
        sizes = {e["request"]["url"]: (e["response"]["status"], e["response"]["content"]["size"])
                 for e in json.loads(har.read_text())["log"]["entries"]}
        for f in files:
            assert sizes[base + f] == (200, os.path.getsize(os.path.join(REAL, f))), f
        for f in files[::100]:
            r = subprocess.run(["nghttp", "-H", identity, base + f], capture_output=True, timeout=60)
            with open(os.path.join(REAL, f), "rb") as src:
                assert r.stdout == src.read(), f
        # Chromium: real pages with their stylesheet and images, nothing failed, all on h2
        from browser import chromium, load_pages
        if chromium() is None:
            pytest.skip("no Chromium (apt-get install chromium; ./dev test does)")
        from tlsutil import trusting_chromium
        wrapper = trusting_chromium(pki.cert, tmp_path)
        pages = ["index.html", "sql-select.html", "gin-implementation.html", "storage-page-layout.html",
                 "datatype-json.html", "functions-json.html"]
        before = len(log.read_text().splitlines()) if log.exists() else 0
        results = load_pages([base + p for p in pages], timeout=30, executable=str(wrapper))
        for res in results:
            assert res.ok, res.problems
        deadline = time.monotonic() + 10  # access-log lines leave the workers once a second
        while (len(log.read_text().splitlines()) - before < len(pages) + 1
               and time.monotonic() < deadline):
            time.sleep(0.1)
        lines = log.read_text().splitlines()[before:]
        assert len(lines) >= len(pages) + 1  # the pages and their stylesheet at least
        assert all('HTTP/2.0" 200' in line or "favicon" in line for line in lines), lines
    finally:
        s.stop()


def test_protocol_layers_import_no_io():
    """Like the core: orisha/protocols never imports socket, select, time, asyncio or a loop
    library (ssl only in tls.py, where the stdlib's TLS state machine is the point)."""
    import ast
    import orisha.protocols as P
    here = os.path.dirname(P.__file__)
    banned = {"socket", "select", "selectors", "time", "asyncio", "uvloop", "liburing"}
    for name in os.listdir(here):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(here, name)) as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            for m in mods:
                top = m.split(".")[0]
                assert top not in banned, f"orisha/protocols/{name} imports {m}"
                assert top != "ssl" or name == "tls.py", f"orisha/protocols/{name} imports ssl"


def test_over_the_connection_limit_h2_answers_503_and_goes_away(site):
    from orisha.protocols.front import to_h2
    app = App(site, Limits(connections=0), protocols=Plain())
    conn = app.connect(NOW, "-")  # cleartext: the protocol is unknown yet, so HTTP/1.1's 503
    assert bytes(conn.outgoing[0]).startswith(b"HTTP/1.1 503")
    conn = app.connect(NOW, "-")
    to_h2(conn, NOW, refuse=True)  # what TLS does when ALPN chose h2 for a refused connection
    sock = MemSock(conn)
    sock.sendall(PREFACE + settings() + frame(HEADERS, 0x5, 1, request_block("/")))
    out = sock.pending + sock._drain()
    from hpack import Decoder
    heads = [p for t, _, _, p in read_frames(out) if t == HEADERS]
    assert dict(Decoder().decode(heads[0]))[":status"] == "503"
    assert goaway_code(out) == 0 and conn.shut_write


# -- the connection's dynamic table (hpack_blocks.vocabulary) ------------------------------
PAGES = ["/", "/css/site.css", "/img/pixel.png", "/docs/", "/js/app.3f2a1b9c.js", "/nope",
         "/data/planets.json"]


def _responses(out: bytes, decoder) -> list[tuple[bytes, list]]:
    """The final responses' header blocks in ``out``, in order, each decoded by ``decoder``
    (one for the whole connection: the client's dynamic table): (block, fields)."""
    got = []
    for t, _, _, p in read_frames(out):
        if t == HEADERS:
            fields = decoder.decode(p, raw=True)
            if dict(fields)[b":status"] != b"103":
                got.append((p, fields))
    return got


def _requests(paths, first_sid: int = 1) -> bytes:
    return b"".join(frame(HEADERS, 0x5, first_sid + 2 * i, request_block(p))
                    for i, p in enumerate(paths))


def test_shared_fields_are_named_from_the_dynamic_table_after_their_first_response(site):
    """Sans-I/O, hpack's Decoder as the client: two rounds of seven pages on one connection
    carry the fields of the build's blocks (a peer with no dynamic table gets those bytes);
    the first round puts the site's shared fields into the table, each once, and then the
    table stops growing and every block of the second round is shorter than the build's."""
    from hpack import Decoder
    plain, _ = raw(site, settings(header_table_size=0) + _requests(PAGES * 2))
    literal = _responses(plain, Decoder())
    blocks = [p for t, _, _, p in read_frames(plain) if t == HEADERS]  # with the 103s
    assert blocks[0][:1] == b"\x20"  # the size update a smaller table is owed (§4.2), once
    assert not any(b.startswith(b"\x20") for b in blocks[1:])
    out, _ = raw(site, _requests(PAGES * 2))
    d = Decoder()
    indexed = _responses(out, d)
    assert [f for _, f in indexed] == [f for _, f in literal]  # the same fields, in order
    entries = list(d.header_table.dynamic_entries)
    assert entries and len(set(entries)) == len(entries)  # shared fields, each in once
    assert all(v for n, v in entries if n != b"date")  # no empty or per-second entries
    n = len(PAGES)
    for (block, _), (build, _) in zip(indexed[n:], literal[n:]):
        assert len(block) < len(build)
    assert sum(len(b) for b, _ in indexed[n:]) < 0.7 * sum(len(b) for b, _ in literal[n:])
    again, _ = raw(site, _requests(PAGES))  # a new connection starts with an empty table
    assert [b for b, _ in _responses(again, Decoder())] == [b for b, _ in indexed[:n]]


def test_a_peer_that_shrinks_its_table_gets_a_size_update_and_blocks_within_it(site):
    """Mid-connection SETTINGS_HEADER_TABLE_SIZE = 100 (below what went in): the next block
    starts with size updates to 0 and to 100 (RFC 7541 §4.2: the smallest, then the last),
    and the table holds at most 100 bytes from then on; the fields stay the build's."""
    from hpack import Decoder
    first, second = _requests(PAGES), _requests(PAGES, first_sid=1 + 2 * len(PAGES))
    out, _ = raw(site, [first, settings(header_table_size=100) + second])
    d = Decoder()
    got = _responses(out, d)
    blocks = [p for t, _, _, p in read_frames(out) if t == HEADERS]  # with the 103s
    updates = [i for i, b in enumerate(blocks) if b.startswith(b"\x20")]
    assert len(updates) == 1 and blocks[updates[0]].startswith(b"\x20\x3f\x45")  # 0, 100
    assert blocks[updates[0]:] and len(blocks[:updates[0]]) >= len(PAGES)  # after round one
    assert d.header_table.maxsize == 100  # (what went past it would name the wrong fields)
    assert sum(len(n) + len(v) + 32 for n, v in d.header_table.dynamic_entries) <= 100
    plain, _ = raw(site, settings(header_table_size=0) + first + second)
    assert [f for _, f in got] == [f for _, f in _responses(plain, Decoder())]


def test_the_size_update_is_sent_once_not_memoised_with_a_block(site):
    """A peer with no table asks for the same page (no early hints) three times: the first
    block starts with the size update it is owed, the others are the build's block alone."""
    from orisha.protocols.hpack_blocks import block
    out, _ = raw(site, settings(header_table_size=0) + _requests(["/css/site.css"] * 3))
    blocks = [p for t, _, _, p in read_frames(out) if t == HEADERS]
    head = next(v.head for v in site.routes[b"/css/site.css"].variants if v.coding == b"identity")
    assert [b[:len(block(head)) + 1] for b in blocks] == [b"\x20" + block(head)] + [
        block(head) + b"\x0f"] * 2  # each then its date field (static name 33: 0x0f 0x12)


def _read_until(sock: socket.socket, done, got: bytes = b"") -> bytes:
    """Read frames until ``done(frames)``; the server's bytes so far."""
    while not done(read_frames(got)):
        chunk = sock.recv(65536)
        assert chunk, read_frames(got)
        got += chunk
    return got


def test_a_reload_answers_the_stream_in_flight_when_it_began(builds, hosted):
    """Over a real socket, across a real SIGHUP: the retiring worker's GOAWAY names
    2^31-1 with a PING; a stream the client sends before it answers the PING is answered
    in full; the GOAWAY after the ACK names it as the last stream, and the connection
    closes. The new generation serves a new connection. (One GOAWAY at once, naming the
    last stream read, refused every request in flight at a reload.)"""
    s = Server(builds["notfound"], "--loop", hosted, "--workers", "1")
    try:
        sock = socket.create_connection(("127.0.0.1", s.port), timeout=30)
        sock.sendall(PREFACE + settings() + frame(HEADERS, 0x5, 1, request_block("/")))
        got = _read_until(sock, lambda fs: any(t == DATA and f & 1 and i == 1 for t, f, i, _ in fs))
        s.proc.send_signal(signal.SIGHUP)
        got = _read_until(sock, lambda fs: any(t == 6 and not f & 1 for t, f, _, _ in fs), got)
        assert _goaways(got) == [((1 << 31) - 1, 0)]
        (ping,) = _pings(got)
        sock.sendall(frame(HEADERS, 0x5, 3, request_block("/css/site.css")) + frame(6, 1, 0, ping))
        got = _read_until(sock, lambda fs: len([t for t, *_ in fs if t == GOAWAY]) == 2, got)
        while chunk := sock.recv(65536):  # then the close
            got += chunk
        frames = read_frames(got)
        assert b"".join(p for t, _, i, p in frames if t == DATA and i == 3) == demo_file("css/site.css")
        assert _goaways(got) == [((1 << 31) - 1, 0), (3, 0)]
        sock.close()
        assert H2Client(socket.create_connection(("127.0.0.1", s.port), timeout=10)).get(
            "/css/site.css").status == 200  # the new generation
    finally:
        s.stop()


def test_nghttp_decodes_the_dynamic_table_and_its_size_updates(h2c_port):
    """A real decoder (nghttp2, which refuses a block that omits a size update it is owed):
    the same pages with its default table and with none (``-c 0``): the same fields, and
    a fifth fewer header-block bytes with the table, or more (the pages share fields)."""
    urls = [f"http://127.0.0.1:{h2c_port}{p}" for p in PAGES]

    def fetch(*opts: str) -> tuple[list[str], int]:
        r = subprocess.run(["nghttp", "-nv", *opts, *urls], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr
        fields = [line.split("] ", 1)[1] for line in r.stdout.splitlines()
                  if "recv (stream_id=" in line and "date:" not in line]
        sizes = [int(line.split("length=")[1].split(",")[0]) for line in r.stdout.splitlines()
                 if "recv HEADERS frame" in line]
        return sorted(fields), sum(sizes)

    with_table, none = fetch(), fetch("-c", "0")
    assert with_table[0] == none[0] and len(with_table[0]) > 5 * len(PAGES)
    assert with_table[1] < 0.8 * none[1], (with_table[1], none[1])  # here: 692 vs 1,067
