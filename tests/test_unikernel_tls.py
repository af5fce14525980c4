"""HTTPS served by the booted unikernel itself (issue 15): mbedTLS in the image.

The demo site is built with ``--tls-cert``/``--tls-key`` from a test CA
(tests/tlsutil.py) and booted with ``orisha boot --port P --http-port Q``: P
reaches the guest's TLS port 443, Q its plain port 80. Clients are curl and
Python's ssl with that CA on real loopback sockets.

The whole conformance suite (tests/test_conformance.py) runs again over HTTPS:
its tests are imported here, and their ``port`` and ``spa_port`` fixtures are
overridden by a TLS client relay — plain TCP from the test to the relay, TLS
(verified against the CA, ALPN http/1.1) from the relay to the guest, each
direction's EOF passed on as close_notify plus FIN, and a reset as a reset — so
every behaviour (framing, pipelining, timeouts, ranges, errors) is checked with
TLS underneath, byte for byte as on the plain port.

A bad key or certificate fails the build with one line naming the file and no
output directory (orisha/targets/unikernel/certs.py).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import ssl
import struct
import subprocess
import sys
import tempfile
import threading
import time

import pytest
from hypothesis import HealthCheck, given, settings as hsettings
from hypothesis import strategies as st
from conftest import DEMO, MODES, ROOT, TEST_LIMITS, demo_file, orisha
from httpraw import read_to_close
from tlsutil import client_context, make_pki, serve
from unikernel_target import build, with_test_cpus

from test_conformance import *  # noqa: F401,F403  (the suite, run again over TLS below)

pytestmark = pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None,
                                reason="apt-get install qemu-system-x86")

WAIT = 60
PAGES = ["/", "/css/site.css", "/docs/", "/docs/guide/getting-started", "/img/pixel.png",
         "/files/big.txt", "/files/empty.txt", "/files/caf%C3%A9%20men%C3%BC.txt", "/nope"]
FILES = {"/": "index.html", "/docs/": "docs/index.html",
         "/docs/guide/getting-started": "docs/guide/getting-started.html",
         "/files/caf%C3%A9%20men%C3%BC.txt": "files/café menü.txt", "/nope": "404.html"}


class TlsBoot:
    """``orisha boot OUT --port 0 --http-port 0`` of a TLS build: ``port`` (https) and
    ``http_port`` from its serving line, the serial log kept."""

    def __init__(self, out: str, *limits: str) -> None:
        self.out = out
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "orisha.cli", "boot", out, "--port", "0", "--http-port", "0",
             *with_test_cpus([*TEST_LIMITS, *limits])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            cwd=ROOT)
        threading.Thread(target=lambda: self.log.extend(self.proc.stderr), daemon=True).start()
        self.line = self.proc.stdout.readline()
        m = re.search(r"https://127\.0\.0\.1:(\d+)/ and http://127\.0\.0\.1:(\d+)/", self.line)
        if not m:
            self.proc.kill()
            self.proc.wait()
            raise RuntimeError(f"no serving line: {self.line!r}\n{''.join(self.log)}")
        self.port, self.http_port = int(m.group(1)), int(m.group(2))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


class Relay:
    """Plain TCP in, TLS to the guest out: one thread per direction of each connection,
    the SSLObject shared under a lock (sends happen outside it, so a full window on
    one side never stalls the other)."""

    def __init__(self, target: int, ctx: ssl.SSLContext) -> None:
        self.target, self.ctx = target, ctx
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.server.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:  # closed: the module is done
                return
            threading.Thread(target=self._connection, args=(client,), daemon=True).start()

    def _connection(self, client: socket.socket) -> None:
        up = socket.create_connection(("127.0.0.1", self.target), timeout=WAIT)
        up.settimeout(None)
        inc, out = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = self.ctx.wrap_bio(inc, out, server_hostname="localhost")
        try:
            while True:  # the handshake, before any byte of the client's
                try:
                    tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    up.sendall(out.read())
                    data = up.recv(65536)
                    if not data:
                        raise ConnectionResetError("EOF in the handshake")
                    inc.write(data)
            up.sendall(out.read())
        except OSError:  # ssl.SSLError too: the guest refused the handshake
            _reset(client)
            up.close()
            return
        lock = threading.Lock()
        down = threading.Thread(target=self._down, args=(tls, inc, lock, up, client), daemon=True)
        down.start()
        try:
            self._up(tls, out, lock, client, up)
            down.join()
        finally:  # whatever happened, the test's socket ends (never a silent hang)
            client.close()
            up.close()

    @staticmethod
    def _up(tls, out, lock, client: socket.socket, up: socket.socket) -> None:
        """Client -> guest: plaintext encrypted; EOF as close_notify and FIN."""
        while True:
            try:
                data = client.recv(65536)
            except OSError:  # the client reset: so does the relay
                _reset(up)
                return
            with lock:
                if data:
                    try:
                        tls.write(data)
                    except ssl.SSLError:  # the guest ended the session: the rest is dropped,
                        return            # and its FIN ends the other direction
                else:
                    try:
                        tls.unwrap()  # close_notify; the guest's own is not awaited
                    except (ssl.SSLWantReadError, ssl.SSLError):
                        pass
                record = out.read()
            try:
                up.sendall(record)
                if not data:
                    up.shutdown(socket.SHUT_WR)
                    return
            except OSError:  # the guest is gone; the other direction reports how
                return

    @staticmethod
    def _down(tls, inc, lock, up: socket.socket, client: socket.socket) -> None:
        """Guest -> client: records decrypted; FIN as FIN, a reset as a reset."""
        while True:
            try:
                data = up.recv(65536)
            except OSError:
                _reset(client)
                return
            if not data:
                try:
                    client.shutdown(socket.SHUT_WR)
                except OSError:  # the client is gone
                    pass
                return
            plain = bytearray()
            with lock:
                inc.write(data)
                while True:
                    try:
                        chunk = tls.read(65536)
                    except (ssl.SSLWantReadError, ssl.SSLZeroReturnError):
                        break  # need more; or the guest's close_notify (its FIN follows)
                    except ssl.SSLError:  # a record the client rejects: shown as a reset
                        _reset(client)
                        _reset(up)
                        return
                    if not chunk:
                        break
                    plain += chunk
            try:
                client.sendall(plain)
            except OSError:  # the client went away: stop reading for it
                _reset(up)
                return


def _reset(s: socket.socket) -> None:
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:  # already closed
        pass
    s.close()


@pytest.fixture(scope="module")
def tls_pki(tmp_path_factory):
    return make_pki(str(tmp_path_factory.mktemp("pki")))


_boots: dict = {}


def _boot(pki, mode: str) -> TlsBoot:
    if mode not in _boots:
        tmp = tempfile.mkdtemp(prefix="orisha-uk-tls-")
        out = os.path.join(tmp, "out")
        build(DEMO, [*MODES[mode], "--tls-cert", pki.chain, "--tls-key", pki.key], out)
        _boots[mode] = (TlsBoot(out), tmp)
    return _boots[mode][0]


@pytest.fixture(scope="module", autouse=True)
def _stop_boots():
    yield
    for vm, tmp in _boots.values():
        vm.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    _boots.clear()


@pytest.fixture(scope="module")
def vm(tls_pki):
    return _boot(tls_pki, "notfound")


# -- the conformance suite over TLS: its fixtures, overridden for this module --------------

@pytest.fixture(scope="module")
def loop():
    return "unikernel"


@pytest.fixture(scope="module")
def port(vm, tls_pki):
    relay = Relay(vm.port, client_context(tls_pki, ("http/1.1",)))
    yield relay.port
    relay.close()


@pytest.fixture(scope="module")
def spa_port(tls_pki):
    relay = Relay(_boot(tls_pki, "spa").port, client_context(tls_pki, ("http/1.1",)))
    yield relay.port
    relay.close()


# -- HTTPS itself ---------------------------------------------------------------------------

def curl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["curl", "-sS", "--max-time", "30", *args], capture_output=True,
                          timeout=60)


@pytest.mark.parametrize("version", ["1.2", "1.3"])
def test_curl_gets_every_page_byte_identical(vm, tls_pki, tmp_path, version):
    """curl with the test CA (certificate verified, HTTP/1.1): every page as in the
    site, and as the plain port serves it."""
    args = ["--http1.1", "--cacert", tls_pki.ca, f"--tlsv{version}", "--tls-max", version,
            "-w", "%{http_version} %{http_code} %{ssl_verify_result}\\n"]
    for i, path in enumerate(PAGES):
        args += ["-o", str(tmp_path / f"s{i}"), f"https://localhost:{vm.port}{path}",
                 "-o", str(tmp_path / f"p{i}"), f"http://127.0.0.1:{vm.http_port}{path}"]
    r = curl(*args)
    assert r.returncode == 0, r.stderr
    rows = r.stdout.decode().splitlines()
    assert [row.split()[0] for row in rows] == ["1.1"] * 2 * len(PAGES)
    assert [row.split()[2] for row in rows[0::2]] == ["0"] * len(PAGES)  # verified
    for i, path in enumerate(PAGES):
        expect = demo_file(FILES.get(path, path[1:]))
        assert (tmp_path / f"s{i}").read_bytes() == expect, path
        assert (tmp_path / f"p{i}").read_bytes() == expect, path


@pytest.mark.parametrize("version", ["1.2", "1.3"])
def test_versions_and_alpn(vm, tls_pki, version):
    """ALPN: h2 when offered (RFC 9113 §3.2; over TLS 1.2 too: every 1.2 suite here is
    ECDHE with an AEAD, §9.2.2), else http/1.1."""
    ctx = client_context(tls_pki, ("h2", "http/1.1"), version)
    with socket.create_connection(("127.0.0.1", vm.port), timeout=WAIT) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as s:
        assert s.version() == f"TLSv{version}" and s.selected_alpn_protocol() == "h2"
    ctx = client_context(tls_pki, ("http/1.1",), version)
    with socket.create_connection(("127.0.0.1", vm.port), timeout=WAIT) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as s:
        assert s.version() == f"TLSv{version}"
        assert s.selected_alpn_protocol() == "http/1.1"
        s.sendall(b"GET /css/site.css HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = read_to_close(s)
    assert data.startswith(b"HTTP/1.1 200 OK\r\n")
    assert data.endswith(demo_file("css/site.css"))


def test_every_key_exchange_group_with_key_shares_made_ahead(tls_pki):
    """ECDHE over x25519, P-256 (key shares the idle loop made ahead: tls.c
    tls_prepare, the link's --wrap=psa_generate_key/psa_export_public_key) and
    P-384 (made in the handshake), TLS 1.3 and (P-256) 1.2, through curl: each handshake
    completes (the client checks the server's share against the transcript and
    the signature) and the page arrives whole; the stop's stats line shows that
    the x25519 and P-256 shares came from the pool."""
    vm = TlsBoot(_boots_out(tls_pki))
    pooled = 0
    try:
        # TLS 1.2 with a client offering only x25519 or only P-384 fails ("wrong curve":
        # the image answers with P-256) before issue 32 too: a separate bug, left out here.
        for group, version in (("X25519", "--tlsv1.3"), ("P-256", "--tlsv1.2"),
                               ("P-256", "--tlsv1.3"), ("P-384", "--tlsv1.3")):
            for _ in range(3):
                r = curl("--cacert", tls_pki.ca, "--curves", group, version, "--tls-max",
                         version[-3:], "-o", "-", f"https://localhost:{vm.port}/css/site.css")
                assert r.returncode == 0 and r.stdout == demo_file("css/site.css"), \
                    (group, version, r.stderr)
                pooled += group != "P-384"
    finally:
        assert vm.stop() == 0
    # One line per core at the stop (each core's handshakes and pool): their sums.
    lines = [s for s in vm.log if "orisha: tls handshakes" in s]
    got = [dict(re.findall(r"(\w+) (\d+)", s.split("orisha: ", 1)[1])) for s in lines]
    handshakes, pooled_keys = (sum(int(g[k]) for g in got) for k in ("handshakes", "pooled_keys"))
    assert handshakes == 12 and pooled_keys >= pooled // 2, lines


def test_big_downloads_in_parallel(vm, tls_pki, tmp_path):
    """Eight 1.2 MB downloads at once over TLS: whole, and the kernel still answers."""
    procs = [subprocess.Popen(["curl", "-sS", "--max-time", "60", "--cacert", tls_pki.ca,
                               "-o", str(tmp_path / f"b{i}"), f"https://localhost:{vm.port}/files/big.txt"],
                              stderr=subprocess.PIPE) for i in range(8)]
    for p in procs:
        assert p.wait(90) == 0, p.stderr.read()
    big = demo_file("files/big.txt")
    for i in range(8):
        assert (tmp_path / f"b{i}").read_bytes() == big


def _exchange(port: int, data: bytes) -> bytes:
    """Send DATA, read to EOF: everything the server wrote. A reset fails (it would
    destroy an answer the client has not read: the server must linger)."""
    with socket.create_connection(("127.0.0.1", port), timeout=WAIT) as s:
        s.sendall(data)
        got = b""
        while chunk := s.recv(4096):
            got += chunk
    return got


def test_plain_http_on_the_tls_port_gets_the_hosted_layers_400(vm, tls_pki, builds):
    """A plain HTTP request on the TLS port: the same bytes as the Python TLS layer
    (nginx's 400 in plain text, orisha/protocols/tls.py, whose bytes the image takes
    from the build) apart from Date, then a FIN after a lingering close, never a
    reset, with a pipelined request behind it too."""
    hosted = serve(builds["notfound"], "--no-http3",  # the image has no HTTP/3: no Alt-Svc
                   "--tls-cert", tls_pki.chain, "--tls-key", tls_pki.key,
                   "--workers", "1", *TEST_LIMITS)
    try:
        for request in (b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
                        b"HEAD /css/site.css HTTP/1.1\r\nHost: x\r\n\r\nGET / HTTP/1.1\r\n\r\n"):
            ours, theirs = (re.sub(rb"\r\nDate: [^\r]*\r\n", b"\r\nDate: -\r\n", _exchange(p, request))
                            for p in (vm.port, hosted.port))
            assert ours.startswith(b"HTTP/1.1 400 Bad Request\r\n") and b"\r\nDate: -\r\n" in ours
            assert ours == theirs
    finally:
        hosted.stop()
    assert vm.proc.poll() is None, "".join(vm.log)


def test_a_silent_handshake_is_dropped_after_the_head_timeout(vm):
    """TCP connected, no ClientHello: closed after --head-timeout (2 s here), as the
    Python TLS layer bounds handshakes."""
    with socket.create_connection(("127.0.0.1", vm.port), timeout=WAIT) as s:
        s.settimeout(10)
        try:
            assert s.recv(1) == b""
        except ConnectionResetError:
            pass


def _rsa_leaf(pki, folder) -> tuple[str, str]:
    """A 2048-bit RSA leaf for localhost signed by the test CA."""
    run = lambda *a: subprocess.run(["openssl", *a], cwd=folder, check=True,  # noqa: E731
                                    capture_output=True, timeout=60)
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "rsa.key", "-out", "rsa.csr",
        "-subj", "/CN=localhost")
    run("x509", "-req", "-in", "rsa.csr", "-CA", pki.ca, "-CAkey", os.path.join(pki.dir, "ca.key"),
        "-CAcreateserial", "-out", "rsa.pem", "-days", "3",
        "-extfile", os.path.join(pki.dir, "leaf.ext"))
    return os.path.join(folder, "rsa.pem"), os.path.join(folder, "rsa.key")


def test_an_rsa_certificate_over_tls12_and_tls13(tls_pki, tmp_path):
    """RSA keys sign with PKCS#1 v1.5 (TLS 1.2) and PSS (TLS 1.3, rsa_pss_rsae_*)."""
    cert, key = _rsa_leaf(tls_pki, str(tmp_path))
    out = str(tmp_path / "out")
    build(DEMO, ["--tls-cert", cert, "--tls-key", key], out)
    booted = TlsBoot(out)
    try:
        for version in ("1.2", "1.3"):
            r = curl("--cacert", tls_pki.ca, f"--tlsv{version}", "--tls-max", version,
                     "-o", str(tmp_path / "page"), f"https://localhost:{booted.port}/css/site.css")
            assert r.returncode == 0, (version, r.stderr)
            assert (tmp_path / "page").read_bytes() == demo_file("css/site.css")
    finally:
        booted.stop()


def test_a_session_on_every_connection_slot(vm, tls_pki):
    """127 TLS sessions open at once (the kernel's 128 PCBs, less the listener's share):
    the TLS heap holds them all, and each answers a request."""
    ctx = client_context(tls_pki, ("http/1.1",))
    socks = []
    try:
        for _ in range(127):  # each asks at once: under TCG the handshakes outlast --idle-timeout
            raw = socket.create_connection(("127.0.0.1", vm.port), timeout=WAIT)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            socks.append(ctx.wrap_socket(raw, server_hostname="localhost"))
            socks[-1].sendall(b"GET /css/site.css HTTP/1.1\r\nHost: x\r\n\r\n")
        for s in socks:
            data = b""
            while not data.endswith(demo_file("css/site.css")):
                chunk = s.recv(65536)
                assert chunk, data[:100]
                data += chunk
            assert data.startswith(b"HTTP/1.1 200 OK\r\n")
    finally:
        for s in socks:
            s.close()


def _junk(rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    noise = lambda n: bytes(rng.randrange(256) for _ in range(n))  # noqa: E731
    if kind == 0:
        return noise(rng.randint(1, 3000))  # anything
    if kind == 1:  # a ClientHello's first bytes, then noise
        return b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + noise(rng.randint(0, 600))
    if kind == 2:  # a record shorter than the message it announces
        return b"\x16\x03\x01\x00\x05hello" + noise(50)
    return b"\x17\x03\x03\x40\x00" + noise(20000)  # application data before any handshake


def test_junk_on_the_tls_port_ends_in_a_close_and_the_kernel_serves_on(vm, tls_pki):
    """200 connections of bytes no handshake can come from (random, truncated, out of
    order): each ends in an alert or a close, never a PANIC; HTTPS works after them."""
    rng = random.Random(15)
    for i in range(200):
        junk = _junk(rng)
        with socket.create_connection(("127.0.0.1", vm.port), timeout=15) as s:
            s.sendall(junk)
            s.shutdown(socket.SHUT_WR)
            try:
                while s.recv(65536):
                    pass
            except ConnectionResetError:  # a close with our bytes unread
                pass
            except TimeoutError:
                raise AssertionError(f"connection {i} ({len(junk)} bytes from {junk[:6].hex()}) "
                                     "was never closed; serial log:\n" + "".join(vm.log[-20:]))
    assert vm.proc.poll() is None, "".join(vm.log)
    ctx = client_context(tls_pki, ("http/1.1",))
    with socket.create_connection(("127.0.0.1", vm.port), timeout=WAIT) as raw, \
            ctx.wrap_socket(raw, server_hostname="localhost") as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert s.recv(12) == b"HTTP/1.1 200"


def test_sigterm_drains_a_slow_tls_download(tls_pki):
    """SIGTERM to ``orisha boot`` mid-download: every byte of the body still arrives over
    TLS, then close_notify and EOF, and the command exits 0 after ``drained``."""
    vm = TlsBoot(_boots_out(tls_pki))
    try:
        ctx = client_context(tls_pki, ("http/1.1",))
        raw = socket.socket()
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16384)  # a slow reader's window
        raw.settimeout(WAIT)
        raw.connect(("127.0.0.1", vm.port))
        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
            s.sendall(b"GET /files/big.txt HTTP/1.1\r\nHost: x\r\n\r\n")
            got = s.recv(65536)
            vm.proc.send_signal(signal.SIGTERM)
            while True:
                try:
                    chunk = s.recv(8192)
                except ssl.SSLZeroReturnError:  # close_notify: the end, as EOF
                    break
                if not chunk:
                    break
                got += chunk
        head, _, body = got.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and body == demo_file("files/big.txt"), len(body)
        assert vm.proc.wait(WAIT) == 0, "".join(vm.log)
        assert any("orisha: drained" in line for line in vm.log)
    finally:
        if vm.proc.poll() is None:
            vm.proc.kill()
            vm.proc.wait()


def test_sigterm_drains_an_h2_download_after_goaway(tls_pki):
    """SIGTERM with an h2 download in flight: GOAWAY NO_ERROR, the stream still ends
    whole, and ``orisha boot`` exits 0 (h2.py's graceful stop). Raw frames: the h2
    library treats a GOAWAY as the end of everything."""
    from hpack import Encoder
    from h2util import DATA, GOAWAY, PREFACE, frame, settings
    vm = TlsBoot(_boots_out(tls_pki))
    try:
        sock = h2_connect(vm, tls_pki)
        block = Encoder().encode([(":method", "GET"), (":path", "/files/big.txt"),
                                  (":scheme", "https"), (":authority", "localhost")])
        sock.sendall(PREFACE + settings(initial_window_size=(1 << 31) - 1)
                     + frame(8, 0, 0, struct.pack(">I", (1 << 31) - 1 - 65535))
                     + frame(1, 0x5, 1, block))
        buf, body, ended, goaway = b"", b"", False, None
        # The GOAWAY may also follow the stream's end: the stop reaches the guest through
        # its console, polled every 50 ms, and the whole body can be out by then.
        while not ended or goaway is None:
            data = sock.recv(65536)
            assert data, (len(body), goaway)
            buf += data
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                n = int.from_bytes(buf[:3], "big")
                ftype, flags, payload, buf = buf[3], buf[4], buf[9:9 + n], buf[9 + n:]
                if ftype == DATA:
                    if not body:
                        vm.proc.send_signal(signal.SIGTERM)
                    body += payload
                    ended = bool(flags & 1)
                elif ftype == GOAWAY:
                    goaway = int.from_bytes(payload[4:8], "big")
        sock.close()
        assert body == demo_file("files/big.txt") and goaway == 0
        assert vm.proc.wait(WAIT) == 0, "".join(vm.log)
    finally:
        if vm.proc.poll() is None:
            vm.proc.kill()
            vm.proc.wait()


def test_over_the_connection_limit_tls_answers_503_and_h2_goes_away(tls_pki):
    """--max-connections 1 with one connection held on every core: HTTPS/1.1 gets HTTP/1.1's
    503; an h2 connection gets a 503 per stream and GOAWAY NO_ERROR (h2.py's refusal).

    The limit is per core, as it is per worker on the hosted server (a core is a worker:
    the serving line counts them): each core admits its own connections (those its hash
    or its tap queue gives it). So with more cores (ORISHA_TEST_CPUS=2) connections are
    held until every core has admitted one; later ones get 503 whichever core they reach."""
    from hpack import Decoder, Encoder
    from h2util import HEADERS, PREFACE, frame, goaway_code, read_frames, settings
    vm = TlsBoot(_boots_out(tls_pki), "--max-connections", "1")
    cores = int(re.search(r"(\d+) workers?", vm.line).group(1))
    held = []
    try:
        for _ in range(32 * cores):  # a new source port each: each core is hit at random
            c = socket.create_connection(("127.0.0.1", vm.http_port), timeout=WAIT)
            c.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            status = c.recv(12)
            if status != b"HTTP/1.1 200":  # a core already full
                assert status == b"HTTP/1.1 503", status
                c.close()
                continue
            held.append(c)
            if len(held) == cores:
                break
        assert len(held) == cores, (len(held), cores)
        ctx = client_context(tls_pki, ("http/1.1",))
        with socket.create_connection(("127.0.0.1", vm.port), timeout=WAIT) as raw, \
                ctx.wrap_socket(raw, server_hostname="localhost") as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(12) == b"HTTP/1.1 503"
        s = h2_connect(vm, tls_pki)
        block = Encoder().encode([(":method", "GET"), (":path", "/"), (":scheme", "https"),
                                  (":authority", "x")])
        s.sendall(PREFACE + settings() + frame(HEADERS, 0x5, 1, block))
        out = read_to_close(s, OSError)  # or a reset after the close
        heads = [p for t, _, _, p in read_frames(out) if t == HEADERS]
        assert dict(Decoder().decode(heads[0]))[":status"] == "503"
        assert goaway_code(out) == 0
    finally:
        for c in held:
            c.close()
        vm.stop()


def _boots_out(pki) -> str:
    """The notfound TLS build's output folder (booted again by tests that stop their VM)."""
    _boot(pki, "notfound")
    return _boots["notfound"][0].out


# -- HTTP/2 (ALPN h2): the Python layer's tests, against the image -------------------------

def h2_connect(vm, pki) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", vm.port), timeout=WAIT)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s = client_context(pki).wrap_socket(s, server_hostname="localhost")
    assert s.selected_alpn_protocol() == "h2"
    return s


def test_h2_answers_equal_the_plain_ports_http11_answers(vm, tls_pki):
    """tests/test_h2.py's cases (negotiation, ranges and multipart, redirects, 304, HEAD,
    404, 405, 400) over h2 on the TLS port: each the same status, fields and body as
    HTTP/1.1 on the image's port 80, Date and Connection aside. test_h2.py's own test,
    with the image's ports for its TLS and cleartext ones."""
    from test_h2 import test_h2_answers_equal_http11_on_every_loop as same_answers
    same_answers("tls", vm.port, vm.http_port, tls_pki)


def test_h2_many_concurrent_streams_on_one_connection(vm, tls_pki):
    """300 streams, 100 at a time (the advertised limit): test_h2.py's own test."""
    from test_h2 import test_many_concurrent_streams_on_one_connection as many_streams
    many_streams("tls", vm.port, None, tls_pki)


def test_h2_with_a_tiny_window(vm, tls_pki):
    """A client window of 1 KiB, opened as it reads: 64 KiB of a download (64 windows:
    a round trip each) and two pages beside it arrive whole."""
    from h2util import H2Client
    client = H2Client(h2_connect(vm, tls_pki), settings={"initial_window_size": 1024})
    try:
        got = client.fetch([("GET", "/files/big.txt", {"range": "bytes=0-65535"}),
                            ("GET", "/css/site.css", {}), ("GET", "/", {})])
        assert got[0].status == 206 and got[0].body == demo_file("files/big.txt")[:65536]
        assert got[1].body == demo_file("css/site.css")
        assert got[2].body == demo_file("index.html")
    finally:
        client.close()


def test_h2_a_stalled_stream_does_not_hold_the_others(vm, tls_pki):
    """Stream windows of 0 (SETTINGS), opened for stream 3 only: stream 3's page arrives
    whole while stream 1's download waits with its HEADERS sent (DATA round robin)."""
    from hpack import Encoder
    from h2util import DATA, HEADERS, PREFACE, frame, read_frames, settings
    enc = Encoder()
    req = lambda sid, path: frame(HEADERS, 0x5, sid, enc.encode(  # noqa: E731
        [(":method", "GET"), (":path", path), (":scheme", "https"), (":authority", "x")]))
    s = h2_connect(vm, tls_pki)
    s.sendall(PREFACE + settings(initial_window_size=0) + frame(8, 0, 0, struct.pack(">I", 1 << 20))
              + req(1, "/files/big.txt") + req(3, "/css/site.css")
              + frame(8, 0, 3, struct.pack(">I", 1 << 20)))
    got, frames = b"", []
    s.settimeout(10)
    while not any(t == DATA and sid == 3 and flags & 1 for t, flags, sid, _ in frames):
        chunk = s.recv(65536)
        assert chunk, frames
        got += chunk
        frames = read_frames(got)
    s.close()
    assert {sid for t, _, sid, _ in frames if t == HEADERS} == {1, 3}
    assert b"".join(p for t, _, sid, p in frames if t == DATA and sid == 3) == demo_file("css/site.css")
    assert not [f for f in frames if f[0] == DATA and f[2] == 1]


def _attacks():
    from test_h2_attacks import ATTACKS
    return sorted(ATTACKS)


@pytest.mark.parametrize("name", _attacks())
def test_h2_attacks_get_the_python_layers_answer(vm, tls_pki, name):
    """Every attack of tests/test_h2_attacks.py over TLS: the GOAWAY code h2.py sends,
    and the server closes (not our timeout)."""
    from test_h2_attacks import ATTACKS, hostile_end
    from h2util import goaway_code
    make, code = ATTACKS[name]
    out, closed = hostile_end(h2_connect(vm, tls_pki), make())
    assert goaway_code(out) == code
    assert closed  # by the kernel, not by our timeout


@hsettings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 255), st.integers(0, 12),
                          st.binary(max_size=40)), max_size=30))
