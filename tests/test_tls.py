"""HTTPS on every hosted loop: TLS 1.3 and 1.2, ALPN, resumption, reload, hostile handshakes.

Servers run ``orisha serve --tls-cert --tls-key`` with a certificate from a test
CA made by the openssl CLI (tests/tlsutil.py); clients are curl, nghttp and
Python's ssl over real loopback sockets. Test ids carry the loop name.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from conftest import DEMO, TEST_LIMITS, demo_file, orisha
from httpraw import Conn, read_to_close, split_responses
from tlsutil import (_stop_servers, client_context, hosted, pki, serve, tls_connect,  # noqa: F401
                     h2c_port, tls_port, tls_server)

PAGES = ["/", "/css/site.css", "/docs/", "/docs/guide/getting-started", "/img/pixel.png",
         "/files/big.txt", "/files/empty.txt", "/nope"]


def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "--max-time", "30", *args], capture_output=True,
                          timeout=60)


def test_curl_gets_every_page_over_h2_and_http11_byte_identical(tls_port, pki, tmp_path):
    for version, flag in (("2", "--http2"), ("1.1", "--http1.1")):
        args = [flag, "--cacert", pki.ca, "-w", "%{http_version} %{http_code}\\n"]
        for i, path in enumerate(PAGES):
            args += ["-o", str(tmp_path / f"{i}"), f"https://localhost:{tls_port}{path}"]
        r = curl(*args)
        assert r.returncode == 0, r.stderr
        lines = r.stdout.decode().split()
        assert lines[0::2] == [version] * len(PAGES)
        for i, path in enumerate(PAGES):
            expect = demo_file("404.html") if path == "/nope" else \
                demo_file({"/": "index.html", "/docs/": "docs/index.html",
                           "/docs/guide/getting-started": "docs/guide/getting-started.html"}
                          .get(path, path[1:]))
            assert (tmp_path / f"{i}").read_bytes() == expect, (version, path)


def test_nghttp_fetches_a_page_and_its_assets(tls_port, pki):
    r = subprocess.run(["nghttp", "-n", "-s", "-a", f"https://localhost:{tls_port}/",
                        f"https://localhost:{tls_port}/files/big.txt"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "/files/big.txt" in r.stdout and " 200 " in r.stdout


@pytest.mark.parametrize("version", ["1.2", "1.3"])
@pytest.mark.parametrize("alpn,expect", [(("h2", "http/1.1"), "h2"), (("http/1.1",), "http/1.1"),
                                         ((), None)])
def test_versions_and_alpn(tls_port, pki, version, alpn, expect):
    s = tls_connect(tls_port, client_context(pki, alpn, version))
    try:
        assert s.version() == f"TLSv{version}"
        assert s.selected_alpn_protocol() == expect
        if expect != "h2":  # HTTP/1.1 inside TLS
            s.sendall(b"GET /css/site.css HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            data = read_to_close(s)
            assert data.startswith(b"HTTP/1.1 200 OK\r\n")
            assert data.endswith(demo_file("css/site.css"))
    finally:
        s.close()


def _negotiated(port: int, *how: str) -> str:
    r = subprocess.run(["openssl", "s_client", "-connect", f"127.0.0.1:{port}", *how,
                        "-servername", "localhost"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=30)
    for line in r.stdout.splitlines():
        if ", Cipher is " in line:
            return line.rsplit(" ", 1)[1]
    raise AssertionError(r.stdout[-600:] + r.stderr[-300:])


def test_the_servers_cipher_order_puts_aes128_first_and_chacha20_where_asked(tls_port, hosted):
    """The server's order (testssl.sh rates a server without one HIGH): offered AES-256 before
    AES-128, a client gets AES-128-GCM (OpenSSL's order by strength picked AES-256-GCM-SHA384,
    ~0.36M instructions of SHA-384 more per handshake); a client that puts ChaCha20 first gets
    it (OP_PRIORITIZE_CHACHA). The pure layer cannot order TLS 1.3's suites (the stdlib has
    no call for it): OpenSSL's default order there."""
    aes128 = "TLS_AES_256_GCM_SHA384" if hosted.endswith("-pure") else "TLS_AES_128_GCM_SHA256"
    assert _negotiated(tls_port, "-tls1_3", "-ciphersuites",
                       "TLS_AES_256_GCM_SHA384:TLS_AES_128_GCM_SHA256") == aes128
    assert _negotiated(tls_port, "-tls1_3", "-ciphersuites",
                       "TLS_CHACHA20_POLY1305_SHA256:TLS_AES_128_GCM_SHA256") == \
        "TLS_CHACHA20_POLY1305_SHA256"
    assert _negotiated(tls_port, "-tls1_2", "-cipher",
                       "ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384:"
                       "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256").endswith(
        "AES128-GCM-SHA256")
    assert _negotiated(tls_port, "-tls1_2", "-cipher",
                       "ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-RSA-CHACHA20-POLY1305:"
                       "ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256").endswith(
        "CHACHA20-POLY1305")