def test_h2_any_frames_give_answers_or_a_goaway_never_a_crash(vm, tls_pki, frames):
    """test_h2_attacks.py's property over a real TLS connection to the image: any frames
    after the preface get frames of known types back, and the kernel lives on."""
    from h2util import frame, read_frames
    from test_h2_attacks import hostile
    out = hostile(h2_connect(vm, tls_pki), b"".join(frame(t, f, s, p) for t, f, s, p in frames),
                  timeout=10)
    for t, _, _, _ in read_frames(out):
        assert t in (0, 1, 3, 4, 6, 7, 8, 9)
    assert vm.proc.poll() is None, "".join(vm.log)


def test_h2_idle_connection_goes_away(vm, tls_pki):
    """No new stream for --idle-timeout (3 s here): GOAWAY NO_ERROR, then the close."""
    from h2util import goaway_code
    s = h2_connect(vm, tls_pki)
    from h2util import PREFACE, settings
    s.sendall(PREFACE + settings())
    s.settimeout(10)
    out = b""
    started = time.monotonic()
    closed = False
    try:
        while chunk := s.recv(65536):
            out += chunk
        closed = True
    except socket.timeout:
        pass
    except OSError:  # a reset after the close
        closed = True
    s.close()
    # Not before the idle timeout (3 s, less a scheduling margin), and by the kernel.
    assert goaway_code(out) == 0 and closed and time.monotonic() - started > 2.5