@pytest.mark.parametrize("version", ["1.2", "1.3"])
def test_session_resumption_across_workers(tls_port, pki, version):
    ctx = client_context(pki, ("http/1.1",), version)
    reused = []
    session = None
    for _ in range(6):  # two workers: resumption must work whichever accepts
        s = tls_connect(tls_port, ctx, session=session)
        s.sendall(b"GET /files/empty.txt HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
        while s.recv(65536):
            pass
        reused.append(s.session_reused)
        session = s.session  # TLS 1.3 tickets arrive after the handshake: read first
        s.close()
    assert reused[0] is False and all(reused[1:]), reused


def test_plain_http_on_the_tls_port_gets_a_clear_400(tls_port):
    c = Conn(tls_port)
    try:
        r = c.request("/")
        assert r.status == 400 and r.body == b"The plain HTTP request was sent to HTTPS port\n"
        assert r.h("connection") == "close" and c.closed()
    finally:
        c.close()


def test_a_silent_or_slow_handshake_is_dropped(tls_port):
    """head-timeout is 2 s in the suite's servers: a handshake may take no longer."""
    s = socket.create_connection(("127.0.0.1", tls_port), timeout=10)
    s.sendall(b"\x16\x03\x01\x02\x00\x01")  # the first bytes of a ClientHello, then nothing
    try:  # the server closes; our 10 s socket timeout would raise instead
        assert s.recv(100) == b""
    except ConnectionResetError:
        pass
    s.close()


@pytest.mark.parametrize("eof", [False, True])
def test_a_truncated_record_ends_the_connection(tls_port, pki, eof):
    s = tls_connect(tls_port, client_context(pki, ("http/1.1",)))
    sock = socket.socket(fileno=os.dup(s.fileno()))  # raw bytes under the TLS session
    sock.sendall(b"\x17\x03\x03\x40\x00" + b"\0" * 100)  # an application record cut short
    if eof:
        sock.shutdown(socket.SHUT_WR)
    sock.settimeout(10)  # the server closes; this timeout would raise instead
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    sock.close()
    s.close()


def test_pipelined_requests_in_many_records_under_a_backed_up_response(tls_port, pki):
    """40 HTTPS/1.1 requests, each its own TLS record, sent at once behind a 1.2 MB body:
    the server stops decrypting while that body waits for the socket and must keep the
    records it has not read yet (the compiled layer's read BIO holds them where the loop
    body left them, read from ``inpos`` on); every response comes, whole, in order."""
    s = tls_connect(tls_port, client_context(pki, ("http/1.1",)), timeout=30)
    paths = ["/files/big.txt"] + ["/css/site.css", "/img/pixel.png", "/nope"] * 13
    for i, path in enumerate(paths):
        last = b"Connection: close\r\n" if i == len(paths) - 1 else b""
        s.sendall(b"GET %s HTTP/1.1\r\nHost: localhost\r\n%s\r\n" % (path.encode(), last))
    data = read_to_close(s, (ConnectionResetError, ssl.SSLEOFError))
    s.close()
    got = split_responses(data)
    assert [status for status, _, _ in got] == [200] + [200, 200, 404] * 13
    assert got[0][2] == demo_file("files/big.txt")
    assert got[1][2] == demo_file("css/site.css") and got[2][2] == demo_file("img/pixel.png")


@pytest.mark.parametrize("which", ["cert", "key", "pair", "missing"])
def test_a_bad_certificate_or_key_is_one_line_naming_the_file(builds, pki, which):
    cert, key = {"cert": (pki.key, pki.key), "key": (pki.cert, pki.cert),
                 "pair": (pki.cert, pki.key2), "missing": (pki.cert, "/nonexistent.pem")}[which]
    r = orisha("serve", builds["notfound"], "--port", "0", "--tls-cert", cert, "--tls-key", key,
               timeout=30)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert lines[-1].startswith("orisha: error: ") and "Traceback" not in r.stderr
    named = {"cert": pki.key, "key": pki.cert, "pair": pki.key2, "missing": "/nonexistent.pem"}
    assert named[which] in lines[-1]


def test_tls_min_13_refuses_tls_12(builds, pki):
    s = tls_server(builds, "epoll", pki, "--tls-min", "1.3")
    with pytest.raises(ssl.SSLError):
        tls_connect(s.port, client_context(pki, version="1.2")).close()
    c = tls_connect(s.port, client_context(pki))
    assert c.version() == "TLSv1.3"
    c.close()


def test_sighup_loads_the_new_certificate_with_no_failed_request(builds, pki, tmp_path):
    cert, key = str(tmp_path / "cert.pem"), str(tmp_path / "key.pem")
    shutil.copy(pki.chain, cert)
    shutil.copy(pki.key, key)
    s = serve(builds["notfound"], "--loop", "epoll", "--workers", "2", "--tls-cert", cert,
              "--tls-key", key, *TEST_LIMITS)
    try:
        ctx = client_context(pki, ("http/1.1",))

        def serial() -> int:
            c = tls_connect(s.port, ctx)
            c.sendall(b"GET / HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := c.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 200 OK")
            n = c.getpeercert()["serialNumber"]
            c.close()
            return n

        before = serial()
        shutil.copy(pki.cert2, cert)
        shutil.copy(pki.key2, key)
        s.proc.send_signal(signal.SIGHUP)
        seen = set()
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # every request succeeds throughout the reload
            seen.add(serial())
            if len(seen) == 2 or (seen and before not in seen):
                break
        assert seen - {before}, "the new certificate was never served"
    finally:
        assert s.stop() == 0


@pytest.mark.parametrize("layer", ["default", "pure"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=8), st.booleans())
def test_any_bytes_on_the_tls_port_end_in_an_alert_or_a_close(builds, pki, layer, chunks,
                                                              handshake_first):
    """Sans-I/O: after garbage (or garbage after a real handshake) the connection says what to
    send and closes; nothing raises, nothing grows. ``default``: the layer a server uses (the
    compiled one where built), ``pure``: ssl.SSLObject's."""
    from orisha.core.connection import App
    from orisha.protocols import tls
    app = App(_site(builds), protocols=(tls.PureTls if layer == "pure" else tls.Tls)(_context(pki)))
    conn = app.connect(1.0, "-")
    if handshake_first:
        _client(conn, pki, "h2")
    for chunk in chunks:
        if conn.should_close:
            break
        conn.receive(chunk, 1.0)
        data = b"".join(bytes(b) for b in conn.outgoing)
        assert len(data) < 1 << 20
        conn.sent(len(data), 1.0)
    conn.receive(b"", 1.0)
    conn.tick(100.0)
    for _ in range(3):  # what is left (an alert, close_notify) goes out, then it ends
        data = b"".join(bytes(b) for b in conn.outgoing)
        conn.sent(len(data), 1.0)
        conn.tick(200.0)
    assert conn.should_close or conn.shut_write
    conn.close()
    assert app.open == 0


def test_an_idle_compiled_tls_connection_keeps_no_received_bytes(builds, pki):
    """Sans-I/O, the compiled layer: after the handshake and a request, OpenSSL has read
    everything it was handed, and the connection holds none of it while it waits (its read
    BIO reads the received bytes in place: they must not stay referenced — up to 64 KiB a
    connection)."""
    from orisha.core.connection import App
    from orisha.protocols import tls
    if tls.Tls is tls.PureTls:
        pytest.skip("the compiled TLS layer is not built")
    app = App(_site(builds), protocols=tls.Tls(_context(pki)))
    conn = app.connect(1.0, "-")
    client, exchange = _client(conn, pki, "http/1.1")
    assert conn.inbuf == b""
    client.write(b"GET / HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"p" * 3000 + b"\r\n\r\n")
    exchange()
    assert client.read(12) == b"HTTP/1.1 200"
    assert conn.inbuf == b"" and not conn.should_close
    conn.close()


def _client(conn, pki, alpn: str):
    """A client ``ssl.SSLObject`` over memory BIOs, its handshake with the sans-I/O ``conn``
    done: (the client, ``exchange()`` — one round of bytes each way)."""
    cin, cout = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context(pki, (alpn,)).wrap_bio(cin, cout, server_hostname="localhost")

    def exchange():
        out = cout.read()
        if out:
            conn.receive(out, 1.0)
        data = b"".join(bytes(b) for b in conn.outgoing)
        conn.sent(len(data), 1.0)
        cin.write(data)

    for _ in range(4):
        try:
            client.do_handshake()
        except ssl.SSLWantReadError:
            pass
        exchange()
    return client, exchange


_cache: dict = {}


def _site(builds):
    from orisha.serving.server import load_site
    return _cache.setdefault("site", load_site(builds["notfound"]))


def _context(pki):
    from orisha.protocols import tls
    return _cache.setdefault("ctx", tls.context(pki.chain, pki.key))


def test_a_client_hello_on_the_plain_port_gets_400(h2c_port, pki):
    cin, cout = ssl.MemoryBIO(), ssl.MemoryBIO()
    client = client_context(pki).wrap_bio(cin, cout, server_hostname="localhost")
    with pytest.raises(ssl.SSLWantReadError):
        client.do_handshake()
    s = socket.create_connection(("127.0.0.1", h2c_port), timeout=10)
    s.sendall(cout.read())
    data = read_to_close(s, ConnectionResetError)
    s.close()
    assert data.startswith(b"HTTP/1.1 400 Bad Request\r\n")


def test_ktls_is_probed_and_the_reason_given(monkeypatch, tmp_path):
    from orisha.protocols import tls
    if not hasattr(ssl, "OP_ENABLE_KTLS"):
        assert "has no ssl.OP_ENABLE_KTLS" in tls.probe_ktls()
        monkeypatch.setattr(ssl, "OP_ENABLE_KTLS", 1 << 3, raising=False)
    ulp = tmp_path / "ulp"
    monkeypatch.setattr(tls, "ULP", str(ulp))
    assert "not Linux" in tls.probe_ktls()
    ulp.write_text("mptcp\n")  # this machine's kernel: no tls module loaded
    assert tls.probe_ktls() == "kTLS off: the kernel offers no 'tls' ULP (has: mptcp)"
    ulp.write_text("mptcp tls\n")  # even then: OpenSSL enables kTLS on socket BIOs only
    assert "memory BIOs" in tls.probe_ktls()


def test_the_compiled_tls_layer_serves_by_default_and_orisha_pure_falls_back(builds, pki):
    """The build made orisha/protocols/compiled_tls (setup.py, as ./dev installs it): a server
    speaks TLS through it (its worker maps the module) and says so; ORISHA_PURE=1 serves
    through ssl.SSLObject instead."""
    env = {k: v for k, v in os.environ.items() if k != "ORISHA_PURE"}
    for extra, layer in (({}, "tls compiled: OpenSSL called from C"),
                         ({"ORISHA_PURE": "1"}, "tls pure: ssl.SSLObject")):
        s = serve(builds["notfound"], "--loop", "epoll", "--workers", "1", "--tls-cert",
                  pki.chain, "--tls-key", pki.key, *TEST_LIMITS, env={**env, **extra})
        try:
            for alpn in (("h2",), ("http/1.1",)):
                c = tls_connect(s.port, client_context(pki, alpn))
                assert c.selected_alpn_protocol() == alpn[0]
                if alpn == ("http/1.1",):
                    c.sendall(b"GET /css/site.css HTTP/1.1\r\nHost: localhost\r\n"
                              b"Connection: close\r\n\r\n")
                    assert read_to_close(c).endswith(demo_file("css/site.css"))
                c.close()
            worker = subprocess.run(["pgrep", "-P", str(s.proc.pid)], capture_output=True,
                                    text=True).stdout.split()[0]
            with open(f"/proc/{worker}/maps") as f:
                assert ("protocols/compiled_tls.cpython" in f.read()) == (not extra)
        finally:
            assert s.stop() == 0
        assert layer in s.proc.stderr.read()


def test_idle_keep_alive_tls_connections_let_their_record_buffers_go(builds, pki):
    """Over real sockets, one epoll worker: 150 keep-alive connections, a request each (6 KB of
    head in, 40 KB of body out), then idle past a tick; then 150 more the same way — over HTTPS
    and, as the baseline, over cleartext HTTP. A busy TLS connection keeps OpenSSL's two record
    buffers (~34 KB) between requests; an idle one lets them go at its tick (the TLS layer's,
    the same on every loop), so the second 150 reuse the first's: measured here, ~14 KiB more
    than cleartext per idle connection, ~46 KiB keeping the buffers. (Epoll, because io_uring's
    ring of receive buffers — 16 MB, shared — is paged in by receives, not connections.)"""
    loop = "epoll"
    from test_server import children, rss_kib
    pad, want = b"p" * 6000, demo_file("files/big.txt")[:40000]

    def get(c) -> None:
        c.sendall(b"GET /files/big.txt HTTP/1.1\r\nHost: localhost\r\nRange: bytes=0-39999\r\n"
                  b"X-Pad: %s\r\n\r\n" % pad)
        data = b""
        while b"\r\n\r\n" not in data:
            data += c.recv(65536)
        head, body = data.split(b"\r\n\r\n", 1)
        length = int(head.split(b"ontent-Length: ")[1].split(b"\r\n")[0])
        while len(body) < length:
            body += c.recv(65536)
        assert head.startswith(b"HTTP/1.1 206") and body == want

    def growth(tls: bool) -> float:
        """KiB the worker grows by per idle connection, from the first 150 to the second."""
        s = serve(builds["notfound"], "--loop", loop, "--workers", "1", "--idle-timeout", "60",
                  *(["--tls-cert", pki.chain, "--tls-key", pki.key] if tls else []))
        ctx = client_context(pki, ("http/1.1",))
        held, rss = [], []
        try:
            worker = children(s.proc.pid)[0]
            for _ in range(2):
                for _ in range(150):
                    raw = socket.create_connection(("127.0.0.1", s.port), timeout=10)
                    held.append(ctx.wrap_socket(raw, server_hostname="localhost") if tls else raw)
                    get(held[-1])
                time.sleep(2.5)  # idle past at least one tick of the worker (once a second)
                rss.append(rss_kib(worker))
            get(held[0])  # all still open, and a connection's buffers come back when it is busy
            get(held[-1])
        finally:
            for c in held:
                c.close()
            s.stop()
        return (rss[1] - rss[0]) / 150

    clear, tls = growth(False), growth(True)
    assert tls - clear < 24, f"an idle HTTPS connection: {tls:.1f} KiB, cleartext: {clear:.1f}"