def test_h2_an_oversized_header_list_gets_431_and_the_connection_lives(vm, tls_pki):
    from h2util import H2Client
    client = H2Client(h2_connect(vm, tls_pki))
    try:
        got = client.fetch([("GET", "/", {"x-big": "v" * 9000}), ("GET", "/", {})])
        assert [r.status for r in got] == [431, 200]
    finally:
        client.close()


def test_h2_a_bad_preface_is_a_protocol_error(vm, tls_pki):
    from h2util import goaway_code
    s = h2_connect(vm, tls_pki)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    out = read_to_close(s, OSError)  # or a reset after the GOAWAY
    assert goaway_code(out) == 1  # PROTOCOL_ERROR


def test_curl_and_nghttp_over_h2(vm, tls_pki, tmp_path):
    """curl (h2 by ALPN) gets every page byte-identical; nghttp fetches a page and its
    assets on one connection."""
    args = ["--http2", "--cacert", tls_pki.ca, "-w", "%{http_version} %{http_code}\\n"]
    for i, path in enumerate(PAGES):
        args += ["-o", str(tmp_path / f"{i}"), f"https://localhost:{vm.port}{path}"]
    r = curl(*args)
    assert r.returncode == 0, r.stderr
    assert r.stdout.decode().split()[0::2] == ["2"] * len(PAGES)
    for i, path in enumerate(PAGES):
        assert (tmp_path / f"{i}").read_bytes() == demo_file(FILES.get(path, path[1:])), path
    if shutil.which("nghttp"):
        r = subprocess.run(["nghttp", "-n", "-s", "-a", f"https://localhost:{vm.port}/",
                            f"https://localhost:{vm.port}/files/big.txt"],
                           capture_output=True, text=True, timeout=60,
                           env={**os.environ, "SSL_CERT_FILE": tls_pki.ca})
        assert r.returncode == 0, r.stdout + r.stderr
        assert "/files/big.txt" in r.stdout and " 200 " in r.stdout


def test_chromium_loads_pages_over_https(vm, tls_pki, tmp_path):
    """Headless Chromium (ALPN h2 first, as every browser) loads demo pages with their
    stylesheet, script and images from the image: nothing failed, no error."""
    from browser import chromium, load_pages
    if chromium() is None:
        pytest.skip("no Chromium (apt-get install chromium; ./dev test does)")
    from tlsutil import trusting_chromium
    wrapper = trusting_chromium(tls_pki.cert, tmp_path)
    base = f"https://localhost:{vm.port}"
    results = load_pages([base + p for p in ("/", "/docs/", "/docs/guide/getting-started")],
                         timeout=30, executable=str(wrapper))
    for res in results:
        assert res.ok, res.problems


def test_bad_key_fails_the_build_with_one_line(tls_pki, tmp_path):
    out = str(tmp_path / "out")
    r = orisha("build", DEMO, "-o", out, "--target", "unikernel",
               "--tls-cert", tls_pki.chain, "--tls-key", tls_pki.key2)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and tls_pki.key2 in lines[0] and "does not match" in lines[0], r.stderr
    assert not os.path.exists(out)
    junk = tmp_path / "junk.pem"
    junk.write_text("not a key\n")
    r = orisha("build", DEMO, "-o", out, "--target", "unikernel",
               "--tls-cert", tls_pki.chain, "--tls-key", str(junk))
    assert r.returncode != 0 and str(junk) in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = orisha("build", DEMO, "-o", out, "--target", "unikernel",
               "--tls-cert", str(junk), "--tls-key", tls_pki.key)
    assert r.returncode != 0 and str(junk) in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert not os.path.exists(out)


def test_kernel_size_with_tls(vm):
    """The manifest's kernel_bytes (the image less the site): at most 428 KB with TLS."""
    from orisha import manifest
    m = manifest.read(vm.out)
    assert m["tls"] is True
    assert m["kernel_bytes"] <= 428 * 1024, m["kernel_bytes"]


def test_mbedtls_moves_its_blocks_without_calls(vm):
    """AES-GCM's 16-byte copies, clears and XORs (memcpy/memset, also behind alignment.h's
    word reads) are inlined, not calls to libc.c's rep movsb: the Makefile builds mbedTLS
    with -fbuiltin after -ffreestanding. Without it gcm.o alone made 64 such calls and the
    guest's AES-GCM ran at 21 cycles a byte instead of 6 (unikernel/README.md)."""
    from orisha.targets.unikernel.kernel import build_dirs, unikernel_dir
    objects = os.path.join(build_dirs(unikernel_dir())[0], "mbedtls")
    for name in ("gcm.o", "aes.o"):
        r = subprocess.run(["objdump", "-dr", os.path.join(objects, name)], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        calls = re.findall(r"R_X86_64_PLT32\s+(memcpy|memset|memmove)\b", r.stdout)
        assert not calls, (name, len(calls))
